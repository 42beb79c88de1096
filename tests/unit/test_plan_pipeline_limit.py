"""A run's pipeline.pipeline_limit (Myelin V-A, Alg. 2's microbatches in flight) reaches the step model:
its makespan is the simulator's for that limit."""
from __future__ import annotations

from pathlib import Path

import pytest

from jaxhybrid.config import load_config
from jaxhybrid.pipeline.costs import Costs
from jaxhybrid.pipeline.schedule import make_schedule
from jaxhybrid.pipeline.simulate import simulate
from jaxhybrid.planner import makespan as mk
from jaxhybrid.planner import step_model
from jaxhybrid.planner.costs import load_hardware
from jaxhybrid.planner.plan import config_layout, machine_from_hardware, score_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "runs" / "myelin-50b-offload.yaml"


def _simulated(p, m, split, bi, bw, msg, limit):
    costs = Costs(forward=(1.0,) * p, backward_input=(bi,) * p, backward_weight=(bw,) * p,
                  message_bytes=(msg,) * p, bandwidth=1.0)
    return simulate(make_schedule("myelin", p, m, split, pipeline_limit=limit, costs=costs), costs).makespan


@pytest.mark.parametrize("split", [False, True])
def test_makespan_is_the_simulators_for_the_limit(split):
    """Short schedules are simulated with the limit; long ones extrapolate from points a whole number of
    limit-sized rounds apart (p apart missed by up to 1.2%, at limit 12)."""
    for limit in (1, 2, 3, 6):
        assert mk.pipeline_makespan("myelin", 4, 8, split, 1.5, 1.0, 0.2, limit)[0] == \
            pytest.approx(_simulated(4, 8, split, 1.5, 1.0, 0.2, limit)), limit
    for limit in (3, 12):
        assert mk.pipeline_makespan("myelin", 16, 129, split, 1.5, 1.0, 0.2, limit)[0] == \
            pytest.approx(_simulated(16, 129, split, 1.5, 1.0, 0.2, limit), rel=1e-3), limit
    assert mk.pipeline_makespan("1f1b", 4, 8, split, 1.5, 1.0, 0.2, 2) == \
        mk.pipeline_makespan("1f1b", 4, 8, split, 1.5, 1.0, 0.2)  # no limit outside Myelin's policy


def test_score_config_predicts_the_runs_limit(monkeypatch):
    """myelin-50b-offload.yaml (8 stages, 128 microbatches) with pipeline_limit 2 and 4: score_config's
    pipeline time against the default's is the simulator's makespan ratio at the step model's own cost
    ratios; fewer microbatches in flight also stash fewer activations."""
    seen = []

    def record(*args):
        seen.append(args)
        return mk.pipeline_makespan(*args)

    monkeypatch.setattr(step_model, "pipeline_makespan", record)
    machine = machine_from_hardware(load_hardware("h100-node"), 8, "bfloat16", 0.5)
    base = score_config(load_config(CONFIG), machine, 512)
    (_, p, m, split, bi, bw, msg, limit0), = seen
    assert (p, m, limit0) == (8, 128, 0)
    for limit in (2, 4):
        cfg = load_config(CONFIG, [f"pipeline.pipeline_limit={limit}"])
        assert config_layout(cfg).pipeline_limit == limit
        got = score_config(cfg, machine, 512)
        assert seen[-1][-1] == limit
        want = _simulated(p, m, split, bi, bw, msg, limit) / _simulated(p, m, split, bi, bw, msg, 0)
        assert got["pipeline_s"] / base["pipeline_s"] == pytest.approx(want), limit
        assert want > 1.01 and got["memory_per_device_bytes"] < base["memory_per_device_bytes"]
    gpipe = load_config(CONFIG, ["pipeline.schedule=gpipe", "pipeline.pipeline_limit=2"])
    assert config_layout(gpipe).pipeline_limit == 0  # the engine reads the limit only under Myelin
