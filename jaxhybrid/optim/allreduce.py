"""Bucketed gradient all-reduce over the data-parallel column (Myelin Alg. 1 line 13, Sec. IV-B).

After the pipeline phase every rank ``(stage i, replica j)`` holds the gradients of its stage for its
batch shard; the ranks of one column (same stage, all replicas) sum them. The flat gradient vector is cut
into equal chunks of ``chunk_elems`` elements (Myelin V-C's coarsened buckets), each reduced by one cached
jitted ``mpi4jax.allreduce`` (never eager: an eager mpi4jax call recompiles every time, facts.md).

MPI cannot reduce bfloat16/float16 ("Unknown MPI type"), so half-precision chunks are reduced in float32
and cast back; Myelin avoids overflow by pre-dividing the loss by the number of microbatches in the global
batch, which the pipeline engine does before the backward pass.

:func:`iter_reduced_chunks` is the seam for the offload issue: it yields each reduced chunk as soon as it
is ready, with the next chunk's reduction already dispatched (JAX dispatch is asynchronous), so an
optimizer bucket update can overlap with the following reduction.
"""
from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

_HALF = (jnp.bfloat16, jnp.float16)


def _check(flat: jax.Array, chunk_elems: int) -> None:
    if flat.ndim != 1:
        raise ValueError(f"all-reduce expects a flat 1-D gradient, got shape {tuple(flat.shape)}; "
                         f"flatten with jax.flatten_util.ravel_pytree first")
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems={chunk_elems} must be >= 1 (optim.bucket_size x optim.allreduce_coarsening)")


_REDUCERS: dict[tuple[int, int, str], Any] = {}


def _chunk_reducer(comm: Any, chunk: int, dtype: Any):
    """One jitted program per (communicator, chunk length, dtype): slice, upcast, all-reduce, cast.

    mpi4py communicators are not hashable; their C handle (``py2f``) names them for the cache.
    """
    key = (comm.py2f(), chunk, str(dtype))
    if key not in _REDUCERS:
        _REDUCERS[key] = _make_reducer(comm, chunk)
    return _REDUCERS[key]


def _make_reducer(comm: Any, chunk: int):
    import mpi4jax
    from mpi4py import MPI

    def reduce(padded: jax.Array, start: jax.Array) -> jax.Array:
        piece = jax.lax.dynamic_slice(padded, (start,), (chunk,))
        wire = piece.astype(jnp.float32) if piece.dtype in _HALF else piece
        out = mpi4jax.allreduce(wire, op=MPI.SUM, comm=comm)
        return out.astype(piece.dtype)

    return jax.jit(reduce)


def iter_reduced_chunks(flat_grads: jax.Array, comm: Any, chunk_elems: int
                        ) -> Iterator[tuple[int, int, jax.Array]]:
    """Yield ``(start, end, reduced)`` for consecutive chunks of ``flat_grads`` summed over ``comm``.

    ``reduced`` has ``end - start`` elements and the dtype of ``flat_grads``. Every rank of ``comm``
    must iterate to the end (the chunks are collective calls, issued in the same order everywhere).
    Chunk ``k + 1`` is dispatched before chunk ``k`` is yielded so the caller's work on chunk ``k``
    overlaps with the next reduction.

    Args:
      flat_grads: 1-D gradient vector (any float dtype).
      comm: an mpi4py communicator made on all its ranks at start-up (the data column).
      chunk_elems: elements per chunk; the last chunk may be shorter.
    """
    flat_grads = jnp.asarray(flat_grads)
    _check(flat_grads, chunk_elems)
    n = int(flat_grads.shape[0])
    if n == 0:
        return
    chunk = min(chunk_elems, n)
    if comm is None or comm.Get_size() == 1:
        for s in range(0, n, chunk):
            yield s, min(s + chunk, n), flat_grads[s:min(s + chunk, n)]
        return
    # Pad to a whole number of chunks so every chunk shares one compiled program.
    pad = (-n) % chunk
    padded = jnp.pad(flat_grads, (0, pad)) if pad else flat_grads
    reducer = _chunk_reducer(comm, chunk, jnp.dtype(flat_grads.dtype))
    starts = list(range(0, n, chunk))
    pending = reducer(padded, jnp.int32(starts[0]))
    for k, s in enumerate(starts):
        current = pending
        if k + 1 < len(starts):
            pending = reducer(padded, jnp.int32(starts[k + 1]))
        e = min(s + chunk, n)
        yield s, e, current if e - s == chunk else current[: e - s]


def allreduce_flat(flat_grads: jax.Array, comm: Any, chunk_elems: int) -> jax.Array:
    """Sum a flat vector over ``comm`` in chunks; returns the whole reduced vector."""
    parts = [c for _, _, c in iter_reduced_chunks(flat_grads, comm, chunk_elems)]
    if not parts:
        return jnp.asarray(flat_grads)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def allreduce_tree(tree: Any, comm: Any, chunk_elems: int, scale: float | None = None) -> Any:
    """Sum a pytree of gradients over ``comm`` in chunks of the flattened vector, optionally scaled.

    Leaves of mixed dtypes are flattened to their common dtype by ``ravel_pytree`` and restored.
    """
    if comm is None or comm.Get_size() == 1:
        return tree if scale is None else jax.tree.map(lambda g: g * jnp.asarray(scale, g.dtype), tree)
    if any(len(x.sharding.device_set) > 1 for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)):
        return _allreduce_per_device(tree, comm, chunk_elems, scale)
    flat, unravel = ravel_pytree(tree)
    out = allreduce_flat(flat, comm, chunk_elems)
    if scale is not None:
        out = out * jnp.asarray(scale, out.dtype)
    return unravel(out)


def _allreduce_per_device(tree: Any, comm: Any, chunk_elems: int, scale: float | None) -> Any:
    """Hybrid pipeline x tensor: leaves sharded over this rank's tensor mesh. mpi4jax moves single-device
    buffers only, so each local device reduces its own shards of every leaf (a bucketed all-reduce per
    device, in device-id order on every rank: the ranks of a data column build identical meshes, so device
    k holds the same shard indices everywhere) and the leaves are reassembled with their shardings."""
    leaves, treedef = jax.tree.flatten(tree)
    shards: dict[Any, list[tuple[int, jax.Array]]] = {}
    for i, leaf in enumerate(leaves):
        for sh in leaf.addressable_shards:
            shards.setdefault(sh.device, []).append((i, sh.data))
    reduced: dict[tuple[int, Any], jax.Array] = {}
    for dev in sorted(shards, key=lambda d: d.id):
        idx, arrs = zip(*shards[dev])
        for i, r in zip(idx, allreduce_tree(list(arrs), comm, chunk_elems, scale)):
            reduced[(i, dev)] = r
    out = [jax.make_array_from_single_device_arrays(
        leaf.shape, leaf.sharding, [reduced[(i, sh.device)] for sh in leaf.addressable_shards])
        for i, leaf in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


def bucket_bounds(n: int, chunk_elems: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` pairs :func:`iter_reduced_chunks` yields for a vector of ``n`` elements."""
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems={chunk_elems} must be >= 1")
    return [(s, min(s + chunk_elems, n)) for s in range(0, n, chunk_elems)] if n else []


__all__ = ["allreduce_flat", "allreduce_tree", "bucket_bounds", "iter_reduced_chunks"]
