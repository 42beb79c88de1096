"""Gradient all-reduce over the data-parallel column (Myelin Alg. 1 line 13, Sec. IV-B and V-C).

After the pipeline phase every rank ``(stage i, replica j)`` holds the gradients of its stage for its
batch shard; the ranks of one column (same stage, all replicas) sum them. Every reduction is a cached
jitted ``mpi4jax.allreduce`` (never eager: an eager mpi4jax call recompiles every time).

MPI cannot reduce bfloat16/float16 ("Unknown MPI type"), so by default half-precision vectors travel and
are summed in float32, then cast back (``optim.allreduce_dtype: float32``). With ``compute`` they travel
as half precision, Myelin's choice (Sec. IV-B), through :func:`jaxhybrid.parallel.data.half_allreduce.half_sum`:
half the bytes. Myelin avoids overflow by pre-dividing the loss by the number of microbatches in the global
batch, which the pipeline engine does before the backward pass.

Three entry points, for three kinds of caller:

* :func:`allreduce_tree` (the pipeline x data step) needs the whole reduced pytree before anything can
  use it, so it is ONE jitted program per gradient structure: flatten, upcast, one all-reduce of the
  whole vector, downcast (or, with ``half_wire``, the half-precision reduce-scatter and all-gather),
  scale, unflatten. Chunking it buys nothing: a jitted mpi4jax call blocks the Python thread until its
  reduction is done, so chunk k + 1 never overlaps chunk k, and each chunk costs a dispatch and a slice
  copy, plus a pad and a concatenation of the whole vector. An eager ``ravel_pytree`` and its unravel
  would dispatch once per leaf.
* :func:`iter_reduced_chunks` (the offloaded optimizer, V-C) consumes chunks as they finish, so it keeps
  the chunks of ``chunk_elems``: its seam for overlapping bucket updates with the next reduction.

* :class:`EarlyColumnSum` (the pipeline x data step with ``optim.overlap_grad_reduce``) starts each stage's
  reduction as soon as the schedule has written its gradients for the last time, in buckets, with
  non-blocking ``MPI_Iallreduce`` on host buffers (mpi4jax has no non-blocking collective), so the
  buckets move while the loop runs the rest of its schedule.

``optim.allreduce_backend: xla`` runs the first two entry points as XLA collectives over a JAX mesh of the
column's processes instead (:mod:`~jaxhybrid.parallel.data.xla_allreduce`).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.parallel.data import half_allreduce
from jaxhybrid.parallel.data.flat import FlatSpec

_HALF = (jnp.bfloat16, jnp.float16)
# One MPI message at most: MPI counts are C ints; a larger stage vector is reduced in pieces this long.
_MAX_MESSAGE = 1 << 30


def _check_flat(flat: jax.Array) -> None:
    if flat.ndim != 1:
        raise ValueError(f"all-reduce expects a flat 1-D gradient, got shape {tuple(flat.shape)}; "
                         f"flatten with jax.flatten_util.ravel_pytree first")


def _check_chunk(chunk_elems: int) -> None:
    """The one check of a chunk length, for both entry points (``iter_reduced_chunks`` via
    :func:`bucket_bounds`)."""
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems={chunk_elems} must be >= 1 (optim.bucket_size x optim.allreduce_coarsening)")


def _sum(x: jax.Array, comm: Any, half_wire: bool) -> jax.Array:
    """Traced: ``x`` (1-D) summed over ``comm``, ``x``'s dtype back. Half floats travel as float32, or as
    themselves with ``half_wire`` (:mod:`~jaxhybrid.parallel.data.half_allreduce`)."""
    import mpi4jax
    from mpi4py import MPI

    if half_wire and x.dtype in _HALF and half_allreduce.fits(x.shape[0], comm.Get_size()):
        return half_allreduce.half_sum(x, comm)
    wire = x.astype(jnp.float32) if x.dtype in _HALF else x
    n = wire.shape[0]
    if n <= _MAX_MESSAGE:
        out = mpi4jax.allreduce(wire, op=MPI.SUM, comm=comm)
    else:  # pragma: no cover - over 2^30 elements on one rank
        out = jnp.concatenate([mpi4jax.allreduce(wire[s:s + _MAX_MESSAGE], op=MPI.SUM, comm=comm)
                               for s in range(0, n, _MAX_MESSAGE)])
    return out.astype(x.dtype)


_PROGRAMS: dict[tuple, Any] = {}


def _cached(key: tuple, make):
    """mpi4py communicators are not hashable; their C handle (``py2f``) names them in the cache keys."""
    if key not in _PROGRAMS:
        _PROGRAMS[key] = make()
    return _PROGRAMS[key]


def _tree_program(comm: Any, half_wire: bool):
    """``(tree, scale) -> tree`` summed over ``comm`` (and times ``scale`` unless None), as one program.

    ``jax.jit`` keys its compilations on the tree structure, shapes, dtypes and devices, so each gradient
    structure is traced once and later calls take jit's C++ dispatch path. The layout is ``FlatSpec``'s
    (``jax.tree.leaves`` order); mixed dtypes are flattened to their common dtype and each leaf is cast
    back, as ``ravel_pytree`` did, so results keep their bits.
    """
    def run(tree, scale):
        spec = FlatSpec(tree)
        dtypes = [x.dtype for x in spec.treedef.flatten_up_to(tree)]
        common = jnp.result_type(*dtypes)
        flat = _sum(spec.ravel(jax.tree.map(lambda x: jnp.asarray(x).astype(common), tree)), comm, half_wire)
        if scale is not None:
            flat = flat * scale
        leaves = spec.treedef.flatten_up_to(spec.unravel(flat))
        return spec.treedef.unflatten([x.astype(d) for x, d in zip(leaves, dtypes)])

    return _cached(("tree", comm.py2f(), half_wire), lambda: jax.jit(run))


def allreduce_tree(tree: Any, comm: Any, chunk_elems: int, scale: float | None = None, half_wire: bool = False
                   ) -> Any:
    """Sum a pytree of gradients over ``comm``, optionally scaled; same structure, dtypes and devices.
    ``half_wire``: half-precision gradients travel as half precision (``optim.allreduce_dtype: compute``).

    Every rank of ``comm`` must call it with the same structure. ``chunk_elems`` is validated but only
    the streaming path cuts chunks (module docstring): nothing here can use a chunk before the last.
    Leaves sharded over several local devices (a hybrid rank's tensor mesh) are reduced per device.
    """
    _check_chunk(chunk_elems)
    if comm is None or comm.Get_size() == 1:
        return _scaled(tree, scale)
    leaves = jax.tree.leaves(tree)
    if any(isinstance(x, jax.Array) and len(x.sharding.device_set) > 1 for x in leaves):
        return _allreduce_per_device(tree, comm, chunk_elems, scale, half_wire)
    if not leaves or not sum(int(np.size(x)) for x in leaves):
        return _scaled(tree, scale)
    if scale is None:
        return _tree_program(comm, half_wire)(tree, None)
    # The scale is an argument (one compilation for all its values) already in the flat vector's dtype:
    # rounded once from the Python float, as ``jnp.asarray(scale, dtype)`` did.
    common = jnp.result_type(*{jnp.asarray(x).dtype for x in leaves})
    return _tree_program(comm, half_wire)(tree, np.asarray(scale, common))


def _scaled(tree: Any, scale: float | None) -> Any:
    """``tree`` times ``scale`` in each leaf's dtype (``tree`` itself when None): nothing to sum over."""
    return tree if scale is None else jax.tree.map(lambda g: g * jnp.asarray(scale, g.dtype), tree)


def _allreduce_per_device(tree: Any, comm: Any, chunk_elems: int, scale: float | None, half_wire: bool) -> Any:
    """Hybrid pipeline x tensor: leaves sharded over this rank's tensor mesh. mpi4jax moves single-device
    buffers only, so each local device reduces its own shards of every leaf (one all-reduce per device,
    in device-id order on every rank: the ranks of a data column build identical meshes, so device k
    holds the same shard indices everywhere) and the leaves are reassembled with their shardings."""
    leaves, treedef = jax.tree.flatten(tree)
    shards: dict[Any, list[tuple[int, jax.Array]]] = {}
    for i, leaf in enumerate(leaves):
        for sh in leaf.addressable_shards:
            shards.setdefault(sh.device, []).append((i, sh.data))
    reduced: dict[tuple[int, Any], jax.Array] = {}
    for dev in sorted(shards, key=lambda d: d.id):
        idx, arrs = zip(*shards[dev])
        for i, r in zip(idx, allreduce_tree(list(arrs), comm, chunk_elems, scale, half_wire)):
            reduced[(i, dev)] = r
    out = [jax.make_array_from_single_device_arrays(
        leaf.shape, leaf.sharding, [reduced[(i, sh.device)] for sh in leaf.addressable_shards])
        for i, leaf in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


def _chunk_program(comm: Any, chunk: int, dtype: Any, half_wire: bool):
    """``(flat, start) -> flat[start:start + chunk]`` summed over ``comm``, the start traced: the full
    chunks share one program and a shorter last chunk gets its own, which saves padding the whole vector
    to a multiple of the chunk (a copy) and slicing the last result."""
    def reduce(flat: jax.Array, start: jax.Array) -> jax.Array:
        return _sum(jax.lax.dynamic_slice(flat, (start,), (chunk,)), comm, half_wire)

    return _cached(("chunk", comm.py2f(), chunk, str(dtype), half_wire), lambda: jax.jit(reduce))


def iter_reduced_chunks(flat_grads: jax.Array, comm: Any, chunk_elems: int, half_wire: bool = False,
                        ahead: bool = True) -> Iterator[tuple[int, int, jax.Array]]:
    """Yield ``(start, end, reduced)`` for consecutive chunks of ``flat_grads`` summed over ``comm``.

    ``reduced`` has ``end - start`` elements and the dtype of ``flat_grads``. Every rank of ``comm``
    must iterate to the end (the chunks are collective calls, issued in the same order everywhere).
    Chunk ``k + 1`` is dispatched before chunk ``k`` is yielded so the caller's work on chunk ``k``
    could overlap with the next reduction where the dispatch returned early. mpi4jax's does not: on CPU
    the call returns when the reduction is done, and on GPU it synchronises the compute stream before
    calling MPI, so the caller's programs run after it either way.

    Args:
      flat_grads: 1-D gradient vector (any float dtype).
      comm: an mpi4py communicator made on all its ranks at start-up (the data column).
      chunk_elems: elements per chunk; the last chunk may be shorter.
      half_wire: half-precision chunks travel as half precision (:func:`allreduce_tree`).
      ahead: dispatch chunk ``k + 1`` before yielding chunk ``k``; off when a thread of its own runs the
        iterator (:func:`reduced_beside`), which is then the one ahead.
    """
    flat_grads = jnp.asarray(flat_grads)
    _check_flat(flat_grads)
    bounds = bucket_bounds(int(flat_grads.shape[0]), chunk_elems)  # validates chunk_elems, even for n == 0
    if not bounds:
        return
    if comm is None or comm.Get_size() == 1:
        for s, e in bounds:
            yield s, e, flat_grads[s:e]
        return
    dtype = jnp.dtype(flat_grads.dtype)

    def dispatch(s: int, e: int) -> jax.Array:  # no slice reaches past n: dynamic_slice never clamps
        return _chunk_program(comm, e - s, dtype, half_wire)(flat_grads, np.int32(s))

    yield from dispatched_ahead(bounds, dispatch, ahead)


def dispatched_ahead(bounds: list[tuple[int, int]], dispatch, ahead: bool = True) -> Iterator[tuple[int, int, Any]]:
    """``(start, end, dispatch(start, end))`` for each of ``bounds`` (not empty), chunk ``k + 1`` dispatched
    before chunk ``k`` is yielded (``ahead``; else each when it is asked for)."""
    if not ahead:
        for s, e in bounds:
            yield s, e, dispatch(s, e)
        return
    pending = dispatch(*bounds[0])
    for k, (s, e) in enumerate(bounds):
        current = pending
        if k + 1 < len(bounds):
            pending = dispatch(*bounds[k + 1])
        yield s, e, current


Record = Callable[[str, str, float, float], None]


def reduced_beside(chunks: Iterable[tuple[int, int, Any]], record: Record | None = None, depth: int = 2
                   ) -> Iterator[tuple[int, int, Any]]:
    """Myelin V-C's overlap (Fig. 7): the chunks of ``chunks`` (an :func:`iter_reduced_chunks` with
    ``ahead=False``) reduced by a thread of its own while the caller updates the buckets of the chunks
    already reduced, at most ``depth`` reduced chunks waiting (the device holds no more than that beyond
    Myelin's footprint). A blocking mpi4jax reduction then runs beside the update instead of before it
    (MPI is initialised thread-multiple by mpi4py); an XLA one is waited for in that thread.

    ``record(name, kind, start, end)``: each chunk's reduction as kind ``"reduce"`` (in the thread, until its
    result is ready) and the caller's time on each chunk, between receiving it and asking for the next, as
    kind ``"update"``: the two lanes of a step's trace. An exception in the thread is raised to the caller."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def reduce() -> None:
        try:
            it = iter(chunks)
            while True:
                t0 = time.perf_counter()
                item = next(it, done)
                if item is done:
                    break
                jax.block_until_ready(item[2])
                if record is not None:
                    record(f"all-reduce [{item[0]}, {item[1]})", "reduce", t0, time.perf_counter())
                ready.put(item)
        except BaseException as e:  # noqa: BLE001 (handed to the caller, which raises it)
            ready.put(e)
            return
        ready.put(done)

    thread = threading.Thread(target=reduce, name="jaxhybrid-allreduce", daemon=True)
    thread.start()
    while (item := ready.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        t0 = time.perf_counter()
        yield item
        if record is not None:
            record(f"update [{item[0]}, {item[1]})", "update", t0, time.perf_counter())
    thread.join()


def bucket_bounds(n: int, chunk_elems: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` pairs :func:`iter_reduced_chunks` yields for a vector of ``n`` elements."""
    _check_chunk(chunk_elems)
    return [(s, min(s + chunk_elems, n)) for s in range(0, n, chunk_elems)] if n else []


class EarlyColumnSum:
    """The column's gradient sum started stage by stage during the pipeline phase (Megatron-LM's overlapped
    gradient reduction; Myelin Alg. 1 line 13 moved into the phase).

    :meth:`add` takes a stage's final gradients (the event loop's ``on_final``: its last fused backward, or
    with 2BP its last weight pass), copies them to the host as one float32 vector and starts one
    non-blocking ``MPI_Iallreduce`` per bucket of ``bucket_elems``. MPICH moves them inside the rank's
    other MPI calls (the loop's polls and sends) while the loop runs the rest of the schedule (with several
    stages per rank, the other stages' work) and waits for its last sends. Every replica
    starts its stages in ``order`` (:meth:`~jaxhybrid.parallel.pipeline.tasks.Schedule.grads_final`), so the
    collectives match whatever order a message-driven loop finishes them in: a stage finished early
    waits for those before it. :meth:`result` waits for all of them and returns ``{stage: summed
    gradients}`` on the gradients' devices, in their dtypes; its ``record(name, kind, start, end)`` (a
    traced step) gets each stage's reduction from its start to its wait's end. Sums are float32, as the
    whole-vector path's default wire.
    """

    @dataclass
    class _Started:
        """One stage's buckets in flight; ``layout`` is each leaf's (shape, dtype, sharding), not the leaves:
        the step may free them."""

        treedef: Any
        layout: list[tuple]
        sent: np.ndarray  # both buffers stay referenced until the requests complete
        summed: np.ndarray
        requests: list
        start: float

    def __init__(self, comm: Any, order: Iterable[int], bucket_elems: int):
        _check_chunk(bucket_elems)
        self.comm, self.order, self.bucket = comm, tuple(order), min(bucket_elems, _MAX_MESSAGE)
        self._final: dict[int, Any] = {}
        self._started: dict[int, EarlyColumnSum._Started] = {}  # by stage, in ``order``

    def add(self, stage: int, grads: Any) -> None:
        if stage not in self.order or stage in self._final or stage in self._started:
            raise ValueError(f"gradients of stage {stage} given twice or not in this rank's stages {self.order}")
        self._final[stage] = grads
        while len(self._started) < len(self.order) and self.order[len(self._started)] in self._final:
            self._start(self.order[len(self._started)])

    def _start(self, stage: int) -> None:
        from mpi4py import MPI

        t0 = time.perf_counter()
        leaves, treedef = jax.tree.flatten(self._final.pop(stage))
        sent = np.concatenate([np.asarray(x).astype(np.float32).ravel() for x in leaves] or [np.zeros(0, np.float32)])
        summed = np.empty_like(sent)
        requests = [self.comm.Iallreduce(sent[a:b], summed[a:b], op=MPI.SUM)
                    for a, b in bucket_bounds(sent.size, self.bucket)]
        self._started[stage] = self._Started(treedef, [(x.shape, x.dtype, x.sharding) for x in leaves], sent,
                                             summed, requests, t0)

    def result(self, record: Callable[..., None] | None = None) -> dict[int, Any]:
        from mpi4py import MPI

        missing = [s for s in self.order if s not in self._started]
        if missing:
            raise RuntimeError(f"the pipeline phase ended without the final gradients of stages {missing}")
        out = {}
        for stage, st in self._started.items():
            MPI.Request.Waitall(st.requests)
            if record is not None:
                record(f"all-reduce s{stage}", "reduce", st.start, time.perf_counter())
            parts, at = [], 0
            for shape, dtype, _ in st.layout:
                size = int(np.prod(shape))
                parts.append(st.summed[at:at + size].reshape(shape).astype(dtype))
                at += size
            out[stage] = st.treedef.unflatten(jax.device_put(parts, [sharding for *_, sharding in st.layout]))
        self._started = {}
        return out


def shard_length(n: int, replicas: int) -> int:
    """Elements per replica's shard of an ``n``-element vector (ZeRO-1): the vector is padded with zeros to
    ``replicas`` equal shards, replica ``j`` owning ``[j * c, (j + 1) * c)``."""
    return -(-n // replicas)


def _reduce_scatter_program(comm: Any, n: int, dtype: Any, half_wire: bool):
    """Jitted ``flat [n] -> this rank's shard [c]`` of the sum over ``comm``: one ``MPI_Alltoall`` of the
    padded ``[p, c]`` vector, then the ``p`` received slices summed in float32 in rank order and rounded
    once, as :mod:`~jaxhybrid.parallel.data.half_allreduce` does (the same bits on every replica, wherever
    an element sits). Half floats travel as ``uint16`` bit patterns with ``half_wire``, else as float32."""
    import mpi4jax

    p = comm.Get_size()
    c = shard_length(n, p)
    half = jnp.dtype(dtype) in _HALF

    def run(flat: jax.Array) -> jax.Array:
        rows = jnp.pad(flat, (0, c * p - n)).reshape(p, c)
        if half and half_wire:
            got = jax.lax.bitcast_convert_type(
                mpi4jax.alltoall(jax.lax.bitcast_convert_type(rows, jnp.uint16), comm=comm), rows.dtype)
        else:
            got = mpi4jax.alltoall(rows.astype(jnp.float32) if half else rows, comm=comm)
        total = got[0].astype(jnp.float32)
        for q in range(1, p):
            total = total + got[q].astype(jnp.float32)
        return total.astype(dtype)

    return _cached(("scatter", comm.py2f(), n, str(dtype), half_wire), lambda: jax.jit(run))


def reduce_scatter(flat: jax.Array, comm: Any, half_wire: bool = False) -> jax.Array:
    """This rank's shard (:func:`shard_length` elements) of ``flat`` summed over ``comm`` (ZeRO-1's
    reduce-scatter; every rank of ``comm`` calls it with the same length and dtype)."""
    _check_flat(flat)
    return _reduce_scatter_program(comm, int(flat.shape[0]), flat.dtype, half_wire)(flat)


def all_gather(shard: jax.Array, comm: Any) -> jax.Array:
    """Every rank's ``shard`` concatenated in rank order (``p x c`` elements: trim the padding). Half floats
    move as their ``uint16`` bits (MPI has no half type), so the copies are bit-identical."""
    import mpi4jax

    _check_flat(shard)
    dtype = shard.dtype

    def run(x: jax.Array) -> jax.Array:
        if dtype in _HALF:
            x = jax.lax.bitcast_convert_type(x, jnp.uint16)
        got = mpi4jax.allgather(x, comm=comm).reshape(-1)
        return jax.lax.bitcast_convert_type(got, dtype) if dtype in _HALF else got

    return _cached(("gather", comm.py2f(), int(shard.shape[0]), str(dtype)), lambda: jax.jit(run))(shard)


__all__ = ["all_gather", "allreduce_tree", "bucket_bounds", "dispatched_ahead", "iter_reduced_chunks",
           "reduce_scatter", "reduced_beside", "shard_length"]
