"""Timelines of pipeline ranks -> Chrome/Perfetto trace JSON and a Gantt PNG (like 2BP Fig. 1).

The one timeline type serves the simulator and the engine's measurements:

``Event(rank, name, kind, start, end, microbatches=(), stage=-1)``
  ``rank``: pipeline rank (one Gantt row). ``kind``: ``"F"``, ``"B"``, ``"BI"``, ``"BW"`` for compute;
  ``"wait"`` for time a rank spent blocked on a message; ``"dispatch"`` for a task the event loop
  queued without waiting for its kernel (never counted as compute); ``"send"`` / ``"recv"`` for a message in
  flight (``rank`` is the sender / receiver); ``"reduce"`` / ``"update"`` for a data-parallel reduction and the
  optimizer's update of what it reduced (Myelin V-C: lanes of their own, which may overlap); anything else
  is drawn as ``"other"``. ``start`` and
  ``end`` are seconds (simulated timelines use cost units, shown as seconds). ``microbatches`` are
  the microbatch numbers written in the box (several for a concatenated BW); ``stage`` is the
  logical stage (-1: none).

The engine records a plain list of events per rank (``start_s``/``end_s`` from one clock such as
``MPI.Wtime``) and builds ``Timeline.merge([events_of_rank0, events_of_rank1, ...], offsets)``;
``offsets[r]`` is added to rank ``r``'s times (clock skew), and the result is shifted so that the
earliest event starts at 0.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Sequence

COMPUTE_KINDS = ("F", "B", "BI", "BW")
COLORS = {"F": "#4c78a8", "B": "#e45756", "BI": "#f58518", "BW": "#54a24b", "wait": "#d9d9d9",
          "send": "#b279a2", "recv": "#9d755d", "reduce": "#72b7b2", "update": "#eeca3b", "other": "#bab0ac"}
# The lanes of a rank beside its compute row (Chrome trace thread ids: offset + rank).
LANES = {"send": (1000, "messages"), "recv": (1000, "messages"), "reduce": (2000, "all-reduce"),
         "update": (3000, "optimizer")}


@dataclass(frozen=True)
class Event:
    """One interval on one rank (see the module docstring)."""

    rank: int
    name: str
    kind: str
    start: float
    end: float
    microbatches: tuple[int, ...] = ()
    stage: int = -1

    def __post_init__(self):
        if self.end < self.start:
            raise ValueError(f"event {self.name!r} on rank {self.rank} ends ({self.end}) before it "
                             f"starts ({self.start})")

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Recorder:
    """Per-rank timeline of :class:`Event` (kinds F/B/BI/BW, wait, send,
    recv), times in seconds of ``time.perf_counter`` (merge ranks with per-rank offsets).

    ``synced`` False: the event loop dispatched its kernels without waiting for them, so its task events
    are ``"dispatch"`` spans, not kernel times, and :meth:`check_timed` refuses to pass them off as a trace.
    """

    rank: int = 0
    events: list[Event] = field(default_factory=list)
    synced: bool = True

    def check_timed(self, who: str) -> None:
        """Raise unless the events hold kernel times (a step run with ``synced``)."""
        if not self.synced:
            raise RuntimeError(f"{who}: the last step dispatched its kernels asynchronously, so its events "
                               f"are dispatch spans, not kernel times; time the step to trace "
                               f"(PipelineEngine.time_tasks(), EventLoop(synced=True))")

    def add(self, name: str, kind: str, start: float, end: float, mbs: tuple[int, ...] = (),
            stage: int = -1) -> None:
        self.events.append(Event(self.rank, name, kind, start, end, tuple(mbs), stage))

    def total(self, *kinds: str) -> float:
        return sum(e.end - e.start for e in self.events if e.kind in kinds)


@dataclass(frozen=True)
class Timeline:
    """Events of all ranks, sorted by (start, rank)."""

    events: tuple[Event, ...]
    num_ranks: int

    @classmethod
    def of(cls, events: Iterable[Event], num_ranks: int | None = None) -> "Timeline":
        evs = tuple(sorted(events, key=lambda e: (e.start, e.rank, e.end)))
        n = max((e.rank for e in evs), default=-1) + 1 if num_ranks is None else num_ranks
        if any(e.rank < 0 or e.rank >= n for e in evs):
            raise ValueError(f"an event's rank is outside 0..{n - 1}")
        return cls(evs, n)

    @classmethod
    def merge(cls, per_rank: Sequence[Iterable[Event]], offsets: Sequence[float] | None = None,
              normalize: bool = True) -> "Timeline":
        """Joins per-rank event lists; ``offsets[r]`` corrects rank ``r``'s clock."""
        offs = list(offsets) if offsets is not None else [0.0] * len(per_rank)
        if len(offs) != len(per_rank):
            raise ValueError(f"{len(offs)} clock offsets for {len(per_rank)} ranks")
        evs = [replace(e, start=e.start + o, end=e.end + o) for evs, o in zip(per_rank, offs) for e in evs]
        t0 = min((e.start for e in evs), default=0.0) if normalize else 0.0
        evs = [replace(e, start=e.start - t0, end=e.end - t0) for e in evs]
        return cls.of(evs, len(per_rank))

    def compute(self) -> tuple[Event, ...]:
        return tuple(e for e in self.events if e.kind in COMPUTE_KINDS)

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.compute()), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(e.duration for e in self.compute() if e.rank == rank)


