"""The single-field ranges of a run config: one table (:data:`RANGES`) of key, predicate and the phrase
that says what the value must be, checked first by :func:`jaxhybrid.runtime.config_checks.validate` so that a value
out of its range is named as such rather than as a symptom in a rule across fields.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

from jaxhybrid.core.config.parse import lookup
from jaxhybrid.core.errors import ConfigError

if TYPE_CHECKING:
    from jaxhybrid.core.config.schema import Config

TENSOR_OPTIMIZATIONS = "ABCDE"  # AxoNN Sec. IV's optimizations A-E


# ``finite``: a bound from below admits inf, which these fields cannot use (their RANGES entry says why).
def _ge(lo: float, why: str = "", *, finite: bool = False) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v >= lo and (v < math.inf or not finite)), f"must be >= {lo}{' and finite' * finite}{why}"


def _gt(lo: float, why: str = "", *, finite: bool = False) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v > lo and (v < math.inf or not finite)), f"must be > {lo}{' and finite' * finite}{why}"


def _in(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = True) -> tuple[Callable[[Any], bool], str]:
    def ok(v):
        return (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)

    return ok, f"must be in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


_COUNTS = ("train.steps", "train.global_batch", "train.eval_batches", "train.log_every", "data.seq_len",
           "parallel.pipeline", "parallel.data", "parallel.tensor_col", "parallel.tensor_row",
           "parallel.tensor_depth", "pipeline.microbatches", "pipeline.virtual_stages",
           "optim.allreduce_coarsening", "precision.loss_scale_window")

# (dotted key, predicate, what the value must be). A predicate that is False (NaN included) is an error.
# Where 0 is allowed because it means something, the phrase says what, so the user sees it is not a typo.
RANGES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("run.dir", lambda v: bool(v.strip()), "must not be empty (it would put config.yaml, metrics and "
     "checkpoints in the current directory)"),
    *((k, *_ge(1)) for k in _COUNTS),
    ("data.val_fraction", *_in(0, 1)),
    ("train.seed", *_ge(0, " (it keys numpy's SeedSequence)")),
    # Compared with the step as logged, from 1: any other value below 1 would inject nothing.
    ("train.inject_overflow_step", lambda v: v == -1 or v >= 1,
     "must be -1 (off) or a step >= 1 (steps count from 1)"),
    ("train.eval_every", *_ge(0, " (0 turns evaluation off)")),
    ("train.max_nonfinite_steps", *_ge(0, " (0 never stops on non-finite steps)")),
    ("train.checkpoint_interval", *_ge(0, " (0 = Myelin's optimal interval)")),
    ("optim.lr", *_in(0, 1, lo_open=True)),
    ("optim.beta1", *_in(0, 1)),
    ("optim.beta2", *_in(0, 1)),
    # inf: every Adam update 0 (eps), or every parameter non-finite after one step (weight_decay).
    ("optim.eps", *_gt(0, finite=True)),
    ("optim.weight_decay", *_ge(0, finite=True)),
    ("optim.warmup_steps", *_ge(0)),
    ("optim.min_lr_ratio", *_in(0, 1, hi_open=False)),
    ("optim.grad_clip", *_ge(0, " (0 disables clipping)")),
    ("optim.bucket_size", *_gt(0)),
    # inf overflows every step, and halving keeps it inf: every update would be skipped without an error.
    ("precision.loss_scale_init", *_gt(0, finite=True)),
    ("pipeline.pipeline_limit", *_ge(0, " (0 = parallel.pipeline, the ranks)")),
    ("pipeline.watchdog_s", *_gt(0)),
    ("pipeline.watchdog_compile_s", *_gt(0)),
    ("checkpoint.every", *_ge(0, " (0 = only at the end)")),
    # orbax's max_to_keep: 0 would delete every checkpoint, the final one included, as it is written.
    ("checkpoint.keep", *_ge(1)),
)


def check_optimizations(letters: str) -> None:
    """The one check of ``tensor.optimizations``' letters, for :func:`validate` (which sees them whether or not
    the run has a tensor grid) and for :class:`~jaxhybrid.parallel.tensor.ops.TensorOps` built without a config."""
    bad = set(letters) - set(TENSOR_OPTIMIZATIONS)
    if bad:
        raise ConfigError(f"tensor.optimizations={letters!r} has unknown letters {sorted(bad)}; use a "
                          f"subset of {TENSOR_OPTIMIZATIONS}")


def range_errors(cfg: Config) -> list[str]:
    """One message per field of :data:`RANGES` (and ``tensor.optimizations``) out of its range."""
    errors = []
    for key, ok, phrase in RANGES:
        v = lookup(cfg, key)
        if not ok(v):
            errors.append(f"{key}={v!r} {phrase}" if isinstance(v, str) else f"{key}={v} {phrase}")
    try:
        check_optimizations(cfg.tensor.optimizations)
    except ConfigError as e:
        errors.append(str(e))
    return errors
