"""Schedule generators: ``make_schedule(name, stages, microbatches, split_backward, ...) -> Schedule``.

Names (``SCHEDULE_NAMES``) and how ``microbatches`` (M, ``pipeline.microbatches``) is read:

* ``naive``: 2BP's baseline, one microbatch at a time through all stages (M = 1 is 2BP's exact setup).
* ``gpipe``: all forwards then all backwards; any M.
* ``1f1b``: 1F1B (PipeDream-Flush) for any M.
* ``1f1b-1``, ``1f1b-2`` (any ``1f1b-K``): 2BP's 1F1B-K, i.e. 1F1B with exactly M = K x stages; another
  M is an error (use ``1f1b`` for that M).
* ``zb-h1``: zero-bubble H1 (always split backward); needs M >= stages.
* ``1f1b-star``: MadPipe 1F1B* (Sec. 4.1) for a contiguous partition, from ``stage_costs=[(U_F, U_B),
  ...]`` (default: ``costs``' F and BI + BW) and ``period=T`` (default: the largest stage or link load; plain 1F1B
  when the stages are equal and messages free), or explicit ``groups``.
* ``myelin``: Myelin Algorithm 2, message-driven with ``pipeline_limit`` (default: stages, the ranks)
  microbatches in flight. The rows are the order the rule produces under ``costs`` (default unit costs); the
  engine and the simulator re-derive the order from arriving messages and treat the F/B/BI tasks of a
  row as the rank's work, placing BWs by the 2BP rule (with the engine's default ``weight_budget``,
  stages; ``simulate(..., weight_budget=...)`` for another).
* ``interleaved-1f1b``: Megatron-LM's interleaved 1F1B (Narayanan et al., SC'21) over ``virtual_stages``
  chunks per rank, loop placement; M must be a multiple of the ranks. With ``virtual_stages=1``, 1F1B.
* ``zb-v``: zero-bubble V (Qi et al.): ``virtual_stages=2``, ``placement='v'``, always split backward; its
  rows are a greedy list schedule under ``costs`` capped at 1F1B's peak activation memory.
* ``periodic``: a periodic pattern (``pattern=("F0+0", "B0+2", ...)``, MadPipe Sec. 3: one period's passes in
  order, each with its index shift) unrolled over M microbatches; ``jaxhybrid partition --out`` writes the
  pattern of its allocation (1F1B*'s groups, or the ILP's for a special processor holding several stages).

Virtual stages: ``stages`` is the number of pipeline RANKS p; with ``virtual_stages=v`` the model is cut
into p x v logical stages (``costs`` has one entry per logical stage) and :func:`stage_placement` gives
``stage_to_rank``: ``loop`` puts stage s on rank s % p (Megatron's interleaving), ``v`` (v = 2 only) puts
stages r and 2p - 1 - r on rank r (ZB-V's V shape). ``naive``, ``gpipe`` and ``myelin`` run over any
placement; ``1f1b``, ``1f1b-K``, ``zb-h1`` and ``1f1b-star`` are one stage per rank. An explicit
``stage_to_rank`` (a MadPipe allocation: any number of stages per rank, in any order) replaces the placement
for ``naive``, ``gpipe``, ``myelin`` and ``periodic``.

``split_backward=True`` applies 2BP: B becomes BI, and BWs run when a rank would otherwise idle (not
for ``gpipe``, where 2BP delays them all, Sec. 3.2; override with ``fill_idle``), with those left after a
rank's last BI joined into one BW per stage (2BP Fig. 2; how: ``pipeline.weight_join``). Where BWs go is
computed with ``costs`` (a :class:`~jaxhybrid.parallel.pipeline.costs.Costs`, default F = BI = BW = 1).
``memory_saving=True`` (2BP Fig. 5) also runs the pending BWs half-way (after BI number ceil(M/2) of each
stage); ``bw_flush_every=K`` does so after every K-th BI.
"""
from __future__ import annotations

import math
import re

from jaxhybrid.parallel.pipeline import generators as gen
from jaxhybrid.parallel.pipeline.costs import Costs
from jaxhybrid.parallel.pipeline.policies import FillPolicy, MessageDrivenPolicy, ZeroBubbleVPolicy
from jaxhybrid.parallel.pipeline.simcore import Core, describe_deadlock
from jaxhybrid.parallel.pipeline.tasks import Kind, Schedule
from jaxhybrid.parallel.pipeline.validate import validate_schedule

SCHEDULE_NAMES = ("naive", "gpipe", "1f1b", "1f1b-1", "1f1b-2", "zb-h1", "1f1b-star", "myelin",
                  "interleaved-1f1b", "zb-v", "periodic")
