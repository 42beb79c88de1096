"""The per-bucket programs of the offloaded optimizer (Myelin V-B) and the host-to-device prefetcher.

Each program is jitted once per (transform, compute dtype, clip) and shared by every optimizer that
uses the same transform; the bucket update donates the fetched bucket and the device parameter vector,
so a step holds only the buckets in flight besides the flat parameters and gradients.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxhybrid.optim.updater import clip_factor


# A vector's squared norm in float32 (the clip norm's parts).
sq_all = jax.jit(lambda g: jnp.sum(jnp.square(g.astype(jnp.float32))))


@functools.lru_cache(maxsize=64)
def programs(inner, split, cdt, grad_clip: float):
    """The jitted per-bucket programs, shared by optimizers with the same transform (compile once)."""

    def update(bucket, shared, grads, goff, params, pstart, factor, nonfinite, decay=None):
        master, per = bucket[0], bucket[1:]
        g = jax.lax.dynamic_slice(grads, (goff,), (master.shape[0],))
        g = g * factor.astype(g.dtype)
        # The bucket is updated as two leaves, as a model's many-leaf tree is: with a single leaf
        # XLA turns optax's division by the scalar bias correction into a multiplication by its
        # reciprocal, which rounds differently from on-device optax on a real parameter tree.
        h = max(master.shape[0] // 2, 1)
        two = lambda x: (x[:h], x[h:])
        state = split.merge(tuple(map(two, per)), shared)

        def stepped(seen):  # the new masters with the decoupled decay seeing ``seen`` as the parameters
            updates, new = inner.update(two(g), state, two(seen))
            return jnp.concatenate(optax.apply_updates(two(master), updates)), new

        new_master, new = stepped(master)
        if decay is not None:
            # The elements that do not decay (buckets.decay_bounds' runs) take the step in which the decay
            # sees zeros (updater.decay_view's rule); the others keep the step above, computed from
            # ``master`` itself: through a masked copy XLA:CPU rounded some updates 1 ulp away from optax's.
            # How: compare each element with all K bounds while K is small (one fused pass), else a binary
            # search (a loop of gathers, far slower at small K; compare_all's cost climbs steeply past 32
            # bounds). A bucket has 4-10 bounds per block it spans.
            method = "compare_all" if decay.shape[-1] <= 32 else "scan"
            decayed = jnp.searchsorted(decay, jnp.arange(master.shape[0], dtype=decay.dtype), side="right",
                                       method=method) % 2 == 1
            new_master = jnp.where(decayed, new_master, stepped(jnp.zeros_like(master))[0])
        new_per, new_shared = split.split(new)
        new_per = tuple(jnp.concatenate(x) for x in new_per)
        params = jax.lax.dynamic_update_slice(params, new_master.astype(cdt), (pstart,))
        nonfinite = jnp.logical_or(nonfinite, jnp.logical_not(jnp.all(jnp.isfinite(g))))
        return (new_master, *new_per), new_shared, params, nonfinite

    update_j = jax.jit(update, donate_argnums=(0, 4))
    upcast_j = jax.jit(lambda g, off, n: jax.lax.dynamic_slice(g, (off,), (n,)).astype(jnp.float32),
                       static_argnums=2)
    write_j = jax.jit(lambda params, m, s: jax.lax.dynamic_update_slice(params, m.astype(cdt), (s,)),
                      donate_argnums=0)
    factor_j = jax.jit(lambda scale, sq: clip_factor(scale, sq, grad_clip))
    init_j = jax.jit(lambda m: split.split(inner.init(m)))
    return update_j, upcast_j, write_j, factor_j, sq_all, init_j


@jax.jit
def sq_outside(g: jax.Array, cut: jax.Array) -> jax.Array:
    """Squared norm of ``g`` without its elements in the ``cut`` ranges (``int32 [K, 2]``, half-open,
    relative to ``g``): the duplicated leaves a global norm must count once (a tied embedding's copy).
    One fused pass with a mask, not slices: the ranges move with every chunk (one program per K)."""
    i = jnp.arange(g.shape[0], dtype=jnp.int32)
    inside = jnp.any((i >= cut[:, :1]) & (i < cut[:, 1:]), axis=0)
    return jnp.sum(jnp.where(inside, 0.0, jnp.square(g.astype(jnp.float32))))


def counted_sq(s: int, e: int, g: jax.Array, uncounted) -> jax.Array:
    """Squared norm of ``g`` = flat ``[s, e)``, less the ``uncounted`` flat ranges it overlaps (a leaf another
    rank counts: a tied embedding's copy)."""
    cut = [(max(a, s) - s, min(b, e) - s) for a, b in uncounted if a < e and b > s]
    return sq_outside(g, np.asarray(cut, np.int32)) if cut else sq_all(g)


class Prefetcher:
    """Keeps up to ``depth`` buckets fetched ahead (``device_put`` is asynchronous)."""

    def __init__(self, store, buckets: tuple, depth: int):
        self.store, self.buckets, self.depth = store, buckets, depth
        self.ready: dict[int, tuple] = {}
        self.next = 0

    def top_up(self, i: int) -> None:
        while self.next < min(i + self.depth, len(self.buckets)):
            self.ready[self.next] = self.store.fetch(self.buckets[self.next])
            self.next += 1

    def get(self, i: int) -> tuple:
        self.top_up(i)
        return self.ready.pop(i)
