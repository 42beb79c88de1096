"""Pure bucket bookkeeping for the host-offloaded optimizer (Myelin Sec. V-B).

Myelin streams the fp32 master weights and the optimizer state through the device in equal buckets of
``bsize`` elements of the flattened parameter vector. That is only correct when the optimizer is
*elementwise*: applying it to a slice of the parameters gives the same numbers as applying it to the
whole vector and slicing. :func:`split_state` and :func:`check_bucketable` verify that for any optax
``GradientTransformation`` before anything is offloaded, so a non-bucketable transform (LAMB's
per-leaf trust ratio, a global-norm clip inside the chain, Adafactor's factored moments, a pytree
mask) fails at construction with a ``ValueError`` naming it, instead of training silently wrong.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclass(frozen=True)
class BucketLayout:
    """Equal buckets ``[i*size, min((i+1)*size, n))`` over a flat vector of ``n`` elements.

    The last bucket is shorter when ``size`` does not divide ``n``.
    """

    n: int
    size: int

    def __post_init__(self):
        if self.size <= 0:
            raise ValueError(f"optim.bucket_size={self.size} must be > 0 (elements per offload bucket)")
        if self.size > self.n:
            raise ValueError(f"optim.bucket_size={self.size} is larger than the parameter count {self.n}; "
                             f"choose a bucket_size <= {self.n}")

    @property
    def count(self) -> int:
        return -(-self.n // self.size)

    def bounds(self, i: int) -> tuple[int, int]:
        return i * self.size, min((i + 1) * self.size, self.n)

    def all_bounds(self) -> list[tuple[int, int]]:
        return [self.bounds(i) for i in range(self.count)]

    def covered(self, start: int, end: int) -> range:
        """Buckets exactly covered by the gradient piece ``[start, end)`` (Myelin V-C: a chunk of
        ``k * bsize`` elements holds ``k`` whole buckets). Raises when the piece cuts a bucket."""
        first, last = start // self.size, -(-end // self.size)
        if start % self.size or (end % self.size and end != self.n):
            raise ValueError(f"gradient chunk [{start}, {end}) is not aligned to bucket_size={self.size}; "
                             f"use all-reduce chunks of k * bucket_size elements")
        return range(first, last)

    def in_order(self, chunks: Iterable[tuple[int, int, Any]]) -> Iterator[tuple[int, int, Any]]:
        """``chunks`` (``(start, end, reduced)``) passed on one at a time, checked to cover ``[0, n)`` in
        order. Lazily: the caller updates a chunk's buckets before the rest of the vector is reduced (Myelin V-C)."""
        expect = 0
        for s, e, arr in chunks:
            if s != expect or e <= s or arr.shape != (e - s,):
                raise ValueError(f"reduced chunk [{s}, {e}) of shape {tuple(arr.shape)} does not continue at "
                                 f"element {expect}; chunks must cover [0, {self.n}) in order")
            expect = e
            yield s, e, arr
        if expect != self.n:
            raise ValueError(f"reduced chunks ended at element {expect}; expected {self.n}")