PLACEMENTS = ("loop", "v")
# Schedules defined over several stages per rank; the others order one stage per rank.
CHUNKED = ("naive", "gpipe", "myelin", "interleaved-1f1b", "zb-v", "periodic")
# Those that run any stage-to-rank map (a MadPipe allocation), not only the placements.
ANY_MAP = ("naive", "gpipe", "myelin", "periodic")
_COMMON = {"costs", "fill_idle", "memory_saving", "bw_flush_every"}
_OPTS = {"1f1b-star": {"stage_costs", "period", "groups"}, "periodic": {"pattern"}}


def _check_sizes(name: str, stages, microbatches) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"schedule {name!r}: stages={stages!r} must be an integer >= 1")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"schedule {name!r}: microbatches={microbatches!r} must be an integer >= 1")


def _check_placement(virtual_stages, placement) -> None:
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages={virtual_stages!r} must be an integer >= 1 (stages per pipeline rank)")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}; choose one of {', '.join(PLACEMENTS)}")
    if placement == "v" and virtual_stages != 2:
        raise ValueError(f"placement='v' puts two stages on each rank (r and 2p-1-r); it needs virtual_stages=2, "
                         f"got virtual_stages={virtual_stages}")


def stage_placement(ranks: int, virtual_stages: int = 1, placement: str = "loop") -> tuple[int, ...]:
    """``stage_to_rank`` of the ``ranks x virtual_stages`` logical stages of a pipeline.

    ``loop`` (Narayanan et al., SC'21, Sec. 2.2, Megatron-LM's interleaving): rank ``r`` holds stages ``r, r + p,
    r + 2p, ...``. ``v`` (Qi et al.'s ZB-V, ``virtual_stages=2``): rank ``r`` holds stages ``r`` and ``2p - 1 - r``,
    so the first and the last stage share rank 0. Either way rank ``r``'s chunk ``c`` is its ``c``-th lowest stage.

    Raises:
      ValueError: ranks < 1, virtual_stages < 1, an unknown placement, ``v`` with virtual_stages != 2.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks={ranks!r} must be an integer >= 1")
    _check_placement(virtual_stages, placement)
    if placement == "v":
        return tuple(range(ranks)) + tuple(reversed(range(ranks)))
    return tuple(s % ranks for s in range(ranks * virtual_stages))


def check_stage_map(stage_to_rank, ranks: int) -> tuple[int, ...]:
    """An explicit stage-to-rank map: one rank in ``0..ranks-1`` per logical stage, every rank holding one."""
    placed = tuple(stage_to_rank)
    if any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < ranks for r in placed):
        raise ValueError(f"stage_to_rank={list(placed)} must name a rank in 0..{ranks - 1} for each stage")
    idle = sorted(set(range(ranks)) - set(placed))
    if idle:
        raise ValueError(f"stage_to_rank={list(placed)} gives rank{'s' if len(idle) > 1 else ''} "
                         f"{', '.join(map(str, idle))} no stage; each of the {ranks} ranks needs one")
    return placed


def _k_of(name: str) -> int | None:
    m = re.fullmatch(r"1f1b-(\d+)", name)
    return int(m.group(1)) if m else None


def _check_chunked(key: str, stages: int, microbatches: int, virtual_stages: int, placement: str) -> None:
    """The rules of schedules over several stages per rank (see the module docstring)."""
    if key == "zb-v" and (virtual_stages, placement) != (2, "v"):
        raise ValueError(f"schedule 'zb-v' is the V shape: it needs virtual_stages=2 and placement='v', got "
                         f"virtual_stages={virtual_stages}, placement={placement!r}")
    if virtual_stages > 1 and key not in CHUNKED:
        hint = "; use 'interleaved-1f1b'" if key.startswith("1f1b") else ""
        raise ValueError(f"schedule {key!r} runs one stage per rank; it cannot run virtual_stages="
                         f"{virtual_stages} (schedules over several stages per rank: {', '.join(CHUNKED)}){hint}")
    if key == "interleaved-1f1b" and placement != "loop":
        raise ValueError(f"schedule 'interleaved-1f1b' is Megatron-LM's loop placement; got placement={placement!r}")
    if key == "interleaved-1f1b" and microbatches % stages:
        raise ValueError(f"schedule 'interleaved-1f1b' needs microbatches a multiple of the pipeline ranks, got "
                         f"microbatches={microbatches} with stages={stages}; use a multiple of {stages}")


def make_schedule(name: str, stages: int, microbatches: int | None, split_backward: bool = False,
                  pipeline_limit: int = 0, *, virtual_stages: int = 1, placement: str = "loop",
                  stage_to_rank=None, **opts) -> Schedule:
    """Builds the named schedule; see the module docstring for names and options.

    Args:
      stages: pipeline ranks p; the schedule has ``stages x virtual_stages`` logical stages.
      virtual_stages: stages per rank (chunks), v.
      placement: ``loop`` or ``v``, see :func:`stage_placement`.
      stage_to_rank: an explicit map instead of the placement (``virtual_stages`` then stays 1); the
        identity map is one stage per rank, as without it.

    Raises:
      ValueError: unknown name (listing the valid ones), stages < 1, microbatches < 1 or not fitting
        the schedule, virtual stages or a placement the schedule cannot run, unknown options.
    """
    key = str(name).lower()
    k = _k_of(key)
    if key not in SCHEDULE_NAMES and k is None:
        raise ValueError(f"unknown schedule {name!r}; valid choices: {', '.join(SCHEDULE_NAMES)} "
                         "(or 1f1b-K for K x stages microbatches)")
    if k is not None and microbatches is None and isinstance(stages, int):
        microbatches = k * stages
    _check_sizes(key, stages, microbatches)
    _check_placement(virtual_stages, placement)
    unknown = set(opts) - _COMMON - _OPTS.get(key, set())
    if unknown:
        raise ValueError(f"schedule {key!r} got unknown options {sorted(unknown)}; valid: "
                         f"{sorted(_COMMON | _OPTS.get(key, set()))}")
    if stage_to_rank is not None and len(stage_to_rank):
        if (virtual_stages, placement) != (1, "loop"):
            raise ValueError(f"an explicit stage_to_rank={list(stage_to_rank)} places the stages itself; leave "
                             f"virtual_stages=1 and placement='loop' (got {virtual_stages}, {placement!r})")
        placed = check_stage_map(stage_to_rank, stages)
        if placed != tuple(range(stages)) and key not in ANY_MAP:
            raise ValueError(f"schedule {key!r} cannot run stage_to_rank={list(placed)} (several stages on a rank, "
                             f"or out of order); schedules over any map: {', '.join(ANY_MAP)}")
    else:
        placed = None
        _check_chunked(key, stages, microbatches, virtual_stages, placement)
    if k is not None and microbatches != k * stages:
        raise ValueError(f"schedule {key!r} is 2BP's 1F1B-{k}: microbatches must be {k} x stages = "
                         f"{k * stages}, got {microbatches}; set microbatches={k * stages} or use "
                         "schedule '1f1b' for any number of microbatches")
    if key == "zb-h1" and microbatches < stages:
        raise ValueError(f"schedule 'zb-h1' needs microbatches >= stages, got microbatches="
                         f"{microbatches} < stages={stages}; raise microbatches or use '1f1b'")
    placed = placed or stage_placement(stages, virtual_stages, placement)
    costs = opts.get("costs") or Costs.uniform(len(placed))
    if costs.num_stages != len(placed):
        raise ValueError(f"costs cover {costs.num_stages} stages, the schedule has {len(placed)}"
                         + (f" ({stages} ranks x {virtual_stages} virtual stages)" if virtual_stages > 1 else ""))
    back = Kind.BI if split_backward else Kind.B
    if key in ("myelin", "zb-h1", "zb-v") and (opts.get("memory_saving") or opts.get("bw_flush_every")):
        # Myelin's BWs follow the 2BP rule (weight_budget), zb-h1's and zb-v's their own: ignored, the flag
        # would give a result other than the one asked for.
        raise ValueError(f"{key} places its own weight gradients; memory_saving/bw_flush_every apply "
                         "to naive, gpipe, 1f1b, 1f1b-star and interleaved-1f1b with split_backward")
    if key == "myelin":
        return _myelin(stages, microbatches, split_backward, pipeline_limit, costs, placed)
    if key == "zb-h1":
        rows = gen.zb_h1_rows(stages, microbatches)
        return Schedule(key, _freeze(rows), placed, microbatches, True, "static", pipeline_limit)
    if key == "zb-v":
        # 1F1B's peak: p microbatches of a whole rank, i.e. 2p chunk activations.
        rows = _run(ZeroBubbleVPolicy(placed, microbatches, virtual_stages * stages), placed, costs, key)
        return Schedule(key, _freeze(rows), placed, microbatches, True, "static", pipeline_limit)
    if key == "naive":
        rows = gen.naive_rows(stages, microbatches, back, placed)
    elif key == "gpipe":
        rows = gen.gpipe_rows(stages, microbatches, back, placed)
    elif key == "interleaved-1f1b":
        rows = gen.interleaved_1f1b_rows(stages, virtual_stages, microbatches, back)
    elif key == "periodic":
        if not opts.get("pattern"):
            raise ValueError("schedule 'periodic' needs its pattern (pipeline.pattern; `jaxhybrid partition --out` "
                             "writes one)")
        rows = gen.periodic_rows(gen.parse_pattern(opts["pattern"], len(placed)), placed, microbatches, back)
    elif key == "1f1b-star":
        rows = gen.one_f_one_b_star_rows(_star_groups(stages, opts, costs), microbatches, back)
    else:
        rows = gen.one_f_one_b_rows(stages, microbatches, back)
    if split_backward:
        flush = opts.get("bw_flush_every") or (math.ceil(microbatches / 2) if opts.get("memory_saving")
                                               else None)
        if flush is not None and (not isinstance(flush, int) or flush < 1):
            raise ValueError(f"bw_flush_every={flush!r} must be an integer >= 1")
        fill = opts.get("fill_idle", key != "gpipe")
        rows = _run(FillPolicy(rows, fill_idle=fill, flush_every=flush), placed, costs, key)
    elif opts.get("memory_saving") or opts.get("bw_flush_every"):
        raise ValueError("memory_saving / bw_flush_every need split_backward=True (2BP Fig. 5)")
    out = Schedule(key, _freeze(rows), placed, microbatches, split_backward, "static", pipeline_limit)
    if key == "periodic":  # a user's pattern (the other generators' rows are checked by their tests)
        validate_schedule(out, costs=costs)
    return out


def _star_groups(stages: int, opts, costs: Costs) -> tuple[int, ...]:
    """MadPipe 4.1's groups at ``period``: each boundary's messages (activation on, gradient back) are a
    resource of their own between the stages."""
    if opts.get("groups") is not None:
        return gen.check_groups(opts["groups"], stages)
    # Loads in the units of the links below (message times of ``costs``), not fixed ones.
    stage_costs = opts.get("stage_costs") or [(costs.forward[s], costs.fused_backward(s)) for s in range(stages)]
    if len(stage_costs) != stages:
        raise ValueError(f"stage_costs has {len(stage_costs)} (U_F, U_B) pairs for {stages} stages")
    links = [2 * costs.message_time(b) for b in range(stages - 1)]
    period = opts.get("period")
    if period is None:  # the smallest period 4.1's rule accepts: no resource, stage or link, exceeds it
        period = max([f + b for f, b in stage_costs] + links)
    return gen.madpipe_groups(stage_costs, float(period), links)


def _myelin(stages, microbatches, split, pipeline_limit, costs, placed) -> Schedule:
    limit = pipeline_limit or stages  # Myelin V-A fixes pipeline_limit = G_inter (the ranks)
    if limit < 1:
        raise ValueError(f"pipeline_limit={pipeline_limit} must be >= 1 (0 means: stages)")
    back = Kind.BI if split else Kind.B
    pool = gen.gpipe_rows(stages, microbatches, back, placed)  # the rank's work; the rule orders it
    rows = _run(MessageDrivenPolicy(pool, placed, limit), placed, costs, "myelin")
    return Schedule("myelin", _freeze(rows), placed, microbatches, split, "message-driven", limit)


def _run(policy, stage_to_rank, costs: Costs, name: str):
    core = Core(stage_to_rank, max(stage_to_rank) + 1, costs)
    stuck = core.run(policy)
    if stuck:  # a generator bug, never a user error; say so loudly
        raise RuntimeError(f"generator {name!r} deadlocked: {describe_deadlock(core, policy, stuck)}")
    return policy.order


def _freeze(rows):
    return tuple(tuple(r) for r in rows)


def configured_schedule(pl, ranks: int, name: str | None = None, split_backward: bool | None = None,
                        pipeline_limit: int | None = None, microbatches: int | None = None) -> Schedule:
    """The schedule of a run's ``pipeline`` config (a :class:`~jaxhybrid.core.config.schema.PipelineConfig`) on
    ``ranks`` pipeline ranks, with its placement or stage map and pattern; the keywords replace its fields."""
    name = pl.schedule if name is None else name
    opts = {"pattern": pl.pattern} if str(name).lower() == "periodic" else {}
    return make_schedule(name, ranks, pl.microbatches if microbatches is None else microbatches,
                         split_backward=pl.split_backward if split_backward is None else split_backward,
                         pipeline_limit=pl.pipeline_limit if pipeline_limit is None else pipeline_limit,
                         virtual_stages=pl.virtual_stages, placement=pl.placement,
                         stage_to_rank=pl.stage_to_rank or None, **opts)


def configured_placement(pl, ranks: int) -> tuple[int, ...]:
    """``stage_to_rank`` of a run's ``pipeline`` config: its explicit map, or its placement's."""
    if pl.stage_to_rank:
        return check_stage_map(pl.stage_to_rank, ranks)
    return stage_placement(ranks, pl.virtual_stages, pl.placement)
