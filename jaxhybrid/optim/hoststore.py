"""Where offloaded buckets live between steps: numpy arrays, or JAX arrays in ``pinned_host`` memory.

Both stores keep one tuple of arrays per bucket (master weights, then the per-parameter optimizer
leaves) and move whole tuples: ``fetch`` starts an asynchronous host-to-device copy (``device_put``
returns before the bytes arrive, so bucket ``i + 1`` streams in while bucket ``i`` updates) and
``send_back`` starts the device-to-host copy of an updated bucket without waiting for it.

``jaxhybrid bench offload`` times both side by side (``host_backend_step_s``); the per-platform choice is
``DEFAULT_BACKEND``. On CPU both are the same RAM; on GPU ``pinned_host`` gives DMA-able page-locked
buffers, which Myelin's prefetching needs to reach PCIe bandwidth.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

# Per platform, the store ``OffloadedOptimizer(backend=None)`` picks. CPU: both stores step equally fast,
# but numpy buckets keep more device arrays alive than Myelin's 4 phi + 16 bsize, pinned_host does not.
# GPU/TPU: page-locked memory for asynchronous DMA.
DEFAULT_BACKEND = {"cpu": "pinned_host", "gpu": "pinned_host", "cuda": "pinned_host", "rocm": "pinned_host",
                   "tpu": "pinned_host"}
BACKENDS = ("numpy", "pinned_host")


def supports_memory(device: Any, kind: str) -> bool:
    try:
        return any(m.kind == kind for m in device.addressable_memories())
    except Exception:  # older PJRT clients without memory spaces
        return False


def resolve_backend(backend: str | None, device: Any) -> str:
    if backend is None:
        backend = DEFAULT_BACKEND.get(device.platform, "numpy")
        return backend if backend == "numpy" or supports_memory(device, backend) else "numpy"
    if backend not in BACKENDS:
        raise ValueError(f"offload backend={backend!r}; choose one of {', '.join(BACKENDS)} or None")
    if backend == "pinned_host" and not supports_memory(device, "pinned_host"):
        raise ValueError(f"offload backend='pinned_host' but device {device} has no pinned_host memory; "
                         f"use backend='numpy'")
    return backend


class NumpyStore:
    """Buckets as numpy arrays. ``send_back`` starts ``copy_to_host_async``; ``land`` reads them."""

    name = "numpy"

    def __init__(self, device: Any):
        self.device = device

    def from_numpy(self, arrays: tuple) -> tuple:
        return tuple(np.array(a, copy=True) for a in arrays)

    def to_numpy(self, arrays: tuple) -> tuple:
        return tuple(np.asarray(a) for a in arrays)

    def fetch(self, arrays: tuple) -> tuple:
        return jax.device_put(arrays, self.device)

    def send_back(self, arrays: tuple) -> tuple:
        for a in arrays:
            a.copy_to_host_async()
        return arrays

    def land(self, pending: tuple) -> tuple:
        # A copy: on CPU ``np.asarray`` would be a view that keeps the device buffer alive.
        return tuple(np.array(a, copy=True) for a in pending)


class PinnedStore:
    """Buckets as JAX arrays in the device's ``pinned_host`` memory space; copies are ``device_put``."""

    name = "pinned_host"

    def __init__(self, device: Any):
        self.device = device
        self.host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        self.dev = jax.sharding.SingleDeviceSharding(device, memory_kind="device")

    def from_numpy(self, arrays: tuple) -> tuple:
        return jax.device_put(tuple(np.asarray(a) for a in arrays), self.host)

    def to_numpy(self, arrays: tuple) -> tuple:
        return tuple(np.asarray(a) for a in arrays)

    def fetch(self, arrays: tuple) -> tuple:
        return jax.device_put(arrays, self.dev)

    def send_back(self, arrays: tuple) -> tuple:
        return jax.device_put(arrays, self.host)

    def land(self, pending: tuple) -> tuple:
        return pending


def make_store(backend: str | None, device: Any):
    name = resolve_backend(backend, device)
    return NumpyStore(device) if name == "numpy" else PinnedStore(device)
