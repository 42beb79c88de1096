"""Predicted step time, communication and memory of one layout of a transformer (device-free).

Compute: flop counts over ``peak x efficiency``, divided over the tensor grid, plus a fixed time per block
pass where the hardware file measured one (:class:`Machine`). Communication: AxoNN eqs.
4-9 for every matmul of a block (optimization A: the attention output and MLP down projections are
transposed), synchronous (AxoNN Assumption 4), plus the pipeline's point-to-point messages and the
data-parallel all-reduce (eq. 8). The pipeline makespan and stashed microbatches come from the schedule
simulator (:mod:`jaxhybrid.planner.makespan`); memory from Myelin's model (:mod:`jaxhybrid.planner.memory`)
with the activations the stage kernels keep (:func:`~jaxhybrid.planner.memory.block_residual_bytes`).
"""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields

from jaxhybrid.core.config.model import ModelConfig, block_matmuls
from jaxhybrid.core.config.schema import OptimConfig, TensorConfig, allreduce_backend_on
from jaxhybrid.core.layout import ParallelDims
from jaxhybrid.model.attention import cudnn_unmet
from jaxhybrid.model.flops import attention_core_flops, forward_flops
from jaxhybrid.parallel.pipeline.schedule import stage_placement
from jaxhybrid.parallel.tensor.mesh import reduce_data_once
from jaxhybrid.planner.comm_model import Network, comm_time, group_bandwidths, layer_comm_volumes
from jaxhybrid.planner.makespan import makespan_floor, pipeline_makespan, sig2
from jaxhybrid.planner.memory import (
    block_residual_bytes,
    boundary_bytes,
    head_residual_bytes,
    optimal_checkpoint_interval,
    param_state_bytes,
)
from jaxhybrid.planner.param_shards import stage_params_per_device

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Layout:
    """One candidate of the search: the parallel sizes (``dims``) and how the step runs on them."""

    dims: ParallelDims
    microbatch_size: int
    microbatches: int
    schedule: str
    split_backward: bool
    offload: bool
    remat: str
    pipeline_limit: int = 0  # Myelin's microbatches in flight (V-A); 0: stages, the engine's default
    virtual_stages: int = 1  # stages per pipeline rank, v (pipeline.virtual_stages)
    placement: str = "loop"  # which stages a rank holds (pipeline.placement): loop, or v (ZB-V's V shape)
    shard_optimizer: bool = False  # ZeRO-1 over the data replicas (optim.shard_optimizer)

    def to_dict(self) -> dict:
        """The flat record a plan (and ``jaxhybrid plan --json``) shows: the five sizes, then the rest."""
        d = self.dims
        return {"pipeline": d.pipeline, "data": d.data, "tensor_col": d.tensor_col, "tensor_row": d.tensor_row,
                "tensor_depth": d.tensor_depth} | {f.name: getattr(self, f.name) for f in fields(self)[1:]}

    @classmethod
    def from_dict(cls, plan: dict) -> "Layout":
        """The layout of a plan's record (:meth:`to_dict`; other keys are ignored; a record from before a
        field with a default, e.g. ``virtual_stages``, has that default)."""
        dims = ParallelDims(*(plan[k] for k in ("pipeline", "data", "tensor_col", "tensor_row", "tensor_depth")))
        return cls(dims, **{f.name: plan[f.name] if f.default is MISSING else plan.get(f.name, f.default)
                            for f in fields(cls)[1:]})


def partition_blocks(n_layers: int, stages: int, head_in_blocks: float, least: int = 1) -> tuple[int, ...]:
    """Blocks per stage minimising the largest stage, the last stage also carrying the head; each stage
    at least ``least`` blocks."""
    if stages == 1:
        return (n_layers,)
    best = None
    for last in range(least, n_layers - least * (stages - 1) + 1):
        rest = n_layers - last
        per = math.ceil(rest / (stages - 1))
        load = max(last + head_in_blocks, per)
        if best is None or load < best[0]:
            best = (load, last)
    last = best[1]
    rest = n_layers - last
    q, r = divmod(rest, stages - 1)
    return tuple([q + 1] * r + [q] * (stages - 1 - r) + [last])


