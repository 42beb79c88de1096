"""How ``jaxhybrid bench stage`` times its kernels: one synchronous call, calls queued behind one sync,
and calls from a known cache state (flushed, or right after the same kernel ran)."""
from __future__ import annotations

import glob
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np


def time_call(fn, *args) -> float:
    """Seconds of one call, synchronised: the host dispatch and the device work."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def noop_call_s(repeats: int) -> float:
    """Median seconds of one synchronous call of a jitted program that adds 1 to a scalar: the fixed
    cost of a call (host dispatch, launch, the wait for its result) apart from its kernels. Timed each with
    its own sync (``split_over_fused_per_call``), the split pays it twice where the fused backward pays it
    once. A real program's fixed cost is larger: its arguments, buffers and CUDA graph."""
    fn, x = jax.jit(lambda v: v + 1), jnp.zeros((), jnp.float32)
    jax.block_until_ready(fn(x))  # compile outside the timing
    return float(np.median([time_call(fn, x) for _ in range(max(5, repeats))]))


def dispatch_times(calls: dict, names, repeats: int, order) -> dict[str, float]:
    """Median seconds until a call returns (its program enqueued, not finished), each from an idle device:
    the host's share of a synchronous call. Where it nears the synchronous time minus the queued time,
    the device waits on the host's launches, which asynchronous dispatch hides behind queued work."""
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(max(3, repeats // 2)):
        for k in order.permutation(list(names)):
            fn, *a = calls[k]
            t0 = time.perf_counter()
            out = fn(*a)
            times[k].append(time.perf_counter() - t0)
            jax.block_until_ready(out)
    return {k: float(np.median(v)) for k, v in times.items()}


def queued_times(calls: dict, repeats: int, order, depth: int = 8) -> dict[str, float]:
    """Per-call seconds of the fused backward and of the split pair (backward_input then backward_weight)
    when ``depth`` calls are queued before one ``block_until_ready``: the host's dispatch overlaps the
    device work still queued, so this is the device-bound cost. Only the newest output stays referenced,
    so queued calls do not pile up memory."""
    def fused():
        fn, *a = calls["backward_fused"]
        for _ in range(depth):
            out = fn(*a)
        return out

    def split():
        (bi, *ai), (bw, *aw) = calls["backward_input"], calls["backward_weight"]
        for _ in range(depth):
            out = bi(*ai), bw(*aw)
        return out

    runs = {"fused": fused, "split": split}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(max(3, repeats // 3)):
        for k in order.permutation(list(runs)):
            times[k].append(time_call(runs[k]) / depth)
    return {k: float(np.median(v)) for k, v in times.items()}


def evictor():
    """A jitted rewrite of a buffer larger than any cache in the way (twice the host's last-level cache, at
    least 128 MiB, which also covers an H100's 50 MB L2), on the default device: run before a timed call,
    it leaves none of that call's inputs cached."""
    llc = 0
    for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):  # e.g. "32768K"
        text = pathlib.Path(f).read_text().strip().upper()
        llc = max(llc, int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1))
    state = [jnp.zeros(max(2 * llc, 2**27) // 4, jnp.float32)]
    step = jax.jit(lambda b: b + 1, donate_argnums=0)

    def evict():
        state[0] = jax.block_until_ready(step(state[0]))
    return evict


def cache_times(calls: dict, names, repeats: int, order) -> dict[str, dict[str, float]]:
    """Median seconds of each kernel from a known cache state: ``cold`` right after :func:`evictor` (as
    a pipeline meets a deferred weight pass: other microbatches' work ran in between), ``warm`` right
    after an untimed call of the same kernel. The random order of the main rounds mixes the two (whether a
    kernel follows one that read the same inputs), so their median can sit in either."""
    evict = evictor()
    keys = [(k, s) for k in names for s in ("cold", "warm")]
    times: dict = {key: [] for key in keys}
    for _ in range(max(3, repeats // 2)):
        for i in order.permutation(len(keys)):
            k, state = keys[i]
            fn, *a = calls[k]
            if state == "cold":
                evict()
            else:
                jax.block_until_ready(fn(*a))
            times[k, state].append(time_call(fn, *a))
    return {s: {k: float(np.median(times[k, s])) for k in names} for s in ("cold", "warm")}
