"""Flat views of a parameter pytree that keep the array dtype (``ravel_pytree`` casts back per leaf).

Myelin keeps the half-precision parameters and gradients as flat device vectors so buckets are plain
slices; the model still sees a pytree. ``FlatSpec`` converts both ways on the device (jitted) and on
the host (numpy), in ``jax.tree.leaves`` order.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


class FlatSpec:
    """Leaf shapes and offsets of a pytree; ``n`` elements in total."""

    def __init__(self, tree: Any):
        leaves, self.treedef = jax.tree.flatten(tree)
        self.paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        self.shapes = [tuple(np.shape(x)) for x in leaves]
        self._dtypes = [np.dtype(jnp.asarray(x).dtype) if not hasattr(x, "dtype") else np.dtype(x.dtype)
                        for x in leaves]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.offsets = [int(o) for o in np.cumsum([0] + self.sizes[:-1])]
        self.n = int(sum(self.sizes))
        self.ravel = jax.jit(lambda t: jnp.concatenate([jnp.ravel(x) for x in self.treedef.flatten_up_to(t)]))
        self.unravel = jax.jit(self._unravel)

    def dtypes(self) -> dict[str, np.dtype]:
        return dict(zip(self.paths, self._dtypes))

    def _unravel(self, flat):
        return self.treedef.unflatten([flat[o:o + s].reshape(shape)
                                       for o, s, shape in zip(self.offsets, self.sizes, self.shapes)])

    def dropped_ranges(self, keep: Callable[[Any], Any]) -> tuple[tuple[int, int], ...]:
        """The flat ``[start, end)`` ranges of the leaves that ``keep`` (a filter of the pytree's dicts,
        such as an engine's ``norm_view``) leaves out, adjacent leaves merged."""
        kept = set(jax.tree.leaves(keep(self.treedef.unflatten(list(range(len(self.sizes)))))))
        ranges: list[tuple[int, int]] = []
        for i in (i for i in range(len(self.sizes)) if i not in kept):
            s, e = self.offsets[i], self.offsets[i] + self.sizes[i]
            if ranges and ranges[-1][1] == s:
                ranges[-1] = (ranges[-1][0], e)
            else:
                ranges.append((s, e))
        return tuple(ranges)

    def ravel_host(self, tree: Any, dtype=np.float32) -> np.ndarray:
        return np.concatenate([np.asarray(x, dtype).ravel() for x in self.treedef.flatten_up_to(tree)])

    def unravel_host(self, flat: np.ndarray) -> Any:
        return self._unravel(np.asarray(flat))


def release(tree: Any) -> None:
    """Delete the device buffers of a pytree whose owner hands it over (what jit donation does to its
    donated inputs): each is freed once the computations already queued on it have read it, instead of
    when the caller's last reference goes. Non-array leaves are left alone."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()