def to_chrome_trace(timeline: Timeline, process_name: str = "pipeline") -> dict:
    """Chrome/Perfetto ``traceEvents``: one thread per rank for compute and waits, one more per rank
    for messages (``tid = 1000 + rank``), and where a step has them its all-reduce (2000 + rank) and
    optimizer (3000 + rank) lanes; times in microseconds."""
    out = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": process_name}}]
    kinds = {e.kind for e in timeline.events}
    lanes = sorted({lane for k, lane in LANES.items() if k in kinds or k == "send"})
    for r in range(timeline.num_ranks):
        out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        for offset, lane in lanes:
            out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": offset + r,
                        "args": {"name": f"rank {r} {lane}"}})
    for e in timeline.events:
        tid = LANES[e.kind][0] + e.rank if e.kind in LANES else e.rank
        out.append({"name": e.name, "cat": e.kind, "ph": "X", "pid": 0, "tid": tid,
                    "ts": e.start * 1e6, "dur": e.duration * 1e6,
                    "args": {"microbatches": list(e.microbatches), "stage": e.stage, "kind": e.kind}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(timeline: Timeline, path: str | Path, process_name: str = "pipeline") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_chrome_trace(timeline, process_name)))
    return path


def rank_chunks(timeline: Timeline) -> dict[tuple[int, int], int]:
    """``(rank, stage) -> chunk``: the ``c``-th lowest stage a rank ran compute of is its chunk ``c``."""
    stages: dict[int, set[int]] = {}
    for e in timeline.compute():
        if e.stage >= 0:
            stages.setdefault(e.rank, set()).add(e.stage)
    return {(r, s): c for r, ss in stages.items() for c, s in enumerate(sorted(ss))}


