"""The optimizer step applied by the trainer: descale, clip by the global norm, AdamW, skip on overflow.

``DeviceUpdater`` keeps fp32 master weights and optax state on the device and runs the whole update in
one jit. The global gradient norm and the overflow flag are computed per process by :meth:`stats` and
reduced across model-parallel ranks by the engine before :meth:`apply`, because clipping must see every
gradient before any update (Myelin's offload makes the same demand per bucket).
"""
from __future__ import annotations

import abc
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax


def lr_schedule(o, total_steps: int) -> optax.Schedule:
    """Linear warmup to ``o.lr`` then cosine decay to ``o.lr * o.min_lr_ratio`` at ``total_steps``.

    Warm-up step ``c`` (from 0) takes ``lr * (c + 1) / (warm + 1)``, as nanoGPT does: the first step already
    moves the weights. (A ramp from 0, as Megatron-LM's from its default ``init_lr`` 0, spends step 1 on
    Adam's moments alone.)"""
    warm = min(o.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=o.lr / (warm + 1), peak_value=o.lr, warmup_steps=warm,
        decay_steps=max(total_steps, warm + 1), end_value=o.lr * o.min_lr_ratio)


def build_transform(o, total_steps: int) -> optax.GradientTransformation:
    """AdamW with Myelin's defaults (lr 1e-3, betas 0.9/0.999, decoupled weight decay 0.01).

    Unmasked on purpose: which parameters decay (:func:`decay_mask`) is applied by the updaters through
    :func:`decay_view`, because the offloaded updaters run this transform on flat buckets where optax's
    per-leaf ``mask`` cannot see the leaves (a mask callable would find one 1-D vector and decay nothing)."""
    return optax.adamw(lr_schedule(o, total_steps), b1=o.beta1, b2=o.beta2, eps=o.eps,
                       weight_decay=o.weight_decay)


DecayMask = Callable[[Any], Any]


def decay_mask(o) -> DecayMask | None:
    """Which parameters AdamW decays (``optim.weight_decay_mask``), as a function of a params pytree to a
    pytree of bools, or None when every parameter decays.

    ``matrices`` (the default) decays the leaves of two or more dimensions, the kernels and embedding
    tables, and leaves biases and norm scales alone, as Megatron-LM and nanoGPT do (decaying a LayerNorm
    scale pulls it towards 0, not towards its init 1). The rule reads only a leaf's rank, which a pipeline
    stage's subtree, a tensor-parallel shard and an offloaded optimizer's list of shards all keep, so every
    layout decays the same elements as the single device."""
    if o.weight_decay_mask == "all" or o.weight_decay == 0:
        return None
    return lambda params: jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


def decay_view(params, mask: DecayMask | None):
    """``params`` as the decoupled weight decay should see them: zeros where ``mask`` says no decay.

    AdamW reads the parameters only in its decay term (``optax.add_decayed_weights``: ``u + wd * p``), so
    updating with this view is optax's ``adamw(mask=...)``, bit for bit (``u + wd * 0 == u``), and works
    the same on a pytree and, element by element, on an offloaded bucket (``bucket_programs``)."""
    if mask is None:
        return params
    return jax.tree.map(lambda p, d: p if d else jnp.zeros_like(p), params, mask(params))


def clip_factor(scale, sq, grad_clip: float):
    """Multiplier for loss-scaled gradients (``1/scale`` times the global-norm clip factor) and the
    unscaled global norm. One expression for the on-device and the offloaded path, so both agree bit
    for bit given the same ``sq``."""
    inv = 1.0 / scale
    factor = inv
    if grad_clip > 0:
        norm = jnp.sqrt(sq) * inv
        factor = inv * jnp.minimum(1.0, grad_clip / (norm + 1e-6))
    return factor, jnp.sqrt(sq) * inv


def place_like(like, saved):
    """Host arrays from a checkpoint, put back with the dtype and sharding of the live tree ``like``
    (committed, so the restored step reuses the compiled programs of a fresh run). Leaves that spanned
    other processes come back from the checkpoint as global arrays placed already."""
    
    def put(ref, x):
        if spans_processes(x):
            return x.astype(ref.dtype) if x.dtype != ref.dtype else x
        return jax.device_put(np.asarray(x, dtype=ref.dtype), ref.sharding)

    return jax.tree.map(put, like, saved)


def guarded_step(transform: optax.GradientTransformation, grad_clip: float, params, opt_state, grads, scale, sq,
                 nonfinite, seen):
    """Traced: one optimizer step on the gradients of ``loss * scale`` (descale and clip by the global
    ``sq``), with ``seen`` the parameters as the weight decay sees them (:func:`decay_view`); the old
    ``params`` and ``opt_state`` where ``nonfinite``. Returns ``(params, opt_state, grad_norm)``."""
    factor, gnorm = clip_factor(scale, sq, grad_clip)
    g = jax.tree.map(lambda x: x * factor.astype(x.dtype), grads)
    updates, new_state = transform.update(g, opt_state, seen)
    new_params = optax.apply_updates(params, updates)
    ok = nonfinite == 0
    pick = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
    return pick(new_params, params), pick(new_state, opt_state), gnorm


