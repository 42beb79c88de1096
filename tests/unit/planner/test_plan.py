"""The planner's search and ranking: feasibility against the device memory, JSON keys, plan files -> config,
clear failures; Myelin's pipeline_limit (V-A, Alg. 2) and ZB-H1 in the search, each scored from the simulator."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxhybrid.core.config.model import PRESETS
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.core.layout import ParallelDims
from jaxhybrid.parallel.pipeline.costs import Costs
from jaxhybrid.parallel.pipeline.schedule import make_schedule
from jaxhybrid.parallel.pipeline.simulate import simulate
from jaxhybrid.planner import makespan as mk
from jaxhybrid.planner import step_model
from jaxhybrid.planner.costs import load_hardware
from jaxhybrid.planner.layouts import layouts, myelin_limits
from jaxhybrid.planner.plan import (
    PLAN_KEYS,
    config_layout,
    load_plan_overrides,
    machine_from_hardware,
    plan_overrides,
    rank_plans,
    score_config,
    write_plan,
)
from jaxhybrid.planner.step_model import Layout, evaluate
from jaxhybrid.runtime.config_load import config_from_dict, load_config


def _machine(hw="h100-node", gpn=8, memory=None):
    h = load_hardware(hw)
    if memory is not None:
        h = {**h, "memory_bytes": memory}
    return machine_from_hardware(h, gpn, "bfloat16", 0.5)


@pytest.mark.parametrize("memory", [80e9, 12e9])
def test_plans_respect_device_memory_and_are_ranked(memory):
    m = _machine(memory=memory)
    plans = rank_plans(PRESETS["gpt2-1.3b"], 8, m, global_batch=32, seq=1024, top=1000)
    assert plans
    assert all(p["memory_per_device_bytes"] <= 0.9 * memory for p in plans)  # the usable share
    times = [p["predicted_step_s"] for p in plans]
    assert times == sorted(times)
    for p in plans:
        assert set(PLAN_KEYS) <= set(p)
        assert p["pipeline"] * p["data"] * p["tensor_col"] * p["tensor_row"] * p["tensor_depth"] == 8
        assert p["microbatch_size"] * p["microbatches"] * p["data"] == 32
        assert sum(p["partition"]) == PRESETS["gpt2-1.3b"].n_layers
    if memory < 20e9:  # 1.3B x 20 bytes = 26 GB: only sharded or offloaded layouts fit
        assert all(p["offload"] or p["pipeline"] * p["tensor_col"] * p["tensor_row"] * p["tensor_depth"] > 1
                   for p in plans)


def test_offload_and_tensor_sharding_lower_memory_and_single_gpu_has_no_comm():
    cfg, m = PRESETS["gpt2-1.3b"], _machine()
    base = Layout(ParallelDims(1, 1, 1, 1, 1), 4, 8, "gpipe", False, False, "none")
    r0 = evaluate(cfg, base, m, 1024)
    assert r0["comm_s"] == 0
    off = evaluate(cfg, Layout(ParallelDims(1, 1, 1, 1, 1), 4, 8, "gpipe", False, True, "none"), m, 1024)
    assert off["memory_per_device_bytes"] < r0["memory_per_device_bytes"]
    tp = evaluate(cfg, Layout(ParallelDims(1, 1, 2, 2, 2), 4, 8, "gpipe", False, False, "none"), m, 1024)
    assert tp["memory_per_device_bytes"] < r0["memory_per_device_bytes"] and tp["comm_s"] > 0
    remat = evaluate(cfg, Layout(ParallelDims(1, 1, 1, 1, 1), 4, 8, "gpipe", False, False, "full"), m, 1024)
    assert remat["memory_per_device_bytes"] < r0["memory_per_device_bytes"]
    assert remat["predicted_step_s"] > r0["predicted_step_s"]  # recomputation costs a forward


def test_step_is_pipeline_plus_data_allreduce_plus_offload_streaming():
    """The step's three phases are reported and add up (Myelin V-B streams 12 bytes per fp32 parameter
    in and out over the host link; serial with the all-reduce, as the runtime is under global-norm
    clipping). Offload time grows with the largest stage's share, so tensor sharding divides it."""
    cfg, m = PRESETS["gpt2-1.3b"], _machine()
    on = evaluate(cfg, Layout(ParallelDims(2, 2, 1, 1, 1), 4, 8, "1f1b", False, True, "none"), m, 1024)
    off = evaluate(cfg, Layout(ParallelDims(2, 2, 1, 1, 1), 4, 8, "1f1b", False, False, "none"), m, 1024)
    assert off["offload_s"] == 0 and on["offload_s"] > 0 and on["data_allreduce_s"] > 0
    for r in (on, off):
        assert r["predicted_step_s"] == pytest.approx(r["pipeline_s"] + r["data_allreduce_s"] + r["offload_s"])
    assert on["predicted_step_s"] - off["predicted_step_s"] == pytest.approx(on["offload_s"])
    tp = evaluate(cfg, Layout(ParallelDims(2, 2, 2, 1, 1), 4, 8, "1f1b", False, True, "none"), m, 1024)
    assert tp["offload_s"] < on["offload_s"]