def _shade(color: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """``color`` lightened towards white for later chunks, so that a rank's stages read apart."""
    from matplotlib.colors import to_rgb

    mix = 0.5 * chunk / max(1, chunks - 1)
    return tuple(c + (1.0 - c) * mix for c in to_rgb(color))


def save_gantt(timeline: Timeline, path: str | Path, title: str | None = None) -> Path:
    """Gantt chart, one row per rank (rank 0 on top), boxes coloured by kind with their microbatch
    numbers, waits in light grey; messages are not drawn; a reduction and an update (V-C) share the row, in
    its upper and lower half, so their overlap shows. A rank running several stages (virtual stages)
    draws its later chunks in lighter shades of the kind's colour, writes the stage under the microbatch
    numbers, and lists its stages on its row label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max((e.end for e in timeline.events), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, 0.35 * len(timeline.compute()) / max(
        1, timeline.num_ranks) + 4)), 0.6 * timeline.num_ranks + 1.2))
    chunk_of = rank_chunks(timeline)
    per_rank = {r: sorted(s for (rr, s) in chunk_of if rr == r) for r in range(timeline.num_ranks)}
    chunks = max((len(v) for v in per_rank.values()), default=1)
    kinds_seen = []
    for e in timeline.events:
        if e.kind in ("send", "recv") or e.duration <= 0:
            continue
        kind = e.kind if e.kind in COLORS else "other"
        if kind not in kinds_seen:
            kinds_seen.append(kind)
        y = timeline.num_ranks - 1 - e.rank
        chunk = chunk_of.get((e.rank, e.stage), 0) if e.kind in COMPUTE_KINDS else 0
        band = {"reduce": (y, 0.4), "update": (y - 0.4, 0.4)}.get(kind, (y - 0.4, 0.8))
        ax.broken_barh([(e.start, e.duration)], band, facecolors=_shade(COLORS[kind], chunk, chunks),
                       edgecolors="black", linewidth=0.4)
        if e.microbatches and e.kind in COMPUTE_KINDS and e.duration / span > 0.008:
            label = ",".join(str(m) for m in e.microbatches)
            if chunks > 1:
                label += f"\ns{e.stage}"
            ax.text(e.start + e.duration / 2, y, label, ha="center", va="center", fontsize=7 if chunks == 1 else 6,
                    color="white" if chunk == 0 else "black", clip_on=True)
    ax.set_yticks(range(timeline.num_ranks))
    ax.set_yticklabels([f"rank {r}" + (f" (s{', s'.join(map(str, per_rank[r]))})" if chunks > 1 else "")
                        for r in reversed(range(timeline.num_ranks))])
    ax.set_xlim(0, span)
    ax.set_xlabel("time")
    if title:
        ax.set_title(title)
    handles = [Patch(facecolor=COLORS[k], label=k) for k in kinds_seen]
    if chunks > 1:  # the shade of each chunk, on F's colour
        handles += [Patch(facecolor=_shade(COLORS["F"], c, chunks), label=f"chunk {c}") for c in range(chunks)]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=max(1, len(handles)),
              fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_measured(per_rank: list[list[Event]], run_dir: str | Path, title: str) -> dict:
    """Merged Chrome trace (``trace.json``) and Gantt PNG (``trace.png``) of the ranks' measured events;
    returns the measured bubble ratio and makespan."""
    tl = Timeline.merge(per_rank)
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_chrome_trace(tl, out / "trace.json")
    save_gantt(tl, out / "trace.png", title=title)
    busy = sum(tl.busy(r) for r in range(tl.num_ranks))
    return {"bubble_ratio": 1.0 - busy / max(tl.num_ranks * tl.makespan, 1e-12), "makespan_s": tl.makespan,
            "period_s": steady_period(tl.events), "exposed_reduction_s": exposed_reduction(tl.events)}


def exposed_reduction(events: Iterable[Event]) -> float | None:
    """The longest time over ranks that a rank spent in data-parallel reductions (kind ``"reduce"``) with
    nothing else to do: no stage kernel, no optimizer update (kind ``"update"``, Myelin V-C) and no wait
    or receive of the pipeline phase beside it (a reduction started during the phase,
    ``optim.overlap_grad_reduce``, runs beside waits the rank has anyway). None when no reduction was
    recorded (one replica, or a step that was not traced)."""
    def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        for s, e in sorted(spans):
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            else:
                out.append((s, e))
        return out

    by_rank: dict[int, tuple[list, list]] = {}
    for e in events:
        reduce, other = by_rank.setdefault(e.rank, ([], []))
        if e.kind == "reduce":
            reduce.append((e.start, e.end))
        elif e.kind in ("update", "wait", "recv") or e.kind in COMPUTE_KINDS:
            other.append((e.start, e.end))
    worst = None
    for reduce, other in by_rank.values():
        if not reduce:
            continue
        covered = union(other)
        alone = 0.0
        for s, e in union(reduce):
            alone += (e - s) - sum(max(0.0, min(e, b) - max(s, a)) for a, b in covered)
        worst = alone if worst is None else max(worst, alone)
    return worst


def steady_period(events: list[Event]) -> float | None:
    """The measured period of a pipelined step (MadPipe Sec. 3: the time between consecutive microbatches in
    the steady state): the median gap between the forwards' starts on the last stage. Under a periodic
    schedule (MadPipe's, 1F1B*, 1F1B) the last stage runs each microbatch's forward and backward in turn, so
    that gap is one period; under GPipe it is only a forward's time. None with fewer than two microbatches."""
    fwd = [e for e in events if e.kind == "F" and e.stage >= 0]
    if not fwd:
        return None
    last = max(e.stage for e in fwd)
    starts = sorted(e.start for e in fwd if e.stage == last)
    gaps = sorted(b - a for a, b in zip(starts, starts[1:]))
    return gaps[len(gaps) // 2] if gaps else None
