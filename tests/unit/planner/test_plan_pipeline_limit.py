"""A run's pipeline.pipeline_limit (Myelin V-A, Alg. 2's microbatches in flight) reaches the step model:
its makespan is the simulator's for that limit. The planner searches a few limits for Myelin layouts and
ranks a larger one where it is faster and fits."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from jaxhybrid.core.config.model import PRESETS
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.parallel.pipeline.costs import Costs
from jaxhybrid.parallel.pipeline.schedule import make_schedule
from jaxhybrid.parallel.pipeline.simulate import simulate
from jaxhybrid.planner import makespan as mk
from jaxhybrid.planner import step_model
from jaxhybrid.planner.costs import load_hardware
from jaxhybrid.planner.layouts import layouts, myelin_limits
from jaxhybrid.planner.plan import config_layout, machine_from_hardware, rank_plans, score_config
from jaxhybrid.planner.step_model import Layout
from jaxhybrid.runtime.config_load import load_config

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "runs" / "myelin-50b-offload.yaml"


def _simulated(p, m, split, bi, bw, msg, limit):
    costs = Costs(forward=(1.0,) * p, backward_input=(bi,) * p, backward_weight=(bw,) * p,
                  message_bytes=(msg,) * p, bandwidth=1.0)
    return simulate(make_schedule("myelin", p, m, split, pipeline_limit=limit, costs=costs), costs).makespan


@pytest.mark.parametrize("split", [False, True])
def test_makespan_is_the_simulators_for_the_limit(split):
    """Short schedules are simulated with the limit; long ones extrapolate from points a whole number of
    limit-sized rounds apart (points p apart miss where the limit is not p)."""
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
    # The engine reads the limit only under Myelin: validation refuses it with another schedule, and an
    # unchecked config's layout leaves it out.
    with pytest.raises(ConfigError, match=r"pipeline.pipeline_limit=2 is read only by pipeline.schedule='myelin'"):
        load_config(CONFIG, ["pipeline.schedule=gpipe", "pipeline.pipeline_limit=2"])
    gpipe = load_config(CONFIG, ["pipeline.schedule=gpipe", "pipeline.pipeline_limit=2"], check=False)
    assert config_layout(gpipe).pipeline_limit == 0


def _machine(usable=None):
    """h100-node, or one whose usable memory per device is ``usable`` bytes."""
    hw = load_hardware("h100-node")
    frac = machine_from_hardware(hw, 8, "bfloat16", 0.5).memory_bytes / float(hw["memory_bytes"])
    return machine_from_hardware(hw if usable is None else {**hw, "memory_bytes": usable / frac}, 8, "bfloat16", 0.5)


def test_the_search_tries_the_candidate_limits_for_myelin_only():
    """Myelin layouts come with 3p/2 and (without 2BP) 2p beside the default, at most M; the others with none."""
    assert myelin_limits(8, 128, False) == (0, 12, 16) and myelin_limits(8, 128, True) == (0, 12)
    assert myelin_limits(8, 12, False) == (0, 12) and myelin_limits(8, 8, False) == (0,)
    groups = {}
    for lay in layouts(PRESETS["gpt-small-cpu"], 8, 64, tensor=False):
        groups.setdefault(dataclasses.replace(lay, pipeline_limit=0), []).append(lay.pipeline_limit)
    assert any(len(v) == 3 for v in groups.values()) and any(len(v) == 2 for v in groups.values())
    for base, limits in groups.items():
        want = myelin_limits(base.dims.pipeline, base.microbatches, base.split_backward) \
            if base.schedule == "myelin" and base.dims.pipeline > 1 else (0,)
        assert tuple(limits) == want, base


def test_the_floor_is_below_every_limits_makespan():
    """makespan_floor bounds the simulated makespan of every limit (the search skips a larger limit only
    where the default is within 1% of it), and is tight for a long 1F1B-like pipeline."""
    for p, m in ((2, 8), (4, 32), (8, 32)):
        for split in (False, True):
            for bi, bw, msg in ((1.0, 1.0, 0.0), (2.0, 0.9, 0.05), (1.0, 0.5, 1.0)):
                floor = mk.makespan_floor(p, m, split, bi, bw, msg)
                for limit in (0, 3 * p // 2, 2 * p, m):
                    assert mk.pipeline_makespan("myelin", p, m, split, bi, bw, msg, limit)[0] >= floor - 1e-9
    ratios = (2.0, 1.0, 0.0)
    assert mk.pipeline_makespan("myelin", 4, 256, True, *ratios)[0] < 1.01 * mk.makespan_floor(4, 256, True, *ratios)


def _best_myelin(plans):
    return next(p for p in plans if p["schedule"] == "myelin" and p["pipeline"] > 1)


def test_ample_memory_ranks_the_faster_limit_and_tight_memory_one_that_fits():
    """gpt-small-cpu on 8 GPUs: its best Myelin plan runs 3p/2 in flight, which the simulator finds faster
    than the default at the step model's ratios; with memory between the two limits' needs, that layout
    keeps the default, and nothing listed exceeds the memory."""
    cfg, ample = PRESETS["gpt-small-cpu"], _machine()
    best = _best_myelin(rank_plans(cfg, 8, ample, 64, 256, 1 << 30, tensor=False))
    lay = Layout.from_dict(best)
    assert lay.pipeline_limit == 3 * lay.dims.pipeline // 2
    default = step_model.evaluate(cfg, dataclasses.replace(lay, pipeline_limit=0), ample, 256)
    assert best["pipeline_s"] < default["pipeline_s"]
    assert best["memory_per_device_bytes"] > default["memory_per_device_bytes"]
    tight = _machine((best["memory_per_device_bytes"] + default["memory_per_device_bytes"]) / 2)
    plans = rank_plans(cfg, 8, tight, 64, 256, 1 << 30, tensor=False)
    assert all(p["memory_per_device_bytes"] <= tight.memory_bytes for p in plans)
    same = [p for p in plans if Layout.from_dict(p) in
            {dataclasses.replace(lay, pipeline_limit=k)
             for k in myelin_limits(lay.dims.pipeline, lay.microbatches, True)}]
    assert [p["pipeline_limit"] for p in same] == [0]


def test_the_plan_table_and_json_show_myelin_limits(capsys):
    """The table's lim column: Myelin's limit in flight (the default as the stage count), '-' for the other
    schedules; the JSON carries pipeline_limit (0: the default)."""
    from jaxhybrid.cli.main import build_parser

    argv = ["plan", "--model", "gpt-tiny", "--gpus", "2", "--gpus-per-node", "2", "--hardware", "h100-node",
            "--global-batch", "16", "--top", "12"]
    for extra in ([], ["--json"]):
        _, args = build_parser(argv + extra)
        assert args._run(args) == 0
    table, js = capsys.readouterr().out.split("\n{", 1)
    plans = json.loads("{" + js)["plans"]
    rows = [line.split() for line in table.splitlines() if line[:2].strip().isdigit()]
    assert table.splitlines()[1].split()[7:10] == ["schedule", "lim", "2BP"] and len(rows) == len(plans) == 12
    for row, p in zip(rows, plans):
        assert row[7] == p["schedule"]
        assert row[8] == (str(p["pipeline_limit"] or p["pipeline"]) if p["schedule"] == "myelin" else "-")
    assert {p["pipeline_limit"] for p in plans if p["schedule"] == "myelin"} == {0, 3}
    assert all(p["pipeline_limit"] == 0 for p in plans if p["schedule"] != "myelin")
