"""``jaxhybrid bench step`` on a config of MPI ranks says what it times, before building anything. It
said "launch with -n 4 or change the grid" (the trainer's check), but ``jaxhybrid launch`` runs ``train``,
not a benchmark: no command line followed that advice."""
from __future__ import annotations

import argparse

import pytest

from jaxhybrid.bench import step
from jaxhybrid.cli.commands import bench


def test_pipeline_config_is_refused_with_the_commands_that_fit():
    ns = argparse.Namespace(name="step", rest=["--config", "configs/runs/pipeline_2x2.yaml"])
    bench.prepare(ns)
    with pytest.raises(ValueError) as e:
        step.run(ns.bench_args)
    msg = str(e.value)
    assert "parallel.pipeline(2) x parallel.data(2) = 4" in msg and "jaxhybrid bench pipeline" in msg
    assert "launch with" not in msg
