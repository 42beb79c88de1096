"""The data column's gradient all-reduce as an XLA collective (``optim.allreduce_backend: xla``).

The MPI path (:mod:`~jaxhybrid.parallel.data.allreduce`) moves host-staged buffers with mpi4jax. Here every
process of the MPI job has joined JAX's distributed runtime (``jaxhybrid.runtime.distributed.initialize``
with process index == MPI world rank), and each rank's data column is one JAX mesh: the first local device
of each of the column's processes, in replica order, on one axis ``data``. A jitted computation over a
mesh of some processes' devices runs when only those processes call it, so every column reduces on its
own, as with its MPI communicator: NCCL on GPUs, gloo on CPU.

A reduction puts this process's flat vector as its row of a global ``[replicas, n]`` array sharded over
the mesh, sums the rows with a ``shard_map`` ``psum`` (replicated out) and takes this process's copy back.
The wire dtype follows the MPI path: half-precision vectors are summed in float32 and cast back, or as
they are with ``half_wire`` (``optim.allreduce_dtype: compute``; XLA reduces bfloat16 and float16). The
collective program is cached per (column, length, wire dtype); the flatten and unflatten around it are
local jitted programs cached per gradient structure.

A hybrid rank (pipeline x tensor x data) drives a local tensor mesh ``(1, depth, row, col)``; its column
is then one mesh ``(data, depth, row, col)`` of every replica's local mesh stacked on the data axis, and
each gradient leaf, sharded over its rank's mesh, is summed over ``data`` in place: its local shards are
the blocks of a global leaf whose first dimension is also split over ``data``, so nothing is gathered,
copied or flattened, and each device sums only with the devices holding the same block.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxhybrid.core.layout import MESH_AXES
from jaxhybrid.parallel.collectives import psum_scatter
from jaxhybrid.parallel.data.allreduce import (_HALF, _check_chunk, _check_flat, _scaled, bucket_bounds,
                                              dispatched_ahead, shard_length)
from jaxhybrid.parallel.data.flat import FlatSpec


def column_devices(world_ranks: list[int]) -> list[Any]:
    """The first device of each process in ``world_ranks`` (JAX process index == MPI world rank), in that
    order; ValueError naming the cause when the distributed runtime does not hold those processes."""
    if jax.process_count() <= max(world_ranks):
        raise ValueError(f"optim.allreduce_backend=xla reduces over JAX processes {world_ranks}, but JAX's "
                         f"distributed runtime has {jax.process_count()} process(es): every MPI rank must call "
                         f"jaxhybrid.runtime.distributed.initialize() before any JAX computation")
    by_process: dict[int, Any] = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        by_process.setdefault(d.process_index, d)
    return [by_process[r] for r in world_ranks]


class XlaColumn:
    """This rank's data column as a one-axis JAX mesh; the reductions of :mod:`allreduce` over it.

    Args:
      world_ranks: the MPI world ranks of the column, in replica order (the same list on each of them).
      rank: this process's MPI world rank, which must be its JAX process index.
      tensor_ids: a hybrid rank's column: the device ids of each replica's local tensor mesh (axes
        ``MESH_AXES``, data size 1), flattened, in replica order; None for one device per rank.
      local_mesh: this rank's local tensor mesh (with ``tensor_ids``).
    """

    def __init__(self, world_ranks: list[int], rank: int, tensor_ids: list[list[int]] | None = None,
                 local_mesh: Mesh | None = None):
        if jax.process_index() != rank:
            raise ValueError(f"optim.allreduce_backend=xla: MPI world rank {rank} is JAX process "
                             f"{jax.process_index()}; initialize jax.distributed with process_id = MPI rank")
        self.size = len(world_ranks)
        devices = column_devices(list(world_ranks))
        self.device = devices[world_ranks.index(rank)]
        self.mesh = Mesh(np.array(devices), ("data",))
        self._rows = NamedSharding(self.mesh, P("data", None))
        self._programs: dict[tuple, Any] = {}
        self.local_mesh, self.tensor_mesh = local_mesh, None
        if tensor_ids is not None:
            by_id = {d.id: d for d in jax.devices()}
            shape = local_mesh.devices.shape[1:]
            self.tensor_mesh = Mesh(np.stack([np.array([by_id[i] for i in ids], dtype=object).reshape(shape)
                                              for ids in tensor_ids]), MESH_AXES,
                                    axis_types=local_mesh.axis_types)

    @classmethod
    def of(cls, topology: Any, local_mesh: Mesh | None = None) -> "XlaColumn":
        """The column of a :class:`~jaxhybrid.parallel.pipeline.topology.Topology` rank, with its local tensor
        mesh when it drives one (the replicas exchange their meshes' device ids over the column)."""
        mine = None if local_mesh is None else [int(d.id) for d in local_mesh.devices.flat]
        ranks, ids = zip(*topology.column.allgather((topology.rank, mine)))  # one exchange at start-up
        return cls(list(ranks), topology.rank, None if local_mesh is None else [list(i) for i in ids], local_mesh)

    def _program(self, key: tuple, make):
        if key not in self._programs:
            self._programs[key] = make()
        return self._programs[key]

    def _psum(self, n: int, dtype: Any):
        """Jitted ``[replicas, n] -> [n]`` sum over the mesh, replicated out."""
        def body(rows):
            return jax.lax.psum(rows[0], "data")

        return self._program(("psum", n, str(dtype)), lambda: jax.jit(
            jax.shard_map(body, mesh=self.mesh, in_specs=P("data", None), out_specs=P())))

    def reduce_row(self, row: jax.Array) -> jax.Array:
        """``row`` (``[1, n]`` on this process's column device) summed over the column: ``[n]``, same dtype."""
        n = int(row.shape[1])
        whole = jax.make_array_from_single_device_arrays((self.size, n), self._rows, [row])
        return self._psum(n, row.dtype)(whole).addressable_data(0)

    def _flatten(self, wire: Any, common: Any):
        """Local jitted ``tree -> [1, n]`` in the wire dtype, on this process's column device."""
        def run(tree):
            spec = FlatSpec(tree)
            flat = spec.ravel(jax.tree.map(lambda x: jnp.asarray(x).astype(common), tree))
            return flat.astype(wire)[None]

        return jax.jit(run, out_shardings=jax.sharding.SingleDeviceSharding(self.device))

    @staticmethod
    def _unflatten(shapes: Any, common: Any):
        """Local jitted ``([n], scale) -> tree`` shaped as ``shapes`` (ShapeDtypeStructs), each leaf's dtype
        back, times ``scale`` unless None."""
        leaves, treedef = jax.tree.flatten(shapes)
        sizes = [int(np.prod(x.shape)) for x in leaves]
        offsets = np.cumsum([0] + sizes[:-1]).tolist()

        def run(flat, scale):
            flat = flat.astype(common)
            if scale is not None:
                flat = flat * scale
            return treedef.unflatten([flat[o:o + n].reshape(x.shape).astype(x.dtype)
                                      for o, n, x in zip(offsets, sizes, leaves)])

        return jax.jit(run)

    def allreduce_tree(self, tree: Any, chunk_elems: int, scale: float | None = None, half_wire: bool = False
                       ) -> Any:
        """:func:`~jaxhybrid.parallel.data.allreduce.allreduce_tree` over the column mesh: same structure,
        dtypes and devices (a hybrid rank's leaves, sharded over its tensor mesh, keep their shardings)."""
        _check_chunk(chunk_elems)
        leaves = jax.tree.leaves(tree)
        if self.size == 1 or not leaves or not sum(int(np.size(x)) for x in leaves):
            return _scaled(tree, scale)
        if self.tensor_mesh is not None:
            return _scaled(self._allreduce_sharded(tree, half_wire), scale)
        common = jnp.result_type(*{jnp.asarray(x).dtype for x in leaves})
        wire = _wire(common, half_wire)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype), tree)
        key = ("tree", jax.tree.structure(tree), tuple((s.shape, str(s.dtype)) for s in jax.tree.leaves(shapes)),
               str(wire), scale is None)
        flatten, unflatten = self._program(key, lambda: (self._flatten(wire, common),
                                                         self._unflatten(shapes, common)))
        summed = self.reduce_row(flatten(tree))
        return unflatten(summed, None if scale is None else np.asarray(scale, common))

    def _allreduce_sharded(self, tree: Any, half_wire: bool) -> Any:
        """Every leaf of ``tree`` (sharded over this rank's local tensor mesh) summed over the column's data
        axis by one program over :attr:`tensor_mesh`: a leaf of shape ``[n, ...]`` and spec ``(s0, ...)`` is
        this replica's block of a global ``[replicas * n, ...]`` leaf of spec ``((data, s0), ...)``, whose
        device blocks are the local shards as they are."""
        leaves, treedef = jax.tree.flatten(tree)
        specs = [self._leaf_spec(x) for x in leaves]
        common = jnp.result_type(*{x.dtype for x in leaves})
        dtypes = tuple(jnp.dtype(x.dtype) for x in leaves)
        data = MESH_AXES[0]
        wire = _wire(common, half_wire)
        global_specs = [P((data, *_axes(s[0])), *s[1:]) for s in specs]

        def make():
            def body(*blocks):
                out = []
                for x in blocks:  # as the flat path: the common dtype, summed in float32 unless half_wire
                    out.append(jax.lax.psum(x.astype(common).astype(wire), data).astype(common).astype(x.dtype))
                return tuple(out)

            return jax.jit(jax.shard_map(body, mesh=self.tensor_mesh, in_specs=tuple(global_specs),
                                         out_specs=tuple(P(*s) for s in specs)))

        # Keyed by what the program closes over (jit itself retraces for new shapes).
        program = self._program(("sharded", treedef, dtypes, tuple(specs), half_wire), make)
        whole = [jax.make_array_from_single_device_arrays(
            (self.size * x.shape[0], *x.shape[1:]), NamedSharding(self.tensor_mesh, g),
            [sh.data for sh in x.addressable_shards]) for x, g in zip(leaves, global_specs)]
        out = []
        for x, summed in zip(leaves, program(*whole)):
            by_device = {sh.device: sh.data for sh in summed.addressable_shards}
            out.append(jax.make_array_from_single_device_arrays(
                x.shape, x.sharding, [by_device[sh.device] for sh in x.addressable_shards]))
        return jax.tree.unflatten(treedef, out)

    def _leaf_spec(self, x: Any) -> tuple:
        """The partition of leaf ``x`` over the local tensor mesh, one entry per dimension; ValueError for a
        leaf this column cannot sum in place (a scalar, another mesh, a spec over the data axis)."""
        sharding = getattr(x, "sharding", None)
        spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else None
        if (spec is None or sharding.mesh != self.local_mesh or np.ndim(x) == 0
                or any(MESH_AXES[0] in _axes(s) for s in spec)):
            raise ValueError(f"optim.allreduce_backend=xla sums a hybrid rank's gradients over its data column "
                             f"leaf by leaf: each must be an array of rank >= 1 sharded over the rank's tensor "
                             f"mesh without its data axis; got shape {np.shape(x)}, sharding {sharding}")
        return spec + (None,) * (x.ndim - len(spec))

    def reduce_scatter(self, flat: jax.Array, half_wire: bool = False) -> jax.Array:
        """:func:`~jaxhybrid.parallel.data.allreduce.reduce_scatter` over the column mesh: a ``shard_map``
        ``psum_scatter`` of the zero-padded vector; this process's shard of the sum, ``flat``'s dtype."""
        _check_flat(flat)
        n, dtype = int(flat.shape[0]), flat.dtype
        c = shard_length(n, self.size)
        wire = _wire(dtype, half_wire)

        def make():
            pad = jax.jit(lambda x: jnp.pad(x.astype(wire), (0, c * self.size - n))[None],
                          out_shardings=jax.sharding.SingleDeviceSharding(self.device))
            scatter = jax.jit(jax.shard_map(
                lambda rows: psum_scatter(rows[0], "data"),
                mesh=self.mesh, in_specs=P("data", None), out_specs=P("data")))
            return pad, scatter

        pad, scatter = self._program(("scatter", n, str(dtype), str(wire)), make)
        row = pad(flat)
        whole = jax.make_array_from_single_device_arrays((self.size, c * self.size), self._rows, [row])
        return scatter(whole).addressable_data(0).astype(dtype)

    def all_gather(self, shard: jax.Array) -> jax.Array:
        """:func:`~jaxhybrid.parallel.data.allreduce.all_gather` over the column mesh (``shard_map``
        ``all_gather``): every process's shard in replica order."""
        _check_flat(shard)
        c = int(shard.shape[0])
        # check_vma off: a tiled all_gather is the same on every device, which jax 0.10 does not infer.
        gather = self._program(("gather", c, str(shard.dtype)), lambda: jax.jit(jax.shard_map(
            lambda x: jax.lax.all_gather(x, "data", tiled=True), mesh=self.mesh, in_specs=P("data"),
            out_specs=P(), check_vma=False)))
        whole = jax.make_array_from_single_device_arrays((c * self.size,), NamedSharding(self.mesh, P("data")),
                                                         [jax.device_put(shard, self.device)])
        return gather(whole).addressable_data(0)

    def iter_reduced_chunks(self, flat_grads: jax.Array, chunk_elems: int, half_wire: bool = False,
                            ahead: bool = True) -> Iterator[tuple[int, int, jax.Array]]:
        """:func:`~jaxhybrid.parallel.data.allreduce.iter_reduced_chunks` over the column mesh: chunk
        ``k + 1`` is dispatched before chunk ``k`` is yielded (XLA's dispatch returns at once, so the
        caller's update of chunk ``k`` can run beside the next reduction)."""
        flat_grads = jnp.asarray(flat_grads)
        _check_flat(flat_grads)
        bounds = bucket_bounds(int(flat_grads.shape[0]), chunk_elems)
        if not bounds:
            return
        if self.size == 1:
            for s, e in bounds:
                yield s, e, flat_grads[s:e]
            return
        dtype = flat_grads.dtype
        wire = _wire(dtype, half_wire)

        def dispatch(s: int, e: int) -> jax.Array:
            cut = self._program(("slice", e - s, str(dtype), str(wire)), lambda: jax.jit(
                partial(_row_slice, size=e - s, wire=wire),
                out_shardings=jax.sharding.SingleDeviceSharding(self.device)))
            return self.reduce_row(cut(flat_grads, np.int32(s))).astype(dtype)

        yield from dispatched_ahead(bounds, dispatch, ahead)


def _wire(dtype: Any, half_wire: bool) -> Any:
    """The dtype a sum of ``dtype`` travels in: half precision as float32 unless ``half_wire``."""
    return dtype if half_wire or dtype not in _HALF else jnp.float32


def _axes(entry: Any) -> tuple:
    """The mesh axes of one ``PartitionSpec`` entry (None, one axis name or a tuple of them) as a tuple."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _row_slice(flat: jax.Array, start: jax.Array, size: int, wire: Any) -> jax.Array:
    """``flat[start:start + size]`` in the wire dtype, as a ``[1, size]`` row (no slice reaches past the end)."""
    return jax.lax.dynamic_slice(flat, (start,), (size,)).astype(wire)[None]


__all__ = ["XlaColumn", "column_devices"]
