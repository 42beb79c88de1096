"""The step model charges each data-parallel all-reduce backend its own costs (optim.allreduce_backend):
MPI through host memory pays the gradient's copies to the host and back; XLA's collective (NCCL) does not."""
from pathlib import Path

import pytest

from jaxhybrid.core.layout import ParallelDims
from jaxhybrid.planner.costs import load_hardware
from jaxhybrid.planner.plan import machine_from_hardware, score_config
from jaxhybrid.planner.step_model import Layout, evaluate
from jaxhybrid.runtime.config_load import load_config

RUNS = Path(__file__).resolve().parents[3] / "configs" / "runs"


@pytest.fixture(scope="module")
def gpt2():
    cfg = load_config(RUNS / "gpt2-small-h100.yaml")
    return cfg, machine_from_hardware(load_hardware("h100-node"), 8, cfg.precision.compute_dtype)


def test_mpi_replicas_pay_the_host_copies_and_xla_does_not(gpt2):
    cfg, machine = gpt2
    mpi, xla = (score_config(cfg, machine, cfg.data.seq_len, b) for b in ("mpi", "xla"))
    assert xla["allreduce_staging_s"] == 0 and mpi["allreduce_staging_s"] > 0
    # Both reduce float32 gradients of the fuller stage: down and back up at host_to_device.
    assert mpi["data_allreduce_s"] == pytest.approx(xla["data_allreduce_s"] + mpi["allreduce_staging_s"])
    assert mpi["predicted_step_s"] == pytest.approx(xla["predicted_step_s"] + mpi["allreduce_staging_s"])
    phi = mpi["allreduce_staging_s"] * machine.net.host_to_device / (2 * 4)
    assert 40e6 < phi < 124e6  # about half of GPT-2 small's 124M parameters on the fuller of 2 stages


def test_no_replicas_no_staging_and_tensor_meshes_reduce_on_xla_anyway(gpt2):
    cfg, machine = gpt2
    one = Layout(ParallelDims(2, 1, 1, 1, 1), 8, 16, "1f1b", True, False, "none")
    assert evaluate(cfg.model, one, machine, 1024, allreduce_backend="mpi")["allreduce_staging_s"] == 0
    mesh = Layout(ParallelDims(1, 2, 2, 2, 1), 8, 16, "1f1b", False, False, "none")  # one mesh: XLA's collectives
    assert evaluate(cfg.model, mesh, machine, 1024, allreduce_backend="mpi")["allreduce_staging_s"] == 0


def test_auto_is_scored_as_a_run_on_these_gpus_resolves_it(gpt2):
    """The hardware files describe GPU nodes, where a run's ``auto`` is ``xla`` (Config.on_platform)."""
    cfg, machine = gpt2
    auto, xla = (score_config(cfg, machine, cfg.data.seq_len, b) for b in ("auto", "xla"))
    assert auto == xla
