"""Several stages per pipeline rank in the planner: interleaved 1F1B (Narayanan et al., SC'21) and ZB-V (Qi et
al., ICLR'24) in the search, their bubble and the activations their schedules stash, plan files that train
with them, and the note that says why the best plan needs them."""
from __future__ import annotations

import pytest

from jaxhybrid.core.config.model import PRESETS
from jaxhybrid.core.layout import ParallelDims
from jaxhybrid.planner import makespan as mk
from jaxhybrid.planner.costs import load_hardware
from jaxhybrid.planner.layouts import layouts
from jaxhybrid.planner.plan import (
    config_layout,
    machine_from_hardware,
    plan_overrides,
    rank_plans,
    virtual_stage_notes,
    write_plan,
)
from jaxhybrid.planner.step_model import Layout, evaluate
from jaxhybrid.runtime.config_load import config_from_dict, load_config


def _machine(memory=80e9):
    return machine_from_hardware({**load_hardware("h100-node"), "memory_bytes": memory}, 8, "bfloat16", 0.5)


def _lay(p, m, sched, split, v=1, placement="loop", b=1):
    return Layout(ParallelDims(p, 1, 1, 1, 1), b, m, sched, split, False, "none", 0, v, placement)


@pytest.fixture(scope="module")
def tight_plans():
    """gpt2-1.3b on 8 GPUs without tensor sharding, 16 GB per device (14.4 usable): interleaving ranks first."""
    return rank_plans(PRESETS["gpt2-1.3b"], 8, _machine(16e9), 16, 1024, 1 << 30, tensor=False)


def test_the_search_tries_interleaving_and_zb_v_where_the_config_accepts_them():
    lays = list(layouts(PRESETS["gpt2-small"], 8, 16, tensor=False))
    chunked = [lay for lay in lays if lay.virtual_stages > 1]
    assert {(lay.schedule, lay.virtual_stages, lay.placement) for lay in chunked} == {
        ("interleaved-1f1b", 2, "loop"), ("interleaved-1f1b", 4, "loop"), ("zb-v", 2, "v")}
    for lay in chunked:
        p = lay.dims.pipeline
        assert p > 1 and p * lay.virtual_stages <= 12
        assert lay.split_backward if lay.schedule == "zb-v" else lay.microbatches % p == 0
    assert all(lay.virtual_stages == 1 and lay.placement == "loop" for lay in lays if lay.schedule not in
               ("interleaved-1f1b", "zb-v"))


def test_interleaving_shrinks_the_bubble(tight_plans):
    """The same ranks, microbatches and blocks per rank: interleaving's pipeline time is shorter than 1F1B's,
    its bubble (the pipeline time beyond the bottleneck rank's work) smaller; the search ranks it first."""
    cfg, m = PRESETS["gpt2-1.3b"], _machine()
    one = evaluate(cfg, _lay(4, 4, "1f1b", False), m, 1024)
    two = evaluate(cfg, _lay(4, 4, "interleaved-1f1b", False, 2), m, 1024)
    assert two["pipeline_s"] < 0.9 * one["pipeline_s"]
    best = tight_plans[0]
    assert best["virtual_stages"] > 1 and best["schedule"] == "interleaved-1f1b"
    assert len(best["partition"]) == best["pipeline"] * best["virtual_stages"]


def _activation_peaks(sched, p, m, split, v=1, placement="loop"):
    """Per rank, the most microbatches' activations it stashes, in whole stages (a chunk is 1/v of one)."""
    _, states = mk.pipeline_makespan(sched, p, m, split, 1.0, 1.0, 0.0, 0, v, placement)
    return [max((sum(a) if v > 1 else a) for a, _ in st) / v for st in states]


@pytest.mark.parametrize("p,m", [(4, 8), (4, 16), (8, 16)])
def test_interleaving_stashes_more_and_zb_v_no_more_than_1f1b(p, m):
    """Derived from the simulated schedules: Megatron's warm-up runs (v - 1) p more chunk forwards than 1F1B's,
    so rank 0 holds more than 1F1B's p stages' activations; ZB-V caps a rank at 1F1B's peak (2p chunks)."""
    ref = max(_activation_peaks("1f1b", p, m, False))
    for split in (False, True):
        for v in (2, 4):
            assert max(_activation_peaks("interleaved-1f1b", p, m, split, v)) > ref, (split, v)
    assert max(_activation_peaks("zb-v", p, m, True, 2, "v")) <= ref


