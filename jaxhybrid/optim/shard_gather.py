"""The sharded offload's updated parameters as global arrays, in one program (``ShardedOffloadUpdater``).

Each device's optimizer writes the compute-precision copies of the shards it owns into one flat vector
(``shard_owners``: every distinct shard of a leaf has one owner among its holders). The other holders of a
replicated shard need the owner's copy. Copying it shard by shard from the host (one eager
``jax.device_put`` per holder, 538 per step for gpt-small-cpu on a (2, 1, 2, 2) mesh) cost a third of the
update; here the flat vectors of all devices form one global array and a single jitted ``shard_map`` over
the params' mesh builds every leaf: each device cuts its own piece of the leaf out of its vector (the
offsets differ per device: a table indexed by the device's mesh position) and all-gathers it over the
mesh axes the leaf is replicated on, then keeps the owner's copy. Only data moves, so the result is the
owner's bits on every holder.

Planned once from the params (:meth:`OwnerGather.build`); None where the layout does not fit: several
processes (each plans over its own shards; the per-device copies stay), leaves on other meshes or
devices, shardings that are not a mesh's ``NamedSharding``, uneven shards. There, and for checkpoint
columns in host memory, :class:`ShardLayout` assembles the leaves holder by holder instead.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxhybrid.optim.shard_owners import shard_key


def _spec_axes(spec: PartitionSpec) -> set:
    used = set()
    for entry in spec:
        if entry is None:
            continue
        used.update(entry if isinstance(entry, tuple) else (entry,))
    return used


class OwnerGather:
    """One program from the owners' flat vectors (each padded to ``n`` elements) to the params' leaves."""

    def __init__(self, mesh, shapes, shardings, offsets, positions, replicated, n):
        self.mesh, self.n = mesh, n
        self.devices = list(mesh.devices.flat)  # block b of the flat global array is on devices[b]
        axes = tuple(mesh.axis_names)
        self._flat_sharding = NamedSharding(mesh, PartitionSpec(axes))
        specs = [s.spec for s in shardings]
        shard_shapes = [s.shard_shape(shape) for s, shape in zip(shardings, shapes)]
        sizes = [int(np.prod(s)) for s in shard_shapes]

        groups: dict[tuple, list[int]] = {}  # the leaves replicated over the same axes: one all-gather each
        for k, rep in enumerate(replicated):
            groups.setdefault(rep, []).append(k)

        def build(flat):
            me = jax.lax.axis_index(axes)
            off, pos = jnp.asarray(offsets)[me], jnp.asarray(positions)[me]
            out = [None] * len(sizes)
            for rep, ks in groups.items():
                pieces = [jax.lax.dynamic_slice(flat, (off[k],), (sizes[k],)) for k in ks]
                if not rep:  # no replica: every device owns its shard
                    for k, piece in zip(ks, pieces):
                        out[k] = piece.reshape(shard_shapes[k])
                    continue
                # Every holder's pieces (the non-owners' are unused), then each leaf's owner's.
                every = jax.lax.all_gather(jnp.concatenate(pieces), rep)
                at = 0
                for k in ks:
                    piece = jax.lax.dynamic_slice(every, (pos[k], at), (1, sizes[k]))
                    out[k], at = piece.reshape(shard_shapes[k]), at + sizes[k]
            return tuple(out)

        mapped = jax.shard_map(build, mesh=mesh, in_specs=PartitionSpec(axes), out_specs=tuple(specs),
                               check_vma=False)
        self._program = jax.jit(mapped, out_shardings=tuple(shardings))

    @classmethod
    def build(cls, leaves: list, owned: dict, offsets: dict, n: int) -> "OwnerGather | None":
        """The plan for ``leaves`` (global arrays laid out like the params), or None where it does not apply.

        ``owned``: device id -> [(leaf, shard key)] (``assign_owners``); ``offsets``: device id -> the offset of
        each of those pieces in that device's flat vector; ``n``: the padded length of every flat vector."""
        if jax.process_count() > 1 or not leaves:
            return None
        shardings = [x.sharding for x in leaves]
        if not all(isinstance(s, NamedSharding) for s in shardings):
            return None
        mesh = shardings[0].mesh
        devices = list(mesh.devices.flat)
        if any(s.mesh != mesh or s.memory_kind != shardings[0].memory_kind for s in shardings):
            return None
        where = {d.id: b for b, d in enumerate(devices)}  # device id -> mesh position (row-major)
        owner = {item: i for i, items in owned.items() for item in items}
        start = {item: o for i, items in owned.items() for item, o in zip(items, offsets.get(i, ()))}
        coords = np.stack(np.unravel_index(np.arange(len(devices)), mesh.devices.shape), axis=1)
        offs = np.zeros((len(devices), len(leaves)), np.int32)
        pos = np.zeros((len(devices), len(leaves)), np.int32)
        replicated = []
        for k, x in enumerate(leaves):
            s = x.sharding
            holders = s.addressable_devices_indices_map(x.shape)
            if {d.id for d in holders} != set(where):
                return None
            rep = tuple(a for a in mesh.axis_names if a not in _spec_axes(s.spec) and mesh.shape[a] > 1)
            rep_dims = [mesh.axis_names.index(a) for a in rep]
            size = int(np.prod(s.shard_shape(x.shape)))
            for d, index in holders.items():
                key = shard_key(index)
                extent = [(hi if hi is not None else dim) - lo for (lo, hi, _), dim in zip(key, x.shape)]
                if int(np.prod(extent)) != size:
                    return None  # uneven shards
                o = owner.get((k, key))
                if o is None or o not in where:
                    return None
                b, ob = where[d.id], where[o]
                # The owner must differ from this holder only along the replicated axes (NamedSharding's rule).
                if any(coords[b, j] != coords[ob, j] for j in range(mesh.devices.ndim) if j not in rep_dims):
                    return None
                if o == d.id:
                    offs[b, k] = start[(k, key)]
                p = 0
                for j in rep_dims:  # the owner's index in the all-gather over ``rep`` (row-major, mesh order)
                    p = p * mesh.devices.shape[j] + int(coords[ob, j])
                pos[b, k] = p
            replicated.append(rep)
        return cls(mesh, [x.shape for x in leaves], shardings, offs, pos, replicated, n)

    def __call__(self, flats: dict) -> list:
        """The leaves from ``flats`` (device id -> that device's ``(n,)`` vector, every mesh device)."""
        glob = jax.make_array_from_single_device_arrays((self.n * len(self.devices),), self._flat_sharding,
                                                        [flats[d.id] for d in self.devices])
        return list(self._program(glob))


