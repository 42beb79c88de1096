"""``jaxhybrid bench NAME``'s arguments are checked before anything is built or timed: counts when parsed, a
config of MPI ranks for ``bench step``, and ``bench tensor``'s grids against the devices, each error naming
the flag or the command that fits."""
from __future__ import annotations

import argparse

import jax
import pytest

from jaxhybrid.bench import step, tensor
from jaxhybrid.cli.commands import bench

# ``jaxhybrid bench NAME``'s counts are checked when parsed: 0 timed steps or rounds used to end in a
# traceback after the compile (``bench tensor --steps 0``: UnboundLocalError; ``bench offload --steps 0``:
# ZeroDivisionError; ``bench pipeline --rounds 0``: "min() arg is an empty sequence" from every MPI rank),
# and ``bench partition --iterations 0`` ran where ``jaxhybrid partition`` refuses it.

def _usage_error(capsys, name: str, *rest: str) -> str:
    """argparse's error line for the benchmark's flag (exit code 2, before JAX or MPI starts)."""
    with pytest.raises(SystemExit) as e:
        bench.prepare(argparse.Namespace(name=name, rest=list(rest)))
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("name, argv, flag, value, floor", [
    ("tensor", (), "--steps", "0", 1),
    ("tensor", (), "--rounds", "0", 1),
    ("tensor", (), "--layers", "0", 1),
    ("tensor", (), "--batch", "-2", 1),
    ("tensor", (), "--seq", "0", 1),
    ("tensor", (), "--devices", "0", 1),
    ("offload", ("--no-sweep",), "--steps", "0", 1),
    ("offload", ("--no-sweep",), "--rounds", "0", 1),
    ("pipeline", ("--stages", "2"), "--rounds", "0", 1),
    ("pipeline", ("--stages", "2"), "--warmup", "-1", 0),
    ("pipeline", ("--stages", "2"), "--microbatch-size", "0", 1),
    ("pipeline", ("--stages", "2"), "--seq", "0", 1),
    ("pipeline", (), "--stages", "0", 1),
    ("pipeline", ("--stages", "2"), "--data", "0", 1),
    ("partition", ("--quick",), "--iterations", "0", 1),
    # bench stage read --microbatch-size 0 and --seq-len 0 as unset: it timed 4 x 128 tokens without a word.
    ("stage", (), "--microbatch-size", "0", 1),
    ("stage", (), "--seq-len", "0", 1),
    ("stage", (), "--concat", "0", 1),
    ("stage", (), "--repeats", "0", 1),
])
def test_bench_counts_are_checked_when_parsed(capsys, name, argv, flag, value, floor):
    assert _usage_error(capsys, name, *argv, flag, value) == \
        f"jaxhybrid bench {name}: error: argument {flag}: must be an integer >= {floor} (got '{value}')"


def test_bench_pipeline_takes_no_warmup():
    """--warmup 0 is a valid choice (every round timed)."""
    ns = argparse.Namespace(name="pipeline", rest=["--stages", "2", "--warmup", "0"])
    bench.prepare(ns)
    assert ns.bench_args.warmup == 0 and ns.bench_args.rounds == 5


def test_help_states_each_default_once(capsys):
    """``--help`` of a command and of a benchmark names the defaults, not "None"/"False" for options
    whose default means "not given", and not twice where the help text already speaks of it."""
    from jaxhybrid.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser(["plan", "--help"])
    plan = " ".join(capsys.readouterr().out.split())
    assert "measured compute_model for the dtype, else 0.5)" in plan and "plans to print (>= 1) (default: 10)" in plan
    assert "(default: None)" not in plan and "(default: False)" not in plan
    assert "else 0.9; the rest is CUDA context, XLA scratch, fragmentation) (default" not in plan
    with pytest.raises(SystemExit):
        bench.prepare(argparse.Namespace(name="tensor", rest=["--help"]))
    tensor = " ".join(capsys.readouterr().out.split())
    assert "--layers LAYERS override the preset's n_layers (default: 2)" in tensor and "--rounds ROUNDS timed rounds (default: 3)" in tensor


@pytest.mark.parametrize("grid", ["21,11", "21,11,11,4", "a,b,c", "21,1,11"])
def test_partition_grids_are_checked_when_parsed(capsys, grid):
    """MadPipe's three grid sizes (t_P, m_P, V; Sec. 5) are checked by argparse in both commands: ``bench
    partition --grid 21,11,11,4`` ended in a TypeError traceback, ``21,11`` silently ran with V's default
    and ``a,b,c`` said only "invalid literal for int()"."""
    want = f"argument --grid: must be three integers t,m,V >= 2 (the grid sizes of t_P, m_P and V), got {grid!r}"
    assert _usage_error(capsys, "partition", "--quick", "--grid", grid) == f"jaxhybrid bench partition: error: {want}"
    from jaxhybrid.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser(["partition", "--processors", "2", "--memory", "1e9", "--bandwidth", "1e9", "--grid", grid])
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"jaxhybrid partition: error: {want}"


def test_bench_partition_needs_a_network():
    """``--networks ""`` ran no case and ended in "max() arg is an empty sequence"."""
    from jaxhybrid.bench import partition

    p = argparse.ArgumentParser()
    partition.add_arguments(p)
    with pytest.raises(ValueError, match=r"^--networks ' , ' names no network; choose from resnet50, transformer"):
        partition.run(p.parse_args(["--quick", "--networks", " , "]))


# ``jaxhybrid bench step`` on a config of MPI ranks says what it times, before building anything. It
# said "launch with -n 4 or change the grid" (the trainer's check), but ``jaxhybrid launch`` runs ``train``,
# not a benchmark: no command line followed that advice.

def test_pipeline_config_is_refused_with_the_commands_that_fit():
    ns = argparse.Namespace(name="step", rest=["--config", "configs/runs/pipeline_2x2.yaml"])
    bench.prepare(ns)
    with pytest.raises(ValueError) as e:
        step.run(ns.bench_args)
    msg = str(e.value)
    assert "parallel.pipeline(2) x parallel.data(2) = 4" in msg and "jaxhybrid bench pipeline" in msg
    assert "launch with" not in msg


# ``jaxhybrid bench tensor``'s grid check names the flag whose grid does not match the devices. With
# ``--devices 2 --only 1,1,1,2`` it said "grid 1,2,2,2 has 8 devices", a grid the user never typed: the
# default of ``--ladder-shape``, which the message did not name.

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
