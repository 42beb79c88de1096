"""Memory accounting for model state, with and without host offload (Myelin Sec. V-B).

Without offload a mixed-precision step holds ``20 phi`` bytes on the device (4 phi fp32 masters,
4 phi fp32 gradients, 2 phi + 2 phi half-precision copies, 8 phi Adam moments); with offload only the
compute copies of parameters and gradients stay (4 phi in half precision) plus the bucket working set:
``16 bsize`` (4 master + 8 moments + 4 fp32 descaled gradient) and ``12 bsize`` per prefetched bucket.
:func:`live_device_bytes` measures what JAX actually holds, for the benchmark's side-by-side numbers.

A run's ``memory.json`` is the report of its fullest rank (:func:`report_over_ranks`: under a pipeline the
stages hold different parameters, and the largest decides an out-of-memory failure), naming it by
``rank``, ``stage`` and ``replica``, with every rank's ``params`` and ``device_total`` under ``per_rank``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_state_bytes(params: int, *, compute_dtype: str = "float32", offload: bool = False,
                      bucket_size: int = 0, state_bytes_per_param: int = 8, prefetch: int = 1,
                      optimizer_shards: int = 1) -> dict:
    """Bytes held for parameters, gradients and optimizer state, by location and component.

    Args:
      params: phi, the parameters one device holds (its stage, or its shards: ``params_per_device``).
      compute_dtype: dtype of the device parameters and gradients.
      offload: masters and optimizer state on host in buckets of ``bucket_size`` elements.
      state_bytes_per_param: optimizer state bytes per parameter (Adam: 8).
      prefetch: buckets fetched ahead (each adds a master + state bucket on the device).
      optimizer_shards: data replicas the optimizer is sharded over (``optim.shard_optimizer``, ZeRO-1): each
        holds the optimizer state of ``ceil(phi / shards)`` parameters, and with offload their masters only.
    """
    if compute_dtype not in _BYTES:
        raise ValueError(f"compute_dtype={compute_dtype!r}; choose one of {', '.join(_BYTES)}")
    c = _BYTES[compute_dtype]
    half = c < 4
    owned = -(-params // optimizer_shards)  # the optimizer's shard of this device's parameters
    if not offload:
        device = {"params_master": 4 * params, "params_compute": c * params if half else 0,
                  "grads_compute": c * params if half else 0, "grads_fp32": 4 * params,
                  "optimizer_state": state_bytes_per_param * owned}
        host = {}
    else:
        bucket = (4 + state_bytes_per_param) * bucket_size
        device = {"params_compute": c * params, "grads_compute": c * params,
                  "buckets": bucket + 4 * bucket_size + prefetch * bucket}
        host = {"params_master": 4 * owned, "optimizer_state": state_bytes_per_param * owned}
    return {"params": params, "compute_dtype": compute_dtype, "offload": offload, "bucket_size": bucket_size,
            "optimizer_shards": optimizer_shards, "device": device, "host": host,
            "device_total": sum(device.values()), "host_total": sum(host.values())}


def params_per_device(params) -> int:
    """Parameters held by the fullest device: a stage's count on one device, the largest per-device sum
    of shard sizes on a tensor mesh (replicated leaves count on every device that holds them)."""
    import jax

    held: dict = {}
    for x in jax.tree.leaves(params):
        shards = getattr(x, "addressable_shards", None)
        if not shards:
            held[None] = held.get(None, 0) + int(x.size)
            continue
        for sh in shards:
            held[sh.device] = held.get(sh.device, 0) + int(sh.data.size)
    return max(held.values(), default=0)


def live_device_bytes(exclude: set | None = None, per_device: bool = False):
    """Bytes of live JAX arrays in device memory (host memory kinds and ids in ``exclude`` left out); with
    ``per_device``, a dict ``device -> bytes`` counting each device's shards (replicas on every holder)."""
    import jax

    total, held = 0, {}
    for a in jax.live_arrays():
        if exclude and id(a) in exclude:
            continue
        try:
            kind = a.sharding.memory_kind
        except Exception:
            kind = None
        if kind in (None, "device") and not a.is_deleted():
            total += a.nbytes
            if per_device:
                shard = math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                for d in a.sharding.addressable_devices:
                    held[d] = held.get(d, 0) + shard
    return held if per_device else total