def test_memory_follows_the_attention_kernel_and_remat_dots_trades_it_for_time():
    """The stage's activations (planner.memory.block_residual_bytes): on hardware with cuDNN flash
    attention a 16-bit block keeps no [H, T, T] probabilities (model.attention xla, float32 or a file
    without flash_attention keep them); remat dots keeps neither and recomputes the attention core."""
    cfg, flash, plain = PRESETS["gpt2-1.3b"], _machine(), _machine("frontier", 8)
    lay = {r: Layout(ParallelDims(1, 8, 1, 1, 1), 8, 4, "1f1b", False, False, r) for r in ("none", "dots")}
    ev = {(r, name): evaluate(c, lay[r], mach, 1024) for r in lay for name, c, mach in (
        ("flash", cfg, flash), ("plain", cfg, plain), ("xla", dataclasses.replace(cfg, attention="xla"), flash))}
    probs = 24 * 8 * cfg.n_heads * 1024 * 1024 * 4  # float32, per block, 24 blocks
    mem = {k: v["memory_per_device_bytes"] for k, v in ev.items()}
    assert mem["none", "plain"] == mem["none", "xla"] > mem["none", "flash"] > mem["dots", "flash"]
    assert mem["none", "plain"] - mem["dots", "plain"] == pytest.approx(probs)
    assert mem["dots", "plain"] == mem["dots", "flash"]
    assert ev["dots", "flash"]["predicted_step_s"] > ev["none", "flash"]["predicted_step_s"]
    wide = dataclasses.replace(cfg, n_heads=8)  # head_dim 256: cuDNN's rule (attention.cudnn_unmet) says no
    assert [evaluate(wide, lay["none"], m, 1024)["memory_per_device_bytes"] for m in (flash, plain)] == \
        [mem["none", "plain"] - probs / 2] * 2
    with pytest.raises(ValueError, match="flash_attention='yes' must be true or false"):
        machine_from_hardware({**load_hardware("h100-node"), "flash_attention": "yes"}, 8, "bfloat16", 0.5)


def test_single_stage_layouts_hold_one_microbatch_as_gradient_accumulation_does():
    """One stage runs its microbatches as gradient accumulation (jaxhybrid.runtime.engines.base.accumulated_step), so its
    activations do not grow with their number, and the planner labels it so."""
    cfg, m = PRESETS["gpt2-1.3b"], _machine()
    mem = [evaluate(cfg, Layout(ParallelDims(1, 2, 2, 2, 2), 8, k, "gpipe", False, False, "none"), m, 1024)
           ["memory_per_device_bytes"] for k in (1, 8, 32)]
    assert mem[0] == mem[1] == mem[2]
    piped = [evaluate(cfg, Layout(ParallelDims(2, 1, 1, 1, 1), 8, k, "gpipe", False, False, "none"), m, 1024)
             ["memory_per_device_bytes"] for k in (2, 8)]
    assert piped[1] > piped[0]  # a real GPipe stashes every microbatch
    plans = rank_plans(cfg, 8, m, 64, 1024, top=10_000, tensor=False)
    assert {p["schedule"] for p in plans if p["pipeline"] == 1} == {"1f1b"}


def test_model_that_cannot_fit_says_which_constraint_and_what_would():
    with pytest.raises(ValueError, match=r"does not fit on 2 GPUs.*needs .* GB per device; \d+ GPUs would fit"):
        rank_plans(PRESETS["myelin-100b"], 2, _machine("summit", 6), global_batch=64, seq=512)


def test_plan_file_round_trips_into_a_valid_config(tmp_path):
    plans = rank_plans(PRESETS["gpt2-small"], 8, _machine(), global_batch=16, seq=1024, top=10_000)
    for p in plans:  # every ranked layout is one the config validation accepts (hybrid ones included)
        config_from_dict({"model": "gpt2-small", "data": {"seq_len": 1024}, **plan_overrides(p, 16)})
    assert any(p["pipeline"] > 1 and p["tensor_col"] * p["tensor_row"] * p["tensor_depth"] > 1 for p in plans)
    piped = next(p for p in plans if p["pipeline"] > 1)
    path = tmp_path / "plan.json"
    write_plan(path, piped, {"model": "gpt2-small", "gpus": 8, "global_batch": 16, "seq_len": 1024,
                             "dtype": "bfloat16"})
    over = load_plan_overrides(path)
    cfg = config_from_dict({"model": "gpt2-small", **over})
    assert cfg.data.seq_len == 1024  # the length the plan was modelled at (the config's default is 128)
    assert cfg.parallel.pipeline == piped["pipeline"] and cfg.pipeline.schedule == piped["schedule"]
    assert cfg.microbatch_size == piped["microbatch_size"] and cfg.optim.offload == piped["offload"]
    assert list(cfg.parallel.partition) == piped["partition"]
    assert cfg.precision.compute_dtype == "bfloat16"  # the dtype the plan was modelled with
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=r"bad\.json has no 'config' with parallel/pipeline/optim overrides"):
        load_plan_overrides(tmp_path / "bad.json")


