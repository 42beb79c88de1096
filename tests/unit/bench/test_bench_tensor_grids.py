"""``jaxhybrid bench tensor``'s grid check names the flag whose grid does not match the devices. With
``--devices 2 --only 1,1,1,2`` it said "grid 1,2,2,2 has 8 devices", a grid the user never typed: the
default of ``--ladder-shape``, which the message did not name."""
from __future__ import annotations

import argparse

import jax
import pytest

from jaxhybrid.bench import tensor
from jaxhybrid.cli.commands import bench


def _args(*rest: str) -> argparse.Namespace:
    ns = argparse.Namespace(name="tensor", rest=list(rest))
    bench.prepare(ns)
    return ns.bench_args


def test_ladder_default_named():
    n = len(jax.devices())
    assert n != 2
    with pytest.raises(ValueError, match=r"^--ladder-shape grid 1,1,1,2 has 2 devices, not the \d+ JAX has"):
        tensor.run(_args("--only", f"1,1,1,{n}", "--ladder-shape", "1,1,1,2"))


def test_only_grid_named():
    with pytest.raises(ValueError, match=r"^--only grid 1,1,1,3 has 3 devices"):
        tensor.run(_args("--only", "1,1,1,3"))


@pytest.mark.parametrize("env, want", [
    ({}, "--xla_force_host_platform_device_count=4"),
    ({"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"},
     "--xla_cpu_multi_thread_eigen=false --xla_force_host_platform_device_count=4"),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, "--xla_force_host_platform_device_count=2"),
    ({"XLA_FLAGS": "--xla_cpu_foo=1", "JAX_NUM_CPU_DEVICES": "2"}, "--xla_cpu_foo=1"),
])
def test_devices_apply_unless_the_environment_sets_a_count(monkeypatch, env, want):
    """``bench tensor --devices 4`` (and ``bench offload --tensor``'s mesh) gave one device whenever
    ``XLA_FLAGS`` was set at all, even to flags that set no device count, and then said "--devices sets the
    fake CPU devices". A count the user set (the flag, or ``JAX_NUM_CPU_DEVICES``) still wins."""
    from jaxhybrid.runtime.host_alloc import default_cpu_devices

    for k in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    default_cpu_devices(4)
    import os

    assert os.environ["XLA_FLAGS"] == want
