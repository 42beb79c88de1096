"""Single-device transformer layers. Parallelism-sensitive ops go through an injected :class:`Ops`.

The few operations whose placement matters to a parallel layout (dense matmuls, the attention core, the
embedding gather, the vocabulary projection and loss, and the normalisations that reduce over the hidden
dim) are methods of an ops object passed to every module. :class:`Ops` is the plain-``jnp`` reference;
tensor parallelism (``jaxhybrid.parallel.tensor.ops``) and the 2BP taps (``jaxhybrid.parallel.twobp.backprop``) supply
other ops objects, so this file never changes for them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxhybrid.model.attention import attention_kernel, causal_attention

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Ops:
    """Reference ops: what one device computes. Subclasses override methods, never the model code.

    ``name`` arguments identify the call site (``attn.qkv``, ``attn.out``, ``mlp.up``, ``mlp.gate``,
    ``mlp.down``) so a parallel ops object can choose a layout per site (e.g. AxoNN optimization A).
    """

    @property
    def saved_names(self) -> tuple[str, ...]:
        """``checkpoint_name`` tags of values a recomputation policy must keep rather than recompute
        (a parallel ops object's gathered weights, AxoNN optimization E); none for one device."""
        return ()

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
        return layer_norm(x, scale, bias, eps, feature_mean)

    def rms_norm(self, x: Array, scale: Array, eps: float) -> Array:
        return rms_norm(x, scale, eps, feature_mean)

    def logits(self, h: Array, kernel: Array, table: bool = False) -> Array:
        """h: [B, T, d], kernel: [d, V] (or, ``table``, a tied embedding table [V, d]) -> float32 logits
        [B, T, V]. Why contract the table as it is rather than its transpose: the backward needs the
        operand, and a transpose made in the forward would be kept per microbatch as a copy of the table
        (a ``[V, d]`` residual; the table itself is the stage's parameter, not stored)."""
        return jnp.einsum("btd,vd->btv" if table else "btd,dv->btv", h, kernel).astype(jnp.float32)

    def cross_entropy(self, logits: Array, targets: Array) -> Array:
        """Mean next-token cross-entropy over all positions (float32)."""
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.mean(lse - tgt)


DEFAULT_OPS = Ops()

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


def feature_mean(v: Array) -> Array:
    """Mean over the last (feature) axis, kept as a size-1 axis: the norms' reduction on one device."""
    return v.mean(-1, keepdims=True)


# What a norm keeps for its backward: its input and the per-token statistics (named NORM_STATS); the
# centred and normalised inputs are recomputed from them in one elementwise pass. Why: autodiff keeps
# three arrays of the model's width per norm (x - mu, 2 (x - mu) and the normalised input), where one suffices.
# The statistics kept are the mean and the variance (mean square), not rsqrt of them: rsqrt's derivative
# reads its input, so keeping its output made the backward recompute the variance, a pass over x and,
# in tensor parallelism, one more all-reduce over row per norm.
# ``mean`` is the feature mean: :func:`feature_mean` here, a psum over the axis that splits the features in
# tensor parallelism (``jaxhybrid.parallel.tensor.ops``), so both layouts share this code and what it keeps.
NORM_STATS = "norm_stats"  # checkpoint name of a norm's per-token statistics
KEEP_STATS = jax.checkpoint_policies.save_only_these_names(NORM_STATS)


def layer_norm_body(x: Array, scale: Array, bias: Array | None, eps: float, mean: Callable[[Array], Array]) -> Array:
    """LayerNorm without its checkpoint (:func:`layer_norm` is this under ``jax.checkpoint(KEEP_STATS)``)."""
    xf = x.astype(jnp.float32)
    mu = checkpoint_name(mean(xf), NORM_STATS)
    var = checkpoint_name(mean(jnp.square(xf - mu)), NORM_STATS)
    y = (xf - mu) * jax.lax.rsqrt(var + eps) * scale
    return (y if bias is None else y + bias).astype(x.dtype)


def rms_norm_body(x: Array, scale: Array, eps: float, mean: Callable[[Array], Array]) -> Array:
    """RMSNorm without its checkpoint (:func:`rms_norm` is this under ``jax.checkpoint(KEEP_STATS)``)."""
    xf = x.astype(jnp.float32)
    ms = checkpoint_name(mean(jnp.square(xf)), NORM_STATS)
    return (xf * jax.lax.rsqrt(ms + eps) * scale).astype(x.dtype)


layer_norm = jax.checkpoint(layer_norm_body, policy=KEEP_STATS, static_argnums=(3, 4))
rms_norm = jax.checkpoint(rms_norm_body, policy=KEEP_STATS, static_argnums=(2, 3))


def _gelu(u: Array) -> Array:
    return jax.nn.gelu(u, approximate=True)


def _swiglu(g: Array, u: Array) -> Array:
    return jax.nn.silu(g) * u


# The MLP activations, recomputed in the backward from their inputs (jax.checkpoint), as Megatron's
# fused bias-GeLU and SwiGLU kernels do. Why: autodiff keeps their intermediates, four or five arrays
# of the MLP's width per block, where the pre-activations (one for GeLU, two for SwiGLU) suffice and
# the recomputation is one elementwise pass. With the norms above this about halves a stage's forward
# residuals and makes the forward faster, the backward no slower.
gelu = jax.checkpoint(_gelu)
swiglu = jax.checkpoint(_swiglu)


def rope(x: Array, theta: float) -> Array:
    """Rotary position embedding (Su et al.) on [B, T, H, Dh]. Rotates the pairs (i, i + Dh/2), the
    split-halves convention of GPT-NeoX and Hugging Face LLaMA (``rotate_half``), not Meta's interleaved
    pairs (2i, 2i + 1): weights from Meta's checkpoints need HF's permutation of the q/k rows."""
    t, dh = x.shape[1], x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : dh // 2], xf[..., dh // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)
