"""What a pipeline stage runs: its block range, its parameter names and, with ``remat="full"``, Myelin's
segments of ``ac`` blocks (Sec. V-A) that the 2BP input pass (backward-p1) recomputes one at a time.

A :class:`StageLayout` is the one description the stage's parts share: the traced passes
(:mod:`~jaxhybrid.parallel.twobp.stage_passes`) read the range and segments, the input checks
(:mod:`~jaxhybrid.parallel.twobp.stage_checks`) the parameter names, and both name the stage by its repr.
"""
from __future__ import annotations

import dataclasses

from jaxhybrid.core.config.model import REMATS
from jaxhybrid.model.remat import optimal_checkpoint_interval
from jaxhybrid.model.transformer import TIED_KEY, Model, block_name


@dataclasses.dataclass(frozen=True, eq=False)
class StageLayout:
    """Blocks ``[first_block, last_block)`` of ``model``; build one with :meth:`build`, which checks the
    arguments (see :class:`~jaxhybrid.parallel.twobp.stage.Stage` for their meaning)."""

    model: Model
    first_block: int
    last_block: int
    remat: str
    checkpoint_interval: int  # Myelin's ac as applied (at most the stage's blocks); 0 unless remat="full"
    segments: list[tuple[int, int]]  # block ranges the input pass recomputes one at a time (one if saved)
    param_names: list[str]  # embed, the blocks, head, and the tied table's copy on a last stage

    @classmethod
    def build(cls, model: Model, first_block: int, last_block: int, *, num_stages_hint: int | None = None,
              remat: str = "none", checkpoint_interval: int = 0) -> StageLayout:
        n = model.cfg.n_layers
        if not (isinstance(first_block, int) and isinstance(last_block, int)) or not 0 <= first_block < last_block <= n:
            raise ValueError(f"stage block range [{first_block}, {last_block}) is empty or outside the model's "
                             f"{n} blocks; need 0 <= first_block < last_block <= {n}")
        if remat not in REMATS:
            raise ValueError(f"remat={remat!r}; choose one of {', '.join(REMATS)}")
        if checkpoint_interval < 0 or (checkpoint_interval > 0 and remat != "full"):
            raise ValueError(f"checkpoint_interval={checkpoint_interval} with remat={remat!r}: the interval must be "
                             f">= 0 and is only used with remat='full'")
        if num_stages_hint is not None and not 1 <= num_stages_hint <= n:
            raise ValueError(f"num_stages_hint={num_stages_hint} must be in [1, n_layers={n}]")
        if remat == "full":
            ac = checkpoint_interval or (optimal_checkpoint_interval(n, num_stages_hint) if num_stages_hint else 1)
            interval = min(ac, last_block - first_block)
            segments = [(lo, min(lo + ac, last_block)) for lo in range(first_block, last_block, ac)]
        else:
            interval, segments = 0, [(first_block, last_block)]
        is_first, is_last = first_block == 0, last_block == n
        names = (["embed"] if is_first else []) + [block_name(i) for i in range(first_block, last_block)]
        names += ["head"] if is_last else []
        if is_last and model.cfg.tie_embeddings and not is_first:
            names.append(TIED_KEY)
        return cls(model, first_block, last_block, remat, interval, segments, names)

    @property
    def cfg(self):
        return self.model.cfg

    @property
    def is_first(self) -> bool:
        return self.first_block == 0

    @property
    def is_last(self) -> bool:
        return self.last_block == self.cfg.n_layers

    @property
    def key(self) -> tuple:
        """The layout as a value: two stages with equal keys trace the same programs (the model with its ops
        and dtype, the block range, remat and segments), so they can share them (:meth:`StageKernels.of`)."""
        return (self.model, self.first_block, self.last_block, self.remat, self.checkpoint_interval,
                tuple(self.segments), tuple(self.param_names))

    def slice_params(self, full_params: dict) -> dict:
        """This stage's parameters from the model's full flat dict (the tied table is shared, not copied)."""
        missing = [k for k in self.param_names if k != TIED_KEY and k not in full_params]
        if missing:
            raise ValueError(f"full params lack {missing} needed by {self!r}")
        out = {k: full_params[k] for k in self.param_names if k != TIED_KEY}
        if TIED_KEY in self.param_names:
            out[TIED_KEY] = full_params["embed"]["wte"]
        return out

    @property
    def init_parts(self) -> tuple[str, ...]:
        """The model parts ``Model.init`` must materialise for this stage (the tied copy comes with head)."""
        return tuple(k for k in self.param_names if k != TIED_KEY)

    def wte(self, params: dict):
        """The token table the head ties to (the first stage's own, or a last stage's copy); None untied."""
        if not self.cfg.tie_embeddings:
            return None
        return params["embed"]["wte"] if self.is_first else params[TIED_KEY]

    def __repr__(self) -> str:
        return (f"Stage(blocks=[{self.first_block}, {self.last_block}), first={self.is_first}, last={self.is_last}, "
                f"remat={self.remat!r}, ac={self.checkpoint_interval}, dtype={self.model.compute_dtype})")