def decay_bounds(sizes: list[int], decayed: list[bool], layout: BucketLayout) -> np.ndarray:
    """Per bucket, where the weight decay applies: ``[count, K]`` int32 rows ``s0, e0, s1, e1, ...`` of the
    runs of decayed elements relative to the bucket's start, padded with int32's maximum. An element ``j``
    decays iff an odd number of the row's values are ``<= j`` (``searchsorted(row, j, 'right')`` is odd),
    so a bucket's program builds its decay mask from ``K`` numbers instead of fetching one flag per
    element. ``sizes``/``decayed``: the flat vector's leaves in order and whether each decays."""
    runs: list[list[int]] = []
    offset = 0
    for size, d in zip(sizes, decayed):
        if d and size:
            if runs and runs[-1][1] == offset:  # adjacent decayed leaves make one run
                runs[-1][1] += size
            else:
                runs.append([offset, offset + size])
        offset += size
    ends, rows = [b for _, b in runs], []
    for s, e in layout.all_bounds():
        row, i = [], bisect.bisect_right(ends, s)  # the first run that ends inside or after this bucket
        while i < len(runs) and runs[i][0] < e:
            row += [max(runs[i][0], s) - s, min(runs[i][1], e) - s]
            i += 1
        rows.append(row)
    width = max(2, max(len(r) for r in rows))
    out = np.full((len(rows), width), np.iinfo(np.int32).max, np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


@dataclass(frozen=True)
class StateSplit:
    """How an inner optax state built on a flat vector splits into bucketed and shared leaves.

    ``per_param[j]`` is True when leaf ``j`` of ``treedef`` has one entry per parameter (bucketed,
    host-resident); False for leaves like Adam's step ``count`` that every bucket shares.
    """

    treedef: Any
    per_param: tuple[bool, ...]

    def merge(self, per: tuple, shared: tuple) -> Any:
        it_p, it_s = iter(per), iter(shared)
        return self.treedef.unflatten([next(it_p) if p else next(it_s) for p in self.per_param])

    def split(self, state: Any) -> tuple[tuple, tuple]:
        leaves = self.treedef.flatten_up_to(state)
        per = tuple(x for x, p in zip(leaves, self.per_param) if p)
        shared = tuple(x for x, p in zip(leaves, self.per_param) if not p)
        return per, shared


def transform_name(inner: optax.GradientTransformation, name: str | None = None) -> str:
    if name:
        return name
    qual = getattr(inner.init, "__qualname__", repr(inner.init))
    return qual.split(".<locals>")[0]


def split_state(inner: optax.GradientTransformation, name: str | None = None) -> StateSplit:
    """Classify the leaves of ``inner.init(flat)``: per-parameter iff the leaf has shape ``(n,)`` for
    every ``n``; shared iff its shape does not depend on ``n``. Anything else cannot be bucketed."""
    label = transform_name(inner, name)
    shapes = []
    for n in (7, 5):
        try:
            shapes.append(jax.eval_shape(inner.init, jax.ShapeDtypeStruct((n,), jnp.float32)))
        except Exception as e:  # a pytree mask or a shape-specific init
            raise ValueError(f"optimizer {label!r} cannot be offloaded in buckets: its init fails on a flat "
                             f"parameter vector ({type(e).__name__}: {e}); use an elementwise optimizer "
                             f"(adam, adamw, sgd, ...) or optim.offload=false") from e
    a, b = shapes
    leaves_a, treedef = jax.tree_util.tree_flatten_with_path(a)
    leaves_b = jax.tree.leaves(b)
    per = []
    for (path, la), lb in zip(leaves_a, leaves_b):
        if la.shape == (7,) and lb.shape == (5,):
            per.append(True)
        elif la.shape == lb.shape:
            per.append(False)
        else:
            raise ValueError(f"optimizer {label!r} cannot be offloaded in buckets: state leaf "
                             f"{jax.tree_util.keystr(path)} has shape {la.shape} for 7 parameters; only "
                             f"per-parameter (n,) or size-independent leaves can be bucketed")
    return StateSplit(jax.tree.structure(a), tuple(per))


@functools.lru_cache(maxsize=32)
def check_bucketable(inner: optax.GradientTransformation, name: str | None = None, steps: int = 2) -> StateSplit:
    """Raise ``ValueError`` unless ``inner`` applied to buckets equals ``inner`` on the whole vector.

    Runs ``steps`` updates on a 7-element probe, whole and as buckets of 3 + 4, and requires equal
    updates and equal shared state (e.g. the step count) in every bucket.
    """
    split = split_state(inner, name)
    label = transform_name(inner, name)
    rng = np.random.default_rng(0)
    p = jnp.asarray(rng.normal(size=7), jnp.float32)
    grads = [jnp.asarray(rng.normal(size=7), jnp.float32) for _ in range(steps)]
    pieces = [(0, 3), (3, 7)]

    init, update = jax.jit(inner.init), jax.jit(inner.update)  # eager optax would compile op by op

    def run(lo, hi):
        x, st, outs = p[lo:hi], init(p[lo:hi]), []
        for g in grads:
            u, st = update(g[lo:hi], st, x)
            x = optax.apply_updates(x, u)
            outs.append(np.asarray(u))
        return np.stack(outs), split.split(st)[1]

    whole, shared = run(0, 7)
    parts = [run(lo, hi) for lo, hi in pieces]
    bucketed = np.concatenate([u for u, _ in parts], axis=1)  # [steps, 7]
    if not np.allclose(bucketed, whole, rtol=1e-6, atol=1e-7):
        diff = float(np.max(np.abs(bucketed - whole)))
        raise ValueError(f"optimizer {label!r} cannot be offloaded in buckets: its update is not elementwise "
                         f"(buckets differ from the whole vector by {diff:.3e}; e.g. a per-leaf norm or a "
                         f"global clip inside the chain); use adam/adamw/sgd-like transforms or optim.offload=false")
    for _, sh in parts:
        for x, y in zip(sh, shared):
            if not np.array_equal(np.asarray(x), np.asarray(y)):
                raise ValueError(f"optimizer {label!r} cannot be offloaded in buckets: a shared state leaf "
                                 f"depends on the bucket's values ({np.asarray(x)} != {np.asarray(y)})")
    return split
