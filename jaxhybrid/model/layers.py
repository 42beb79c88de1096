"""Single-device transformer layers. Parallelism-sensitive ops go through an injected :class:`Ops`.

The few operations whose placement matters to a parallel layout (dense matmuls, the attention core, the
embedding gather, the vocabulary projection and loss, and the normalisations that reduce over the hidden
dim) are methods of an ops object passed to every module. :class:`Ops` is the plain-``jnp`` reference;
tensor parallelism (``jaxhybrid.tensor.ops``) and the 2BP taps (``jaxhybrid.model.backprop``) supply
other ops objects, so this file never changes for them.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Ops:
    """Reference ops: what one device computes. Subclasses override methods, never the model code.

    ``name`` arguments identify the call site (``attn.qkv``, ``attn.out``, ``mlp.up``, ``mlp.gate``,
    ``mlp.down``) so a parallel ops object can choose a layout per site (e.g. AxoNN optimization A).
    """

    def dense(self, x: Array, kernel: Array, bias: Array | None = None, *, name: str = "") -> Array:
        y = jnp.einsum("...i,io->...o", x, kernel)
        return y if bias is None else y + bias

    def attention(self, q: Array, k: Array, v: Array, kernel: str = "auto") -> Array:
        """Causal attention. q: [B, T, H, Dh]; k, v: [B, T, Hkv, Dh] -> [B, T, H, Dh].

        ``kernel`` (``model.attention``): ``xla`` materialises the [B, H, T, T] scores; ``cudnn`` is cuDNN's
        fused flash attention (scores never leave the chip; its backward recomputes them from the saved
        log-sum-exp); ``auto`` picks cudnn where it applies (:func:`attention_kernel`).
        """
        if attention_kernel(kernel, q) == "cudnn":
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return causal_attention(q, k, v)

    def embed(self, ids: Array, table: Array) -> Array:
        return jnp.take(table, ids, axis=0)

    def layer_norm(self, x: Array, scale: Array, bias: Array | None, eps: float) -> Array:
        return _layer_norm(x, scale, bias, eps)

    def rms_norm(self, x: Array, scale: Array, eps: float) -> Array:
        return _rms_norm(x, scale, eps)

    def logits(self, h: Array, kernel: Array) -> Array:
        """h: [B, T, d], kernel: [d, V] -> float32 logits [B, T, V]."""
        return jnp.einsum("btd,dv->btv", h, kernel).astype(jnp.float32)

    def cross_entropy(self, logits: Array, targets: Array) -> Array:
        """Mean next-token cross-entropy over all positions (float32)."""
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.mean(lse - tgt)


DEFAULT_OPS = Ops()

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
    already repeated to q's heads."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * _softmax_scale(q)
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
    the masked scores (two more ``[B, H, T, T]`` float32 arrays) and k and v repeated. Measured on
    4-block stages at 4 x 128 tokens, float32, session 20: the forward's residuals shrank 18-34%
    (llama-small-cpu 43.2 -> 33.2 MB, gpt-small-cpu 49.1 -> 40.0, llama-tiny 14.1 -> 9.3; a 2-block
    gpt2-small stage at 2 x 256 tokens 147 -> 120), the forward took 6-13% less time, the backward
    about the same.
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


def attention_kernel(kernel: str, q: Array) -> str:
    """Resolve ``model.attention`` for queries ``q``: cuDNN flash attention needs an NVIDIA GPU, 16-bit
    q/k/v and a head dim that is a multiple of 8 and at most 128 (jax's cuDNN checks); ``auto`` takes it
    when all hold (MaxText's autoselection does the same), else the XLA path."""
    dev = jax.devices()[0]
    why = [w for ok, w in (
        (dev.platform == "gpu" and "nvidia" in dev.device_kind.lower(), f"device {dev.device_kind!r}"),
        (q.dtype in (jnp.bfloat16, jnp.float16), f"dtype {q.dtype}"),
        (q.shape[-1] % 8 == 0 and q.shape[-1] <= 128, f"head_dim {q.shape[-1]}")) if not ok]
    if kernel == "cudnn" and why:
        raise ValueError(f"model.attention='cudnn' needs an NVIDIA GPU, bfloat16/float16 and head_dim a "
                         f"multiple of 8 <= 128; got {', '.join(why)}")
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"model.attention={kernel!r}; choose one of {ATTENTION_KERNELS}")
    return "xla" if kernel == "xla" or why else "cudnn"


def _init(std: float):
    return nn.initializers.normal(stddev=std)


class Dense(nn.Module):
    """A matmul through ``ops.dense``. Params: kernel [in, out] (+ bias [out])."""

    features: int
    ops: Any
    site: str
    use_bias: bool = True
    dtype: Any = jnp.float32
    std: float = 0.02

    @nn.compact
    def __call__(self, x: Array) -> Array:
        kernel = self.param("kernel", _init(self.std), (x.shape[-1], self.features), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32) if self.use_bias else None
        return self.ops.dense(x.astype(self.dtype), kernel.astype(self.dtype),
                              None if bias is None else bias.astype(self.dtype), name=self.site)


class LayerNorm(nn.Module):
    ops: Any
    eps: float = 1e-5
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: Array) -> Array:
        d = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (d,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (d,), jnp.float32) if self.use_bias else None
        return self.ops.layer_norm(x, scale, bias, self.eps)