def test_the_step_model_counts_interleavings_extra_memory():
    """The same model on the same ranks: interleaved 1F1B needs more memory per device than 1F1B, with or
    without 2BP; ZB-V no more activations than 1F1B + 2BP (and fewer weight residuals)."""
    cfg, m = PRESETS["gpt2-1.3b"], _machine()
    for split in (False, True):
        one = evaluate(cfg, _lay(4, 8, "1f1b", split), m, 1024)["memory_per_device_bytes"]
        two = evaluate(cfg, _lay(4, 8, "interleaved-1f1b", split, 2), m, 1024)["memory_per_device_bytes"]
        assert two > one, split
    zbv = evaluate(cfg, _lay(4, 8, "zb-v", True, 2, "v"), m, 1024)
    assert zbv["memory_per_device_bytes"] <= evaluate(cfg, _lay(4, 8, "1f1b", True), m, 1024)["memory_per_device_bytes"]


def test_long_chunked_schedules_extrapolate_the_simulated_makespan():
    """Past MAX_SIMULATED tasks (4 ranks x 4 stages x 132 microbatches) the makespan is the simulation's."""
    for split in (False, True):
        got = mk.pipeline_makespan("interleaved-1f1b", 4, 132, split, 1.5, 1.0, 0.2, 0, 4)[0]
        assert got == pytest.approx(mk._simulate("interleaved-1f1b", 4, 132, split, 1.5, 1.0, 0.2, 0, 4)[0], rel=0.01)


def test_a_plan_with_virtual_stages_round_trips_and_trains(tight_plans, tmp_path):
    for sched in ("interleaved-1f1b", "zb-v"):
        plan = next(p for p in tight_plans if p["schedule"] == sched)
        over = plan_overrides(plan, 16, "bfloat16", 1024)
        assert (over["pipeline"]["virtual_stages"], over["pipeline"]["placement"]) == \
            (plan["virtual_stages"], plan["placement"])
        cfg = config_from_dict({"model": "gpt2-1.3b", **over})  # the config checks accept it
        assert list(cfg.parallel.partition) == plan["partition"]
        assert config_layout(cfg) == Layout.from_dict(plan)
        path = tmp_path / f"{sched}.json"
        write_plan(path, plan, {"model": "gpt2-1.3b", "global_batch": 16, "seq_len": 1024, "dtype": "bfloat16"})
        run = load_config(None, ["model.name=gpt2-1.3b", f"plan.file={path}"])
        assert (run.pipeline.schedule, run.pipeline.virtual_stages, run.pipeline.placement) == \
            (sched, plan["virtual_stages"], plan["placement"])
    old = {k: v for k, v in tight_plans[0].items() if k not in ("virtual_stages", "placement")}
    assert Layout.from_dict(old).virtual_stages == 1  # a plan from before virtual stages
    assert plan_overrides(old, 16)["pipeline"]["virtual_stages"] == 1


def _plan(v, step, pipeline=4, data=2, sched=None):
    return {"pipeline": pipeline, "data": data, "tensor_col": 1, "tensor_row": 1, "tensor_depth": 1,
            "virtual_stages": v, "placement": "loop", "schedule": sched or ("interleaved-1f1b" if v > 1 else "1f1b"),
            "predicted_step_s": step}


def test_the_note_says_whether_virtual_stages_fit_or_win(tight_plans):
    wins = virtual_stage_notes([_plan(2, 0.9), _plan(1, 1.0, sched="zb-h1"), _plan(1, 1.1, 8, 1)])
    assert wins == ["the best plan runs 2 stages per pipeline rank (interleaved-1f1b, placement loop): it wins on "
                    "time, 10.0% faster than the best plan of one stage per rank (zb-h1, 1 s against 0.9 s)"]
    fits = virtual_stage_notes([_plan(2, 0.9), _plan(1, 1.2, 8, 1)])
    assert fits == ["the best plan runs 2 stages per pipeline rank (interleaved-1f1b, placement loop): it needs "
                    "them to fit, no plan of one stage per rank with its pipeline x data x tensor sizes (4x2x1x1x1) "
                    "fits in memory; it is 25.0% faster than the best plan of one stage per rank (1f1b, 1.2 s "
                    "against 0.9 s)"]
    assert virtual_stage_notes([_plan(2, 0.9)])[0].endswith("(4x2x1x1x1) fits in memory")
    assert virtual_stage_notes([_plan(1, 1.0), _plan(2, 1.1)]) == []
    assert "it wins on time" in virtual_stage_notes(tight_plans)[0]
