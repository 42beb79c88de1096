"""The trainer: builds the engine, optimizer, data and writers from a config, then runs the step loop.

No feature flags inside the step: the parallel layout is an engine object (single device, pipeline
over MPI, or tensor mesh), the optimizer an updater object (on device, or host-offloaded in buckets).
Each step: engine -> (loss, grads of loss*scale) -> per-process grad stats reduced over the
model-parallel group -> one update (descale, clip, AdamW, or skip on an agreed overflow) -> loss scale.
Every ``train.eval_every`` steps (and at the end) the engine's forward-only ``eval_loss`` scores fixed
batches of the held-out split.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.core.config.schema import Config
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.core.hardware import run_peak_flops
from jaxhybrid.model import Model
from jaxhybrid.model import flops as metrics_lib
from jaxhybrid.model.transformer import PARAM_LAYOUT
from jaxhybrid.optim import lr_schedule
from jaxhybrid.optim.loss_scale import from_config as loss_scale_from_config
from jaxhybrid.optim.memory_report import gather_entries, rank_entry, report_over_ranks, summary_line, write_report
from jaxhybrid.optim.updater import place_like
from jaxhybrid.planner.plan import trace_line
from jaxhybrid.runtime import data as data_lib
from jaxhybrid.runtime.checkpoint.export import check_init_from, params_for, read_meta
from jaxhybrid.runtime.checkpoint.store import Checkpointer, DamagedStep, UnreadableCheckpoint
from jaxhybrid.runtime.config_checks import validate
from jaxhybrid.runtime.data.splits import open_dataset, validation_batches
from jaxhybrid.runtime.engines.build import build_engine, build_updater, committed
from jaxhybrid.runtime.metrics.writer import MetricsWriter
from jaxhybrid.runtime.nonfinite import NonFiniteGuard, NonFiniteStop
from jaxhybrid.runtime.run_dir import check_run_dir, write_run_config
from jaxhybrid.runtime.run_lock import RunLock
from jaxhybrid.runtime.stop import StopOnSignal


@dataclass
class TrainState:
    step: int
    params: Any
    opt_state: Any
    loss_scale: Any
    # Optimizer updates applied so far: the learning-rate schedule's count, which a skipped (overflow) step
    # does not advance. It differs from ``step`` after a skip, so the logged lr needs it, saved and restored.
    updates: int = 0


class Trainer:
    """Runs ``cfg.train.steps`` optimizer steps and writes the run directory (writer rank only)."""

    def __init__(self, cfg: Config, world_size: int | None = None, writes_run_dir: bool = True):
        """``writes_run_dir`` False (benchmarks, which only call :meth:`step`): run.dir is not checked."""
        validate(cfg, world_size)
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.writes_run_dir = writes_run_dir
        if writes_run_dir:
            check_run_dir(cfg)  # writable, and no earlier run's checkpoints unless resuming (same layout)
        check_init_from(cfg)  # an export with this model's shapes, before anything is built
        self.dataset = open_dataset(cfg)  # a missing data file fails here, before anything is written
        self.sampler = data_lib.Sampler(self.dataset, cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed)
        self.val_batches = validation_batches(cfg) if cfg.train.eval_every else []
        self.model = Model(cfg.model, compute_dtype=cfg.precision.compute_dtype)
        self.engine = build_engine(cfg, self.model)
        self.updater = build_updater(cfg, self.engine)
        # The updater's schedule, for the logged lr; jitted as the update computes it (eager optax pays a
        # dispatch per operation every step).
        self.lr = jax.jit(lr_schedule(cfg.optim, cfg.train.steps))
        self.rank = int(self.engine.rank)
        self.streamed = (cfg.optim.stream_allreduce and self.updater.streams_chunks
                         and self.engine.streams_reduced_chunks)

    def overlap_note(self) -> str | None:
        """Why Myelin V-C's overlap of the offloaded update with the all-reduce is partial or off for a
        pipeline with data replicas and ``optim.offload`` (the update otherwise waits silently)."""
        o = self.cfg.optim
        if not (o.offload and o.stream_allreduce and self.cfg.world_size > 1 and self.cfg.parallel.data > 1):
            return None
        if o.shard_optimizer:
            return ("optim.stream_allreduce: with optim.shard_optimizer the gradients are reduce-scattered in one "
                    "program before this replica's shard updates; nothing streams")
        if not self.streamed:
            unused = (f"; optim.allreduce_coarsening={o.allreduce_coarsening} is unused" if o.allreduce_coarsening != 1
                      else "")
            return ("optim.stream_allreduce: the offloaded update waits for the whole all-reduce here (it streams "
                    "only with one device per rank: a tensor mesh's sharded leaves reduce per device); its bucket "
                    f"fetches start after it, so nothing overlaps it{unused}")
        if o.grad_clip > 0:
            return (f"optim.grad_clip={o.grad_clip}: the global norm needs every reduced chunk before the first "
                    f"bucket update, so only the first buckets' fetches are issued before the all-reduce (grad_clip=0 "
                    f"updates each chunk's buckets once it is reduced)")
        return None

    # -- state -------------------------------------------------------------------------------------
    def init_state(self) -> TrainState:
        params = committed(self.engine.init_params(jax.random.key(self.cfg.train.seed)))
        src = self.cfg.train.init_from
        if src and not self.cfg.run.resume:  # exported weights, sliced for this rank
            params = params_for(params, src)
            if self.engine.is_writer:
                meta = read_meta(src)
                print(f"jaxhybrid: weights from {src} (step {meta['step']} of {meta['source']}); a fresh optimizer",
                      file=sys.stderr, flush=True)
        opt_state = committed(self.updater.init(params), like=params)
        # The engine sees the updater's compute copy from step 0 on (offload: bf16/fp16 params, so step 0
        # and a resumed step get half-precision gradients like every other step; on device: unchanged).
        return TrainState(0, committed(self.updater.compute_params(params)), opt_state,
                          loss_scale_from_config(self.cfg.precision))

    def _checkpointer(self) -> Checkpointer:
        return Checkpointer(self.run_dir, self.rank, keep=self.cfg.checkpoint.keep, ranks=self.cfg.world_size)

    def save(self, ckpt: Checkpointer, st: TrainState, finite: bool = True) -> None:
        meta = {"step": st.step, "loss_scale": st.loss_scale.state_dict(), "param_layout": PARAM_LAYOUT,
                "sampler": self.sampler.state_dict(st.step), "seed": self.cfg.train.seed, "updates": st.updates}
        ckpt.save(st.step, {"params": st.params, "opt_state": self.updater.state_dict(st.opt_state)}, meta, finite)

    def _common_step(self, ckpt: Checkpointer, below: float = math.inf) -> int:
        """The newest step below ``below`` that every rank holds (-1: none): ranks that crashed mid-save must
        not be ahead of the rest."""
        mine = max((s for s in ckpt.steps() if s < below), default=-1)
        step = int(-self.engine.global_max(jnp.float32(-mine)))
        if step >= 0 and step not in ckpt.steps():  # only where a rank deleted it (keep=1, or by hand)
            raise ConfigError(f"rank {self.rank} holds checkpoints {ckpt.steps()} in {ckpt.dir} but not step {step}, "
                              f"the newest that every rank saved: no step is common to all ranks")
        return step

    def _restore_step(self, ckpt: Checkpointer, st: TrainState, step: int) -> tuple[Any, dict]:
        def read_saved():  # only an updater whose format depends on the writer's process count reads it
            try:
                return ckpt.state_metadata(step)["opt_state"]
            except UnreadableCheckpoint as e:
                raise DamagedStep(step, f"{ckpt.dir / str(step)} cannot be read ({e.reason})") from None

        opt_like = self.updater.restore_like(st.opt_state, read_saved)
        return ckpt.restore(step, {"params": st.params, "opt_state": opt_like})

    def restore(self, ckpt: Checkpointer, st: TrainState) -> TrainState:
        step = self._common_step(ckpt)
        if step < 0:
            raise ConfigError(f"run.resume=true but no checkpoint was found in {ckpt.dir}")
        while True:  # a step that is damaged on any rank: every rank falls back to the previous common step
            try:
                state, meta = self._restore_step(ckpt, st, step)
                damaged = None
            except DamagedStep as e:
                damaged = e
            if not float(self.engine.global_max(float(damaged is not None))):
                break
            earlier = self._common_step(ckpt, below=step)
            if earlier < 0:
                if damaged is not None:
                    raise damaged
                raise ConfigError(f"step {step} is damaged on another rank and rank {self.rank} holds no earlier step "
                                  f"every rank saved ({ckpt.steps()} in {ckpt.dir}); start a new run")
            if damaged is not None:
                aside = ckpt.set_aside(step)
                print(f"jaxhybrid: rank {self.rank}: {damaged}; moved it to {aside} and resumes from step {earlier}, "
                      f"the previous step every rank saved", file=sys.stderr, flush=True)
            step = earlier
        # Newer steps (a save the last run did not finish on every rank) go once this one has restored: the
        # run saves them again, and they stay for a look if the restore fails.
        dropped = ckpt.discard_after(step)
        if dropped:
            print(f"jaxhybrid: rank {self.rank} resumes from step {step}, the newest every rank saved; deleted "
                  f"its newer checkpoints {dropped} (an unfinished save of the last run)", file=sys.stderr, flush=True)
        params = place_like(st.params, state["params"])
        opt_state = self.updater.load_state_dict(st.opt_state, state["opt_state"])
        self.sampler.load_state_dict(meta["sampler"])
        # Checkpoints from before "updates" was saved: every step counted (exact unless one was skipped).
        updates = int(meta.get("updates", meta["step"]))
        return TrainState(int(meta["step"]), params, opt_state, st.loss_scale.load_state_dict(meta["loss_scale"]),
                          updates)

    # -- loop --------------------------------------------------------------------------------------
    def step(self, st: TrainState) -> tuple[TrainState, dict]:
        cfg = self.cfg
        scale = st.loss_scale.scale
        if st.step + 1 == cfg.train.inject_overflow_step:  # the step as logged (1-based)
            scale = math.inf  # an injected overflow travels the real path: non-finite grads
        batch = self.sampler.batch(st.step)
        # Engines whose ranks hold duplicated leaves (tied embeddings) say which to count in the norm.
        norm_view = self.engine.norm_view
        if self.updater.reduces_over_replicas:  # ZeRO-1: the updater reduce-scatters and all-gathers
            loss, grads = self.engine.loss_and_local_grads(st.params, batch, scale)
            params, opt_state, gnorm, nonfinite = self.updater.apply_local(
                st.params, st.opt_state, grads, scale, self.engine.global_sum, self.engine.global_max, norm_view)
        elif self.streamed:  # Myelin V-C: the offloaded update consumes the all-reduce chunk by chunk
            loss, chunks = self.engine.loss_and_grad_chunks(st.params, batch, scale, self.updater.opt.flatten)
            params, opt_state, gnorm, nonfinite = self.updater.apply_streamed(
                st.params, st.opt_state, chunks, scale, self.engine.global_sum, self.engine.global_max, norm_view)
        else:
            loss, grads = self.engine.loss_and_grads(st.params, batch, scale)
            sq, nonfinite = self.updater.stats(norm_view(grads))
            sq, nonfinite = self.engine.global_sum(sq), self.engine.global_max(nonfinite)
            params, opt_state, gnorm = self.updater.apply(st.params, st.opt_state, grads, scale, sq, nonfinite)
        finite = not bool(nonfinite)
        # lr: what this step's update applied (or would have, when skipped), as Megatron-LM logs it.
        info = {"loss": float(loss), "grad_norm": float(gnorm), "lr": float(self.lr(st.updates)),
                "loss_scale": float(scale), "skipped": not finite}
        return TrainState(st.step + 1, params, opt_state, st.loss_scale.update(finite), st.updates + finite), info

    def evaluate(self, params) -> dict:
        """Validation loss (mean over the fixed val batches), its perplexity and the time it took."""
        t0 = time.perf_counter()
        losses = [float(self.engine.eval_loss(params, b)) for b in self.val_batches]
        loss = float(np.mean(losses))
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 80.0)), "eval_time_s": time.perf_counter() - t0}

    def run(self) -> dict:
        """Train, holding run.dir's lock (:mod:`jaxhybrid.runtime.run_lock`) from before the resume reads it."""
        lock, refused = None, None
        if self.writes_run_dir and self.engine.is_writer:
            try:
                lock = RunLock(self.run_dir).acquire()
            except ConfigError as e:
                refused = e
        if float(self.engine.global_max(float(refused is not None))):  # every rank stops, not the writer alone
            raise refused or ConfigError(f"{self.run_dir} is in use by another job (the writer rank names it)")
        try:
            return self._train()
        finally:
            if lock is not None:
                lock.release()

    def _train(self) -> dict:
        cfg = self.cfg
        writer = self.engine.is_writer
        # Before any compilation: a named file's peak for the compute dtype, or the device's file (auto).
        peak, peak_note = run_peak_flops(cfg.metrics.hardware, cfg.precision.compute_dtype,
                                                     jax.devices()[0])
        st = self.init_state()
        ckpt = self._checkpointer()
        if cfg.run.resume:
            st = self.restore(ckpt, st)

        # Collective: every rank's phi on the writer, which reports the fullest rank (with and without offload).
        entries = gather_entries(self.engine, rank_entry(self.engine, st.params))
        mem = report_over_ranks(cfg, entries) if writer else None
        if writer:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_run_config(self.run_dir, cfg, st.step)
            write_report(self.run_dir, mem)
            print(summary_line(mem), file=sys.stderr, flush=True)
            print(f"jaxhybrid: {peak_note}", file=sys.stderr, flush=True)
        n_dev = cfg.num_devices
        mw = MetricsWriter(self.run_dir, total_steps=cfg.train.steps, tensorboard=cfg.metrics.tensorboard,
                           progress=cfg.metrics.progress, is_writer=writer,
                           log_every=cfg.train.log_every, start_step=st.step, title=cfg.run.name)
        batch, seq = cfg.train.global_batch, cfg.data.seq_len
        # Model flops (mfu) count no recomputation; hardware flops (hfu) add what train.remat recomputes.
        flops = metrics_lib.model_flops_per_step(cfg.model, batch, seq)
        hw_flops = metrics_lib.hardware_flops_per_step(cfg.model, batch, seq, cfg.train.remat)
        losses, times, last_val, traced_apart = [], [], None, False
        guard, stop_line = NonFiniteGuard(cfg.train.max_nonfinite_steps), None
        try:
            with StopOnSignal() as stop:  # SIGINT/SIGTERM: stop after the step, saved (jaxhybrid/runtime/stop.py)
                while st.step < cfg.train.steps:
                    if cfg.metrics.trace and st.step + 1 == cfg.train.steps:
                        # The trace written below is this step's: kernel times, synced. Where the others were
                        # dispatched asynchronously its time is not theirs: the summary leaves it out.
                        traced_apart = not self.engine.tasks_timed
                        self.engine.time_tasks()
                    t0, scale = time.perf_counter(), st.loss_scale
                    st, info = self.step(st)
                    dt = time.perf_counter() - t0
                    losses.append(info["loss"])
                    times.append(dt)
                    rec = {"step": st.step, **info, "step_time_s": dt,
                           "tokens_per_s": metrics_lib.tokens_per_s(batch, seq, dt),
                           # mfu/hfu null: no peak for this device
                           **metrics_lib.step_flop_rates(flops, hw_flops, dt, n_dev, peak),
                           "time_to_train_s": metrics_lib.time_to_train_s(dt, batch, seq)}
                    ev = cfg.train.eval_every
                    if ev and (st.step % ev == 0 or st.step == cfg.train.steps):
                        rec.update(self.evaluate(st.params))
                        last_val = rec["val_loss"]
                    mw.log(st.step, rec)
                    stop_line = guard.observe(st.step, info, scale)  # the same on every rank: agreed flags
                    if stop_line:
                        break
                    every = cfg.checkpoint.every
                    if every and st.step % every == 0 and st.step < cfg.train.steps:
                        self.save(ckpt, st, finite=not guard.streak)
                    # All ranks agree (their steps are coupled: one stopping alone would leave the rest waiting).
                    if st.step < cfg.train.steps and float(self.engine.global_max(float(bool(stop.requested)))):
                        if st.step > (ckpt.latest() or 0):
                            self.save(ckpt, st, finite=not guard.streak)
                        print(f"jaxhybrid: stopped by {stop.requested or 'another rank'}; rank {self.rank} saved "
                              f"step {st.step} in {ckpt.dir} (continue with --resume)", file=sys.stderr, flush=True)
                        # Under `python -m mpi4py` the first rank to exit with status 130 aborts the job: every
                        # rank closes its files, then they meet, so none is killed inside its save or plot.
                        ckpt.close()
                        mw.close(plot=cfg.metrics.plot)
                        self.engine.global_max(0.0)
                        raise KeyboardInterrupt(stop.requested)
                if cfg.checkpoint.at_end and not stop_line:
                    self.save(ckpt, st, finite=not guard.streak)
                if cfg.metrics.trace and not stop_line:
                    traced = self.engine.write_trace(self.run_dir)  # collective: every rank sends its events
                    if writer and traced:
                        print(f"jaxhybrid: {trace_line(traced, cfg.plan.file)}", file=sys.stderr, flush=True)
        finally:
            ckpt.close()
            mw.close(plot=cfg.metrics.plot)
        # Every rank reaches here after the same last step (an interrupt or a failure aborts the job instead):
        # a pipeline rank cancels its posted receives, frees its communicators and stops its watchdog.
        self.engine.close()
        if stop_line:
            raise NonFiniteStop(stop_line)
        self.final_state = st
        # Steady state (Myelin VI-D averages the last 10 of 11 batches): the steps after the first, which compiles.
        return {"steps": st.step, "first_loss": losses[0] if losses else None,
                "last_loss": losses[-1] if losses else None, "last_val_loss": last_val,
                **metrics_lib.steady_state(times[:-1] if traced_apart and len(times) > 2 else times, flops,
                                           hw_flops, batch, seq, n_dev, peak)}