def write_report(run_dir: str | Path, report: dict) -> Path:
    """Write ``memory.json`` into the run directory; returns its path."""
    path = Path(run_dir) / "memory.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def rank_entry(engine, params) -> dict:
    """This rank's line of the report: its rank, pipeline stage and replica (None outside a pipeline) and
    :func:`params_per_device` of its ``params``."""
    stage, replica = getattr(engine, "stage_index", None), getattr(engine, "replica", None)
    return {"rank": int(getattr(engine, "rank", 0)), "stage": None if stage is None else int(stage),
            "replica": None if replica is None else int(replica), "params": int(params_per_device(params))}


def gather_entries(engine, entry: dict) -> list[dict] | None:
    """Every rank's :func:`rank_entry` on the writer (rank 0), None on the other ranks; collective under
    MPI: the pipeline engine's world communicator gathers, as its trace's events are gathered
    (``PipelineEngine.gather_events``), under the engine's watchdog like its other collectives: it is the
    first one of a run, and a peer stuck before it (its init or restore) left the writer waiting in it
    for good. One process (single device, tensor mesh): ``[entry]``."""
    world = getattr(getattr(engine, "topo", None), "world", None)
    if world is None:
        return [entry]
    with engine.watchdog.watching("gathering every rank's memory report"):
        return world.gather(entry, root=0)


def report_over_ranks(cfg, entries: list[dict]) -> dict:
    """:func:`report_from_config` of the rank whose model state takes the most device bytes (the one that
    runs out of memory first; the lowest such rank on a tie), named by ``rank``, ``stage`` and
    ``replica``, with every rank's ``params`` and ``device_total`` under ``per_rank``."""
    if not entries:
        raise ValueError("report_over_ranks: no ranks")
    reports = [report_from_config(cfg, e["params"]) for e in entries]
    i = max(range(len(entries)), key=lambda k: (reports[k]["device_total"], -entries[k]["rank"]))
    return {**reports[i], "rank": entries[i]["rank"], "stage": entries[i].get("stage"),
            "replica": entries[i].get("replica"), "ranks": len(entries),
            "per_rank": [{**e, "device_total": r["device_total"]} for e, r in zip(entries, reports)]}


def summary_line(report: dict) -> str:
    """The console's line; under several ranks it names the largest one (the report's rank)."""
    gib = 2.0**30
    where = ""
    if report.get("ranks", 1) > 1:
        stage = f", pipeline stage {report['stage']}" if report.get("stage") is not None else ""
        where = f" (largest of {report['ranks']} ranks: rank {report['rank']}{stage})"
    line = (f"model state per device{where}: device {report['device_total'] / gib:.3f} GiB, host "
            f"{report['host_total'] / gib:.3f} GiB (phi={report['params']}, {report['compute_dtype']}, "
            f"offload={report['offload']})")
    # The note only when the run chose offload: otherwise it is about the alternative, in memory.json.
    return f"{line}; note: {report['note']}" if report["offload"] and "note" in report else line


def report_from_config(cfg, params: int) -> dict:
    """The report for one device's ``params`` under ``cfg`` (optim.offload, optim.bucket_size,
    precision.compute_dtype), with the other choice alongside so the saving is visible at start-up."""
    shards = cfg.parallel.data if cfg.optim.shard_optimizer else 1
    kw = dict(compute_dtype=cfg.precision.compute_dtype, optimizer_shards=shards)
    b = min(cfg.optim.bucket_size, -(-params // shards))
    chosen = model_state_bytes(params, offload=cfg.optim.offload, bucket_size=b if cfg.optim.offload else 0, **kw)
    other = model_state_bytes(params, offload=not cfg.optim.offload, bucket_size=0 if cfg.optim.offload else b, **kw)
    report = {**chosen, "alternative": other}
    on, off = (chosen, other) if cfg.optim.offload else (other, chosen)
    if on["device_total"] >= off["device_total"]:
        # Why say so: the module docstring's bucket working set (16 + 12 per prefetch bytes per bucket
        # element) only pays when buckets are well below phi; a small model with the default 1M-element
        # bucket gets one bucket of the whole model, and offload then holds more on the device, not less.
        report["note"] = (f"offload holds {on['device_total']:,} device bytes against {off['device_total']:,} "
                          f"without: its buckets ({b:,} elements, at most phi={params:,}) need to be well below "
                          f"phi to save device memory (set optim.bucket_size)")
    return report