class ShardLayout:
    """The params' leaves as laid out over the devices, and the per-holder assembly for any layout: every
    local holder of a shard gets its copy by a device-to-device copy of the owner's array (or from host
    data), one ``jax.device_put`` each, where :class:`OwnerGather` does not apply."""

    def __init__(self, leaves: list):
        self.shapes = [x.shape for x in leaves]
        self.shardings = [x.sharding for x in leaves]
        # Every local holder of every leaf and the key of the shard it holds, in the sharding's order: planned
        # once (``addressable_devices_indices_map`` walks every device of the mesh; assemble ran it per step).
        self._holders = [[(dev, shard_key(index)) for dev, index in s.addressable_devices_indices_map(shape).items()]
                         for shape, s in zip(self.shapes, self.shardings)]

    def assemble(self, pieces: dict, kind: str | None = None) -> list:
        """Global arrays with the params' shardings from one array per distinct shard (``pieces``: (leaf,
        shard key) -> the owner's device array, or host data): every local holder gets its copy (the other
        holders of a device shard by a device-to-device copy). ``kind``: in that memory kind."""
        out = []
        for k, (shape, sharding) in enumerate(zip(self.shapes, self.shardings)):
            parts = []
            for dev, key in self._holders[k]:
                x = pieces[(k, key)]
                if kind or not isinstance(x, jax.Array):
                    x = jax.device_put(x, jax.sharding.SingleDeviceSharding(dev, memory_kind=kind))
                elif x.devices() != {dev}:
                    x = jax.device_put(x, dev)
                parts.append(x)
            target = sharding.with_memory_kind(kind) if kind else sharding
            out.append(jax.make_array_from_single_device_arrays(shape, target, parts))
        return out

    def host_pieces(self, tree) -> dict:
        """(leaf, shard key) -> numpy data of this process's shards of a pytree of global arrays."""
        leaves = jax.tree.leaves(tree)
        if len(leaves) != len(self.shapes):
            raise ValueError(f"checkpoint column has {len(leaves)} leaves; this model has {len(self.shapes)}")
        return {(k, shard_key(sh.index)): np.asarray(sh.data, np.float32) for k, x in enumerate(leaves)
                for sh in x.addressable_shards}


__all__ = ["OwnerGather", "ShardLayout"]
