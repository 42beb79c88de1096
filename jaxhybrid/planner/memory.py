"""Memory per device: Myelin's parameter-state model (Sec. V-B), activations (Sec. V-A) and schedules.

* Parameter state: what the trainer's memory report counts (:func:`param_state_bytes`). Without offload
  20 phi bytes (fp32 theta and grad: 4 + 4, fp16 copies 2 + 2, Adam 8; 16 phi in float32). With the
  bucketed host offload 4 phi + 16 bsize (V-B: fp16 theta and grad stay; one bucket of fp32 theta, Adam
  state and descaled gradient visits the device at a time) + 12 bsize per prefetched bucket.
* AxoNN shards parameter state over the tensor grid (Alg. 1, DIVIDE_WEIGHTS), matrices over G_d G_r G_c
  and vectors over one axis: the step model counts phi per device leaf by leaf
  (:mod:`jaxhybrid.planner.param_shards`), not phi / (G_d G_r G_c).
* Stashed microbatches per pipeline rank come from the schedule module (:func:`stashed_microbatches`).
* Checkpointing (Myelin Sec. V-A): M_activation = G_inter (N / (G_inter ac) + 1 + ac) layer outputs, with
  ac the factor of N / G_inter closest to sqrt(N).
"""
from __future__ import annotations

from jaxhybrid.model.remat import optimal_checkpoint_interval
from jaxhybrid.optim.memory_report import model_state_bytes
from jaxhybrid.parallel.pipeline.schedule import make_schedule
from jaxhybrid.parallel.pipeline.validate import peak_stashed

__all__ = ["param_state_bytes", "myelin_activation_units", "optimal_checkpoint_interval",
           "stashed_microbatches", "block_residual_bytes", "head_residual_bytes", "boundary_bytes"]


def param_state_bytes(phi: float, offload: bool = False, bucket_size: float = 0, tensor_size: int = 1,
                      dtype_bytes: int = 2, optimizer_shards: int = 1) -> float:
    """Bytes of parameters, gradients and Adam state on one device (Myelin Sec. V-B), by the trainer's own
    count (:func:`jaxhybrid.optim.memory_report.model_state_bytes`, which its ``memory.json`` reports): with
    offload ``4 phi + 16 bsize`` plus ``12 bsize`` for the bucket the offloaded optimizer prefetches.

    Args:
      phi: parameters held by this pipeline stage, before tensor sharding; or one device's share
        (:func:`~jaxhybrid.planner.param_shards.stage_params_per_device`) with ``tensor_size`` 1.
      offload: Myelin's bucketed optimizer offload.
      bucket_size: bsize, elements per offload bucket (``optim.bucket_size``); a device's buckets are at
        most its shard, as the optimizer makes them.
      tensor_size: G_c x G_r x G_d to divide all of ``phi`` evenly over; the trainer does so only for
        matrices (its vectors are held in full over some axes), hence the step model's per-device phi.
      dtype_bytes: the compute dtype's (float32 keeps no separate compute copies: 16 phi without offload).
      optimizer_shards: data replicas the optimizer state is sharded over (``optim.shard_optimizer``).
    """
    if phi < 0 or bucket_size < 0 or tensor_size < 1:
        raise ValueError(f"phi={phi}, bucket_size={bucket_size} must be >= 0 and tensor_size={tensor_size} >= 1")
    shard = phi / tensor_size
    dtype = "float32" if dtype_bytes == 4 else "bfloat16"  # bfloat16 and float16 count alike
    bsize = min(bucket_size, shard / optimizer_shards) if offload else 0
    return float(model_state_bytes(shard, compute_dtype=dtype, offload=offload, bucket_size=bsize,
                                   optimizer_shards=optimizer_shards)["device_total"])


def myelin_activation_units(n_layers: int, g_inter: int, ac: int) -> float:
    """Myelin Sec. V-A: peak stored activations per GPU, in layer outputs, with checkpoint interval ac."""
    if ac < 1 or g_inter < 1 or n_layers < 1:
        raise ValueError(f"n_layers={n_layers}, g_inter={g_inter}, ac={ac} must be >= 1")
    return g_inter * (n_layers / (g_inter * ac) + 1 + ac)


def stashed_microbatches(schedule: str, stages: int, microbatches: int, split_backward: bool = False,
                         ) -> list[int]:
    """Peak microbatches each rank keeps, from the schedule generator's rows (the simulator's count).

    GPipe keeps all m; 1F1B keeps min(m, N - rank); with 2BP a microbatch stays until its weight pass
    (the residuals of the input pass), which 2BP runs last, so every rank keeps all m. Myelin + 2BP runs a
    weight pass once ``weight_budget`` (N, the engine's default) are pending: 7, 6, 5, 4 at N = 4, m = 16.
    """
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages={stages} and microbatches={microbatches} must be >= 1")

    return peak_stashed(make_schedule(schedule, stages, microbatches, split_backward))


