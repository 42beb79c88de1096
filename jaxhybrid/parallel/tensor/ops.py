"""The tensor-parallel ops object injected into the single-device model (AxoNN-4D Secs. III-IV).

Every parallelism-sensitive op is a ``shard_map`` island on the ``(data, depth, row, col)`` mesh; the
model itself runs unchanged in global view under ``jit``. Layouts (see :mod:`jaxhybrid.parallel.tensor.linear`):

* The residual stream ``[B, T, d]`` is ``P((data, depth), None, row)``: batch over data x depth (X's rows,
  Alg. 1 line 8), features over row, replicated over column.
* Dense sites: with optimization A the layers that read the stream (``attn.qkv``, ``mlp.up``,
  ``mlp.gate``, the vocabulary projection) are normal (k over row, n over column) and the layers that
  write it back (``attn.out``, ``mlp.down``) are transposed (k over column, n over row), so every output
  lands where its consumer reads it (Sec. IV-A). Without A every layer is normal and its output is
  re-laid out from column to row by an explicit all-gather over column (the paper's baseline).
* Attention runs per (batch shard, head shard): heads are split over the axis that carries the qkv
  output features when both head counts divide it, otherwise replicated over it. The fused qkv output's
  columns are grouped per key/value head (``jaxhybrid.model.transformer.PARAM_LAYOUT``), so each shard's
  contiguous block holds whole groups and the split into q, k, v moves nothing (AxoNN's per-shard
  ``[q_i | k_i | v_i]``; with ``[q | k | v]`` columns the compiler moved the k and v blocks).
* Norms reduce their statistics with a psum over row. The embedding table ``[V, d]`` is stored
  ``P(col, (row, depth))`` so its transpose is exactly a normal layer's weight (tied head); lookups
  mask the local vocabulary block and psum over column. The loss is a vocabulary-parallel
  cross-entropy: max, sum of exponentials and target logit reduced over column.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxhybrid.core.config.ranges import check_optimizations
from jaxhybrid.model.layers import KEEP_STATS, Ops, layer_norm_body, rms_norm_body
from jaxhybrid.parallel.tensor.linear import ALLGATHER_NAME, NORMAL, TRANSPOSED, Layout, Linear3D, Switches
from jaxhybrid.parallel.tensor.mesh import BATCH, COL, DEPTH, REPLICA_BATCH, ROW

STREAM = ROW  # mesh axis that splits the residual stream's features
WRITERS = ("attn.out", "mlp.down")  # sites that write the residual stream (transposed under A)
SITES = ("attn.qkv", "attn.out", "mlp.gate", "mlp.up", "mlp.down", "head.logits")
EMBED_SPEC = P(COL, (ROW, DEPTH))


@dataclasses.dataclass(frozen=True)
class TensorOps(Ops):
    """AxoNN 3D tensor-parallel ops. Build with :meth:`build`; hashable, so it can sit in a jitted model.

    Attributes:
      mesh: the 4D mesh.
      letters: the optimizations switched on, a subset of ``"ABCDE"``.
      head_axis: mesh axis splitting attention heads, or None (heads replicated over tensor axes).
    """

    mesh: Mesh | None = None
    letters: str = "ABCDE"
    head_axis: str | None = None
    batch: tuple[str, ...] = BATCH

    @classmethod
    def build(cls, mesh: Mesh, n_heads: int, kv_heads: int, letters: str = "ABCDE") -> "TensorOps":
        check_optimizations(letters)  # built without a config too (tests, benchmarks)
        ax = COL if "A" in letters else ROW  # where attn.qkv's output features live
        g = mesh.shape[ax]
        head_axis = ax if (g > 1 and n_heads % g == 0 and kv_heads % g == 0) else None
        return cls(mesh=mesh, letters="".join(sorted(set(letters))), head_axis=head_axis)

    def per_replica(self) -> "TensorOps":
        """These ops for a model run under ``jax.vmap`` over the data replicas (``spmd_axis_name`` data):
        each call sees one replica's rows, split over depth only, and leaves the replicas' gradient sums
        (eq. 8) to the caller (:func:`jaxhybrid.runtime.engines.base.accumulated_step`, once per step)."""
        return dataclasses.replace(self, batch=REPLICA_BATCH)

    # -- layouts ---------------------------------------------------------------------------------
    @property
    def switches(self) -> Switches:
        return Switches.from_letters(self.letters)

    @property
    def saved_names(self) -> tuple[str, ...]:
        """Optimization E: the gathered weights (named in :mod:`jaxhybrid.parallel.tensor.linear`) are kept across
        recomputation, not gathered again. Only with a depth axis: without one the "gathered" W is the
        parameter itself, and saving the shard_map's copy would stash one more weight per microbatch."""
        return (ALLGATHER_NAME,) if self.switches.cache_allgather and self.mesh.shape[DEPTH] > 1 else ()

    def layout(self, site: str) -> Layout:
        """Optimization A: stream writers transposed, everything else normal."""
        return TRANSPOSED if ("A" in self.letters and site in WRITERS) else NORMAL

    def _smap(self, f, in_specs, out_specs):
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)

    # -- dense ------------------------------------------------------------------------------------
    def dense(self, x, kernel, bias=None, *, name: str = ""):
        if name not in SITES:
            raise ValueError(f"TensorOps.dense: unknown site {name!r}; known sites: {', '.join(SITES)}")
        lay = self.layout(name)
        with jax.named_scope(f"axonn_{name}"):  # lets jaxhybrid.planner.hlo attribute collectives to sites
            y = Linear3D(self.mesh, lay, self.switches, self.batch)(x, kernel, bias)
        if lay.out_ax != STREAM and "A" not in self.letters:
            with jax.named_scope("axonn_relayout"):
                y = self.relayout(y, lay.out_ax, STREAM)
        return y

    def relayout(self, y, src: str, dst: str):
        """Move features from axis ``src`` to ``dst`` (the no-A baseline's layer-boundary communication).

        Local ``[b, T, n/G_src]`` (replicated over dst) -> ``[b, T, n/G_dst]`` (replicated over src): an
        all-gather over src keeps this device's dst block. Its backward is the same move from dst to src
        (a custom_vjp: autodiff would transpose the gather into an all-reduce of the full ``[b, T, n]``).
        """
        return _relayout(self.mesh, self.batch, src, dst, y)

    # -- attention -----------------------------------------------------------------------------
    def attention(self, q, k, v, kernel="auto"):
        """q: [B, T, H, Dh] -> local [B/(G_data G_d), T, H/G_h, Dh] (per replica: B is one replica's rows,
        split over depth); heads over ``head_axis``."""
        spec = P(self.batch, None, self.head_axis, None)
        return self._smap(partial(Ops.attention, self, kernel=kernel), (spec, spec, spec), spec)(q, k, v)

    # -- norms ---------------------------------------------------------------------------------------
    def _norm(self, norm, x, *vectors):
        """``norm`` on the stream shard: x local [b, T, d/G_r], its scale (and bias) local [d/G_r].

        Recomputed in the backward from the statistics it names, as the reference norm is; the
        checkpoint wraps the island rather than sitting inside it because jax 0.10.2 fails to batch a
        checkpoint inside a shard_map body under ``vmap(spmd_axis_name=...)`` (its varying-axes types
        lose the vmapped axis), which :meth:`per_replica` ops run under.
        """
        xs = P(self.batch, *[None] * (x.ndim - 2), STREAM)
        island = self._smap(norm, (xs, *[P(STREAM)] * len(vectors)), xs)
        return jax.checkpoint(island, policy=KEEP_STATS)(x, *vectors)

    def layer_norm(self, x, scale, bias, eps):
        """The reference norm's body with its statistics psum'd over row."""
        vectors = (scale,) if bias is None else (scale, bias)
        return self._norm(lambda a, s, b=None: layer_norm_body(a, s, b, eps, _stream_mean), x, *vectors)

    def rms_norm(self, x, scale, eps):
        return self._norm(lambda a, s: rms_norm_body(a, s, eps, _stream_mean), x, scale)

    # -- embedding and vocabulary loss ---------------------------------------------------------------
    def embed(self, ids, table):
        """ids local [b, T]; table local [V/G_c, d/(G_r G_d)], all-gathered over depth -> [b, T, d/G_r]."""
        v_loc = table.shape[0] // self.mesh.shape[COL]

        def f(il, tl):
            t = lax.all_gather(tl, DEPTH, axis=1, tiled=True)  # varying: its transpose is a reduce-scatter
            lid = il - lax.axis_index(COL) * v_loc
            ok = (lid >= 0) & (lid < v_loc)
            rows = jnp.take(t, jnp.clip(lid, 0, v_loc - 1), axis=0)
            return lax.psum(jnp.where(ok[..., None], rows, jnp.zeros((), rows.dtype)), COL)

        return self._smap(f, (P(self.batch, None), EMBED_SPEC), P(self.batch, None, STREAM))(ids, table)

    def logits(self, h, kernel, table: bool = False):
        """The vocabulary projection as a normal 3D layer: [B, T, d] x [d, V] -> [B, T, V] over column
        (``table``: a tied [V, d] embedding table, transposed here)."""
        kernel = kernel.T if table else kernel
        with jax.named_scope("axonn_head.logits"):
            return Linear3D(self.mesh, NORMAL, self.switches, self.batch)(h, kernel).astype(jnp.float32)

    def cross_entropy(self, logits, targets):
        """Vocabulary-parallel mean cross-entropy. logits local [b, T, V/G_c]; targets local [b, T]."""
        v_loc = logits.shape[-1] // self.mesh.shape[COL]
        count = targets.size

        def f(lg, tg):
            mx = lax.pmax(lax.stop_gradient(lg.max(-1, keepdims=True)), COL)  # any shift works: no gradient
            lse = jnp.log(lax.psum(jnp.exp(lg - mx).sum(-1), COL)) + mx[..., 0]
            lid = tg - lax.axis_index(COL) * v_loc
            ok = (lid >= 0) & (lid < v_loc)
            pick = jnp.take_along_axis(lg, jnp.clip(lid, 0, v_loc - 1)[..., None], axis=-1)[..., 0]
            tgt = lax.psum(jnp.where(ok, pick, 0.0), COL)
            return lax.psum(jnp.sum(lse - tgt), self.batch) / count

        return self._smap(f, (P(self.batch, None, COL), P(self.batch, None)), P())(logits, targets)


def _stream_mean(v):
    """The feature mean of a stream shard ``[b, T, d/G_r]``: local sums psum'd over row, over the full d."""
    return lax.psum(v.sum(-1, keepdims=True), STREAM) / (v.shape[-1] * lax.axis_size(STREAM))


def _move(mesh: Mesh, batch: tuple[str, ...], src: str, dst: str, y):
    n_dst = y.shape[-1] // mesh.shape[dst]
    nd = y.ndim

    def f(yl):
        full = lax.all_gather(yl, src, axis=nd - 1, tiled=True, to="invarying")
        return lax.dynamic_slice_in_dim(full, lax.axis_index(dst) * n_dst, n_dst, axis=nd - 1)

    spec = lambda ax: P(batch, *[None] * (nd - 2), ax)  # noqa: E731
    return jax.shard_map(f, mesh=mesh, in_specs=spec(src), out_specs=spec(dst), check_vma=True)(y)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _relayout(mesh, batch, src, dst, y):
    return _move(mesh, batch, src, dst, y)


_relayout.defvjp(lambda mesh, batch, src, dst, y: (_move(mesh, batch, src, dst, y), None),
                 lambda mesh, batch, src, dst, _, dy: (_move(mesh, batch, dst, src, dy),))
