"""``jaxhybrid bench tensor``'s grid check names the flag whose grid does not match the devices. With
``--devices 2 --only 1,1,1,2`` it said "grid 1,2,2,2 has 8 devices", a grid the user never typed: the
default of ``--ladder-shape``, which the message did not name."""
from __future__ import annotations

import argparse

import jax
import pytest

from jaxhybrid.bench import tensor
from jaxhybrid.commands import bench


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
