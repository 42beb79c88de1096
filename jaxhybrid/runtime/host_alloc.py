"""Keep XLA:CPU's per-execution host buffers mapped between calls: glibc's malloc tuned once at start-up.

Why: XLA:CPU allocates each execution's temporaries (one buffer of all of a program's intermediates) and
its results with ``malloc``. glibc serves a request above its adaptive mmap threshold, or one a thread's
64 MiB arena heaps cannot hold, with a fresh ``mmap`` that ``free`` unmaps again, and trims free heap back
to the kernel; either way every page is zero-filled anew on first touch, a page fault per page per step.

:func:`configure_host_malloc` sets ``M_MMAP_MAX = 0`` (never ``mmap``), ``M_TRIM_THRESHOLD`` at its maximum
(never hand free heap back) and, in a process that drives one CPU device, ``M_ARENA_MAX = 1`` (the main
arena grows with ``brk`` and holds any size; a thread arena would still mmap what its heaps cannot hold).
With several CPU devices in one process (the tests' fake devices) one arena would serialise their
threads, and their per-device buffers fit per-thread heaps anyway. The price: the process keeps its
resident high-water mark, as a caching device allocator does.

Only where JAX computes on the CPU (:func:`~jaxhybrid.core.launch_env.accelerator_backend`): on a GPU host
the same settings slow the host side down badly. It must run before JAX starts its CPU client, since threads
that already allocated keep their own arenas: the ``jaxhybrid`` command calls it once the command has settled
its environment (``prepare`` in :mod:`jaxhybrid.cli.main`); a library user calls it at the top of their
script, after setting ``XLA_FLAGS``.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import sys

from jaxhybrid.core.launch_env import accelerator_backend

log = logging.getLogger(__name__)

# glibc's mallopt parameter numbers (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
OPT_OUT = "JAXHYBRID_HOST_MALLOC"  # "system": leave glibc's defaults
_USER_KNOBS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
               "GLIBC_TUNABLES")
_applied: dict | None = None


def glibc() -> bool:
    """Whether this process runs on glibc (whose ``mallopt`` options these are)."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no confstr, or no such name off glibc
        return False


def host_malloc_status() -> dict:
    """What :func:`configure_host_malloc` did in this process, without configuring anything (reports)."""
    return _applied if _applied is not None else {"applied": False, "reason": "configure_host_malloc not called"}


def _skip_reason(environ) -> str | None:
    if environ.get(OPT_OUT, "").lower() == "system":
        return f"{OPT_OUT}=system"
    set_by_user = [k for k in _USER_KNOBS if k in environ]
    if set_by_user:
        return f"the environment sets {', '.join(set_by_user)}"
    if not glibc():
        return f"not glibc ({sys.platform})"
    accelerator = accelerator_backend(environ)
    if accelerator:
        return f"JAX will compute on {accelerator}, not the CPU (the tuning is for XLA:CPU's buffers)"
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is not None and getattr(bridge, "backends_are_initialized", lambda: False)():
        return "JAX's backend already started (its threads keep their own arenas)"
    return None


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def default_cpu_devices(n: int) -> None:
    """``n`` fake CPU devices for this process, unless the environment sets a count (``XLA_FLAGS``' flag
    or ``JAX_NUM_CPU_DEVICES``: the user's choice wins). Other XLA flags are kept and the count is added
    to them: a set ``XLA_FLAGS`` used to mean one device. Only before JAX's backend starts, which reads
    it; before :func:`configure_host_malloc`, which reads the count too."""
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG not in flags and not os.environ.get("JAX_NUM_CPU_DEVICES", "").strip():
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={n}".strip()


def cpu_devices(environ) -> int:
    """CPU devices this process will drive, from what JAX reads when it starts: ``JAX_NUM_CPU_DEVICES``,
    which JAX's CPU client takes over the flag when it is set, else ``--xla_force_host_platform_device_count``
    in ``XLA_FLAGS``, else 1."""
    m = re.search(DEVICE_COUNT_FLAG + r"=(\S*)", environ.get("XLA_FLAGS", ""))
    if m and not m.group(1).isdigit():  # XLA itself aborts every process on it, dumping all its flags
        raise ValueError(f"XLA_FLAGS sets {DEVICE_COUNT_FLAG}={m.group(1)}: give a whole number of CPU devices, "
                         f"e.g. {DEVICE_COUNT_FLAG}=8")
    n = environ.get("JAX_NUM_CPU_DEVICES", "").strip()  # JAX names a malformed value itself, later
    if n.isdigit():
        return max(1, int(n))
    return int(m.group(1)) if m else 1


def configure_host_malloc(environ=None) -> dict:
    """Apply the settings once per process; returns ``{"applied": bool, "reason" or settings}``. Skipped
    (and said why) off glibc, with ``JAXHYBRID_HOST_MALLOC=system``, when the environment already sets one
    of glibc's malloc variables (the user's choice wins), or when JAX's backend is already up."""
    global _applied
    if _applied is not None:
        return _applied
    environ = os.environ if environ is None else environ
    reason = _skip_reason(environ)
    if reason is None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        settings = {"M_MMAP_MAX": (M_MMAP_MAX, 0),
                    "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, -1)}  # -1: the largest size_t, never trim
        if cpu_devices(environ) == 1:
            settings = {"M_ARENA_MAX": (M_ARENA_MAX, 1), **settings}
        failed = [k for k, (param, value) in settings.items() if libc.mallopt(param, value) != 1]
        if failed:
            reason = f"mallopt refused {', '.join(failed)}"
        else:
            _applied = {"applied": True, **{k: v for k, (_, v) in settings.items()}}
            return _applied
    log.info("host malloc left as it is: %s", reason)
    _applied = {"applied": False, "reason": reason}
    return _applied


__all__ = ["configure_host_malloc", "host_malloc_status", "cpu_devices", "default_cpu_devices",
           "glibc", "OPT_OUT"]
