"""Which device offloads which parameter shard (Myelin V-B under AxoNN's layouts).

AxoNN's layouts replicate some shards over mesh axes (norm weights, biases, the data axis). Each distinct
shard of a leaf gets one owner among the devices holding it, the least loaded so far, largest shards
first: the host state and the bucket traffic split evenly, where a fixed rule (say, the lowest device id)
would hand every replicated shard to the same devices. Pure and deterministic: every process that holds
the same shards computes the same owners.
"""
from __future__ import annotations

import jax
import numpy as np


def shard_key(index: tuple) -> tuple:
    """A hashable, sortable form of a shard's index (a tuple of slices)."""
    return tuple((s.start or 0, s.stop, s.step or 1) if isinstance(s, slice) else (s, s, 1) for s in index)


def assign_owners(leaves: list[jax.Array]) -> tuple[dict, dict, dict]:
    """Owners of this process's shards of ``leaves`` (global arrays).

    Returns:
      ``(index, devices, owned)``: ``index`` maps (leaf, shard key) to the shard's slices; ``devices``
      maps device id to device, for every device of the leaves' shardings; ``owned`` maps each of those
      device ids to its owned ``[(leaf, shard key)]`` in leaf order (a device's flat vector follows the
      model's leaves), empty for a device that owns nothing.
    """
    index: dict[tuple[int, tuple], tuple] = {}
    devices = {d.id: d for x in leaves for d in x.sharding.device_set}
    shards = []  # (elements, leaf, key, holders) of every distinct shard
    for k, x in enumerate(leaves):
        holders: dict[tuple, list[int]] = {}
        for sh in x.addressable_shards:
            holders.setdefault(shard_key(sh.index), []).append(sh.device.id)
            index[(k, shard_key(sh.index))] = sh.index
        size = int(np.prod(x.sharding.shard_shape(x.shape)))
        shards += [(size, k, key, sorted(ids)) for key, ids in holders.items()]
    load = dict.fromkeys(devices, 0)
    owned: dict[int, list[tuple[int, tuple]]] = {i: [] for i in sorted(devices)}
    for size, k, key, ids in sorted(shards, key=lambda t: (-t[0], t[1], t[2])):
        owner = min(ids, key=lambda i: (load[i], i))
        load[owner] += size
        owned[owner].append((k, key))
    for items in owned.values():
        items.sort()
    return index, devices, owned
