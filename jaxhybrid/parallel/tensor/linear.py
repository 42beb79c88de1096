"""Agarwal's 3D-parallel fully-connected layer as AxoNN modifies it (AxoNN-4D Sec. III-B, Algorithm 1).

Axis naming, made consistent
----------------------------
Algorithm 1 indexes GPU_{ijk} with i on the column axis, j on the row axis and k on depth; X is split as
``X_{kj}`` (rows m over depth, columns k over row) and W as ``W_{ji}`` (rows k over row, columns n over
column), which is also what the text of Sec. III-B and Fig. 2 say. Then in ``Y'_{ki} = X_{kj} W_{ji}``
the contracted index j runs over the **row** axis, so the forward all-reduce of line 12 must be over
**row**, and in ``dX_{kj} = dY_{ki} W_{ji}^T`` the contracted index i runs over **column**, so the
backward all-reduce of line 19 must be over **column**. Algorithm 1 prints the two names the other way
round (line 12 "column", line 19 "row"); eqs. 6-7 use the consistent names (eq. 6: row group, buffer
``mn/(G_d G_c)``; eq. 7: column group, buffer ``mk/(G_d G_r)``), and so does this module and
``jaxhybrid.planner.comm_model``. A layer transposed by optimization A swaps the roles of row and column.

So for a layout with ``in_ax`` (splits k, the contraction) and ``out_ax`` (splits n):

=========  ==================================  ===============================================
tensor     global spec                         local shape on device (data, depth, r, c)
=========  ==================================  ===============================================
X          ``P((data, depth), None, in_ax)``   ``[B/(G_data G_d), T, k/G_in]``
W (stored) ``P((in_ax, depth), out_ax)``       ``[k/(G_in G_d), n/G_out]`` unique per tensor device
W (gath.)  ``P(in_ax, out_ax)``                ``[k/G_in, n/G_out]`` after all-gather over depth
bias       ``P(out_ax)``                       ``[n/G_out]``
Y, dY      ``P((data, depth), None, out_ax)``  ``[B/(G_data G_d), T, n/G_out]``
=========  ==================================  ===============================================

Forward: all-gather W over depth (eq. 4), local matmul, all-reduce over ``in_ax`` (eq. 6). Backward:
``dX`` all-reduced over ``out_ax`` (eq. 7); ``dW`` reduce-scattered over depth (eq. 5) then all-reduced
over data (eq. 8). The backward is two islands, input gradient and weight gradient, so a 2BP stage can
run them at different times; the custom_vjp runs both. A layer built with ``batch=REPLICA_BATCH`` runs
under ``jax.vmap`` over the data replicas: its X and Y are one replica's rows, split over depth only
(``[B/(G_data G_d), ...]`` locally all the same), and eq. 8 is left to its caller, which reduces the
accumulated gradients once per step (:func:`jaxhybrid.runtime.engines.base.accumulated_step`).

Optimizations B-E are switches here (A is a layout choice, made by :mod:`jaxhybrid.parallel.tensor.ops`). XLA has
no user-visible async collectives, so a switch that is *off* pins the unoptimised order with a global-view
``optimization_barrier`` between islands (inside an island it would merge the varying-axes types of its
operands), and *on* leaves the islands independent so the latency-hiding scheduler may overlap.

What the compiled HLO shows (``jaxhybrid.planner.hlo``): on the CPU backend every collective is
synchronous (no ``*-start``/``*-done`` pairs, so nothing can overlap) and the barriers are expanded before
scheduling: a 2-block GPT on (1, 2, 2, 2) with recomputation compiles to the same sequence of 64
collectives with B, C, D on or off, and XLA's CSE merges the recomputed all-gathers of unchanged weights,
so E holds on CPU even when switched off (the lowered program shows the switch: fewer all-gathers with
E). The overlap itself is a GPU-backend property, which :func:`hlo.async_overlap` reports.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxhybrid.parallel.collectives import psum_scatter
from jaxhybrid.parallel.tensor.mesh import BATCH, COL, DATA, DEPTH, ROW

ALLGATHER_NAME = "axonn_weight_allgather"  # checkpoint name of the gathered W (optimization E)


@dataclass(frozen=True)
class Layout:
    """Which mesh axis splits the contraction dim (``in_ax``) and which the output features."""

    in_ax: str = ROW
    out_ax: str = COL

    @property
    def transposed(self) -> bool:
        return self.in_ax == COL

    def x_spec(self, ndim: int = 3, batch: tuple[str, ...] = BATCH) -> P:
        return P(batch, *([None] * (ndim - 2)), self.in_ax)

    def y_spec(self, ndim: int = 3, batch: tuple[str, ...] = BATCH) -> P:
        return P(batch, *([None] * (ndim - 2)), self.out_ax)

    @property
    def w_spec(self) -> P:
        return P((self.in_ax, DEPTH), self.out_ax)

    @property
    def w_gathered_spec(self) -> P:
        return P(self.in_ax, self.out_ax)

    @property
    def b_spec(self) -> P:
        return P(self.out_ax)


NORMAL, TRANSPOSED = Layout(ROW, COL), Layout(COL, ROW)


@dataclass(frozen=True)
class Switches:
    """AxoNN Sec. IV optimizations B-E (A lives in the ops object: it picks layouts per site)."""

    overlap_input_grad: bool = True  # B: dX all-reduce may overlap the dW matmul
    defer_reduce_scatter: bool = True  # C: dW reduce-scatter need not finish before dX is released
    prefetch_allgather: bool = True  # D: W all-gather may be issued before this layer's input exists
    cache_allgather: bool = True  # E: gathered W is saved across activation recomputation

    @classmethod
    def from_letters(cls, letters: str) -> "Switches":
        return cls("B" in letters, "C" in letters, "D" in letters, "E" in letters)


def _mm(x, w):
    return jnp.einsum("...i,io->...o", x, w)


def _fwd_local(x, w_shard, b, *, lay: Layout):
    """Alg. 1 lines 9-12. x: [b, T, k/G_in]; w_shard: [k/(G_in G_d), n/G_out]; b: [n/G_out] or None.

    Returns y [b, T, n/G_out] (summed over ``in_ax``) and the gathered W [k/G_in, n/G_out].
    """
    w = lax.all_gather(w_shard, DEPTH, axis=0, tiled=True, to="invarying")  # eq. 4
    w = checkpoint_name(w, ALLGATHER_NAME)
    y = lax.psum(_mm(x, w), lay.in_ax)  # eq. 6
    return (y if b is None else y + b), w


def _dx_local(dy, w, *, lay: Layout):
    """Alg. 1 line 19: dX = AllReduce_out(dY W^T). dy: [b, T, n/G_out], w: [k/G_in, n/G_out]."""
    return lax.psum(jnp.einsum("...o,io->...i", dy, w), lay.out_ax)  # eq. 7


def _dw_local(x, dy, *, lay: Layout, has_bias: bool, batch: tuple[str, ...]):
    """Alg. 1 line 20 plus the data-parallel all-reduce: dW shard [k/(G_in G_d), n/G_out], db [n/G_out].
    Without data in ``batch`` (one replica's rows, under vmap) the replicas' sums are left to the caller."""
    xf, dyf = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dw = psum_scatter(xf.T @ dyf, DEPTH)  # eq. 5
    if DATA in batch:
        dw = lax.psum(dw, DATA)  # eq. 8
    if not has_bias:
        return dw
    return dw, lax.psum(dyf.sum(0), batch)


@dataclass(frozen=True)
class Linear3D:
    """One 3D-parallel FC layer ``y = x @ W + b`` on ``mesh`` with layout ``lay``; global view in and out.

    ``__call__`` is a custom_vjp whose backward is :meth:`backward`; :meth:`forward`, :meth:`input_grad`
    and :meth:`weight_grad` are the three islands, usable on their own for a 2BP split.
    """

    mesh: Mesh
    lay: Layout = NORMAL
    sw: Switches = Switches()
    batch: tuple[str, ...] = BATCH  # mesh axes splitting X's rows (REPLICA_BATCH: one replica's, under vmap)

    def _smap(self, f, in_specs, out_specs):
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)

    def forward(self, x, w, b=None):
        """Global x [B, T, k], W [k, n] (stored layout), b [n] -> (y [B, T, n], gathered W [k, n])."""
        lay, nd, bt = self.lay, x.ndim, self.batch
        if not self.sw.prefetch_allgather:
            # D off: the all-gather of W may not be issued before this layer's input exists.
            x, w = lax.optimization_barrier((x, w))
        f = partial(_fwd_local, lay=lay)
        outs = (lay.y_spec(nd, bt), lay.w_gathered_spec)
        if b is None:
            return self._smap(lambda x_, w_: f(x_, w_, None), (lay.x_spec(nd, bt), lay.w_spec), outs)(x, w)
        return self._smap(f, (lay.x_spec(nd, bt), lay.w_spec, lay.b_spec), outs)(x, w, b)

    def input_grad(self, dy, w_gathered):
        """2BP input-gradient island: dX [B, T, k] from dY and the gathered W (eq. 7)."""
        lay, nd, bt = self.lay, dy.ndim, self.batch
        g = self._smap(partial(_dx_local, lay=lay), (lay.y_spec(nd, bt), lay.w_gathered_spec), lay.x_spec(nd, bt))
        return g(dy, w_gathered)

    def weight_grad(self, x, dy, has_bias: bool):
        """2BP weight-gradient island: (dW [k, n] in the stored layout, db [n] or None), eqs. 5 and 8."""
        lay, nd, bt = self.lay, dy.ndim, self.batch
        f = partial(_dw_local, lay=lay, has_bias=has_bias, batch=bt)
        ins = (lay.x_spec(nd, bt), lay.y_spec(nd, bt))
        if has_bias:
            return self._smap(f, ins, (lay.w_spec, lay.b_spec))(x, dy)
        return self._smap(f, ins, lay.w_spec)(x, dy), None

    def backward(self, x, w_gathered, dy, has_bias: bool):
        """The whole backward, (dX, dW, db): the two 2BP islands ordered by optimizations B and C."""
        dx = self.input_grad(dy, w_gathered)
        if not self.sw.overlap_input_grad:
            # B off: the weight-gradient matmul waits for the input-gradient all-reduce.
            dx, dy = lax.optimization_barrier((dx, dy))
        dw, db = self.weight_grad(x, dy, has_bias)
        if not self.sw.defer_reduce_scatter:
            # C off: dX, which the previous layer's backward needs, is released only after the
            # reduce-scatter (and data all-reduce) of this layer's dW.
            dx, dw = lax.optimization_barrier((dx, dw))
        return dx, dw, db

    def __call__(self, x, w, b=None):
        return _linear(self, x, w, b)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _linear(layer: Linear3D, x, w, b):
    return layer.forward(x, w, b)[0]


def _linear_fwd(layer, x, w, b):
    y, wg = layer.forward(x, w, b)
    if layer.mesh.shape[DEPTH] == 1:
        # Nothing to gather: keep W itself, not the shard_map's copy of it. Why: a residual that IS the
        # parameter is not stored per microbatch (a 2BP stage swaps it for a slot, residuals.strip_params);
        # the copy was one more weight shard per microbatch a pipeline stage stashes.
        wg = w
    # Alg. 1 line 13: cache X and the gathered W (the bias only marks that a bias gradient is due).
    return y, (x, wg) if b is None else (x, wg, jnp.zeros((), b.dtype))


def _linear_bwd(layer, res, dy):
    x, wg = res[:2]
    dx, dw, db = layer.backward(x, wg, dy, len(res) == 3)
    return dx, dw, db


_linear.defvjp(_linear_fwd, _linear_bwd)
