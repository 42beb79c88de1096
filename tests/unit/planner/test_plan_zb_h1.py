"""ZB-H1 (zero bubble, always split backward) in the planner's search: scored from the simulator as the
other schedules are, long schedules with its own memory closed form, and its plan file loads."""
from __future__ import annotations

import pytest

from jaxhybrid.core.config.model import PRESETS
from jaxhybrid.parallel.pipeline.costs import Costs
from jaxhybrid.parallel.pipeline.schedule import make_schedule
from jaxhybrid.parallel.pipeline.simulate import simulate
from jaxhybrid.planner import makespan as mk
from jaxhybrid.planner.costs import load_hardware
from jaxhybrid.planner.layouts import layouts
from jaxhybrid.planner.plan import machine_from_hardware, rank_plans, write_plan
from jaxhybrid.runtime.config_load import load_config


def _costs(p, bi, bw, msg):
    return Costs(forward=(1.0,) * p, backward_input=(bi,) * p, backward_weight=(bw,) * p,
                 message_bytes=(msg,) * p, bandwidth=1.0)


def test_zb_h1_is_searched_only_with_its_split_backward_and_enough_microbatches():
    zb = [lay for lay in layouts(PRESETS["gpt2-small"], 8, 16) if lay.schedule == "zb-h1"]
    assert zb and all(lay.split_backward and lay.dims.pipeline > 1 and lay.microbatches >= lay.dims.pipeline
                      for lay in zb)


def test_zb_h1_makespan_and_memory_are_the_simulators():
    """Short: one simulation. Long (16 x 129 > MAX_SIMULATED tasks): the makespan extrapolated within
    1e-3, and the closed form's per-rank counts are the simulated peaks: 1F1B's p - rank activations,
    rank + 1 weight residuals (it was m residuals, GPipe + 2BP's bound: 129 on every rank)."""
    c = _costs(4, 2.0, 0.5, 0.2)
    assert mk.pipeline_makespan("zb-h1", 4, 8, True, 2.0, 0.5, 0.2)[0] == \
        pytest.approx(simulate(make_schedule("zb-h1", 4, 8, costs=c), c).makespan)
    for costs in ((1.0, 1.0, 0.0), (1.5, 1.0, 0.2)):
        make, bound = mk.pipeline_makespan("zb-h1", 16, 129, True, *costs)
        full = simulate(make_schedule("zb-h1", 16, 129), _costs(16, *costs)).makespan
        assert make == pytest.approx(full, rel=1e-3), costs
        states = mk._simulate("zb-h1", 16, 129, True, *costs)[1]
        peaks = [(max(a for a, _ in st), max(r for _, r in st)) for st in states]
        assert [b[0] for b in bound] == peaks == [(16 - r, r + 1) for r in range(16)], costs


def test_zb_h1_plans_rank_and_their_plan_file_loads(tmp_path):
    plans = rank_plans(PRESETS["gpt2-small"], 8, machine_from_hardware(load_hardware("h100-node"), 8, "bfloat16", 0.5),
                       global_batch=16, seq=1024, top=10_000)
    zb = next(p for p in plans if p["schedule"] == "zb-h1")
    path = tmp_path / "plan.json"
    write_plan(path, zb, {"model": "gpt2-small", "global_batch": 16, "dtype": "bfloat16"})
    run = load_config(None, ["model.name=gpt2-small", "data.seq_len=1024", f"plan.file={path}"])
    assert (run.pipeline.schedule, run.pipeline.split_backward) == ("zb-h1", True)
    assert (run.parallel.pipeline, run.pipeline.microbatches) == (zb["pipeline"], zb["microbatches"])