def block_residual_bytes(cfg, seq: int, microbatch: int, dtype_bytes: int = 2, remat: str = "none",
                         flash: bool = False) -> tuple[float, float]:
    """What one transformer block of :class:`jaxhybrid.parallel.twobp.stage.Stage` keeps per microbatch: bytes
    ``(activations, weight_residuals)``, i.e. its ``residual_bytes`` (forward -> backward-p1) and
    ``weight_residual_bytes`` (backward-p1 -> backward-p2, 2BP Sec. 4.2), counted from the arrays the stage
    keeps (``tests/unit/planner/test_memory_model.py`` checks them against the stage's own count).

    Per token, with ``c`` the compute dtype's bytes, ``d`` the width, ``f`` the MLP width, ``k`` the key and
    value width (``d`` unless the model has grouped-query heads, ``model.n_kv_heads``):

    * site inputs (records), both passes: ``c (3d + f)`` (the two norm outputs, the attention output and
      the MLP activation); the weight pass also keeps each site's output cotangent: GPT-2 ``c (3d + 2k + f)``,
      LLaMA ``c (3d + 2k + 2f)``, plus per-sample norm-weight and bias gradients;
    * the forward, ``remat`` none: the block input, q, k and v, the residual stream after attention, the
      MLP pre-activations (GPT-2 ``c (3d + 2k + f)``, LLaMA ``c (3d + 2k + 2f)``) and float32 norm statistics
      (8 and 4 bytes per norm); the attention core keeps its ``[H, T, T]`` float32 probabilities per
      sequence (``model.attention: xla``) or, with cuDNN's flash attention (``flash``), its output and
      float32 log-sum-exp (``c d + 4 H`` per token). LLaMA also keeps its rotary tables (float32
      ``4 T Dh`` per block, whatever the batch);
    * ``remat`` dots: the same minus the attention core's and the rotary tables' (recomputed), since
      the saved site outputs (matmul + bias) take the place of the pre-activations, q, k and v;
    * ``remat`` full: only segment inputs; see :func:`boundary_bytes` (not this function).

    Korthikanti et al.'s ``s b h (34 + 5 a s / h)`` (Megatron: dropout masks, 16-bit probabilities)
    overstates this stage by 1.2x (GPT-2 small, xla attention, 1024 tokens) to 3.5x (flash attention).
    """
    if remat not in ("none", "dots"):
        raise ValueError(f"remat={remat!r}: block_residual_bytes models none and dots (full keeps segment inputs)")
    c, d, f, h = dtype_bytes, cfg.d_model, cfg.d_ff, cfg.n_heads
    llama = cfg.kind == "llama"
    k = cfg.kv_heads * cfg.head_dim
    tokens = seq * microbatch
    records = c * (3 * d + f)
    # outputs, or their cotangents (k = d for GPT-2 unless it has grouped-query heads too)
    sites = c * (3 * d + 2 * k + 2 * f) if llama else c * (3 * d + 2 * k + f)
    stats = 8 if llama else 16  # RMSNorm: mean square; LayerNorm: mean and variance (float32), 2 norms
    per_sample = 2 * 4 * d  # the two norms' scales, per-sample copies (float32)
    act = tokens * (records + sites + stats) + microbatch * per_sample
    if remat == "none":
        if flash:
            act += tokens * (c * d + 4 * h)
        else:
            act += microbatch * 4 * h * seq * seq
        if llama:
            act += 4 * 4 * seq * (cfg.head_dim // 2)  # cos and sin of q and k: [T, Dh / 2] float32 each
    vectors = 2 * d if llama else 4 * d  # norm scales (and biases): float32
    biases = 0 if llama else c * (3 * d + 2 * k + f)
    wres = tokens * (records + sites) + microbatch * (4 * vectors + biases)
    return float(act), float(wres)


def head_residual_bytes(cfg, seq: int, microbatch: int, dtype_bytes: int = 2) -> tuple[float, float]:
    """What the last stage's head (final norm, logits, loss) keeps per microbatch beyond its blocks:
    ``(activations, weight_residuals)`` as :func:`block_residual_bytes` counts them.

    Per token: the float32 softmax of the ``V`` logits, the norm's input and output (``2 c d``), its
    statistics, the loss mask, weight and target index (9 bytes); the weight pass keeps the norm output
    and the logits' cotangent in the compute dtype (``c d + c V``; tensor-parallel stages keep the latter
    in float32). Per sample: the norm's float32 weight copies.
    With ``V`` in the tens of thousands this is several blocks' worth, held for every microbatch the last
    stage stashes (all M of them under GPipe).
    """
    c, d, v = dtype_bytes, cfg.d_model, cfg.vocab_size
    llama = cfg.kind == "llama"
    tokens = seq * microbatch
    act = tokens * (4 * v + 2 * c * d + (4 if llama else 8) + 9) + microbatch * 4 * d
    wres = tokens * c * (d + v) + microbatch * 4 * (d if llama else 2 * d)
    return float(act), float(wres)


def boundary_bytes(seq: int, microbatch: int, d_model: int, dtype_bytes: int = 2) -> float:
    """One hidden state: what crosses a pipeline boundary and what a checkpoint keeps."""
    return float(seq * microbatch * d_model * dtype_bytes)
