"""Single-device transformer layers. Parallelism-sensitive ops go through an injected :class:`Ops`.

The few operations whose placement matters to a parallel layout (dense matmuls, the attention core, the
embedding gather, the vocabulary projection and loss, and the normalisations that reduce over the hidden
dim) are methods of an ops object passed to every module. :class:`Ops` is the plain-``jnp`` reference;
tensor parallelism (``jaxhybrid.tensor.ops``) and the 2BP taps (``jaxhybrid.model.backprop``) supply
other ops objects, so this file never changes for them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

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
        rep = q.shape[2] // k.shape[2]
        if rep > 1:
            k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scale = 1.0 / jnp.sqrt(jnp.asarray(q.shape[-1], jnp.float32))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
        t = q.shape[1]
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    def embed(self, ids: Array, table: Array) -> Array:
        return jnp.take(table, ids, axis=0)

    def layer_norm(self, x: Array, scale: Array, bias: Array | None, eps: float) -> Array:
        xf = x.astype(jnp.float32)
        mu = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mu).mean(-1, keepdims=True)
        y = (xf - mu) * jax.lax.rsqrt(var + eps) * scale
        return (y if bias is None else y + bias).astype(x.dtype)

    def rms_norm(self, x: Array, scale: Array, eps: float) -> Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps) * scale
        return y.astype(x.dtype)

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
