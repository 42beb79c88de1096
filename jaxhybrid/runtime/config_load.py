"""Loading a run config: defaults <- YAML file <- a plan file (``plan.file``) <- ``--set`` overrides, then
every check of :mod:`jaxhybrid.runtime.config_checks`. Here, above the planner and the parallel layers,
because merging a plan and checking a layout need their rules; the schema itself is in
:mod:`jaxhybrid.core.config`."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jaxhybrid.core.config.parse import apply_updates, load_yaml, merge, parse_overrides
from jaxhybrid.core.config.schema import Config
from jaxhybrid.planner.plan import load_plan_overrides
from jaxhybrid.runtime.config_checks import validate


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                *, check: bool = True) -> Config:
    """Defaults <- YAML file <- ``--set`` overrides, then :func:`validate`."""
    tree: dict[str, Any] = load_yaml(path) if path else {}
    cli = parse_overrides(list(overrides))
    tree = merge(tree, cli)
    cfg = apply_updates(Config(), tree)
    if cfg.plan.file:
        # A plan from `jaxhybrid plan --out` sits between the YAML file and the command line.
        # The plan's layout and memory were modelled for one model: a run of another must not take it.
        plan = load_plan_overrides(cfg.plan.file, model=cfg.model.name, shape=dataclasses.asdict(cfg.model))
        base = load_yaml(path) if path else {}
        cfg = apply_updates(Config(), merge(merge(base, plan), cli))
    if check:
        validate(cfg)
    return cfg


def config_from_dict(tree: dict[str, Any], *, check: bool = True) -> Config:
    cfg = apply_updates(Config(), tree)
    if check:
        validate(cfg)
    return cfg
