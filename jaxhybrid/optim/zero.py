"""A sharded optimizer over data replicas (``optim.shard_optimizer``): ZeRO stage 1, Megatron-LM's distributed
optimizer.

Every replica of a pipeline stage holds the stage's whole parameters and computes its whole local gradient,
but owns only ``1/G_data`` of the optimizer: the flat vector of the stage's parameters (``FlatSpec`` order,
zero-padded to ``G_data`` equal shards) is cut so that replica ``j`` owns ``[j c, (j + 1) c)``. One step:

1. reduce-scatter the local gradients over the column (:class:`~jaxhybrid.parallel.data.column.ReplicaColumn`):
   each replica gets the summed gradient of its shard only, half the bytes of an all-reduce;
2. the global norm from the shards (summed over the column, then over the stages) and the overflow flag,
   agreed by every rank before any update, as the unsharded path does;
3. AdamW on the shard: on the device (the shard's moments; the float32 parameters are the masters), or with
   ``optim.offload`` on the host in buckets (Myelin V-B), where each replica keeps only its shard's master
   weights and moments;
4. all-gather the updated shards: every replica's parameters again.

Optimizer-state bytes per rank are divided by ``G_data`` (the masters too with offload). The update is
elementwise, so each element sees exactly the arithmetic of the unsharded step; only the sum order of the
reduction and of the norm differ. Weight decay follows ``optim.weight_decay_mask`` per leaf, each shard
cut at leaf boundaries into pieces that keep their leaf's rule.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxhybrid.optim.bucket_programs import counted_sq
from jaxhybrid.optim.offload import OffloadedOptimizer
from jaxhybrid.optim.updater import Updater, decay_mask, decay_view, guarded_step, place_like
from jaxhybrid.parallel.data.column import ReplicaColumn
from jaxhybrid.parallel.data.flat import FlatSpec, release


class ZeroUpdater(Updater):
    """The trainer's updater when ``optim.shard_optimizer`` is on (module docstring). It takes this rank's
    unreduced gradients (:attr:`reduces_over_replicas`) and does the data-parallel reduction itself.

    Args:
      transform: the elementwise optax transform (``build_transform``: AdamW).
      cfg: the run config (``optim``: clip, decay mask, offload, buckets, wire dtype; ``precision``).
      column: this stage's data replicas.
    """

    reduces_over_replicas = True

    def __init__(self, transform: optax.GradientTransformation, cfg, column: ReplicaColumn):
        o = cfg.optim
        self.transform, self.column, self.grad_clip = transform, column, float(o.grad_clip)
        self.half_wire = o.allreduce_dtype == "compute"
        self.rule = decay_mask(o)
        self.offload = None
        if o.offload:
            self.offload = OffloadedOptimizer(transform, o.bucket_size, grad_clip=o.grad_clip,
                                              compute_dtype=cfg.precision.compute_dtype, name="adamw",
                                              decay=None if self.rule is None else (lambda _: self.flags))
        self.spec: FlatSpec | None = None
        self._uncounted = None  # the norm's cut-out ranges in shard coordinates, from the first step's norm_view

    # -- the shard ---------------------------------------------------------------------------------
    def _layout(self, params) -> None:
        """This replica's shard of the flat parameters and its pieces: one per leaf it overlaps (in shard
        coordinates, each with its leaf's decay flag), then the padding past the last leaf."""
        spec = self.spec = FlatSpec(params)
        c = self.c = self.column.shard_length(spec.n)
        lo = self.lo = self.column.index * c
        decays = jax.tree.leaves(self.rule(params)) if self.rule is not None else [True] * len(spec.sizes)
        self.cuts, self.flags = [], []
        for off, size, d in zip(spec.offsets, spec.sizes, decays):
            a, b = max(off, lo), min(off + size, lo + c)
            if a < b:
                self.cuts.append((a - lo, b - lo))
                self.flags.append(bool(d))
        if lo + c > spec.n:
            self.cuts.append((max(spec.n - lo, 0), c))
            self.flags.append(False)
        pad = c * self.column.size - spec.n
        self._shard_of = jax.jit(lambda tree: jax.lax.dynamic_slice(jnp.pad(spec.ravel(tree), (0, pad)), (lo,), (c,)))
        self._step = jax.jit(self._device_step, donate_argnums=(1,))

    def _pieces(self, flat: jax.Array) -> list:
        return [flat[a:b] for a, b in self.cuts]

    def _device_step(self, p, state, g, scale, sq, nonfinite):
        """``DeviceUpdater``'s step on the shard's pieces, each decayed by its leaf's rule."""
        ps = self._pieces(p)
        new, state, gnorm = guarded_step(self.transform, self.grad_clip, ps, state, self._pieces(g), scale, sq,
                                         nonfinite, decay_view(ps, lambda _: self.flags))
        return jnp.concatenate(new), state, gnorm

    # -- Updater -----------------------------------------------------------------------------------
    def init(self, params) -> Any:
        self._layout(params)
        shard = self._shard_of(params)
        if self.offload is not None:
            return self.offload.init([np.asarray(x, np.float32) for x in self._pieces(shard)])
        return self.transform.init(self._pieces(shard))

    def compute_params(self, params):
        if self.offload is None:
            return params
        return jax.tree.map(lambda x: jnp.asarray(x, self.offload.compute_dtype), params)

    def apply(self, params, opt_state, grads, scale, sq, nonfinite):
        raise ValueError("optim.shard_optimizer: the updater reduces the gradients itself; call apply_local "
                         "with this rank's unreduced gradients")

    def apply_local(self, params, opt_state, grads, scale, global_sum, global_max, norm_view=None):
        """One step on this rank's unreduced gradients of ``loss * scale`` (module docstring); consumes
        ``params`` and ``grads``. ``global_sum``/``global_max``: the engine's sum over the stages and max
        over all ranks; ``norm_view``: its filter of the leaves this rank counts in the norm (a tied copy
        is counted once). Returns ``(params, state, grad_norm, nonfinite)``."""
        flat = self.spec.ravel(grads)
        release(grads)
        g = self.column.reduce_scatter(flat, self.half_wire)
        del flat
        sq = self._sq(g, norm_view)
        sq = jnp.float32(global_sum(jnp.float32(self.column.sum(float(sq)))))
        nonfinite = global_max(jnp.float32(not np.isfinite(float(sq))))
        if self.offload is not None:
            release(params)
            opt_state, shard, info = self.offload.step(opt_state, grads=g, loss_scale=scale,
                                                       finite=not bool(nonfinite), sq=sq)
            gnorm = jnp.float32(info["grad_norm"])
        else:
            shard, opt_state, gnorm = self._step(self._shard_of(params), opt_state, g, jnp.float32(scale), sq,
                                                 nonfinite)
        whole = self.column.all_gather(shard, self.spec.n)
        return self.spec.unravel(whole), opt_state, gnorm, nonfinite

    def _sq(self, g: jax.Array, norm_view) -> jax.Array:
        """Squared norm of the reduced shard ``g``, less the ranges the engine's ``norm_view`` leaves out (the
        same leaves every step: found once)."""
        if self._uncounted is None:
            self._uncounted = self.spec.dropped_ranges(norm_view) if norm_view is not None else ()
        return counted_sq(self.lo, self.lo + self.c, g, self._uncounted)

    def state_dict(self, opt_state) -> Any:
        """This replica's shard of the state; with offload the host format (``master`` and the moments,
        flat) plus ``shard`` = (replica, replicas, parameters), by which an export puts the masters together."""
        if self.offload is None:
            return opt_state
        return {**self.offload.state_dict(opt_state),
                "shard": np.asarray([self.column.index, self.column.size, self.spec.n], np.int64)}

    def load_state_dict(self, like, saved) -> Any:
        if self.offload is None:
            return place_like(like, saved)
        shard = np.asarray(saved["shard"]).tolist()
        if shard != [self.column.index, self.column.size, self.spec.n]:
            raise ValueError(f"the checkpoint holds shard {shard[0]} of {shard[1]} of {shard[2]} parameters; this "
                             f"rank owns shard {self.column.index} of {self.column.size} of {self.spec.n}: resume "
                             f"with the layout that wrote it")
        return self.offload.load_state_dict(saved)


__all__ = ["ZeroUpdater"]
