"""One compilation per program among the processes that share a persistent compilation cache.

Ranks with equal stage layouts (the data replicas of a stage, the middle stages of a deep pipeline) build
the same XLA programs, and they build them at the same moment: each misses JAX's persistent cache and
compiles its own copy. Where ranks share cores (more ranks than cores: a laptop, a CI machine) those
copies take the cores from each other. With this hook the first process to miss a program compiles it
while the others sleep on a lock for the same cache key, then load what it wrote.

Mechanism: JAX calls ``jax._src.compiler._compile_and_write_cache`` on a persistent-cache miss. The hook
takes an exclusive POSIX record lock on one byte of ``<cache>.locks`` (the byte's offset a hash of the key:
one file, however many programs), reads the cache again, and compiles only if the entry is still missing.
It writes the entry from every process, whatever its compile time: JAX writes from JAX process 0 only,
and only programs over ``jax_persistent_cache_min_compile_time_secs``, so under ``jax.distributed``
(``optim.allreduce_backend: xla``) or for a quick program the waiters would find nothing and compile after
all, one after another. A lock that the file system refuses falls back to compiling at once.

Turned on by ``JAXHYBRID_COMPILE_ONCE=1`` (``jaxhybrid launch`` sets it when ranks outnumber cores) before
:func:`~jaxhybrid.cli.commands.train.enable_compilation_cache`. The hook wraps a private JAX function
(jax is pinned below 0.11); :func:`install` raises if it is gone, so a changed JAX fails loudly.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import time
from pathlib import Path

ENV = "JAXHYBRID_COMPILE_ONCE"
_SLOTS = 1 << 20  # lock offsets; two keys on one byte only wait for each other's compile
_LOCKS: list[Path] = []  # the lock file of the installed hook


def requested(env=None) -> bool:
    """Whether the environment asks for one compilation per program (``JAXHYBRID_COMPILE_ONCE=1``)."""
    return (os.environ if env is None else env).get(ENV, "") == "1"


def lock_path(cache: Path) -> Path:
    """The lock file beside the cache folder (inside it, JAX's size-bounded cache would count it)."""
    return cache.with_name(cache.name + ".locks")


def install(cache: Path) -> None:
    """Make this process's persistent-cache misses wait for any other process compiling the same key."""
    from jax._src import compiler

    needed = ("_compile_and_write_cache", "_cache_read", "backend_compile_and_load")
    if missing := [n for n in needed if not hasattr(compiler, n)]:
        raise RuntimeError(f"{ENV}=1: this JAX lacks jax._src.compiler.{', '.join(missing)}; unset {ENV} or "
                           f"install jax<0.11")
    first = not _LOCKS
    _LOCKS[:] = [lock_path(cache)]
    if first:
        compiler._compile_and_write_cache = _compile_once


def _compile_once(backend, computation, executable_devices, compile_options, host_callbacks, module_name, cache_key):
    """``jax._src.compiler._compile_and_write_cache`` under the key's lock (module docstring)."""
    from jax._src import compilation_cache, compiler

    fd = None if host_callbacks else _lock(cache_key)  # host callbacks are never cached: nothing to wait for
    try:
        if fd is not None:  # another process may have written it while this one waited
            found, _ = compiler._cache_read(module_name, cache_key, compile_options, backend, executable_devices)
            if found is not None:
                return found
        start = time.monotonic()
        executable = compiler.backend_compile_and_load(backend, computation, executable_devices, compile_options,
                                                       host_callbacks)
        if not host_callbacks:
            try:
                compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                          int(time.monotonic() - start))
            except Exception:  # noqa: BLE001 (a full disk costs a compile later, not the run)
                pass
        return executable
    finally:
        if fd is not None:
            os.close(fd)  # releases the record lock


def _lock(cache_key: str) -> int | None:
    """An open descriptor of the lock file holding the key's byte, or None where the file system refuses
    (then the caller compiles as JAX would)."""
    offset = int(hashlib.sha256(cache_key.encode()).hexdigest()[:8], 16) % _SLOTS
    try:
        fd = os.open(_LOCKS[0], os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX, 1, offset)
    except OSError:
        os.close(fd)
        return None
    return fd


__all__ = ["ENV", "install", "lock_path", "requested"]