@jax.jit
def _stats(grads):
    leaves = jax.tree.leaves(grads)
    sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves)
    nonfinite = jnp.logical_not(jnp.isfinite(sq)).astype(jnp.float32)
    return sq, nonfinite


class Updater(abc.ABC):
    """Every hook the trainer calls on its optimizer: on device (:class:`DeviceUpdater`) or host-offloaded
    (``OffloadUpdater``, ``ShardedOffloadUpdater``). A base class for the same reason as the engines' (the
    hooks only offload needs have one default here), so the trainer probes none of them."""

    # Whether apply_streamed takes the all-reduce's reduced chunks (Myelin V-C); else the gradients come whole.
    streams_chunks: bool = False
    # Whether apply_local takes this rank's unreduced gradients and reduces them itself (optim.shard_optimizer).
    reduces_over_replicas: bool = False

    def stats(self, grads) -> tuple[jax.Array, jax.Array]:
        """This process's squared gradient norm and overflow flag (1.0 if any is non-finite), which the
        engine reduces over its ranks before :meth:`apply`: clipping must see every gradient first."""
        return _stats(grads)

    @abc.abstractmethod
    def init(self, params) -> Any:
        """The optimizer state of freshly initialised float32 ``params``."""

    @abc.abstractmethod
    def compute_params(self, params):
        """The parameters the engine computes with (offload: a half-precision copy; on device: themselves)."""

    @abc.abstractmethod
    def apply(self, params, opt_state, grads, scale, sq, nonfinite):
        """One step on the gradients of ``loss * scale``: ``(params, opt_state, grad_norm)``, the old ones
        where ``nonfinite`` (the step is skipped)."""

    @abc.abstractmethod
    def state_dict(self, opt_state) -> Any:
        """The state as a checkpoint holds it."""

    @abc.abstractmethod
    def load_state_dict(self, like, saved) -> Any:
        """The state of a checkpoint's :meth:`state_dict`, placed like ``like``."""

    def apply_streamed(self, params, opt_state, chunks, scale, global_sum, global_max, norm_view=None):
        """The step fed by reduced gradient chunks; only where :attr:`streams_chunks`."""
        raise ValueError(f"{type(self).__name__} takes whole gradients (streams_chunks is false): call apply")

    def apply_local(self, params, opt_state, grads, scale, global_sum, global_max, norm_view=None):
        """The step on this rank's gradients before the data-parallel reduction; only where
        :attr:`reduces_over_replicas`. Returns ``(params, state, grad_norm, nonfinite)``."""
        raise ValueError(f"{type(self).__name__} takes reduced gradients (reduces_over_replicas is false): call apply")

    def restore_like(self, opt_state, read_saved: Callable[[], Any]) -> Any:
        """The restore target of a checkpoint; ``read_saved()`` reads its optimizer state's tree of metadata.
        Default: this state's own :meth:`state_dict` (the one format this updater writes; nothing is read)."""
        return self.state_dict(opt_state)


class DeviceUpdater(Updater):
    """Optax on device. ``apply`` returns the old params and state unchanged when ``nonfinite``.
    ``decay``: which parameters the weight decay applies to (:func:`decay_mask`; None: all)."""

    def __init__(self, transform: optax.GradientTransformation, grad_clip: float, decay: DecayMask | None = None):
        self.transform = transform
        self.grad_clip = grad_clip

        def apply(params, opt_state, grads, scale, sq, nonfinite):
            return guarded_step(transform, grad_clip, params, opt_state, grads, scale, sq, nonfinite,
                                decay_view(params, decay))

        self._apply = jax.jit(apply, donate_argnums=(0, 1))

    def init(self, params) -> Any:
        # Eager on purpose: a jitted init only builds zeros, so XLA puts every state leaf on one device;
        # eager zeros_like keeps each parameter's sharding (tensor-parallel params stay sharded).
        return self.transform.init(params)

    def apply(self, params, opt_state, grads, scale, sq, nonfinite):
        return self._apply(params, opt_state, grads, jnp.float32(scale), sq, nonfinite)

    def state_dict(self, opt_state) -> Any:
        return opt_state

    def load_state_dict(self, like, saved) -> Any:
        return place_like(like, saved)

    def compute_params(self, params):
        return params


def device_updater(cfg) -> DeviceUpdater:
    """The trainer's on-device updater for a run config (its transform, clip and decay mask)."""
    return DeviceUpdater(build_transform(cfg.optim, cfg.train.steps), cfg.optim.grad_clip, decay_mask(cfg.optim))


def spans_processes(x) -> bool:
    """A jax.Array spanning devices of other processes (``--distributed``): no process can fetch it whole,
    so orbax writes each process's shards of it into the one checkpoint."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable
