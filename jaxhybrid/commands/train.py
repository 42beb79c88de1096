"""``jaxhybrid train --config FILE [--set key=value ...] [--resume]``: one process, or one MPI rank."""
from __future__ import annotations

import argparse
import json
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file of overrides (configs/runs/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. --set train.steps=50 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run.dir")


def launched_world_size() -> int:
    """World size from the launcher's environment, read without initialising MPI."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS_WORLD", "SLURM_NTASKS"):
        if os.environ.get(var, "").isdigit():
            if var == "SLURM_NTASKS" and "SLURM_PROCID" not in os.environ:
                continue
            return int(os.environ[var])
    return 1


def run(args: argparse.Namespace) -> int:
    from jaxhybrid.config import load_config, validate

    overrides = list(args.overrides) + (["run.resume=true"] if args.resume else [])
    cfg = load_config(args.config, overrides, check=False)
    validate(cfg, launched_world_size())
    from jaxhybrid.train import Trainer

    trainer = Trainer(cfg, launched_world_size())
    summary = trainer.run()
    if trainer.engine.is_writer:
        print(json.dumps({"run_dir": str(cfg.run.dir), **summary}), file=sys.stdout)
    return 0
