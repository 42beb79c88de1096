"""Every rule a run config must meet, checked by :func:`validate` before any compilation or communication.

Single-field ranges come first (:mod:`jaxhybrid.core.config.ranges`), so a value out of its range is named as
such rather than as a symptom in some later rule (e.g. ``data.val_fraction=-0.1`` with evaluation on is
out of [0, 1), not "a split that holds none"). The cross-field rules then see only in-range values.
:mod:`jaxhybrid.core.config.schema` re-exports :func:`validate`; this module imports no config classes at run time,
so the two do not import each other in a cycle.
"""
from __future__ import annotations

from functools import reduce
from typing import TYPE_CHECKING

from jaxhybrid.core.config.model import REMATS
from jaxhybrid.core.config.parse import flatten, lookup, to_plain
from jaxhybrid.core.config.ranges import range_errors
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.parallel.pipeline.schedule import configured_schedule
from jaxhybrid.parallel.pipeline.topology import partition_blocks
from jaxhybrid.runtime.data.tokenizer import TOKENIZERS

if TYPE_CHECKING:
    from jaxhybrid.core.config.schema import Config

DTYPES = ("float32", "bfloat16", "float16")


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Check every rule; raise :class:`ConfigError` naming the values and the fix. Ranges first: a rule
    across fields would only report a symptom of a value out of its range."""
    cfg.model.validate()
    errors = range_errors(cfg)
    if errors:
        raise ConfigError(_with_plan_note(cfg, "; ".join(errors)))
    errors = _cross_field_errors(cfg)
    p = cfg.parallel
    if world_size is not None and world_size != cfg.world_size:
        errors.append(f"parallel.pipeline({p.pipeline}) x parallel.data({p.data}) = {cfg.world_size} "
                      f"!= world size {world_size}; "
                      + (f"start {cfg.world_size} ranks (jaxhybrid launch -n {cfg.world_size})" if cfg.world_size > 1
                         else "run it as one process (jaxhybrid train, or jaxhybrid launch -n 1)")
                      + " or change the grid"
                      + ("; or parallel.mesh_data=true for data replicas on this process's devices"
                         if world_size == 1 and p.pipeline == 1 else ""))
    if errors:
        raise ConfigError(_with_plan_note(cfg, "; ".join(errors)))


def _with_plan_note(cfg: Config, message: str) -> str:
    """``message``, and the values among those it names that ``plan.file`` set: a plan sits between the YAML
    file and ``--set`` (layout, remat, dtype, batch), so the run may break a rule with a value its own
    config does not hold. A key whose value differs from the plan's was set over it by the command line."""
    if not cfg.plan.file:
        return message
    from jaxhybrid.planner.plan import load_plan_overrides

    try:
        planned = flatten(load_plan_overrides(cfg.plan.file))
    except (OSError, ValueError):  # a plan that cannot be read says so where it is loaded; the rule's message stands
        return message
    named = [f"{k}={to_plain(v)}" for k, v in planned.items()
             if k in message and lookup(cfg, k) == to_plain(v)]
    return f"{message} (plan.file={cfg.plan.file} set {', '.join(named)})" if named else message


