"""Digests of a checkpoint's arrays and host state, recorded at save and checked at restore.

orbax keeps no checksum: bytes damaged inside a step's array files restore without complaint (as
non-finite or wrong weights). Each save records a CRC-32 per array (``zlib.crc32``: the fastest digest of
the standard library here, and enough to catch damage, not forgery) and one of the host state (the step's
JSON ``meta``, less the digests). An array that spans processes is digested per addressable shard, keyed by
the shard's index, since no process sees the others' bytes.
"""
from __future__ import annotations

import json
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from jaxhybrid.optim.updater import spans_processes

META_KEY = "digests"  # where the digests sit in a step's meta


def leaf_name(path) -> str:
    """A pytree path as orbax names its arrays: dict keys, sequence indices and attribute names joined by dots."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _crc(x) -> str:
    # As bytes through a uint8 view: a buffer of ml_dtypes' bfloat16 or float8 has no format memoryview takes.
    a = np.ascontiguousarray(x).reshape(-1)
    return f"{zlib.crc32(a.view(np.uint8)) if a.size else 0:08x}"


def _entry(x) -> dict:
    if spans_processes(x):
        shards = {str(s.index): _crc(np.asarray(s.data)) for s in x.addressable_shards if s.replica_id == 0}
        return {"dtype": str(x.dtype), "shape": list(x.shape), "shards": shards}
    a = np.asarray(x)
    return {"dtype": str(a.dtype), "shape": list(a.shape), "crc32": _crc(a)}


def _leaves(tree) -> list[tuple[str, Any]]:
    return [(leaf_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def tree_digests(tree) -> dict[str, dict]:
    """``{leaf name: {dtype, shape, crc32 | shards}}`` of a host-copied state (numpy, or global arrays that span
    processes). zlib releases the GIL on large buffers, so the leaves are digested on a few threads."""
    leaves = _leaves(tree)
    with ThreadPoolExecutor(max_workers=4) as pool:
        entries = list(pool.map(lambda kv: _entry(kv[1]), leaves))
    return {name: e for (name, _), e in zip(leaves, entries)}


def meta_digest(meta: dict) -> str:
    """The CRC-32 of the host state: ``meta`` without its digests, as sorted JSON (a float's repr survives the
    JSON round trip, so the restored meta digests the same)."""
    body = json.dumps({k: v for k, v in meta.items() if k != META_KEY}, sort_keys=True)
    return f"{zlib.crc32(body.encode()):08x}"


def record(state, meta: dict) -> dict:
    """``meta`` with the digests of ``state`` and of itself added under :data:`META_KEY`."""
    return {**meta, META_KEY: {"state": tree_digests(state), "meta": meta_digest(meta)}}


def mismatches(state, meta: dict) -> list[str] | None:
    """What a restored ``state`` and ``meta`` do not share with the digests ``meta`` records, one line each
    (``meta`` itself, then ``state/<leaf>``); None for a step saved without digests (nothing to check). A leaf
    restored into another dtype than it was saved in (a resume that casts), or sharded otherwise, is not
    compared: its bytes differ by design."""
    saved = meta.get(META_KEY)
    if saved is None:
        return None
    out = [] if meta_digest(meta) == saved.get("meta") else ["meta (the step's host state: step, loss scale, sampler)"]
    recorded = saved.get("state", {})
    leaves = dict(_leaves(state))
    out += [f"state/{k}: recorded but not restored" for k in recorded if k not in leaves]
    for name, x in leaves.items():
        want = recorded.get(name)
        if want is None:
            out.append(f"state/{name}: restored but no digest recorded")
            continue
        got = _entry(x)
        if got["dtype"] != want["dtype"]:
            continue
        if "crc32" in want and "crc32" in got:
            if got["crc32"] != want["crc32"]:
                out.append(f"state/{name} {tuple(want['shape'])} {want['dtype']}: crc32 {got['crc32']}, recorded "
                           f"{want['crc32']}")
        elif "shards" in want and "shards" in got:
            bad = [i for i, c in got["shards"].items() if i in want["shards"] and want["shards"][i] != c]
            if bad:
                out.append(f"state/{name} shard {bad[0]}: crc32 differs from the one recorded")
    return out
