"""The attention core of the single-device model: causal softmax attention with grouped-query heads.

``causal_attention`` is the materialised-scores path (XLA) with its backward written out, so the forward
keeps only what the backward reads; :func:`attention_kernel` chooses between it and cuDNN's fused flash
attention (``model.attention``). :class:`jaxhybrid.model.layers.Ops` calls both; tensor parallelism runs
the same code per head shard inside ``shard_map`` (``jaxhybrid.parallel.tensor.ops``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxhybrid.core.errors import ConfigError

Array = jax.Array

ATTENTION_KERNELS = ("auto", "xla", "cudnn")


def _repeat_kv(x: Array, heads: int) -> Array:
    """Grouped-query attention: each of ``x``'s kv heads serves ``heads / Hkv`` consecutive query heads."""
    rep = heads // x.shape[2]
    return jnp.repeat(x, rep, axis=2) if rep > 1 else x


def _sum_kv_groups(g: Array, kv_heads: int) -> Array:
    """The transpose of :func:`_repeat_kv`: each kv head's gradient is the sum over the query heads it served."""
    b, t, h, d = g.shape
    return g.reshape(b, t, kv_heads, h // kv_heads, d).sum(axis=3) if h != kv_heads else g


def _softmax_scale(q: Array) -> Array:
    return 1.0 / jnp.sqrt(jnp.asarray(q.shape[-1], jnp.float32))


def _attention_probs(q: Array, k: Array) -> Array:
    """Causal softmax probabilities ``[B, H, Tq, Tk]`` in float32 (scores scaled by 1/sqrt(Dh)); ``k``
    already repeated to q's heads. The scores leave the matmul in float32: in float16 the unscaled
    ``q . k`` overflows (inf, then NaN probabilities) at 65504, sqrt(Dh) times below a scaled score
    that float16 could hold."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * _softmax_scale(q)
    t = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), s, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(s, axis=-1)


@jax.custom_vjp
def causal_attention(q: Array, k: Array, v: Array) -> Array:
    """The materialised-scores attention core, ``softmax(q k^T / sqrt(Dh)) v``. q: ``[B, T, H, Dh]``;
    k, v: ``[B, T, Hkv, Dh]`` with ``Hkv`` dividing ``H`` (grouped-query attention).

    Its backward is written out (the softmax derivative ``dS = P * (dP - rowsum(dP * P))``, as
    FlashAttention's backward uses it) so that the forward keeps q, k, v (k and v before their repeat
    to q's heads) and the probabilities P only. Why: autodiff of the same code also keeps the scaled and
    the masked scores (two more ``[B, H, T, T]`` float32 arrays) and k and v repeated, so this keeps the
    forward's residuals smaller and the forward faster at no cost to the backward.
    """
    return _causal_attention_fwd(q, k, v)[0]


def _causal_attention_fwd(q, k, v):
    h = q.shape[2]
    p = _attention_probs(q, _repeat_kv(k, h))
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), _repeat_kv(v, h)), (q, k, v, p)


def _causal_attention_bwd(res, do):
    q, k, v, p = res
    h, hkv = q.shape[2], k.shape[2]
    dv = jnp.einsum("bhqk,bqhd->bkhd", p.astype(v.dtype), do)
    dp = jnp.einsum("bqhd,bkhd->bhqk", do, _repeat_kv(v, h)).astype(jnp.float32)
    ds = (p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True)) * _softmax_scale(q)).astype(q.dtype)  # 0 where masked
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, _repeat_kv(k, h))
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q)
    return dq, _sum_kv_groups(dk, hkv), _sum_kv_groups(dv, hkv)


causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


def cudnn_unmet(dtype, head_dim: int) -> list[str]:
    """What keeps cuDNN's fused flash attention from q/k/v of ``dtype`` and ``head_dim`` (jax's cuDNN
    checks: 16-bit, a head dim that is a multiple of 8 and at most 128), one phrase each; empty when
    it can run on an NVIDIA GPU. Pure, so the planner applies the same rule to a model it only sizes."""
    return [w for ok, w in ((jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16), f"dtype {jnp.dtype(dtype)}"),
                            (head_dim % 8 == 0 and head_dim <= 128, f"head_dim {head_dim}")) if not ok]


def cudnn_device_unmet(dev) -> list[str]:
    """[] where ``dev`` can run cuDNN's fused attention (an NVIDIA GPU), else the phrase naming it."""
    return [] if dev.platform == "gpu" and "nvidia" in dev.device_kind.lower() else [f"device {dev.device_kind!r}"]


def check_cudnn_device(kernel: str, dev) -> None:
    """``model.attention=cudnn`` on a device that cannot run it, refused before an engine is built: found
    when the first attention was traced, it failed every MPI rank mid-job. (The dtype and head_dim rules
    need no device: :func:`jaxhybrid.runtime.config_checks.validate` applies them.)"""
    if kernel == "cudnn" and cudnn_device_unmet(dev):
        raise ConfigError(f"model.attention=cudnn needs an NVIDIA GPU; this process's device is "
                          f"{dev.device_kind!r}: set model.attention=auto (cuDNN where it can run) or xla")


def attention_kernel(kernel: str, q: Array) -> str:
    """Resolve ``model.attention`` for queries ``q``: cuDNN flash attention needs an NVIDIA GPU and
    :func:`cudnn_unmet`'s conditions; ``auto`` takes it when all hold (MaxText's autoselection does the
    same), else the XLA path."""
    why = cudnn_device_unmet(jax.devices()[0]) + cudnn_unmet(q.dtype, q.shape[-1])
    if kernel == "cudnn" and why:
        raise ValueError(f"model.attention='cudnn' needs an NVIDIA GPU, bfloat16/float16 and head_dim a "
                         f"multiple of 8 <= 128; got {', '.join(why)}")
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"model.attention={kernel!r}; choose one of {ATTENTION_KERNELS}")
    return "xla" if kernel == "xla" or why else "cudnn"
