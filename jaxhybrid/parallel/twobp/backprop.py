"""The 2BP split of a backward pass (2BP Sec. 3, backward-p1 / backward-p2) with the "taps" pattern.

Every weighted sublayer of the model goes through the injected ops object (``ops.dense``,
``ops.layer_norm``, ``ops.rms_norm``, ``ops.logits``; the embedding is tapped at the stage level).
:class:`TapOps` wraps the model's ops and, per call site ("site"):

* mode ``"tap"`` (forward): records the site's input and adds a zero "tap" tensor to its output. The
  input pass takes ``jax.vjp`` with respect to (stage input, taps); the tap cotangents are then
  dL/d(site output), i.e. exactly what each site's weight gradient needs.
* mode ``"replay"`` (weight pass): recomputes each site from its *recorded* input with the live
  parameters and adds ``sum(site_output * tap_cotangent)`` to a scalar. The gradient of that scalar with
  respect to the parameters is the stage's full weight gradient (backward-p2); everything else the replay
  traces is dead code that XLA removes. Because every record has a leading batch dim, the records and
  cotangents of K microbatches concatenated along the batch give the SUM of their K weight gradients in
  one larger matmul per site (2BP Fig. 2). Linear sites of the reference ops skip the recomputation:
  their weight gradient is 2BP's ``dW = x^T dy`` (Sec. 3), computed directly (see :meth:`Tape.linear`).
* Weights applied alike to every token (norm scale and bias, matmul bias) of the reference ops take a
  cheaper route, :meth:`Tape.per_sample`: in tap mode they are per-sample copies ``w + tap`` (tap:
  zeros ``[mb, 1, d]``), so the input pass returns each sample's gradient as that tap's cotangent, a
  token reduction fused into the backward it runs anyway; the weight pass only sums over the batch. A
  norm then keeps neither its input nor its output cotangent for the weight pass.
* mode ``"discover"``: records the shapes of the site outputs and of the per-sample weight taps.
* mode ``"plain"``: the wrapped ops unchanged (forward-only recomputation segments).

Under other ops (tensor-parallel: sharded norm statistics, collectives in the matmuls) linear and norm
sites are replayed sites as above. The attention core and the loss have no parameters and are replaced
by cheap placeholders in replay mode.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxhybrid.model.layers import Ops

SITE_OUTPUT = "site_output"  # checkpoint name of a tapped site's output (remat dots saves these)

Array = jax.Array


class Tape:
    """Per-trace mutable state of a :class:`TapOps` (one trace, one tape; never shared across traces).

    Attributes:
      mode: tap | replay | discover | plain.
      taps: zero tensors added to the site outputs, in site order (tap mode).
      records: distinct site inputs, in first-use order (tap mode fills; replay mode reads).
      site_index: for each site, the position of its input in ``records`` (llama's gate and up share one).
      cots: tap cotangents dL/d(site output), in site order (replay mode).
      shapes: ShapeDtypeStruct of each site output (discover mode).
      wtaps: zero per-sample taps on the per-token weight vectors, in order (tap mode).
      partials: their per-sample gradients, the wtaps' cotangents, packed per dtype name (replay mode;
        ``residuals.pack_partials``); ``offsets`` walks each packed array in per_sample order.
      wshapes: ShapeDtypeStruct of each of those taps (discover mode).
      cots_in_program: replay mode inside the fused backward, whose cotangents are computed in the same
        program rather than read as inputs (see :meth:`linear`).
    """

    def __init__(self, mode: str, taps=None, records=None, site_index=(), cots=None, wtaps=None, partials=None,
                 cots_in_program: bool = False):
        if mode not in ("tap", "replay", "discover", "plain"):
            raise ValueError(f"Tape mode {mode!r}; choose tap, replay, discover or plain")
        self.mode = mode
        self.taps = list(taps or [])
        self.records = list(records or [])
        self.site_index = list(site_index)
        self.cots = list(cots or [])
        self.shapes: list[jax.ShapeDtypeStruct] = []
        self.wtaps = list(wtaps or [])
        self.partials = dict(partials or {})
        self.offsets: dict[str, int] = {}
        self._sums: dict[str, Array] = {}
        self.wshapes: list[jax.ShapeDtypeStruct] = []
        self.cots_in_program = cots_in_program
        self.acc = jnp.zeros((), jnp.float32)
        self.i = 0  # next site
        self.k = 0  # next per-token weight vector (per_sample)

    def per_sample(self, x: Array, weights: tuple[Array, ...]) -> tuple[Array, ...]:
        """Weights applied alike to every token of ``x`` (norm scale and bias, matmul bias: vectors
        ``[d]``). Their gradient is a token reduction of the output cotangent (times the normalized input
        for a scale), which the input pass has at hand while it forms that cotangent: in tap mode they
        become per-sample copies ``w + tap`` (tap: zeros ``[mb, 1.., d]``), so the input pass's vjp returns
        each sample's gradient as the tap's cotangent, a reduction fused into the fusion that produces the
        cotangent. Samples stay separate so that weight residuals of K microbatches still concatenate
        along the batch (2BP Fig. 2); in replay mode the weight pass sums them over the batch.

        Why not in the weight pass: a norm would keep its input and output cotangent (two ``[mb, T, d]``
        arrays) and recompute its statistics there; a matmul bias would read its cotangent a second time.
        """
        if self.mode == "replay":
            for w in weights:
                key = jnp.dtype(w.dtype).name
                if key not in self._sums:  # one batch reduction per packed array, then slices of it
                    self._sums[key] = jax.lax.stop_gradient(jnp.sum(self.partials[key], axis=0))
                o = self.offsets.get(key, 0)
                g = self._sums[key][o:o + w.size].reshape(w.shape)
                self.offsets[key] = o + w.size
                self.acc = self.acc + jnp.sum((w * g.astype(w.dtype)).astype(jnp.float32))
                self.k += 1
        elif self.mode == "discover":
            lead = (x.shape[0],) + (1,) * (x.ndim - 2)
            self.wshapes.extend(jax.ShapeDtypeStruct(lead + w.shape, w.dtype) for w in weights)
        elif self.mode == "tap":
            taps = self.wtaps[self.k:self.k + len(weights)]
            self.k += len(weights)
            weights = tuple(w + t for w, t in zip(weights, taps))
        return weights

    def norm(self, fn: Callable[..., Array], x: Array, weights: tuple[Array, ...]) -> Array:
        """A norm site ``fn(x, *weights)`` of the reference ops: all its weights go through
        :meth:`per_sample`, so it keeps nothing of shape ``[mb, T, d]`` for the weight pass."""
        weights = self.per_sample(x, weights)
        return x if self.mode == "replay" else fn(x, *weights)  # replay: downstream is dead code

    def linear(self, fn: Callable[[Any, Any], Array], x: Any, kernel: Array, bias: Array | None,
               out_major: bool = False) -> Array:
        """A site ``fn(x, bias) = x @ kernel (+ bias)`` (``out_major``: ``x @ kernel.T``, the kernel stored
        ``[out, in]``, as a tied embedding table) of the reference ops; its bias goes through
        :meth:`per_sample`. In replay mode the kernel gradient is formed directly, ``dW = sum_tokens
        x^T dy`` (2BP Sec. 3), and enters the scalar as ``sum(kernel * dW)`` with dW a constant, so that
        ``jax.grad`` of the scalar still returns it (through the compute-dtype cast) next to the others.

        Why not replay through autodiff as :meth:`site` does: the transpose of ``einsum(x, W)`` w.r.t. W
        is ``dot(dy, x)`` followed by a transpose, which XLA:CPU lowers to a generic (Eigen) matmul on
        a transposed copy of dy; ``dot(x, dy)`` over the token dims maps to its fast (YNNPACK) matmul.
        """
        b = None if bias is None else self.per_sample(x, (bias,))[0]
        if self.mode != "replay":
            return self.site(lambda v: fn(v, b), x)
        r, c = self.records[self.site_index[self.i]], self.cots[self.i]
        lead = tuple(range(r.ndim - 1))
        # c in the compute dtype, as the fused backward's cotangent reaching the matmul (logits: f32 -> dtype).
        cr = c.astype(r.dtype)
        if out_major:  # dW is [out, in]: dy^T x, the dot in the order the kernel is stored
            dw = jnp.tensordot(cr, r, axes=(lead, lead))
        elif r.shape[-1] > c.shape[-1] and not self.cots_in_program:
            # The token dims lead in both operands, so one of them is transposed for the matmul: transpose
            # the narrower one (dy of mlp.down, not its 4x wider input) and the small [out, in] result.
            # The barrier stops XLA from folding the transpose back into the dot (the folded form runs slower).
            # Not in the fused backward: there dy of mlp.down is the residual stream's gradient, made in
            # the same program, and XLA wrote its transpose from inside the norm backward producing it,
            # repeating that fusion, so transposing the input there costs less.
            dw = jax.lax.optimization_barrier(jnp.tensordot(cr, r, axes=(lead, lead))).T
        else:
            dw = jnp.tensordot(r, cr, axes=(lead, lead))
        dw = jax.lax.stop_gradient(dw)
        self.acc = self.acc + jnp.sum((kernel * dw.astype(kernel.dtype)).astype(jnp.float32))
        self.i += 1
        return c  # the site output's shape and dtype; downstream of a site the replay is dead code

    def site(self, fn: Callable[[Any], Array], x: Any) -> Array:
        """Apply one weighted site ``fn`` (input -> output, weights closed over) per the tape's mode."""
        if self.mode == "replay":
            y = fn(self.records[self.site_index[self.i]])
            # d/dW sum(y * c) = the site's weight gradient for output cotangent c (exact for any dtype:
            # the cotangent arriving at y is c itself, as in the fused backward).
            self.acc = self.acc + jnp.sum((y * self.cots[self.i].astype(y.dtype)).astype(jnp.float32))
            self.i += 1
            return y
        y = fn(x)
        if self.mode == "discover":
            self.shapes.append(jax.ShapeDtypeStruct(y.shape, y.dtype))
        elif self.mode == "tap":
            # Deduplicate by identity: sites that read the same tensor (llama gate/up) store it once.
            pos = next((j for j, r in enumerate(self.records) if r is x), None)
            if pos is None:
                pos = len(self.records)
                self.records.append(x)
            self.site_index.append(pos)
            tap = self.taps[self.i]
            if tap.shape != y.shape or tap.dtype != y.dtype:
                raise ValueError(f"tap {self.i}: {tap.shape} {tap.dtype} != site output {y.shape} {y.dtype}")
            y = checkpoint_name(y + tap, SITE_OUTPUT)
            self.i += 1
        return y