def chunk_partition(n_layers: int, ranks: int, virtual_stages: int, placement: str,
                    head_in_blocks: float) -> tuple[int, ...]:
    """Blocks of each of the ``ranks x virtual_stages`` stages (in stage order) balancing the ranks' loads,
    not the stages': blocks per rank by :func:`partition_blocks` (the rank holding the last stage also
    carries the head, at least one block per stage it holds), then each rank's split over its stages as
    evenly as they go, the head's stage again taking fewer."""
    v = virtual_stages
    if v == 1:
        return partition_blocks(n_layers, ranks, head_in_blocks)
    owner = stage_placement(ranks, v, placement)
    per_rank = partition_blocks(n_layers, ranks, head_in_blocks, least=v)  # the head's rank last
    ordered = [r for r in range(ranks) if r != owner[-1]] + [owner[-1]]
    split = {r: partition_blocks(k, v, head_in_blocks if r == owner[-1] else 0.0) for r, k in zip(ordered, per_rank)}
    held = [owner[:s].count(owner[s]) for s in range(len(owner))]  # a stage's index among its rank's
    return tuple(split[owner[s]][held[s]] for s in range(len(owner)))


def block_bytes_per_device(cfg: ModelConfig, lay: Layout, seq: int, dtype_bytes: int, flash: bool) -> dict:
    """Bytes one block keeps per microbatch on one device of the layout's tensor grid: its activations
    with remat none (``none``) and with the layout's remat (``kept``), its 2BP weight residuals, and the
    all-gathered weights it keeps for its backward (``gathered_w``).

    The stage's count (:func:`~jaxhybrid.planner.memory.block_residual_bytes`) divided by G_d x min(G_r,
    G_c): the batch is split over depth, and a layer's input or output features over row or column. With
    a depth axis each layer also keeps its all-gathered W (``k / G_r x n / G_c``, AxoNN Alg. 1 line 13).
    ``tests/unit/parallel/test_hybrid_local.py`` holds this to a sharded stage's own bytes per device: equal where
    G_r = G_c, above them otherwise (a row- or column-only grid shards fewer arrays than the other).
    """
    b, dims = lay.microbatch_size, lay.dims
    act_shard = dims.tensor_depth * min(dims.tensor_row, dims.tensor_col)
    none, wres = (v / act_shard for v in block_residual_bytes(cfg, seq, b, dtype_bytes, "none", flash))
    kept = block_residual_bytes(cfg, seq, b, dtype_bytes, "dots", flash)[0] / act_shard if lay.remat == "dots" \
        else none
    gathered = sum(k * n for k, n, _ in block_matmuls(cfg)) * dtype_bytes / (dims.tensor_row * dims.tensor_col) \
        if dims.tensor_depth > 1 else 0.0
    return {"none": none, "kept": kept, "weight_residuals": wres, "gathered_w": gathered}


def gathered_weights(lay: Layout, letters: str) -> dict:
    """Where a layer's all-gathered W (AxoNN Alg. 1 line 13) lives, as the engines keep it (measured in
    their lowered programs: ``tests/unit/planner/test_plan_vs_engines.py``). ``kept``: stored with each block's
    activations per microbatch, not gathered again: remat none, and dots with optimization E (Sec. IV-E,
    the ops' ``saved_names`` in either engine's save policy). ``cached_full``: remat full in the whole-model
    engine with E: every block's gathered W is saved through the recomputation; a pipeline stage's
    segments recompute everything, the all-gathers included."""
    e = "E" in letters
    dims = lay.dims
    return {"kept": lay.remat == "none" or (lay.remat == "dots" and e),
            "cached_full": lay.remat == "full" and dims.pipeline == 1 and e}


