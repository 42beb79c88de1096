"""The trainer's updater over the host-offloaded optimizer (Myelin V-B, V-C): the same interface as
``DeviceUpdater`` (``init``, ``stats``, ``apply``, state dicts) on the params and gradient pytrees the
engines use, plus ``apply_streamed`` for the all-reduce's reduced chunks. The bucketed step itself is
:class:`~jaxhybrid.optim.offload.OffloadedOptimizer`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxhybrid.optim.offload import OffloadedOptimizer, OffloadState
from jaxhybrid.optim.updater import Updater, decay_mask
from jaxhybrid.parallel.data.flat import release


class OffloadUpdater(Updater):
    """The trainer's updater interface (like ``DeviceUpdater``) over :class:`OffloadedOptimizer`.

    ``apply`` takes the params pytree the engine used and returns the new compute-precision pytree;
    ``stats`` is ``DeviceUpdater``'s (:meth:`Updater.stats`), so the norm and overflow are agreed the same way.
    """

    streams_chunks = True

    def __init__(self, transform: optax.GradientTransformation, cfg, backend: str | None = None):
        o = cfg.optim
        self.opt = OffloadedOptimizer(transform, o.bucket_size, grad_clip=o.grad_clip,
                                      compute_dtype=cfg.precision.compute_dtype, backend=backend, name="adamw",
                                      decay=decay_mask(o))

    def init(self, params) -> OffloadState:
        return self.opt.init(params)

    def compute_params(self, params):
        return jax.tree.map(lambda x: jnp.asarray(x, self.opt.compute_dtype), params)

    def apply(self, params, opt_state, grads, scale, sq, nonfinite):
        """One step; consumes ``params`` and ``grads`` (their buffers are deleted, as jit donation would).

        Why: Myelin's device footprint is the compute parameters, the gradients and a few buckets. Kept
        alive by the caller, the old parameter and gradient pytrees would sit next to the flat vectors the
        buckets slice, well over that goal (``jaxhybrid bench offload`` reports the peak). The old
        compute parameters are not needed at all (each bucket writes its new ones from the host masters,
        and a skipped step rebuilds them from there), so they go first; the gradient pytree goes once its
        flat copy is queued. At most two pytree-sized arrays are then alive at any moment: the gradients
        twice while they are flattened (``on_bucket(-1)`` probes it), then one flat gradient vector and
        the flat parameter vector the buckets fill in place."""
        release(params)
        flat_g = self.opt.flatten(grads)
        if self.opt.on_bucket is not None:
            self.opt.on_bucket(-1)
        release(grads)
        new_state, flat, info = self.opt.step(opt_state, flat_g, loss_scale=scale, finite=not bool(nonfinite),
                                              sq=sq)
        del flat_g
        return self.opt.params_tree(flat), new_state, jnp.float32(info["grad_norm"])

    def apply_streamed(self, params, opt_state, chunks, scale, global_sum, global_max, norm_view=None):
        """Myelin V-C: the step fed by reduced gradient chunks as the all-reduce produces them
        (``PipelineEngine.loss_and_grad_chunks``). Consumes ``params`` as :meth:`apply` does. The norm
        for clipping is summed from the reduced chunks over the stages (``global_sum``); with clipping on
        every chunk is reduced before the first bucket updates (the first fetches are issued before the
        reductions), without it each chunk's buckets update once it is reduced (after the next chunk's
        reduction, which mpi4jax finishes before it returns: :mod:`~jaxhybrid.optim.offload`). A
        non-finite chunk on any rank (``global_max``) rolls every rank back to ``opt_state`` and its
        parameters. ``norm_view``: the engine's filter of the leaves this rank counts in the norm (the
        last stage leaves out its tied-embedding copy, which the first stage counts). Returns
        ``(params, state, grad_norm, nonfinite)``."""
        release(params)
        uncounted = self.opt.spec.dropped_ranges(norm_view) if norm_view is not None else ()
        new_state, flat, info = self.opt.step(opt_state, chunks=chunks, loss_scale=scale, global_sum=global_sum,
                                              uncounted=uncounted)
        nonfinite = global_max(jnp.float32(info["nonfinite"]))
        if bool(nonfinite) and not info["nonfinite"]:  # another rank overflowed: undo this rank's update
            new_state, flat = opt_state, self.opt.device_params(opt_state)
        return self.opt.params_tree(flat), new_state, jnp.float32(info["grad_norm"]), nonfinite

    def state_dict(self, opt_state) -> dict:
        return self.opt.state_dict(opt_state)

    def load_state_dict(self, like, saved) -> OffloadState:
        return self.opt.load_state_dict(saved)