@dataclasses.dataclass(frozen=True, eq=False)
class TapOps(Ops):
    """Wraps another ops object (the reference or a tensor-parallel one) and routes weighted sites
    through a :class:`Tape`. Model code is unchanged: it still calls ``ops.dense(x, kernel, bias)``."""

    inner: Ops = dataclasses.field(default_factory=Ops)
    tape: Tape = dataclasses.field(default_factory=lambda: Tape("plain"))

    def __getattr__(self, name):  # extra methods of a custom inner ops object
        return getattr(object.__getattribute__(self, "inner"), name)

    @property
    def saved_names(self) -> tuple[str, ...]:
        return self.inner.saved_names

    @property
    def reference(self) -> bool:
        """Whether the wrapped ops are exactly the reference :class:`Ops`, whose linear sites are plain
        ``x @ W + b`` (tensor-parallel ops replay their own code, collectives included)."""
        return type(self.inner) is Ops

    def dense(self, x, kernel, bias=None, *, name=""):
        fn = lambda v, b: self.inner.dense(v, kernel, b, name=name)  # noqa: E731
        if self.reference:
            return self.tape.linear(fn, x, kernel, bias)
        return self.tape.site(lambda v: fn(v, bias), x)

    def layer_norm(self, x, scale, bias, eps):
        if self.reference:
            ws = (scale,) if bias is None else (scale, bias)
            return self.tape.norm(lambda v, s, b=None: self.inner.layer_norm(v, s, b, eps), x, ws)
        return self.tape.site(lambda v: self.inner.layer_norm(v, scale, bias, eps), x)

    def rms_norm(self, x, scale, eps):
        if self.reference:
            return self.tape.norm(lambda v, s: self.inner.rms_norm(v, s, eps), x, (scale,))
        return self.tape.site(lambda v: self.inner.rms_norm(v, scale, eps), x)

    def logits(self, h, kernel, table: bool = False):
        if self.reference:
            return self.tape.linear(lambda v, _: self.inner.logits(v, kernel, table), h, kernel, None, table)
        return self.tape.site(lambda v: self.inner.logits(v, kernel, table), h)

    def attention(self, q, k, v, kernel="auto"):
        if self.tape.mode == "replay":  # no parameters: its output is dead in the weight pass
            return q
        return self.inner.attention(q, k, v, kernel)

    def embed(self, ids, table):
        return self.inner.embed(ids, table)

    def cross_entropy(self, logits, targets):
        if self.tape.mode == "replay":
            return jnp.zeros((), jnp.float32)
        return self.inner.cross_entropy(logits, targets)