def _cross_field_errors(cfg: Config) -> list[str]:
    m, t, p, pl, pr = cfg.model, cfg.train, cfg.parallel, cfg.pipeline, cfg.precision
    errors = []
    if t.eval_every and not cfg.data.path and cfg.data.val_fraction <= 0:
        errors.append(f"train.eval_every={t.eval_every} needs a validation split, but data.val_fraction="
                      f"{cfg.data.val_fraction} holds none out of the built-in corpus: set it > 0 or eval_every=0")

    if cfg.data.tokenizer not in TOKENIZERS:  # the ranks' data preparation found it, after mpiexec started
        errors.append(f"data.tokenizer={cfg.data.tokenizer!r}; choose {' or '.join(TOKENIZERS)}")
    if cfg.data.seq_len > m.max_seq_len:
        errors.append(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    per = p.data * pl.microbatches
    if t.global_batch % per:
        errors.append(
            f"train.global_batch={t.global_batch} is not divisible by parallel.data({p.data}) x "
            f"pipeline.microbatches({pl.microbatches}) = {per}; use a multiple of {per}")
    if pr.compute_dtype not in DTYPES:
        errors.append(f"precision.compute_dtype={pr.compute_dtype!r}; choose one of {', '.join(DTYPES)}")
    if pr.param_dtype != "float32":
        errors.append(f"precision.param_dtype={pr.param_dtype!r}: master weights must be float32")
    if m.attention == "cudnn" and pr.compute_dtype in DTYPES:  # the device is checked where the engine is built
        from jaxhybrid.model.attention import cudnn_unmet

        if why := cudnn_unmet(pr.compute_dtype, m.head_dim):
            # A 16-bit dtype is offered only where the same rule says it would be enough.
            dtype_fix = "" if cudnn_unmet("bfloat16", m.head_dim) else "precision.compute_dtype=bfloat16, or "
            errors.append(f"model.attention=cudnn needs bfloat16/float16 compute and head_dim a multiple of 8 <= 128 "
                          f"(cuDNN's fused attention); got {', '.join(why)}: set {dtype_fix}model.attention=auto "
                          f"(cuDNN where it can run) or xla")
    if t.remat not in REMATS:
        errors.append(f"train.remat={t.remat!r}; choose one of {', '.join(REMATS)}")
    if cfg.optim.weight_decay_mask not in ("matrices", "all"):
        errors.append(f"optim.weight_decay_mask={cfg.optim.weight_decay_mask!r}; choose matrices (kernels and "
                      f"embeddings decay, biases and norm scales do not) or all")
    # The schedule module is the one source of its rules (names, microbatches per stage, 2BP needs).

    try:
        configured_schedule(pl, p.pipeline)
    except ValueError as e:
        chunks = (f", pipeline.virtual_stages={pl.virtual_stages}, pipeline.placement={pl.placement!r}"
                  if (pl.virtual_stages, pl.placement) != (1, "loop") else "")
        chunks += f", pipeline.stage_to_rank={list(pl.stage_to_rank)}" if pl.stage_to_rank else ""
        errors.append(f"pipeline.schedule={pl.schedule!r} with parallel.pipeline={p.pipeline}, "
                      f"pipeline.microbatches={pl.microbatches}{chunks}: {e}")
    else:
        if pl.schedule != pl.schedule.lower():  # make_schedule reads any case; the rules below and the planner do not
            errors.append(f"pipeline.schedule={pl.schedule!r}: schedule names are lower case; use "
                          f"pipeline.schedule={pl.schedule.lower()}")
    if pl.pipeline_limit and pl.schedule.lower() != "myelin":
        # Only Myelin's message-driven policy (Alg. 2) caps the microbatches in flight; a static schedule runs
        # its rows in their fixed order and would ignore the limit without a word.
        errors.append(f"pipeline.pipeline_limit={pl.pipeline_limit} is read only by pipeline.schedule='myelin' "
                      f"(Myelin Alg. 2's microbatches in flight); pipeline.schedule={pl.schedule!r} runs a fixed "
                      f"order and would ignore it: set pipeline.pipeline_limit=0 or pipeline.schedule=myelin")
    if pl.schedule in ("zb-h1", "zb-v") and not pl.split_backward and (p.pipeline > 1 or pl.schedule == "zb-v"):
        # ZB-H1 and ZB-V are made of the split passes (their weight passes fill the bubbles): they run them
        # either way, so a false here would be ignored without a word, and the planner scores zb-h1 as split.
        other = "1f1b" if pl.schedule == "zb-h1" else "interleaved-1f1b"
        errors.append(f"pipeline.schedule={pl.schedule!r} always splits the backward into input and weight passes; "
                      f"set pipeline.split_backward=true (or choose {other} without the split)")
    if pl.transport not in ("mpi4jax", "mpi4py", "transfer"):
        errors.append(f"pipeline.transport={pl.transport!r}; choose mpi4jax, mpi4py or transfer")
    if pl.dispatch not in ("auto", "async", "sync"):
        errors.append(f"pipeline.dispatch={pl.dispatch!r}; choose auto, async or sync")
    if pl.weight_join not in ("auto", "sum", "concat"):
        errors.append(f"pipeline.weight_join={pl.weight_join!r}; choose auto, sum or concat")
    if p.mesh_data and p.pipeline > 1:
        errors.append(f"parallel.mesh_data=true with parallel.pipeline={p.pipeline}: a pipeline's data replicas "
                      f"are MPI ranks; set mesh_data=false, or pipeline=1 for one mesh")
    if pl.pattern and pl.schedule != "periodic":
        errors.append(f"pipeline.pattern is read only by pipeline.schedule='periodic'; pipeline.schedule="
                      f"{pl.schedule!r} would ignore it: clear pipeline.pattern or set pipeline.schedule=periodic")
    v, stages = pl.virtual_stages, len(pl.stage_to_rank) or p.pipeline * pl.virtual_stages
    if p.pipeline > m.n_layers:
        errors.append(f"parallel.pipeline={p.pipeline} stages exceed model.n_layers={m.n_layers} blocks")
    elif pl.stage_to_rank and stages > m.n_layers:
        errors.append(f"pipeline.stage_to_rank has {stages} stages, more than model.n_layers={m.n_layers} blocks; "
                      f"every stage needs one")
    elif p.pipeline * v > m.n_layers:  # every stage (chunk) needs at least one block
        errors.append(f"parallel.pipeline={p.pipeline} x pipeline.virtual_stages={v} = {p.pipeline * v} stages "
                      f"exceed model.n_layers={m.n_layers} blocks; every stage needs one: use at most "
                      f"{m.n_layers // p.pipeline} virtual stages")
    if p.partition:
        count = (f"pipeline.stage_to_rank's {stages} (one per stage)" if pl.stage_to_rank else
                 f"parallel.pipeline={p.pipeline}" if v == 1 else
                 f"parallel.pipeline={p.pipeline} x pipeline.virtual_stages={v} = {p.pipeline * v} (one per stage)")
        if len(p.partition) != stages or any(b < 1 for b in p.partition) or sum(p.partition) != m.n_layers:
            errors.append(f"parallel.partition={list(p.partition)} must have {count} "
                          f"positive entries summing to model.n_layers={m.n_layers}")
    o = cfg.optim
    if o.allreduce_coarsening != 1 and not o.offload:
        # k only sizes the chunks the offloaded optimizer takes from the streamed all-reduce (Myelin V-C); the
        # on-device update gets the whole gradient from one all-reduce program.
        errors.append(f"optim.allreduce_coarsening={o.allreduce_coarsening} sizes the all-reduce chunks that the "
                      f"offloaded optimizer updates as they arrive (Myelin V-C: k x optim.bucket_size); without "
                      f"optim.offload=true the gradients are reduced whole and it is unused: set optim.offload=true "
                      f"or optim.allreduce_coarsening=1")
    if o.allreduce_dtype not in ("float32", "compute"):
        errors.append(f"optim.allreduce_dtype={o.allreduce_dtype!r}; choose float32 or compute")
    elif o.allreduce_dtype == "compute":
        # Half-precision gradients exist only where the offloaded optimizer keeps the compute-precision copy
        # (Myelin V-B); the on-device update differentiates float32 parameters.
        if not o.offload or pr.compute_dtype == "float32":
            errors.append(f"optim.allreduce_dtype=compute all-reduces half-precision gradients as half precision; "
                          f"with optim.offload={o.offload} and precision.compute_dtype={pr.compute_dtype} the "
                          f"gradients are float32: set optim.offload=true with bfloat16 or float16, or "
                          f"optim.allreduce_dtype=float32")
        if cfg.on_mesh:
            errors.append("optim.allreduce_dtype=compute applies to data replicas that are MPI ranks (a pipeline, "
                          "or parallel.pipeline=1 without a mesh); tensor mode reduces over its mesh's data axis "
                          "with XLA collectives: set optim.allreduce_dtype=float32")
    if backend_error := _allreduce_backend_error(cfg):
        errors.append(backend_error)
    if o.shard_optimizer and (shard_error := _shard_optimizer_error(cfg)):
        errors.append(shard_error)
    if cfg.checkpoint.keep < 2 and cfg.world_size > 1:
        # Each rank's manager deletes its older step once its newer one is saved: a save that some ranks
        # finished and others did not (a crash, a kill) would leave no step that every rank holds.
        errors.append(f"checkpoint.keep={cfg.checkpoint.keep} with {cfg.world_size} ranks: a save cut off on "
                      f"some ranks would leave no step every rank holds to resume from; use keep >= 2")
    if t.checkpoint_interval and t.remat != "full":
        errors.append(f"train.checkpoint_interval={t.checkpoint_interval} needs train.remat=full (Myelin's ac: "
                      f"blocks per recomputed segment); got train.remat={t.remat!r}")
    elif t.checkpoint_interval:
        errors += _interval_errors(cfg)
    if cfg.tensor_size > 1 and not errors:  # the sizes below assume the batch rules above hold
        errors += _tensor_layout_errors(cfg)
    return errors


def _allreduce_backend_error(cfg: Config) -> str | None:
    """``optim.allreduce_backend``: the sum over data replicas that are MPI ranks, by mpi4jax or by an XLA
    collective over a JAX mesh of each data column, a hybrid rank's local tensor mesh included
    (:mod:`jaxhybrid.parallel.data.xla_allreduce`)."""
    backend, p = cfg.optim.allreduce_backend, cfg.parallel
    if backend not in ("auto", "mpi", "xla"):
        return (f"optim.allreduce_backend={backend!r}; choose mpi (mpi4jax), xla (XLA collectives over a JAX "
                f"mesh of each data column: NCCL on GPUs, gloo on CPU) or auto (xla on accelerators, mpi on CPU)")
    if backend != "xla" or cfg.layout.replicas_on_ranks:
        return None
    if cfg.on_mesh:
        return ("optim.allreduce_backend=xla applies to data replicas that are MPI ranks (a pipeline, or "
                "parallel.pipeline=1 without a mesh); tensor mode already reduces over its mesh's data axis "
                "with XLA collectives: set optim.allreduce_backend=mpi")
    return (f"optim.allreduce_backend=xla reduces gradients over data replicas that are MPI ranks; with "
            f"parallel.data={p.data} there is nothing to reduce: set optim.allreduce_backend=mpi or "
            f"parallel.data >= 2")


def _shard_optimizer_error(cfg: Config) -> str | None:
    """``optim.shard_optimizer`` (ZeRO-1, :mod:`jaxhybrid.optim.zero`): data replicas that are MPI ranks of one
    device each, whose flat stage vectors it cuts into shards."""
    p = cfg.parallel
    if cfg.layout.replicas_are_ranks:
        return None
    if cfg.on_mesh:
        return ("optim.shard_optimizer=true shards the optimizer over data replicas that are MPI ranks (a pipeline, "
                "or parallel.pipeline=1 without a mesh); tensor mode keeps its data axis on one mesh, which it does "
                "not support: set optim.shard_optimizer=false")
    if p.data < 2:
        return (f"optim.shard_optimizer=true divides the optimizer state over data replicas; with parallel.data="
                f"{p.data} there is one replica: set parallel.data >= 2 or optim.shard_optimizer=false")
    return (f"optim.shard_optimizer=true shards one device's flat parameters per rank; a hybrid rank's tensor "
            f"mesh (tensor depth x row x col = {p.tensor_depth} x {p.tensor_row} x {p.tensor_col}) is not "
            f"supported: set optim.shard_optimizer=false or the tensor axes to 1")


def _interval_errors(cfg: Config) -> list[str]:
    """Myelin V-A: an explicit ``train.checkpoint_interval`` (ac) must divide the blocks of every stage
    (N / G_inter, N / (G_inter x v) with virtual stages; with ``parallel.partition`` or an uneven split, each
    stage's count), so that every recomputed segment holds ac blocks: a stage would otherwise clamp it or end
    in a shorter segment."""
    from math import gcd

    p, ac, n, pl = cfg.parallel, cfg.train.checkpoint_interval, cfg.model.n_layers, cfg.pipeline
    v, stages = pl.virtual_stages, len(pl.stage_to_rank) or p.pipeline * pl.virtual_stages
    named = (f"pipeline.stage_to_rank's {stages} stages" if pl.stage_to_rank else
             f"parallel.pipeline={p.pipeline}" + (f" x pipeline.virtual_stages={v}" if v > 1 else ""))
    try:  # with virtual stages every one of the pipeline x v stages holds its own blocks
        counts = [hi - lo for lo, hi in partition_blocks(n, stages, p.partition)]
    except ConfigError:  # more stages than blocks, or a bad partition: their own rules above say so
        return []
    if all(c % ac == 0 for c in counts):
        return []
    g = reduce(gcd, counts)
    factors = ", ".join(str(f) for f in range(1, g + 1) if g % f == 0)
    if len(counts) == 1:
        where = f"model.n_layers={n} blocks of the one stage (parallel.pipeline=1)"
    elif len(set(counts)) == 1:
        where = f"model.n_layers={n} / {named} = {counts[0]} blocks per stage"
    else:
        source = f"parallel.partition={list(p.partition)}" if p.partition else \
            f"model.n_layers={n} split over {named}"
        where = f"stages of {counts} blocks ({source})"
    return [f"train.checkpoint_interval={ac} does not divide the {where}: Myelin's ac (Sec. V-A) must be a "
            f"factor of every stage's blocks; use {'one of ' if g > 1 else ''}{factors}, or 0 for Myelin's "
            f"optimal interval"]


def _tensor_layout_errors(cfg: Config) -> list[str]:
    """The tensor engines' own divisibility rules (:func:`~jaxhybrid.parallel.tensor.sharding.check_layout`) on the
    mesh this config builds: one process's (data, depth, row, col) mesh in tensor mode, each rank's
    (1, depth, row, col) mesh under a pipeline; with the sizes, one axis changed at a time, that fit."""
    from jaxhybrid.parallel.tensor.sharding import run_layout_error

    p = cfg.parallel
    sizes = {"tensor_depth": p.tensor_depth, "tensor_row": p.tensor_row, "tensor_col": p.tensor_col}

    def error(s: dict) -> str | None:
        return run_layout_error(cfg.model, p.pipeline, p.data, s["tensor_depth"], s["tensor_row"], s["tensor_col"],
                                cfg.microbatch_size, cfg.tensor.optimizations)

    message = error(sizes)
    if message is None:
        return []
    fits = [f"parallel.{ax}={v}" for ax, n in sizes.items() if n > 1
            for v in [next((v for v in range(n - 1, 0, -1) if error({**sizes, ax: v}) is None), None)] if v]
    return [message + (f" Fits with one axis changed: {', '.join(fits)}." if fits else "")]
