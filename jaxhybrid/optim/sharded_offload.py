"""The host-offloaded optimizer for parameters sharded over a device mesh (tensor and hybrid layouts).

Myelin V-B per device: every device streams, in buckets, the fp32 master weights and optimizer state of
the parameter shards it owns, and writes their compute-precision copies. AxoNN's layouts replicate some
shards over mesh axes (norm weights, biases, the data axis), so each distinct shard of a leaf is owned
by one of the devices holding it (:func:`~jaxhybrid.optim.shard_owners.assign_owners`); the other holders
receive the owner's updated shard: in one process, from one jitted program over the mesh that cuts every
leaf out of the owners' flat vectors and all-gathers it over the axes it is replicated on
(:class:`~jaxhybrid.optim.shard_gather.OwnerGather`); across processes, by device-to-device copies
(:class:`~jaxhybrid.optim.shard_gather.ShardLayout`). Every
owner applies the same global clip factor (``sq`` is the squared norm of the global gradients), so the
result equals the single-device optimizer's, shard by shard.

Across processes (``--distributed``) every process plans over the shards it holds: a shard held in several
processes (the data axis, replicated norm weights) has an owner in each, which all apply the same update.
Checkpoints of one process use the single-device format (``OffloadedOptimizer.state_dict``: flat global
master and state vectors in ``jax.tree.leaves`` order), independent of the mesh, the ownership and the
bucket size; across processes, pytrees of global host-memory arrays that orbax writes shard by shard.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.optim.hoststore import supports_memory
from jaxhybrid.optim.offload import DTYPES, OffloadedOptimizer
from jaxhybrid.optim.shard_gather import OwnerGather, ShardLayout
from jaxhybrid.optim.shard_owners import assign_owners, shard_key
from jaxhybrid.optim.updater import Updater, decay_mask
from jaxhybrid.parallel.data.flat import FlatSpec, release


def is_sharded(params: Any) -> bool:
    """Whether any leaf spans more than one device (then each device offloads its own shards)."""
    return any(len(x.sharding.device_set) > 1 for x in jax.tree.leaves(params) if isinstance(x, jax.Array))


@dataclass(frozen=True)
class ShardedOffloadState:
    """Per device id: the :class:`OffloadState` of the shards that device owns."""

    per_device: dict


class ShardedOffloadUpdater(Updater):
    """``OffloadUpdater``'s trainer interface over sharded params: one :class:`OffloadedOptimizer` per
    device, on the shards it owns (see the module docstring). ``stats`` is jitted over the global
    gradients, so the norm and the overflow check see every element of every leaf once."""

    def __init__(self, transform, cfg, backend: str | None = None):
        o = cfg.optim
        self.compute_dtype = DTYPES[cfg.precision.compute_dtype]
        self._make = lambda dev: OffloadedOptimizer(transform, o.bucket_size, grad_clip=o.grad_clip,
                                                    compute_dtype=cfg.precision.compute_dtype, backend=backend,
                                                    name="adamw", device=dev, decay=decay_mask(o))
        self.opts: dict[int, OffloadedOptimizer] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.owned: dict[int, list[tuple[int, tuple]]] = {}  # device id -> [(leaf, shard key)]
        self._gather: OwnerGather | None = None  # the one-program assembly (one process), from init

    # -- ownership ---------------------------------------------------------------------------------
    def _plan(self, params: Any) -> list:
        """Owners and optimizers for ``params``' shards. Returns the leaves (global arrays) for the rest
        of :meth:`init`, which reads them once more (each owner's data, the one-program assembly)."""
        leaves, self.treedef = jax.tree.flatten(params)
        self.shards = ShardLayout(leaves)
        self.gspec = FlatSpec(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32), params))
        self.index, self.devices, self.owned = assign_owners(leaves)
        self.opts = {i: self._make(self.devices[i]) for i, items in self.owned.items() if items}
        return leaves

    def _local(self, leaves: list) -> dict[int, list]:
        """Each owning device's data of its shards, from global arrays laid out like the params (one pass
        over every leaf's shards, then lookups)."""
        data = {(sh.device.id, k, shard_key(sh.index)): sh.data
                for k, x in enumerate(leaves) for sh in x.addressable_shards}
        out = {}
        for i in self.opts:
            missing = [(k, key) for k, key in self.owned[i] if (i, k, key) not in data]
            if missing:
                k, key = missing[0]
                raise ValueError(f"leaf {self.gspec.paths[k]}: device {i} holds no shard {key}; gradients must "
                                 f"have the parameters' shardings")
            out[i] = [data[(i, k, key)] for k, key in self.owned[i]]
        return out

    # -- updater interface -------------------------------------------------------------------------
    def init(self, params) -> ShardedOffloadState:
        leaves = self._plan(params)
        local = self._local(leaves)
        state = ShardedOffloadState({i: opt.init([np.asarray(x) for x in local[i]]) for i, opt in self.opts.items()})
        # Every device's flat vector is padded to the longest, so together they form one global array.
        self._n = max(opt.layout.n for opt in self.opts.values())
        self._gather = OwnerGather.build(leaves, self.owned,
                                         {i: opt.spec.offsets for i, opt in self.opts.items()}, self._n)
        self._zeros = {}  # device id -> the vector of a mesh device that owns nothing
        return state

    def compute_params(self, params):
        return jax.tree.map(lambda x: x.astype(self.compute_dtype), params)

    def apply(self, params, opt_state: ShardedOffloadState, grads, scale, sq, nonfinite):
        """One step; consumes ``params`` and ``grads`` as ``OffloadUpdater.apply`` does (and for the same
        reason): every device then holds its flat gradient shards and the flat parameters its buckets fill."""
        sq = np.float32(sq)  # one host scalar for every device's clip factor (it is replicated on the mesh)
        finite = not bool(nonfinite)
        release(params)
        local = self._local(jax.tree.leaves(grads))
        flat_g = {i: opt.flatten(local[i]) for i, opt in self.opts.items()}
        del local
        for opt in self.opts.values():
            if opt.on_bucket is not None:
                opt.on_bucket(-1)
        release(grads)

        gather = self._gather

        def one(i):
            opt = self.opts[i]
            # With the one-program assembly the buckets write into a vector of the common length (a skipped
            # step returns the state's parameters, of the device's own length, instead: padded below).
            buf = jnp.zeros((self._n,), self.compute_dtype, device=opt.device) if gather and finite else None
            st, flat, info = opt.step(opt_state.per_device[i], flat_g.pop(i), buf, loss_scale=scale,
                                      finite=finite, sq=sq)
            if gather is None:
                return st, opt.params_tree(flat), info["grad_norm"]
            if flat.shape[0] != self._n:
                flat = jnp.pad(flat, (0, self._n - flat.shape[0]))
            return st, flat, info["grad_norm"]

        # One host thread per device: each waits on its own bucket transfers, so the devices stream their
        # buckets at the same time instead of one after another (JAX dispatch is thread-safe).
        if self._pool is None:
            self._pool = ThreadPoolExecutor(len(self.opts), thread_name_prefix="offload")
        results = dict(zip(self.opts, self._pool.map(one, self.opts)))
        gnorm = next(iter(results.values()))[2]
        if gather is not None:
            flats = {i: r[1] for i, r in results.items()}
            for d in gather.devices:
                if d.id not in flats:
                    if d.id not in self._zeros:
                        self._zeros[d.id] = jnp.zeros((self._n,), self.compute_dtype, device=d)
                    flats[d.id] = self._zeros[d.id]
            new = self.treedef.unflatten(gather(flats))
            release([x for i, x in flats.items() if i in self.opts])  # the vectors, once the program read them
        else:
            updated = {k: x for i, (_, parts, _) in results.items() for k, x in zip(self.owned[i], parts)}
            new = self.treedef.unflatten(self.shards.assemble(updated))
        return new, ShardedOffloadState({i: r[0] for i, r in results.items()}), jnp.float32(gnorm)

    def _owned_columns(self, opt_state: ShardedOffloadState) -> tuple[list[dict], list]:
        """Every owned shard's host data per column (master, then each per-parameter state), keyed by
        (leaf, shard key), and the shared (not per-parameter) states."""
        split = next(iter(self.opts.values())).split
        cols: list[dict] = [{} for p in [True, *split.per_param] if p]
        shared: list = []
        for i, opt in self.opts.items():
            sd = opt.state_dict(opt_state.per_device[i])
            flats = [sd["master"]] + [sd["state"][f"{j:03d}"] for j, p in enumerate(split.per_param) if p]
            for col, flat in zip(cols, flats):
                col.update(zip(self.owned[i], opt.spec.unravel_host(flat)))
            shared = [sd["state"][f"{j:03d}"] for j, p in enumerate(split.per_param) if not p]
        return cols, shared

    def state_dict(self, opt_state: ShardedOffloadState) -> dict:
        """One process: the single-device format (flat global master and per-parameter state vectors,
        shared leaves). Several processes (``--distributed``; none need hold every shard): each column is
        a pytree of global arrays sharded like the params, in host memory, from which orbax writes every
        process's shards into the one checkpoint."""
        split = next(iter(self.opts.values())).split
        cols, shared = self._owned_columns(opt_state)
        if jax.process_count() > 1:  # host memory where the devices have it: a checkpoint costs no device bytes
            dev = self.devices[next(iter(self.opts))]  # a device of this process
            kind = "pinned_host" if supports_memory(dev, "pinned_host") else None
            trees = [self.treedef.unflatten(self.shards.assemble(col, kind)) for col in cols]
        else:
            trees = []
            for col in cols:
                leaves = [np.zeros(s, np.float32) for s in self.shards.shapes]
                for (k, key), part in col.items():
                    leaves[k][self.index[(k, key)]] = part
                trees.append(self.gspec.ravel_host(self.treedef.unflatten(leaves)))
        per, sh = iter(trees[1:]), iter(shared)
        return {"master": trees[0],
                "state": {f"{j:03d}": next(per) if p else next(sh) for j, p in enumerate(split.per_param)}}

    def restore_like(self, opt_state: ShardedOffloadState, read_saved: Callable[[], Any]) -> dict:
        """The restore target of a checkpoint whose optimizer state has the tree of metadata ``read_saved()``,
        in the format that wrote it, which :meth:`load_state_dict` reads either way: a checkpoint of one
        process (flat vectors) resumed by ``--distributed`` processes, or theirs (pytrees of global
        arrays) resumed by one process on the same mesh. Without this the target had this process
        count's format and orbax stopped with a tree-structure mismatch."""
        written_as_trees = isinstance(read_saved()["master"], dict)
        like = self.state_dict(opt_state)
        if written_as_trees == (jax.process_count() > 1):
            return like
        split = next(iter(self.opts.values())).split
        if written_as_trees:  # global arrays, each shard read onto a device that holds it
            col = self.treedef.unflatten([jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding) for shape, sharding
                                          in zip(self.shards.shapes, self.shards.shardings)])
        else:  # flat global vectors, read whole by every process
            col = np.zeros((self.gspec.n,), np.float32)
        return {"master": col, "state": {f"{j:03d}": col if p else like["state"][f"{j:03d}"]
                                         for j, p in enumerate(split.per_param)}}

    def load_state_dict(self, like, saved) -> ShardedOffloadState:
        """Each device's owned shards of a checkpoint in either format of :meth:`state_dict`: flat vectors
        (any layout may have written them), or, across processes, pytrees of global arrays restored with
        this layout's shardings (each process reads the shards it holds)."""
        split = next(iter(self.opts.values())).split
        state = {f"{j:03d}": saved["state"][f"{j:03d}"] for j in range(len(split.per_param))}
        columns = [saved["master"]] + [v for v, p in zip(state.values(), split.per_param) if p]
        if not isinstance(saved["master"], (np.ndarray, jax.Array)):  # pytrees of global arrays
            pick = [self.shards.host_pieces(c) for c in columns]
        else:
            master = np.asarray(saved["master"], np.float32)
            if master.shape != (self.gspec.n,):
                raise ValueError(f"checkpoint master has shape {master.shape}; this model has {self.gspec.n} "
                                 f"parameters")
            flat = [jax.tree.leaves(self.gspec.unravel_host(np.asarray(c, np.float32))) for c in columns]
            pick = [{(k, key): g[k][self.index[(k, key)]] for k, key in self.index} for g in flat]
        states = {}
        for i, opt in self.opts.items():
            mine = [opt.spec.ravel_host([col[item] for item in self.owned[i]]) for col in pick]
            per, rest = iter(mine[1:]), {}
            for (j, v), p in zip(state.items(), split.per_param):
                rest[j] = next(per) if p else v
            states[i] = opt.load_state_dict({"master": mine[0], "state": rest})
        return ShardedOffloadState(states)

    def master_params(self, opt_state: ShardedOffloadState) -> Any:
        """fp32 master weights as the global params pytree (numpy; across processes, global host arrays)."""
        master = self.state_dict(opt_state)["master"]
        return master if jax.process_count() > 1 else self.gspec.unravel_host(master)


__all__ = ["ShardedOffloadState", "ShardedOffloadUpdater", "is_sharded"]
