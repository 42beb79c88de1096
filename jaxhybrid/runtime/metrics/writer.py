"""The run's metric record: ``metrics.jsonl`` (one JSON object per step), TensorBoard scalars, a progress
bar (plain lines when stderr is not a terminal) and ``loss_curve.png`` at the end. The formulas behind
the throughput columns are in :mod:`jaxhybrid.model.flops`.

Names: every number of a ``metrics.jsonl`` line is a TensorBoard scalar of the same step, tagged
``train/<key>`` (``train/loss``, ``train/tflops_per_device``, ``train/mfu``, ``train/hw_tflops_per_device``,
``train/hfu``, ...), except the evaluation's, which go under ``val/`` without their prefix (``val_loss``
-> ``val/loss``, ``val_ppl`` -> ``val/ppl``, ``eval_time_s`` -> ``val/time_s``). The console's line shows
loss, val_loss, val_ppl and the evaluation's time (on the steps that evaluate), lr, tok/s, TFLOP/s/dev
(``tflops_per_device``), mfu, hfu, s/step and the loss scale; a terminal's progress bar shows loss, val_loss,
tok/s and mfu.
Both files are flushed at every step: a killed run keeps every step it logged, in both.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from jaxhybrid.runtime.metrics.tb_events import EVENTS_PREFIX, EventFile, tb_tag


def finite_or_none(x: Any) -> Any:
    """JSON has no NaN/Infinity: a non-finite float (an overflow step's scale, a diverged loss) is null, in
    metrics.jsonl and in ``jaxhybrid train``'s summary on stdout."""
    if hasattr(x, "item") and not isinstance(x, (list, dict)):
        x = x.item()  # numpy / jax scalars
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class MetricsWriter:
    """Per-step metrics of a run, written by the writer rank only (other ranks: every call is a no-op).

    Args:
      run_dir: the run directory (created).
      total_steps: steps of the whole run (for the progress bar).
      tensorboard: write TensorBoard event files under ``run_dir/tensorboard``.
      progress: a tqdm bar when ``stream`` is a terminal, else a plain line every ``log_every`` steps.
      is_writer: False on every rank but the writer.
      log_every: plain-line interval.
      start_step: steps already done (resume): earlier lines of ``metrics.jsonl`` with a later step
        (written after the checkpoint the run resumes from) are dropped, so each step appears once.
      stream: where progress goes (default stderr, keeping stdout for the command's JSON summary).
      title: the loss curve's title (``run.name``); empty: the run directory's name.
    """

    def __init__(self, run_dir: str | Path, *, total_steps: int, tensorboard: bool = True, progress: bool = True,
                 is_writer: bool = True, log_every: int = 10, start_step: int = 0, stream: TextIO | None = None,
                 title: str = ""):
        self.enabled = bool(is_writer)
        self._closed = False
        if not self.enabled:
            return
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.title = title or self.run_dir.name
        self.path = self.run_dir / "metrics.jsonl"
        self.total_steps, self.log_every, self.start_step = int(total_steps), max(1, int(log_every)), int(start_step)
        self.stream = stream or sys.stderr
        self._series = self._keep_earlier_records()  # plotted: {"loss": [(step, v)], "val_loss": [...]}
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            if not self.start_step:  # a new run (run.overwrite): an earlier run's events would mix with its own
                for old in (self.run_dir / "tensorboard").glob(EVENTS_PREFIX + "*"):
                    old.unlink()
            # purge_step hides events of steps after the resume point left by an interrupted run.
            self._tb = EventFile(self.run_dir / "tensorboard",
                                 purge_step=self.start_step + 1 if self.start_step else None)
        self._bar = None
        self._plain = bool(progress) and not _isatty(self.stream)
        if progress and not self._plain:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, initial=self.start_step, file=self.stream, unit="step",
                             dynamic_ncols=True)

    def _keep_earlier_records(self) -> dict[str, list[tuple[int, float]]]:
        """Keep lines with ``step <= start_step``, rewritten atomically; return their plotted points."""
        series: dict[str, list[tuple[int, float]]] = {k: [] for k in _PLOTTED}
        if not self.path.is_file():
            return series
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash mid-write
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= self.start_step:
                kept.append(line)
                _collect(series, rec)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(l + "\n" for l in kept), encoding="utf-8")
        os.replace(tmp, self.path)
        return series

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record ``metrics`` of ``step``: one JSON line and its TensorBoard scalars (both flushed), progress."""
        if not self.enabled or self._closed:
            return
        rec = {"step": int(step), **{k: finite_or_none(v) for k, v in metrics.items() if k != "step"}}
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()  # a crash loses at most the line being written
        _collect(self._series, rec)
        if self._tb is not None:
            self._tb.scalars(rec["step"], {tb_tag(k): v for k, v in rec.items()
                                           if k != "step" and isinstance(v, (int, float))})
            self._tb.flush()  # with metrics.jsonl's line: a killed run loses neither
        if self._bar is not None:
            self._bar.n = rec["step"]
            self._bar.set_postfix_str(_summary(rec, short=True), refresh=True)
        elif self._plain and (rec["step"] % self.log_every == 0 or rec["step"] == self.total_steps
                              or rec["step"] == self.start_step + 1 or "val_loss" in rec):  # every evaluation
            print(f"step {rec['step']}/{self.total_steps} {_summary(rec)}", file=self.stream, flush=True)

    def close(self, plot: bool = True) -> None:
        """Close every output; with ``plot``, write ``loss_curve.png`` from all recorded steps."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        if plot:
            plot_loss(self._series["loss"], self.run_dir / "loss_curve.png", title=self.title,
                      val=self._series["val_loss"])

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close(plot=False)