class RMSNorm(nn.Module):
    ops: Any
    eps: float = 1e-5

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        return self.ops.rms_norm(x, scale, self.eps)


# What a norm keeps for its backward: its input and the per-token statistics (named "norm_stats"); the
# centred and normalised inputs are recomputed from them in one elementwise pass. Why: autodiff keeps
# three arrays of the model's width per norm (x - mu, 2 (x - mu) and the normalised input), where one suffices.
_KEEP_STATS = jax.checkpoint_policies.save_only_these_names("norm_stats")


@functools.partial(jax.checkpoint, policy=_KEEP_STATS, static_argnums=(3,))
def _layer_norm(x: Array, scale: Array, bias: Array | None, eps: float) -> Array:
    xf = x.astype(jnp.float32)
    mu = checkpoint_name(xf.mean(-1, keepdims=True), "norm_stats")
    r = checkpoint_name(jax.lax.rsqrt(jnp.square(xf - mu).mean(-1, keepdims=True) + eps), "norm_stats")
    y = (xf - mu) * r * scale
    return (y if bias is None else y + bias).astype(x.dtype)


@functools.partial(jax.checkpoint, policy=_KEEP_STATS, static_argnums=(2,))
def _rms_norm(x: Array, scale: Array, eps: float) -> Array:
    xf = x.astype(jnp.float32)
    r = checkpoint_name(jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps), "norm_stats")
    return (xf * r * scale).astype(x.dtype)


def _gelu(u: Array) -> Array:
    return jax.nn.gelu(u, approximate=True)


def _swiglu(g: Array, u: Array) -> Array:
    return jax.nn.silu(g) * u


# The MLP activations, recomputed in the backward from their inputs (jax.checkpoint), as Megatron's
# fused bias-GeLU and SwiGLU kernels do. Why: autodiff keeps their intermediates, four or five arrays
# of the MLP's width per block, where the pre-activations (one for GeLU, two for SwiGLU) suffice and
# the recomputation is one elementwise pass. Measured with the norms above (session 20, 4-block stages,
# 4 x 128 tokens, float32): forward residuals 33.2 -> 20.2 MB (llama-small-cpu), 40.0 -> 20.0 MB
# (gpt-small-cpu), forward 6-29% faster, backward as before; whole-model value_and_grad of
# gpt-small-cpu 220 -> 133 ms.
gelu = jax.checkpoint(_gelu)
swiglu = jax.checkpoint(_swiglu)


def rope(x: Array, theta: float) -> Array:
    """Rotary position embedding (Su et al.) on [B, T, H, Dh], rotating interleaved halves."""
    t, dh = x.shape[1], x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : dh // 2], xf[..., dh // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)
