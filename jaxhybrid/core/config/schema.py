"""Typed, frozen run configuration: defaults in dataclasses, overrides from YAML and ``--set``.

A config is built in three layers, later ones winning: dataclass defaults, a YAML file of overrides,
then ``--set section.key=value`` pairs. Unknown keys are errors; every range and cross-field rule is checked
in :func:`validate` (:mod:`jaxhybrid.runtime.config_checks`) before any compilation or communication, with a message
that shows the numbers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from jaxhybrid.core.config.model import ModelConfig
from jaxhybrid.core.config.parse import to_plain
from jaxhybrid.core.layout import ParallelDims


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"  # run directory: metrics.jsonl, config.yaml, checkpoints, traces
    name: str = ""  # the run's label: loss_curve.png's title; "" = the run directory's name
    resume: bool = False  # continue from the latest checkpoint in dir
    # train over a dir whose earlier run left metrics but no checkpoint, replacing its metrics.jsonl and
    # TensorBoard events (false: such a dir is refused, so two runs' records never mix)
    overwrite: bool = False
    compilation_cache: str = "auto"  # persistent XLA cache dir for `jaxhybrid train`; auto: $JAXHYBRID_CACHE/xla; "": off


@dataclass(frozen=True)
class DataConfig:
    path: str = ""  # token memmap (.bin) from `jaxhybrid prepare-data`; empty = built-in corpus
    # byte | bpe for the built-in corpus; a data.path's ids were fixed by prepare-data (another value is an error)
    tokenizer: str = "byte"
    seq_len: int = 128  # tokens per sequence (targets are the next tokens)
    # Tail of the built-in corpus held out for evaluation. A data.path's split was fixed by prepare-data
    # --val-fraction: another value than the data's (and this default) is an error, not ignored.
    val_fraction: float = 0.02


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200  # optimizer steps
    global_batch: int = 16  # sequences per step, over all replicas and microbatches
    seed: int = 0  # parameter init and sampler seed
    log_every: int = 10  # steps between progress lines (metrics.jsonl and TensorBoard get every step)
    remat: str = "none"  # activation checkpointing policy: none | dots | full
    # Myelin's ac: blocks per recomputed segment with remat full, a factor of every stage's blocks (N / G_inter);
    # 0 = the optimal one (Sec. V-A)
    checkpoint_interval: int = 0
    inject_overflow_step: int = -1  # test hook: make this step's gradients non-finite (as logged, from 1); -1: off
    # Stop (non-zero status, nothing saved) after this many skipped non-finite steps in a row, or on a skip with
    # the float16 loss scale at its floor; 25 covers the 15 halvings from 2^15 to 1 with margin. 0 = never stop
    max_nonfinite_steps: int = 25
    eval_every: int = 0  # steps between validation losses on the held-out split (and at the end); 0 = off
    eval_batches: int = 4  # global batches of the validation split per evaluation (the same ones each time)
    init_from: str = ""  # a `jaxhybrid export` folder: start from its weights (any layout), fresh optimizer


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3  # Myelin Sec. VI-C
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.999  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's denominator epsilon (added to sqrt of the second moment)
    weight_decay: float = 0.01  # decoupled (AdamW)
    weight_decay_mask: str = "matrices"  # matrices: kernels and embeddings decay, biases and norm scales not | all
    warmup_steps: int = 20  # updates ramping to lr; a run of no more steps ramps over train.steps - 1 (its last: lr)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    offload: bool = False  # fp32 master weights + Adam state on host, streamed in buckets (Myelin V-B)
    bucket_size: int = 1 << 20  # elements per offload bucket (bsize); at most a rank's parameter count
    # k (Myelin V-C): the streamed all-reduce's chunks hold k * bucket_size elements. Used only where the offloaded
    # update streams it: offload and stream_allreduce on, parallel.data > 1 as MPI ranks of one device each;
    # elsewhere the gradients are reduced whole. Other than 1 needs offload.
    allreduce_coarsening: int = 1
    stream_allreduce: bool = True  # offload x data replicas: update each reduced chunk's buckets at once (V-C)
    # What the MPI data replicas' all-reduce moves: float32 (MPI reduces no half floats), or compute: the
    # offloaded optimizer's half-precision gradients as they are (Myelin IV-B; optim/half_allreduce.py).
    allreduce_dtype: str = "float32"
    # Data replicas' gradient sum: mpi (mpi4jax) | xla (a JAX mesh per data column: NCCL on GPUs, gloo on CPU) |
    # auto: xla where JAX computes on an accelerator (GPUs) and the replicas are MPI ranks, else mpi
    allreduce_backend: str = "auto"
    # mpi backend, one device per rank, float32 wire: start each stage's reduction, in buckets of bucket_size, as soon
    # as the schedule has written its gradients for the last time (non-blocking MPI, beside the rest of the phase).
    overlap_grad_reduce: bool = True
    # ZeRO-1 over data replicas that are MPI ranks: reduce-scatter the gradients, each replica updates 1/G_data of the
    # optimizer state (and of the host masters with offload), all-gather the parameters.
    shard_optimizer: bool = False


@dataclass(frozen=True)
class PrecisionConfig:
    compute_dtype: str = "float32"  # float32 | bfloat16 | float16
    param_dtype: str = "float32"  # master weights
    loss_scale_init: float = 2.0**15  # dynamic loss scaling (used for float16; bfloat16 may opt in)
    loss_scale_window: int = 1000  # grow the scale after this many finite steps
    dynamic_loss_scale: bool | None = None  # None = on for float16 only


@dataclass(frozen=True)
class ParallelConfig:
    pipeline: int = 1  # G_inter: pipeline stages
    data: int = 1  # G_data: data-parallel replicas
    tensor_col: int = 1  # G_c
    tensor_row: int = 1  # G_r
    tensor_depth: int = 1  # G_d
    partition: tuple[int, ...] = ()  # blocks per stage; empty = even split
    # Data replicas as a mesh axis of one process (or of --distributed processes), all-reduced by XLA's
    # collectives (NCCL on GPUs), even without tensor axes; false: MPI ranks (Myelin's bucketed all-reduce).
    # Tensor layouts (pipeline 1, a tensor axis > 1) always put data on their mesh.
    mesh_data: bool = False


# Read by the MPI pipeline engine (more than one rank); a one-process run reads only microbatches and notes
# the others it sets (jaxhybrid.runtime.config_notes).
@dataclass(frozen=True)
class PipelineConfig:
    schedule: str = "1f1b"  # naive | gpipe | 1f1b | zb-h1 | myelin | 1f1b-star | interleaved-1f1b | zb-v | periodic
    microbatches: int = 1  # per replica per step
    split_backward: bool = False  # 2BP: separate input- and weight-gradient passes
    pipeline_limit: int = 0  # schedule myelin only (others: must be 0): microbatches in flight; 0 = parallel.pipeline
    virtual_stages: int = 1  # stages per pipeline rank (v): the model is cut into parallel.pipeline x v stages
    placement: str = "loop"  # a rank's stages: loop (r, r+p, r+2p, ...; Megatron-LM) | v (v = 2: r and 2p-1-r; zb-v)
    # The rank of each stage, for any number of stages per rank (a MadPipe allocation from `jaxhybrid partition
    # --out`; schedules naive, gpipe, myelin, periodic); empty: parallel.pipeline x virtual_stages by placement.
    stage_to_rank: tuple[int, ...] = ()
    # Schedule periodic only: one period's passes in order, F<stage>+<shift> | B<stage>+<shift> (MadPipe Sec. 3:
    # microbatch b runs it in period b + shift), as `jaxhybrid partition --out` writes them.
    pattern: tuple[str, ...] = ()
    # How activations cross the stages: mpi4jax (received into a device buffer; sent from it where MPI reads device
    # memory, with MPI4JAX_USE_CUDA_MPI=1 on GPUs, else through host memory) | mpi4py
    # (host-staged, receives posted ahead) | transfer (pulled into device buffers by JAX's transfer server: its runtime
    # copies through pinned host memory and TCP off the loop; an MPI header)
    transport: str = "mpi4jax"
    # The event loop's kernels: async (dispatched, Myelin IV-A) | sync (each waited for) | auto: sync on CPU,
    # where a rank's polling shares its core with XLA:CPU's kernels, async elsewhere (pipeline/engine.py).
    dispatch: str = "auto"
    # 2BP: one BW over several microbatches as sum (their weight passes in one program) | concat (2BP Fig. 2:
    # residuals copied into one batch, one larger matmul per site) | auto (concat where that copy moves fewer bytes
    # than K gradient trees and is at most one tree, else sum: jaxhybrid.parallel.twobp.stage.auto_weight_join)
    weight_join: str = "auto"
    watchdog_s: float = 300.0  # abort if a rank makes no progress for this long
    watchdog_compile_s: float = 1800.0  # the same, the first time each phase runs (compiling); the larger of the two


@dataclass(frozen=True)
class TensorConfig:
    optimizations: str = "ABCDE"  # AxoNN Sec. IV optimizations switched on


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep: int = 2  # newest checkpoints kept per rank, >= 1; >= 2 with several ranks (orbax max_to_keep)
    at_end: bool = True  # save the final step (false with every 0: none; a signal-stopped run saves its step anyway)


@dataclass(frozen=True)
class MetricsConfig:
    hardware: str = "auto"  # configs/hardware/<name>.yaml (peak flop/s for MFU); auto: the run's device's
    tensorboard: bool = True  # TensorBoard events of every step in run.dir (needs tensorboardX)
    plot: bool = True  # loss_curve.png in run.dir at the end
    trace: bool = False  # Chrome trace of the MPI ranks' last step (a one-process run writes none, and notes it)
    progress: bool = True  # console: a bar on a terminal, else a line every train.log_every steps; false: none


@dataclass(frozen=True)
class PlanConfig:
    file: str = ""  # a plan JSON from `jaxhybrid plan`; its layout overrides parallel/pipeline keys


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    tensor: TensorConfig = field(default_factory=TensorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    @property
    def layout(self) -> ParallelDims:
        """The parallel layout ``parallel.*`` describes (sizes, derived counts, rank arithmetic)."""
        p = self.parallel
        return ParallelDims(p.pipeline, p.data, p.tensor_col, p.tensor_row, p.tensor_depth, p.mesh_data)

    @property
    def microbatch_size(self) -> int:
        """Sequences per microbatch: global_batch / (data x microbatches)."""
        return self.train.global_batch // (self.layout.data * self.pipeline.microbatches)

    @property
    def on_mesh(self) -> bool:
        """Tensor mode (:attr:`ParallelDims.on_mesh`)."""
        return self.layout.on_mesh

    @property
    def world_size(self) -> int:
        """MPI ranks (:attr:`ParallelDims.world_size`)."""
        return self.layout.world_size

    @property
    def num_devices(self) -> int:
        """Devices of the whole job (:attr:`ParallelDims.num_devices`)."""
        return self.layout.num_devices

    @property
    def tensor_size(self) -> int:
        """G_d x G_r x G_c (:attr:`ParallelDims.tensor_size`)."""
        return self.layout.tensor_size

    def on_platform(self, accelerator: bool) -> Config:
        """This config as a run trains it where JAX computes on an accelerator (``accelerator``) or on the CPU:
        its ``auto`` settings that depend on the platform resolved (:func:`allreduce_backend_on`)."""
        backend = allreduce_backend_on(self.optim.allreduce_backend, accelerator, self.layout.replicas_on_ranks)
        return dataclasses.replace(self, optim=dataclasses.replace(self.optim, allreduce_backend=backend))

    def to_dict(self) -> dict[str, Any]:
        return to_plain(dataclasses.asdict(self))


def allreduce_backend_on(setting: str, accelerator: bool, replicas_on_ranks: bool = True) -> str:
    """``optim.allreduce_backend`` as it runs: ``auto`` is ``xla`` where JAX computes on an accelerator and
    the data replicas are MPI ranks, else ``mpi``; ``mpi`` and ``xla`` stay as they are.

    Why: on GPUs XLA's collective (NCCL) sums the gradients where they are, as Myelin Sec. IV-B does, while
    ``mpi`` copies them to the host and back each step; on CPU mpich's shared-memory sum is the faster one
    (``jaxhybrid bench allreduce`` measures both side by side). Without replicas on ranks ``xla`` has
    nothing to reduce.
    """
    if setting != "auto":
        return setting
    return "xla" if accelerator and replicas_on_ranks else "mpi"


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