@pytest.mark.parametrize("model,gpus,batch,seq", [("gpt2-1.3b", 8, 8, 1024), ("gpt-tiny", 16, 4, 128)])
def test_every_ranked_plan_is_one_the_trainer_runs(model, gpus, batch, seq):
    """The ranking kept layouts whose mesh the trainer refuses (tensor.sharding.check_layout, which the config
    validation applies), and ranked them first: col 2 over GPT-2's 50257-token vocabulary for gpt2-1.3b on 8
    GPUs at global batch 8, depth 2 over a microbatch of one sequence for gpt-tiny on 16 GPUs at batch 4."""
    plans = rank_plans(PRESETS[model], gpus, _machine(), global_batch=batch, seq=seq, top=10_000)
    assert any(p["tensor_col"] * p["tensor_row"] * p["tensor_depth"] > 1 for p in plans)
    for p in plans:
        config_from_dict({"model": model, "data": {"seq_len": seq}, **plan_overrides(p, batch)})


def test_plan_cli_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "jaxhybrid", "plan", "--model", "gpt2-small", "--gpus", "4",
                          "--gpus-per-node", "4", "--hardware", "perlmutter", "--top", "3", "--global-batch", "8",
                          "--json", "--out", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)["plans"]
    assert 1 <= len(plans) <= 3 and set(PLAN_KEYS) <= set(plans[0])
    assert json.loads((tmp_path / "p.json").read_text())["plan"]["predicted_step_s"] == plans[0]["predicted_step_s"]
    bad = subprocess.run([sys.executable, "-m", "jaxhybrid", "plan", "--model", "gpt2-small", "--gpus", "4",
                          "--gpus-per-node", "4", "--hardware", "cpu"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "bandwidth" in bad.stderr


def test_the_slowest_stage_counts_the_head():
    """GPT-2 small's head is 4.5 blocks of work: with 8 stages of [2,2,2,2,1,1,1,1] blocks the last one
    (1 block + head) sets the pace, not a 2-block stage; the step cannot beat M x its F + BI + BW."""
    from jaxhybrid.model.flops import forward_flops

    cfg, m = PRESETS["gpt2-small"], _machine()
    ev = evaluate(cfg, Layout(ParallelDims(8, 1, 1, 1, 1), 8, 8, "1f1b", False, False, "none"), m, 1024)
    assert ev["partition"] == [2, 2, 2, 2, 1, 1, 1, 1]
    last = (forward_flops(cfg, 8, 1024, 1, head=True)) / m.flops_per_s
    assert ev["compute_s"] >= 8 * 3 * last * 0.99
    dp = evaluate(cfg, Layout(ParallelDims(1, 8, 1, 1, 1), 8, 1, "1f1b", False, False, "none"), m, 1024)
    assert ev["predicted_step_s"] > 2 * dp["predicted_step_s"]  # a 5.5 : 2 imbalance no bubble-free DP has


def test_2bp_memory_peaks_where_activations_and_residuals_coexist():
    """GPipe + 2BP frees a microbatch's activations at its BI, keeping its weight residuals: the two peaks
    never meet, so the planner takes the largest a A + r R over the states a rank passes through, not
    the sum of the two peaks (1.6x for GPT-2 small, 2 stages, M = 8)."""
    from jaxhybrid.planner.makespan import pipeline_makespan

    _, states = pipeline_makespan("gpipe", 2, 4, True, 1.0, 1.0, 0.0)
    assert states[0] == ((0, 4), (1, 3), (2, 2), (3, 1), (4, 0))
    cfg, m = PRESETS["gpt2-small"], _machine()
    mem = {split: evaluate(cfg, Layout(ParallelDims(2, 1, 1, 1, 1), 8, 8, "gpipe", split, False, "none"), m, 1024)
           ["memory_per_device_bytes"] for split in (False, True)}
    assert mem[False] <= mem[True] < 1.1 * mem[False]  # activations (214.5 MB a block) >= residuals (201.5)


def test_long_schedules_extrapolate_the_simulated_makespan():
    """Beyond MAX_SIMULATED tasks the makespan is extrapolated linearly from two simulated ones: it equals
    the simulation (1F1B + 2BP adds 3 per microbatch at unit costs, not GPipe-2BP's closed form). Myelin
    is periodic in M with period p (a round of pipeline_limit = p injections), so its points are
    congruent to M modulo p: 2p and 3p gave 486.4 against 459 fused at unit costs."""
    from jaxhybrid.planner import makespan as mk

    for sched in ("1f1b", "gpipe", "myelin"):
        for split in (True, False):
            got = mk.pipeline_makespan(sched, 16, 129, split, 1.0, 1.0, 0.0)[0]
            assert got == pytest.approx(mk._simulate(sched, 16, 129, split, 1.0, 1.0, 0.0)[0], rel=1e-9), sched
    for costs in ((1.5, 1.0, 0.2), (1.0, 0.5, 1.3), (0.8, 0.6, 0.4)):  # uneven costs, messages
        for split, rel in ((False, 1e-9), (True, 0.01)):  # 2BP's weight passes settle more slowly
            got = mk.pipeline_makespan("myelin", 16, 129, split, *costs)[0]
            assert got == pytest.approx(mk._simulate("myelin", 16, 129, split, *costs)[0], rel=rel), (split, costs)


def test_myelin_2bp_memory_is_what_the_engine_holds():
    """Myelin + 2BP: the engine pays a weight pass once ``weight_budget`` (= stages) are pending
    (pipeline/message_driven.py), so the planner's states peak at 7, 6, 5, 4 microbatches at 4 stages and
    M = 16 (the simulator without the budget: 16, 15, 15, 16). Past MAX_SIMULATED the closed form bounds
    every simulated state: p in flight on any stage (Alg. 2's limit, not 1F1B's p - rank), p residuals."""
    from jaxhybrid.planner import makespan as mk

    _, states = mk.pipeline_makespan("myelin", 4, 16, True, 1.0, 1.0, 0.0)
    assert [max(a + r for a, r in st) for st in states] == [7, 6, 5, 4]
    for split in (True, False):
        _, bound = mk.pipeline_makespan("myelin", 16, 129, split, 1.0, 1.0, 0.0)
        assert bound[0] == ((16, 16 if split else 0),)
        for rank, (full, (top,)) in enumerate(zip(mk._simulate("myelin", 16, 129, split, 1.0, 1.0, 0.0)[1], bound)):
            assert all(a <= top[0] and r <= top[1] for a, r in full), (split, rank, full, top)


def test_full_recompute_repeats_the_forward_collectives():
    """remat full runs each forward's tensor collectives again in the backward: comm_s counts them."""
    cfg, m = PRESETS["gpt2-1.3b"], _machine()
    ev = {r: evaluate(cfg, Layout(ParallelDims(2, 1, 2, 2, 1), 4, 8, "1f1b", False, False, r), m, 1024)
          for r in ("none", "full")}
    assert ev["full"]["comm_s"] > ev["none"]["comm_s"]
    assert ev["full"]["compute_s"] + ev["full"]["comm_s"] <= ev["full"]["predicted_step_s"] * 1.001


def test_planner_makespan_is_the_simulate_commands():
    """The planner builds a 2BP schedule with the layout's cost ratios, as `jaxhybrid simulate --costs`
    does (unit costs placed the weight passes elsewhere: 35.5 against 34)."""
    from jaxhybrid.parallel.pipeline.costs import parse_costs
    from jaxhybrid.parallel.pipeline.schedule import make_schedule
    from jaxhybrid.parallel.pipeline.simulate import simulate
    from jaxhybrid.planner.makespan import pipeline_makespan

    for sched, split in (("1f1b", True), ("gpipe", True), ("1f1b", False)):
        costs = parse_costs("1,2,0.5", 4)
        want = simulate(make_schedule(sched, 4, 8, split, costs=costs), costs).makespan
        assert pipeline_makespan(sched, 4, 8, split, 2.0, 0.5, 0.0)[0] == pytest.approx(want), sched


def test_plans_fill_the_usable_share_of_memory_that_train_preallocates():
    """A plan fills at most 90% of a device (the hardware file or --memory-fraction may say otherwise), the
    share `jaxhybrid train` lets XLA preallocate unless the environment chooses (JAX's own default, 75%,
    would leave a plan at 79 of 80 GB short)."""
    from jaxhybrid.core.launch_env import MEM_FRACTION_ENV, reserve_device_memory

    h = load_hardware("h100-node")
    assert machine_from_hardware(h, 8, "bfloat16", 0.5).memory_bytes == pytest.approx(72e9)
    assert machine_from_hardware({**h, "usable_memory_fraction": 0.8}, 8, "bfloat16", 0.5).memory_bytes == \
        pytest.approx(64e9)
    assert machine_from_hardware(h, 8, "bfloat16", 0.5, memory_fraction=1.0).memory_bytes == pytest.approx(80e9)
    with pytest.raises(ValueError, match=r"memory fraction 1.5 \(plan --memory-fraction, or hardware h100-node's "
                                         r"usable_memory_fraction\) must be in \(0, 1\]"):
        machine_from_hardware(h, 8, "bfloat16", 0.5, memory_fraction=1.5)
    tight = rank_plans(PRESETS["gpt2-1.3b"], 8, _machine(memory=12e9), global_batch=32, seq=1024, top=1 << 30)
    whole = rank_plans(PRESETS["gpt2-1.3b"], 8, machine_from_hardware(
        {**h, "memory_bytes": 12e9}, 8, "bfloat16", 0.5, memory_fraction=1.0), global_batch=32, seq=1024, top=1 << 30)
    assert len(tight) < len(whole) and max(p["memory_per_device_bytes"] for p in whole) > 10.8e9
    env = {}
    assert reserve_device_memory(env) == "0.9" and env == {MEM_FRACTION_ENV: "0.9"}
    assert reserve_device_memory({MEM_FRACTION_ENV: ".5"}) == ".5"  # the user's choice stands
    assert reserve_device_memory({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}) == ""


def test_data_allreduce_moves_float32_over_mpi_and_the_compute_dtype_on_a_mesh():
    """MPI reduces no half floats (optim/allreduce.py upcasts them), so data replicas that are MPI ranks move
    4 bytes per gradient in any dtype. A tensor mesh reduces each layer in the compute dtype (AxoNN eq. 8)
    in every microbatch, unless M x dtype bytes > 4, where it reduces float32 once after its scan."""
    h = load_hardware("h100-node")
    bf16, fp32 = (machine_from_hardware(h, 8, dt, 0.5) for dt in ("bfloat16", "float32"))
    cfg = PRESETS["gpt2-1.3b"]
    pipe = Layout(ParallelDims(2, 4, 1, 1, 1), 1, 8, "1f1b", False, False, "none")
    ar = lambda lay, m: evaluate(cfg, lay, m, 1024)["data_allreduce_s"]  # noqa: E731
    mesh = lambda mbs: Layout(ParallelDims(1, 2, 2, 2, 1), 16 // mbs, mbs, "1f1b", False, False, "none")  # noqa: E731
    assert ar(pipe, bf16) == pytest.approx(ar(pipe, fp32)) and ar(pipe, bf16) > 0
    once = ar(mesh(1), fp32)
    assert ar(mesh(1), bf16) == pytest.approx(once / 2)  # one microbatch: per layer, bf16
    assert ar(mesh(2), bf16) == pytest.approx(once)  # 2 x bf16 per layer = float32 once: per layer
    assert ar(mesh(2), fp32) == ar(mesh(8), fp32) == ar(mesh(8), bf16) == pytest.approx(once)  # once, float32


def test_the_search_ranks_myelin_with_and_without_2bp_and_its_plan_file_loads(tmp_path):
    """Myelin's message-driven schedule (Alg. 2), fused and with 2BP, is searched like GPipe and 1F1B: the
    engine runs it for any pipeline and microbatch count. Its plan file resets pipeline.pipeline_limit to
    the default (stages) it was modelled with, whatever the run's YAML set."""
    from jaxhybrid.planner.layouts import layouts
    from jaxhybrid.runtime.config_load import load_config

    cfg = PRESETS["gpt2-small"]
    searched = {(lay.schedule, lay.split_backward) for lay in layouts(cfg, 8, 16) if lay.dims.pipeline > 1}
    assert {("myelin", False), ("myelin", True)} <= searched
    plans = rank_plans(cfg, 8, _machine(), global_batch=16, seq=1024, top=10_000)
    myelin = [p for p in plans if p["schedule"] == "myelin"]
    assert {p["split_backward"] for p in myelin} == {False, True}
    yaml_path, plan_path = tmp_path / "run.yaml", tmp_path / "plan.json"
    yaml_path.write_text("model: {name: gpt2-small}\ndata: {seq_len: 1024}\npipeline: {pipeline_limit: 1}\n")
    for p in (next(p for p in myelin if p["split_backward"]), next(p for p in myelin if not p["split_backward"])):
        write_plan(plan_path, p, {"model": "gpt2-small", "global_batch": 16, "dtype": "bfloat16"})
        run = load_config(yaml_path, [f"plan.file={plan_path}"])
        assert (run.pipeline.schedule, run.pipeline.split_backward) == ("myelin", p["split_backward"])
        assert run.pipeline.pipeline_limit == 0 and run.parallel.pipeline == p["pipeline"]
    # A plan of a static schedule sets the limit to 0 too: the YAML's Myelin limit would be refused with it
    # (only the message-driven schedule reads one), and so does a plan file written before it said so.
    static = next(p for p in plans if p["schedule"] != "myelin" and p["pipeline"] > 1)
    write_plan(plan_path, static, {"model": "gpt2-small", "global_batch": 16, "dtype": "bfloat16"})
    run = load_config(yaml_path, [f"plan.file={plan_path}"])
    assert (run.pipeline.schedule, run.pipeline.pipeline_limit) == (static["schedule"], 0)
    old = json.loads(plan_path.read_text())
    del old["config"]["pipeline"]["pipeline_limit"]
    plan_path.write_text(json.dumps(old))
    assert load_config(yaml_path, [f"plan.file={plan_path}"]).pipeline.pipeline_limit == 0


def test_a_config_is_scored_with_its_own_offload_bucket_size():
    """`plan --model CONFIG` scores the config's layout, and ranks plans, with its optim.bucket_size: each
    offloaded device holds 28 bytes per bucket element (memory_report), so the 16M-element buckets of
    myelin-50b-offload.yaml hold 28 x 15M bytes more than the default 1M-element ones."""
    from pathlib import Path

    from jaxhybrid.planner.plan import score_config
    from jaxhybrid.runtime.config_load import load_config

    path = Path(__file__).resolve().parents[3] / "configs" / "runs" / "myelin-50b-offload.yaml"
    cfg, small = load_config(path), load_config(path, ["optim.bucket_size=1048576"])
    assert cfg.optim.offload and cfg.optim.bucket_size == 1 << 24
    m, seq = _machine(), cfg.data.seq_len
    got = score_config(cfg, m, seq)["memory_per_device_bytes"] - score_config(small, m, seq)["memory_per_device_bytes"]
    assert got == pytest.approx(28 * ((1 << 24) - (1 << 20)))
    ranked = {b: rank_plans(cfg.model, 16, m, 512, seq, top=1, tensor=False, offload=True, bucket_size=b)[0]
              for b in (1 << 20, 1 << 24)}
    assert ranked[1 << 24]["memory_per_device_bytes"] > ranked[1 << 20]["memory_per_device_bytes"]


def test_half_precision_allreduce_halves_the_modelled_data_allreduce():
    """myelin-50b-offload.yaml all-reduces its bf16 gradients as bf16 (``optim.allreduce_dtype: compute``,
    Myelin IV-B): the step model charges its MPI replicas half the float32 wire's all-reduce time, and the
    step that much less; nothing else changes."""
    from pathlib import Path

    from jaxhybrid.planner.plan import score_config
    from jaxhybrid.runtime.config_load import load_config

    path = Path(__file__).resolve().parents[3] / "configs" / "runs" / "myelin-50b-offload.yaml"
    half, f32 = load_config(path), load_config(path, ["optim.allreduce_dtype=float32"])
    assert half.optim.allreduce_dtype == "compute" and half.precision.compute_dtype == "bfloat16"
    m, seq = _machine(), half.data.seq_len
    a, b = score_config(half, m, seq), score_config(f32, m, seq)
    assert b["data_allreduce_s"] > 0 and a["data_allreduce_s"] == pytest.approx(b["data_allreduce_s"] / 2)
    assert a["predicted_step_s"] == pytest.approx(b["predicted_step_s"] - b["data_allreduce_s"] / 2)
    assert a["memory_per_device_bytes"] == b["memory_per_device_bytes"]


def test_plan_ranks_a_config_with_its_own_allreduce_dtype(tmp_path, capsys):
    """`plan --model CONFIG` scored the config's own layout with its optim.allreduce_dtype (Myelin IV-B's
    half-precision all-reduce: half the float32 wire's bytes) but ranked every plan with float32, so the
    same layout listed as a plan was predicted slower than "the config's own layout" and its rank compared
    two wires. Both now use the config's setting: the identical plan has the identical prediction."""
    from jaxhybrid.cli.main import main

    path = tmp_path / "half.yaml"
    path.write_text("model: {name: gpt2-small}\ndata: {seq_len: 1024}\ntrain: {global_batch: 16}\n"
                    "optim: {offload: true, bucket_size: 1048576, allreduce_dtype: compute}\n"
                    "precision: {compute_dtype: bfloat16}\nparallel: {pipeline: 2, data: 2}\n"
                    "pipeline: {schedule: myelin, microbatches: 4}\n")
    assert main(["plan", "--model", str(path), "--gpus", "4", "--gpus-per-node", "4", "--hardware", "h100-node",
                 "--no-tensor", "--offload", "--top", "100000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    own = out["config_layout"]
    keys = ("pipeline", "data", "microbatch_size", "schedule", "pipeline_limit", "split_backward", "remat", "offload")
    same = [p for p in out["plans"] if all(p[k] == own[k] for k in keys)]
    assert len(same) == 1 and own["data_allreduce_s"] > 0
    assert same[0]["predicted_step_s"] == own["predicted_step_s"]
    assert own["rank"] == sum(p["predicted_step_s"] < own["predicted_step_s"] for p in out["plans"])


@pytest.mark.parametrize("name,gpus,grid", [("myelin-12b", 48, (6, 8)), ("myelin-24b", 96, (12, 8))])
def test_myelin_table_ii_grid_is_the_step_models_fastest(name, gpus, grid):
    """Myelin Table II: tuned on Summit (6 x 16 GB V100 per node, float16, batch 16384 x 512, Sec. VI), Myelin
    runs the 12B model as G_inter x G_data = 6 x 8 and the 24B as 12 x 8. Scored Myelin's way (its
    message-driven schedule, checkpointing at ac (V-A), the bucketed offload with bsize 16M (V-B), no tensor
    parallelism, microbatch 1 to keep the search short), the step model's fastest layout that fits is the
    same grid: the smallest G_inter whose 4 phi / G_inter leaves room, as V-B argues."""
    from jaxhybrid.planner.layouts import layouts

    cfg, m = PRESETS[name], machine_from_hardware(load_hardware("summit"), 6, "float16", 0.5)
    fastest = {}
    for lay in layouts(cfg, gpus, 16384, tensor=False, offload=True, schedules=("myelin",), remats=("full",),
                       max_microbatch=1):
        if lay.split_backward or lay.pipeline_limit:  # Myelin's Alg. 2 as published: no 2BP, limit G_inter
            continue
        r = evaluate(cfg, lay, m, 512, 16_000_000)
        if r["memory_per_device_bytes"] <= m.memory_bytes:
            fastest[lay.dims.pipeline, lay.dims.data] = r["predicted_step_s"]
    assert min(fastest, key=fastest.get) == grid
    assert (grid[0] // 2, grid[1] * 2) not in fastest  # half the stages do not fit 16 GB


def test_a_plan_applies_to_the_config_it_was_made_for(tmp_path):
    """A config with Myelin V-C's coarsening and IV-B's half-precision all-reduce (as myelin-50b-offload.yaml)
    ranks plans without offload or on a tensor mesh too, where neither exists: their plan files reset both
    (else `--set plan.file` was a ConfigError on the config the plan was made for); a plan with offload on
    MPI replicas keeps the run's own."""
    from jaxhybrid.runtime.config_load import load_config

    path = tmp_path / "half.yaml"
    path.write_text("model: {name: gpt2-small}\ndata: {seq_len: 1024}\ntrain: {global_batch: 16}\n"
                    "optim: {offload: true, bucket_size: 1048576, allreduce_coarsening: 4, allreduce_dtype: compute}\n"
                    "precision: {compute_dtype: bfloat16}\nparallel: {pipeline: 2, data: 2}\n"
                    "pipeline: {schedule: myelin, microbatches: 4}\n")
    cfg = load_config(path)
    plans = rank_plans(cfg.model, 4, _machine("h100-node", 4), 16, 1024, top=100000,
                       allreduce_dtype=cfg.optim.allreduce_dtype)
    def mesh(p):
        return p["pipeline"] == 1 and p["tensor_col"] * p["tensor_row"] * p["tensor_depth"] > 1

    # (which plan, the run's (allreduce_dtype, allreduce_coarsening) from its plan file)
    cases = {"no offload": (lambda p: not p["offload"], ("float32", 1)),
             "mesh": (lambda p: p["offload"] and mesh(p), ("float32", 4)),
             "offload on MPI": (lambda p: p["offload"] and p["pipeline"] > 1 and p["data"] > 1, ("compute", 4))}
    for what, (pick, want) in cases.items():
        plan = next(p for p in plans if pick(p))
        write_plan(tmp_path / "p.json", plan, {"model": "gpt2-small", "global_batch": 16, "dtype": "bfloat16"})
        run = load_config(path, [f"plan.file={tmp_path / 'p.json'}"])
        assert (run.optim.allreduce_dtype, run.optim.allreduce_coarsening) == want, what


# A run's pipeline.pipeline_limit (Myelin V-A, Alg. 2's microbatches in flight) reaches the step model:
# its makespan is the simulator's for that limit. The planner searches a few limits for Myelin layouts and
# ranks a larger one where it is faster and fits.

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


def _machine_usable(usable=None):
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
    cfg, ample = PRESETS["gpt-small-cpu"], _machine_usable()
    best = _best_myelin(rank_plans(cfg, 8, ample, 64, 256, 1 << 30, tensor=False))
    lay = Layout.from_dict(best)
    assert lay.pipeline_limit == 3 * lay.dims.pipeline // 2
    default = step_model.evaluate(cfg, dataclasses.replace(lay, pipeline_limit=0), ample, 256)
    assert best["pipeline_s"] < default["pipeline_s"]
    assert best["memory_per_device_bytes"] > default["memory_per_device_bytes"]
    tight = _machine_usable((best["memory_per_device_bytes"] + default["memory_per_device_bytes"]) / 2)
    plans = rank_plans(cfg, 8, tight, 64, 256, 1 << 30, tensor=False)
    assert all(p["memory_per_device_bytes"] <= tight.memory_bytes for p in plans)
    same = [p for p in plans if Layout.from_dict(p) in
            {dataclasses.replace(lay, pipeline_limit=k)
             for k in myelin_limits(lay.dims.pipeline, lay.microbatches, True)}]
    assert [p["pipeline_limit"] for p in same] == [0]


def test_the_plan_table_and_json_show_myelin_limits(capsys):
    """The table's lim column: Myelin's limit in flight (the default as the stage count), '-' for the other
    schedules; its v column the stages per rank (with l or v for the placement); the JSON carries
    pipeline_limit (0: the default) and virtual_stages."""
    from jaxhybrid.cli.main import build_parser

    argv = ["plan", "--model", "gpt-tiny", "--gpus", "2", "--gpus-per-node", "2", "--hardware", "h100-node",
            "--global-batch", "16", "--top", "12"]
    for extra in ([], ["--json"]):
        _, args = build_parser(argv + extra)
        assert args._run(args) == 0
    table, js = capsys.readouterr().out.split("\n{", 1)
    plans = json.loads("{" + js)["plans"]
    rows = [line.split() for line in table.splitlines() if line[:2].strip().isdigit()]
    assert table.splitlines()[1].split()[7:11] == ["schedule", "lim", "v", "2BP"] and len(rows) == len(plans) == 12
    for row, p in zip(rows, plans):
        assert row[7] == p["schedule"]
        assert row[8] == (str(p["pipeline_limit"] or p["pipeline"]) if p["schedule"] == "myelin" else "-")
        assert row[9] == (f"{p['virtual_stages']}{p['placement'][0]}" if p["virtual_stages"] > 1 else "1")
    assert {p["pipeline_limit"] for p in plans if p["schedule"] == "myelin"} == {0, 3}
    assert all(p["pipeline_limit"] == 0 for p in plans if p["schedule"] != "myelin")


# ZB-H1 (zero bubble, always split backward) in the planner's search: scored from the simulator as the
# other schedules are, long schedules with its own memory closed form, and its plan file loads.

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


def test_a_sharded_optimizer_divides_the_optimizer_state_of_pipeline_replicas():
    """rank_plans(shard_optimizer=True) marks the layouts whose data replicas are MPI ranks of one
    device (the config's rule) and charges them 8 phi / G_data bytes of Adam state instead of 8 phi; other
    layouts are scored as before, and a plan's overrides carry the setting into a valid config."""
    kw = dict(global_batch=16, seq=128, top=10_000, tensor=False, offload=False)
    plain, zero = (rank_plans(PRESETS["gpt2-small"], 8, _machine(), shard_optimizer=z, **kw) for z in (False, True))
    key = lambda p: tuple(p[k] for k in ("pipeline", "data", "microbatch_size", "schedule", "virtual_stages",
                                         "split_backward", "remat", "pipeline_limit"))
    before = {key(p): p for p in plain}
    sharded = [p for p in zero if p["shard_optimizer"]]
    assert sharded and all(p["shard_optimizer"] == (p["data"] > 1) for p in zero)  # tensor=False: no mesh
    compared = [(before[key(p)], p) for p in sharded if key(p) in before]
    assert compared
    for b, p in compared:  # without offload a parameter holds 20 bytes in bf16 (16 in fp32), 8 of them Adam's
        saved = b["memory_per_device_bytes"] - p["memory_per_device_bytes"]
        assert saved == pytest.approx(b["param_state_bytes"] - p["param_state_bytes"])
        share = saved / b["param_state_bytes"]
        assert any(share == pytest.approx(8 / per * (1 - 1 / p["data"]), rel=1e-3) for per in (20, 16)), (share, p)
    p = sharded[0]
    cfg = config_from_dict({"model": "gpt2-small", "data": {"seq_len": 128}, **plan_overrides(p, 16)})
    assert cfg.optim.shard_optimizer