_PLOTTED = ("loss", "val_loss")


def _collect(series: dict[str, list[tuple[int, float]]], rec: dict[str, Any]) -> None:
    """Append ``rec``'s plotted values (those it has) to their series."""
    for k in _PLOTTED:
        if isinstance(rec.get(k), (int, float)):
            series[k].append((rec["step"], float(rec[k])))


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _summary(rec: dict[str, Any], short: bool = False) -> str:
    fields = [("loss", "loss {:.4f}"), ("val_loss", "val_loss {:.4f}"), ("val_ppl", "val_ppl {:.4g}"),
              ("eval_time_s", "eval {:.3g} s"), ("lr", "lr {:.3g}"),
              ("tokens_per_s", "{:,.0f} tok/s"),
              ("tflops_per_device", "{:.3g} TFLOP/s/dev"), ("mfu", "mfu {:.1%}"), ("hfu", "hfu {:.1%}"),
              ("step_time_s", "{:.3f} s/step"),
              ("loss_scale", "scale {:g}")]
    if short:  # the progress bar's postfix
        fields = [f for f in fields if f[0] in ("loss", "val_loss", "tokens_per_s", "mfu")]
    parts = [fmt.format(rec[k]) for k, fmt in fields if isinstance(rec.get(k), (int, float))]
    if rec.get("skipped"):
        parts.append("SKIPPED (overflow)")
    return "  ".join(parts)


def plot_loss(points: list[tuple[int, float]], path: str | Path, title: str = "",
              val: list[tuple[int, float]] = ()) -> Path | None:
    """Loss against step as a PNG (Agg canvas: no display, no global backend switch), with the
    validation losses ``val`` as markers; None if no points."""
    pts = sorted((s, l) for s, l in points if math.isfinite(l))
    if not pts:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps, losses = zip(*pts)
    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, losses, lw=0.8, alpha=0.5 if len(pts) > 20 else 1.0, label="loss")
    if len(pts) > 20:  # an exponential moving average shows the trend through batch noise
        ema, smooth = losses[0], []
        for l in losses:
            ema = 0.9 * ema + 0.1 * l
            smooth.append(ema)
        ax.plot(steps, smooth, lw=1.5, label="EMA (0.9)")
    vpts = sorted((s, l) for s, l in val if math.isfinite(l))
    if vpts:
        ax.plot(*zip(*vpts), "o-", ms=3, lw=1.0, label="validation")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    return out