@dataclass(frozen=True)
class Machine:
    """What a layout runs on: peak flop/s of the dtype times an efficiency, memory, network, and whether
    16-bit attention runs cuDNN's flash attention there (``model.attention: auto`` picks it).

    ``block_overhead_s`` (forward, backward): seconds each block's pass costs a device on top of its
    flops at ``flops_per_s``. Why: a constant fraction of peak makes small matmuls as efficient as large
    ones, so the planner took the smallest microbatch (the smallest bubble) every time, where a GPU runs a
    block of few tokens far below its peak and a large block several times closer to it.
    ``time = flops / flops_per_s + overhead``
    is that curve: efficiency ``flops / (flops + overhead x flops_per_s)`` of the asymptote. The
    hardware file's ``compute_model`` gives both (:func:`~jaxhybrid.planner.plan.machine_from_hardware`).
    """

    flops_per_s: float
    memory_bytes: float
    net: Network
    dtype_bytes: int = 2
    flash_attention: bool = False
    block_overhead_s: tuple[float, float] = (0.0, 0.0)


def evaluate(cfg: ModelConfig, lay: Layout, machine: Machine, seq: int,
             bucket_size: int = OptimConfig.bucket_size, letters: str = TensorConfig.optimizations,
             allreduce_dtype: str = OptimConfig.allreduce_dtype,
             allreduce_backend: str = OptimConfig.allreduce_backend) -> dict:
    """Predicted step time, exposed communication and peak memory per device of one layout; with offload
    the optimizer's buckets hold ``bucket_size`` elements (``optim.bucket_size``, default the config's);
    ``letters`` (``tensor.optimizations``) decide which axis splits each bias (A); ``allreduce_dtype``
    (``optim.allreduce_dtype``) what MPI replicas' all-reduce moves, and ``allreduce_backend``
    (``optim.allreduce_backend``) how: ``xla`` is the collective alone at the hardware file's bandwidths
    (NCCL), ``mpi`` (mpi4jax on host buffers, no CUDA-aware MPI assumed) adds the gradient's copy to the host
    and back at ``host_to_device`` (``allreduce_staging_s``; Myelin Sec. IV-B reduces on the GPUs instead), and
    ``auto`` is ``xla``, as a run resolves it on GPUs: the hardware files the model reads are GPU nodes. The
    reduction is charged after the pipeline phase: with one stage per rank that is when ``mpi``'s
    ``optim.overlap_grad_reduce`` starts it too (the rank's last gradient pass writes every bucket); with
    several stages per rank the overlap of the stages finished first is not counted. ``param_state_bytes``
    is the fullest stage's parameter state per device, what the trainer's ``memory.json`` reports;
    ``pipeline_floor_s`` the pipeline time no schedule or Myelin limit beats (:func:`makespan_floor`).

    Several stages per rank (``virtual_stages`` v, ``placement``): the blocks are split over p v stages and a
    rank's time, parameters and gradients are those of its stages together; the schedule is simulated over
    the chunks, each costing its share of the rank's (1/v of F, BI, BW), with a message at every boundary
    between two ranks: v times as many as one stage per rank, less the V placement's local turn. Interleaving
    cuts the bubble to (p - 1) / (v m + p - 1) of the step (Narayanan et al., SC'21, Sec. 2.2) but stashes
    more: the simulated schedule holds each chunk's microbatches from its F to its backward, counted per
    chunk at that chunk's bytes (Megatron's warm-up runs (v - 1) p more chunk forwards than 1F1B's). ZB-V
    (Qi et al., ICLR'24) keeps 1F1B's activation peak with ZB-H1's nearly empty bubble."""
    dims = lay.dims
    b, ts, db = lay.microbatch_size, dims.tensor_size, machine.dtype_bytes
    tokens = b * seq
    d = cfg.d_model
    mm = block_matmuls(cfg)
    attn_flops = attention_core_flops(cfg, b, seq)  # QK^T and AV
    f_blk = forward_flops(cfg, b, seq, 1, head=False) / (machine.flops_per_s * ts)  # the count metrics use
    f_head = 2 * tokens * d * cfg.vocab_size / (machine.flops_per_s * ts)
    o_f, o_b = machine.block_overhead_s  # per block and device, whatever the tensor split (each runs every kernel)
    # The head in blocks of a stage's whole work (forward + backward: 3 x the forward flops, + the overheads).
    v = lay.virtual_stages
    parts = chunk_partition(cfg.n_layers, dims.pipeline, v, lay.placement, f_head / (f_blk + (o_f + o_b) / 3))
    owner = stage_placement(dims.pipeline, v, lay.placement)
    chunks = [[s_ for s_ in range(len(parts)) if owner[s_] == r_] for r_ in range(dims.pipeline)]  # by rank
    bw_ = group_bandwidths(machine.net, dims.tensor_col, dims.tensor_row, dims.tensor_depth, dims.data)
    # Ranks: tensor grid innermost, then pipeline stages, then data replicas (the launch order), so a data
    # group's stride includes the pipeline: treat the stages as an extra inner level for its bandwidth.
    bw_["data"] = group_bandwidths(machine.net, dims.tensor_col, dims.tensor_row,
                                   dims.tensor_depth * dims.pipeline, dims.data)["data"]
    times = [comm_time(layer_comm_volumes(tokens, k, n, dims.tensor_col, dims.tensor_row, dims.tensor_depth,
                                          dims.data, tr), bw_, db) for k, n, tr in mm]  # per matmul, eq. 9
    per_blk = {key: sum(t[key] for t in times) for key in times[0] if key != "total"}
    head = comm_time(layer_comm_volumes(tokens, d, cfg.vocab_size, dims.tensor_col, dims.tensor_row,
                                        dims.tensor_depth, dims.data), bw_, db)  # the vocabulary projection
    # The stage's attention kernel, by attention_kernel's own rule (a 2-byte dtype: bf16 or fp16).
    flash = machine.flash_attention and cfg.attention != "xla" and \
        not cudnn_unmet("bfloat16" if db == 2 else "float32", cfg.head_dim)
    f_attn = attn_flops / (machine.flops_per_s * ts)  # attention core: no weights, backward = 2 x forward
    g = gathered_weights(lay, letters)
    last_s = len(parts) - 1

    def phases(n_: int, last: bool) -> tuple[dict, dict]:
        """(compute, comm) seconds of F, BI, BW per microbatch for a stage of ``n_`` blocks (2BP: BI ~ the
        input-gradient matmuls, BW ~ the weight ones); the last stage also runs the head, whose collectives
        are eqs. 4-7 of the vocabulary projection like any layer's (AxoNN Sec. V, eq. 9 over all layers)."""
        h = 1.0 if last else 0.0
        coll = {key: n_ * per_blk[key] + h * head[key] for key in per_blk}  # this stage's collectives
        # The backward's overhead is split evenly between BI and BW (unmeasured apart; their sum is the fused pass's).
        comp = {"F": n_ * (f_blk + o_f) + h * f_head, "BI": n_ * (f_blk + f_attn + o_b / 2) + h * f_head,
                "BW": n_ * (f_blk - f_attn + o_b / 2) + h * f_head}
        comm = {"F": coll["all_gather"] + coll["all_reduce_fwd"], "BI": coll["all_reduce_bwd"],
                "BW": coll["reduce_scatter"]}
        if lay.remat == "full":  # the backward runs the forward again: the whole model's blocks, a stage's head too
            rh = h if dims.pipeline > 1 else 0.0
            comp["BI"] += n_ * (f_blk + o_f) + rh * f_head
            comm["BI"] += (0.0 if g["cached_full"] else n_ * per_blk["all_gather"] + rh * head["all_gather"]) + \
                n_ * per_blk["all_reduce_fwd"] + rh * head["all_reduce_fwd"]
        elif lay.remat == "dots":  # recomputes the attention core (and, without E, re-gathers the weights)
            comp["BI"] += n_ * f_attn
            comm["BI"] += 0.0 if g["kept"] else n_ * per_blk["all_gather"]
        return comp, comm

    # Bottleneck rank: the last stage's head can outweigh several blocks (GPT-2 small's: 4.5), so the most
    # blocks is not the slowest stage then. On a tie, the rank with more blocks (more collectives).
    def rank_load(r_: int) -> tuple[dict, dict]:  # its stages' phases together
        each = [phases(parts[s_], s_ == last_s) for s_ in chunks[r_]]
        return tuple({k: sum(e[i][k] for e in each) for k in each[0][i]} for i in (0, 1))

    loads = [rank_load(r_) for r_ in range(dims.pipeline)]
    blocks = [sum(parts[s_] for s_ in c) for c in chunks]
    slow = max(range(dims.pipeline), key=lambda r_: (sum(loads[r_][0].values()) + sum(loads[r_][1].values()),
                                                     blocks[r_]))
    comp, comm_ = loads[slow]
    F, BI, BW = (comp[k] + comm_[k] for k in ("F", "BI", "BW"))  # the rank's; a chunk runs 1/v of them
    # Pipeline messages: each tensor rank sends its shard of the hidden state to the next stage.
    msg_bytes = tokens * d * db / (dims.tensor_depth * dims.tensor_row)
    span = 2 * ts
    gpn = machine.net.gpus_per_node
    p2p_bw = machine.net.intra_bandwidth(span) if span <= gpn and gpn % span == 0 else \
        machine.net.inter_node / min(ts, gpn)
    msg = msg_bytes / p2p_bw if dims.pipeline > 1 else 0.0
    crossings = sum(owner[s_] != owner[s_ + 1] for s_ in range(len(owner) - 1))  # messages each way per microbatch
    # Ratios to 2 significant digits: the simulated makespan is scale-free, and the cache then serves
    # the thousands of layouts of a search with a few hundred simulations.
    # One stage runs its microbatches as gradient accumulation (jaxhybrid.runtime.engines.base.accumulated_step: forward
    # and backward of each in turn, one microbatch's activations live) whatever the config's schedule;
    # GPipe's order would hold all M.
    if dims.pipeline == 1:  # exact, no simulation: the ratios' rounding would hide e.g. dots' recompute
        makespan, states = lay.microbatches * (F + BI + BW), (((1, 0),),)
        floor = makespan
    else:
        ratios = sig2(BI / F), sig2(BW / F), sig2(v * msg / F)  # to one chunk's forward, F / v
        make, states = pipeline_makespan(lay.schedule, dims.pipeline, lay.microbatches, lay.split_backward,
                                         *ratios, lay.pipeline_limit, *((v, lay.placement) if v > 1 else ()))
        floor = makespan_floor(dims.pipeline, lay.microbatches, lay.split_backward, *ratios, v) * F / v
        makespan = make * F / v
    # Each leaf as the trainer shards it: vectors are not split over the whole grid (param_shards).
    part_phi = stage_params_per_device(cfg, parts, dims.tensor_col, dims.tensor_row, dims.tensor_depth, letters)
    stage_phi = [sum(part_phi[s_] for s_ in c) for c in chunks]  # per rank: v does not change the whole
    # Every rank all-reduces its own gradients over the replicas at once: the step waits for the largest.
    data_ar = max(sum(parts[s_] * per_blk["all_reduce_data"] + (head["all_reduce_data"] if s_ == last_s else 0.0)
                      for s_ in c) for c in chunks)
    # Replicas that are MPI ranks reduce float32 (MPI reduces no half floats; optim/allreduce.py) unless the
    # offloaded optimizer's half-precision gradients travel as they are (optim.allreduce_dtype: compute, the
    # sendrecvs of optim/half_allreduce.py). The tensor engine reduces float32 where it accumulates each replica's float32
    # gradients over its scan and reduces them once after it (step.accumulated_step's replicas); else each
    # layer's backward of every microbatch reduces in the compute dtype (eq. 8 as is).
    mpi = dims.pipeline > 1 or ts == 1
    f32 = (mpi and not (allreduce_dtype == "compute" and lay.offload)) or (
        not mpi and reduce_data_once(dims.data, lay.microbatches, db))
    ar_dtype = 4 / db if f32 else 1.0
    data_ar *= ar_dtype if f32 or mpi else lay.microbatches
    staging = 0.0
    if mpi and dims.data > 1 and allreduce_backend_on(allreduce_backend, accelerator=True) == "mpi":
        # device -> host, reduce, host -> device
        staging = 2 * max(stage_phi) * (4 if f32 else db) / machine.net.host_to_device
        data_ar += staging
    offload_s = 0.0
    if lay.offload:  # fp32 theta + Adam state in, back out, over the host link (Myelin V-B)
        offload_s = 2 * 12 * max(stage_phi) / machine.net.host_to_device
    # Serial, not overlapped (V-C): with global-norm clipping (optim.grad_clip, on by default) every chunk
    # is reduced before the first bucket updates, and only ``prefetch`` buckets are fetched meanwhile.
    step = makespan + data_ar + offload_s
    # remat full runs each forward's collectives again in the backward (phases' BI).
    tensor_comm = (lay.microbatches + (dims.pipeline - 1) / v) * sum(comm_.values())
    comm = tensor_comm + 2 * crossings * msg + data_ar
    # Memory: parameter state, stashed activations, transient (recomputed segment, logits).
    blk = block_bytes_per_device(cfg, lay, seq, db, flash)
    blk_none, blk_kept, residual, blk_gathered = blk["none"], blk["kept"], blk["weight_residuals"], blk["gathered_w"]
    act_shard = dims.tensor_depth * min(dims.tensor_row, dims.tensor_col)
    bnd = boundary_bytes(seq, b, d, db) / act_shard
    head_act, head_res = (x / act_shard for x in head_residual_bytes(cfg, seq, b, db))  # dots: as none
    ac = optimal_checkpoint_interval(cfg.n_layers, dims.pipeline * v)

    def stage_bytes(n_: int, last: bool) -> tuple[float, float, float]:
        """(stash, weight residuals) per microbatch and the transient bytes of one stage of ``n_`` blocks."""
        if lay.remat == "full":  # a stage's head is in its last segment: recomputed with it
            if g["cached_full"]:  # E: every block's gathered W is saved from the forward to its backward
                stash, transient = math.ceil(n_ / ac) * bnd + n_ * blk_gathered, min(ac, n_) * blk_none
            else:
                stash, transient = math.ceil(n_ / ac) * bnd, min(ac, n_) * (blk_none + blk_gathered)
            transient += head_act if last else 0.0
        else:
            kept_w = blk_gathered if g["kept"] else 0.0  # else gathered again, one layer at a time
            stash = n_ * (blk_kept + kept_w) + (head_act if last else 0.0)
            transient = blk_gathered - kept_w
        wres = n_ * residual + (head_res if last else 0.0)
        if last:
            transient += tokens * cfg.vocab_size * 4 / ts  # the backward's float32 logits gradient
        return stash, wres, transient

    mem = param_state = 0.0
    for r_, (c, phi) in enumerate(zip(chunks, stage_phi)):
        state = param_state_bytes(phi, lay.offload, bucket_size, 1, db,  # phi is per device already
                                  lay.dims.data if lay.shard_optimizer else 1)
        param_state = max(param_state, state)
        each = [stage_bytes(parts[s_], s_ == last_s) for s_ in c]
        transient = max(t for _, _, t in each)  # one stage's pass runs at a time
        if v == 1:
            held = max(a * each[0][0] + r * each[0][1] for a, r in states[r_])
        else:  # per-chunk counts, each at its own stage's bytes
            held = max(sum(x * e[0] + y * e[1] for x, y, e in zip(a, r, each)) for a, r in states[r_])
        mem = max(mem, state + held + transient)
    # The largest single collective or message (eqs. 1-9 have no latency term to weigh small ones).
    largest = max([v for t in times for key, v in t.items() if key != "total"] + [head["all_reduce_data"] * ar_dtype, msg])
    return {"predicted_step_s": step, "comm_s": comm, "memory_per_device_bytes": mem, "max_collective_s": largest,
            "compute_s": makespan - tensor_comm, "pipeline_s": makespan, "pipeline_floor_s": floor,
            "data_allreduce_s": data_ar, "allreduce_staging_s": staging, "offload_s": offload_s, "param_state_bytes": param_state,
            "partition": list(parts)}
