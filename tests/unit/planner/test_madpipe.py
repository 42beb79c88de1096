"""MadPipe (1F1B* groups, PipeDream DP, MadPipe-DP + Algorithm 1, ILP patterns) and profile validation."""
import dataclasses
import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from jaxhybrid.planner.chain import Chain, Stage
from jaxhybrid.planner.costs import LayerCost, Profile, load_profile, profile_from_json, resnet50_chain, save_profile
from jaxhybrid.planner.ilp import load_bound, schedule_allocation, stored_bytes
from jaxhybrid.planner.madpipe import Grid, madpipe, madpipe_dp
from jaxhybrid.planner.pattern import pattern_to_schedule, validate_pattern
from jaxhybrid.planner.pipedream import (
    group_numbers,
    one_f_one_b_star_period,
    pipedream,
    pipedream_dp,
    stage_groups,
    stage_memory,
)

SMALL = Grid(21, 6, 11)


def random_profile(seed, L=10):
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(L):
        f = float(rng.uniform(0.5, 2.0))
        # activations shrink along the chain, like a CNN's
        layers.append(LayerCost(f"l{i}", f, 2 * f, float(rng.uniform(0.05, 0.3)),
                                float(rng.uniform(0.5, 1.5) * (L - i) / L)))
    return Profile(1.0, tuple(layers))


def test_1f1b_star_groups_fill_the_period_from_the_last_stage():
    # 4 stages of load 1, free links, T = 2: groups {s3, s4} and {s1, s2}.
    assert group_numbers([1, 0, 1, 0, 1, 0, 1], 2.0)[::2] == [2, 2, 1, 1]
    # Figure 3's shape: three groups when the loads only pair up partially.
    assert group_numbers([2, 0, 1, 0, 2, 0, 1, 0, 1], 3.0)[::2] == [3, 2, 2, 1, 1]


@pytest.mark.parametrize("P", [2, 3, 5])
def test_1f1b_star_first_stage_stores_2p_minus_1_with_heavy_links(P):
    # Sec. 5: every stage and every link loads exactly T, so each resource is its own group and the
    # first stage keeps 2P - 1 activations (PipeDream assumes P).
    loads = [1.0] * (2 * P - 1)
    assert group_numbers(loads, 1.0)[::2] == list(range(2 * P - 1, 0, -2))


def test_1f1b_star_period_is_the_smallest_that_fits():
    chain = Chain.from_profile(random_profile(1), memory=10.0, bandwidth=4.0)
    stages = [Stage(1, 3, 0), Stage(4, 7, 1), Stage(8, 10, 2)]
    T = one_f_one_b_star_period(chain, stages)
    assert np.isfinite(T)
    assert max(stage_memory(chain, stages, stage_groups(chain, stages, T))) <= chain.memory
    assert T > max(chain.U(s.first, s.last) for s in stages)  # memory, not load, sets this period
    smaller = T * (1 - 1e-6)
    assert max(stage_memory(chain, stages, stage_groups(chain, stages, smaller))) > chain.memory


def test_stored_bytes_replace_the_layer_input_in_the_memory_model():
    """A profile's ``stored_bytes`` (what a layer keeps for its backward) takes the place of MadPipe's
    a_{l-1} in M(k, l, g) and in the ILP's ā_s; without it the chain is MadPipe's."""
    prof = random_profile(3, L=6)
    plain = Chain.from_profile(prof, memory=10.0, bandwidth=2.0)
    np.testing.assert_array_equal(plain.stored[1:], plain.a[:-1])
    inputs = [prof.input_bytes] + [lc.activation_bytes for lc in prof.layers]
    heavy = [dataclasses.replace(lc, stored_bytes=5 * inputs[i]) for i, lc in enumerate(prof.layers)]
    chain = Chain.from_profile(dataclasses.replace(prof, layers=tuple(heavy)), memory=10.0, bandwidth=2.0)
    k, l, g = 2, 5, 3
    weights_and_buffers = plain.mem(k, l, 0)
    assert chain.mem(k, l, 0) == pytest.approx(weights_and_buffers)
    assert chain.mem(k, l, g) - weights_and_buffers == pytest.approx(5 * (plain.mem(k, l, g) - weights_and_buffers))
    assert stored_bytes(chain, Stage(k, l, 0)) == pytest.approx(5 * stored_bytes(plain, Stage(k, l, 0)))
    with pytest.raises(ValueError, match=r"layers\[0\].stored_bytes=-1"):
        layer = {"name": "x", "forward_s": 1, "backward_s": 1, "weight_bytes": 1, "activation_bytes": 1}
        profile_from_json({"input_bytes": 1, "layers": [{**layer, "stored_bytes": -1}]})


def test_pipedream_dp_matches_brute_force():
    chain = Chain.from_profile(random_profile(2, L=8), memory=10.0, bandwidth=3.0)
    P, L = 3, chain.L
    best = np.inf
    for j in range(1, P + 1):
        for cuts in itertools.combinations(range(1, L), j - 1):
            bounds = [0, *cuts, L]
            period = 0.0
            for i in range(j):
                k, l = bounds[i] + 1, bounds[i + 1]
                if chain.mem(k, l, j - i) > chain.memory:
                    period = np.inf
                period = max(period, chain.U(k, l), chain.C(l) if l < L else 0.0)
            best = min(best, period)
    period, stages = pipedream_dp(chain, P)
    assert period == pytest.approx(best)
    assert [s.first for s in stages][0] == 1 and stages[-1].last == L


@pytest.mark.parametrize("seed,P,M", [(3, 3, 8.0), (3, 3, 10.0), (4, 4, 11.0), (5, 3, 9.0), (6, 4, 16.0)])
def test_madpipe_never_worse_than_pipedream_and_ilp_pattern_validates(seed, P, M):
    chain = Chain.from_profile(random_profile(seed), memory=M, bandwidth=2.0)
    pd = pipedream(chain, P)
    mp = madpipe(chain, P, iterations=6, grid=SMALL)
    assert mp.valid_period <= pd.valid_period * (1 + 1e-9)
    assert np.isfinite(mp.valid_period) or not np.isfinite(pd.valid_period)
    if mp.stages:
        assert [s.first for s in mp.stages] == [1] + [s.last + 1 for s in mp.stages[:-1]]
        assert mp.stages[-1].last == chain.L
        assert mp.valid_period >= load_bound(chain, list(mp.stages)) * (1 - 1e-9)


def test_madpipe_dp_allocation_shape_and_ilp_schedule_is_valid():
    chain = Chain.from_profile(random_profile(7, L=12), memory=10.0, bandwidth=2.0)
    T_hat = float(chain.u.sum()) / 2
    period, stages = madpipe_dp(chain, 4, T_hat, SMALL)
    assert np.isfinite(period) and stages
    normal = [s.processor for s in stages if s.processor != 3]
    assert normal == sorted(set(normal))  # each normal processor holds one stage
    assert period >= max(chain.U(s.first, s.last) for s in stages) - 1e-9
    pat = schedule_allocation(chain, stages)
    assert pat is not None
    report = validate_pattern(chain, pat)  # dependencies, one op at a time, memory <= M
    assert max(report["peak_memory"].values()) <= chain.memory
    # The unrolled pattern is also a schedule the pipeline validator and simulator accept.
    from jaxhybrid.parallel.pipeline.simulate import simulate
    from jaxhybrid.parallel.pipeline.validate import validate_schedule
    sched = pattern_to_schedule(pat, microbatches=6)
    validate_schedule(sched)
    assert simulate(sched).makespan > 0


def test_validator_rejects_a_broken_pattern():
    chain = Chain.from_profile(random_profile(8, L=6), memory=100.0, bandwidth=2.0)
    stages = [Stage(1, 3, 0), Stage(4, 6, 1)]
    pat = schedule_allocation(chain, stages)
    broken = type(pat)(pat.period, pat.ops, pat.start, tuple(0 for _ in pat.shift), pat.stages)
    # All shifts 0: the gradient's transfer back (cB0) would start before stage 1's B1 of its batch ends.
    with pytest.raises(ValueError, match=r"^cB0 of batch 0 starts before B1 of batch 0 ends$"):
        validate_pattern(chain, broken)
    tight = Chain.from_profile(random_profile(8, L=6), memory=1.0, bandwidth=2.0)
    with pytest.raises(ValueError, match="memory"):
        validate_pattern(tight, pat)


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["layers"][1].__setitem__("forward_s", -1.0), "layers[1].forward_s"),
    (lambda d: d["layers"][0].pop("weight_bytes"), "weight_bytes"),
    (lambda d: d.pop("input_bytes"), "input_bytes"),
    (lambda d: d["layers"][2].__setitem__("activation_bytes", "big"), "layers[2].activation_bytes"),
    (lambda d: d["layers"][0].__setitem__("backward_input_s", 0.1), "backward_weight_s"),
])
def test_bad_profiles_name_the_field(mutate, field):
    data = random_profile(9, L=4).to_json()
    mutate(data)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        profile_from_json(data)


def test_profile_round_trip_and_partition_cli(tmp_path):
    prof = random_profile(10, L=8)
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert load_profile(path) == prof
    out = subprocess.run([sys.executable, "-m", "jaxhybrid", "partition", "--profile", str(path),
                          "--processors", "3", "--memory", "10", "--bandwidth", "2", "--algorithm", "pipedream",
                          "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert set(res) >= {"algorithm", "period_s", "valid_period_s", "stages"}
    assert res["stages"][0]["layers"][0] == 0 and res["stages"][-1]["layers"][1] == 7
    bad = subprocess.run([sys.executable, "-m", "jaxhybrid", "partition", "--profile", str(path),
                          "--processors", "2", "--memory", "0.5", "--bandwidth", "2", "--algorithm", "pipedream"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "would fit" in bad.stderr
    # MadPipe is not bisected: the hint names PipeDream's threshold as the bound it is.
    bad = subprocess.run([sys.executable, "-m", "jaxhybrid", "partition", "--profile", str(path),
                          "--processors", "2", "--memory", "0.5", "--bandwidth", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "PipeDream + 1F1B* fits from about --memory=" in bad.stderr
    assert "(MadPipe, not bisected, may need less)" in bad.stderr


def test_resnet_chain_is_memory_heavy_at_the_front():
    prof = resnet50_chain()
    acts = [lc.activation_bytes for lc in prof.layers]
    assert len(prof.layers) == 50 and acts[0] > 5 * min(acts[-10:-1])


def test_profiled_costs_from_the_stage_kernels_plan_on_a_laptop(tmp_path):
    """Profile a one-block model on this device (the 2BP stage kernels), save, reload and partition it."""
    import dataclasses

    from jaxhybrid.core.config.model import PRESETS
    from jaxhybrid.planner.profile import profile_model

    cfg = dataclasses.replace(PRESETS["gpt-tiny"], n_layers=1, d_model=32, d_ff=64, max_seq_len=16)
    prof = profile_model(cfg, microbatch=2, seq=16, repeats=1)
    assert len(prof.layers) == 1 and prof.input_bytes == 2 * 16 * 4
    for lc in prof.layers:
        assert lc.forward_s > 0 and lc.backward_s > 0 and lc.weight_bytes > 0
        assert lc.backward_input_s > 0 and lc.backward_weight_s > 0
    assert prof.layers[0].activation_bytes == 0  # the last layer's output is the loss
    save_profile(prof, tmp_path / "p.json")
    chain = Chain.from_profile(load_profile(tmp_path / "p.json"), memory=1e9, bandwidth=1e9)
    assert np.isfinite(pipedream(chain, 1).valid_period)


def test_bench_partition_quick_json(capsys):
    import argparse

    from jaxhybrid.bench import partition as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    assert bench.run(p.parse_args(["--json", "--quick", "--networks", "transformer", "--grid", "21,6,11",
                                   "--iterations", "4"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["cases"]) == 4 and out["madpipe_worse_cases"] == 0
    assert set(out["geomean_by_memory_gb"]["transformer"]) == {"4", "8"}
    for c in out["cases"]:
        assert {"pipedream_valid_period_s", "madpipe_valid_period_s", "madpipe_wall_s"} <= set(c)


def test_madpipe_dp_keeps_v_states_where_only_a_longer_stage_fits():
    """Sec. 4.2.2 minimises over every stage k..l; a state may be dropped only if no k fits. The one-layer
    stage 2..2 pays a 2 a_1 buffer that 1..2 does not, so it alone cannot rule out layer 2's states."""
    three = Profile(0.01, tuple(LayerCost(n, 0.5, 0.5, 0.01, a) for n, a in (("a", 1.0), ("b", 0.1), ("c", 0.1))))
    period, stages = madpipe_dp(Chain.from_profile(three, 1.5, 10.0), 2, 2.0, Grid(21, 11, 11))
    assert period < 2.2 and [(s.first, s.last) for s in stages] == [(1, 2), (3, 3)]  # was 3.0: all on one
    F, B, A = [0.6, 0.4, 0.8, 0.6, 0.6, 0.7], [1.3, 0.7, 1.6, 1.3, 1.1, 1.5], [0.06, 0.04, 0.08, 1.1, 0.1, 0.02]
    six = Profile(0.01, tuple(LayerCost(f"l{i}", F[i], B[i], 0.01, A[i]) for i in range(6)))
    chain = Chain.from_profile(six, 3.2, 10.0)
    mp = madpipe(chain, 3, 6, Grid(21, 11, 11))
    assert mp.valid_period == pytest.approx(4.1) and pipedream(chain, 3).valid_period == pytest.approx(5.4)


def test_madpipe_dp_v_above_the_load_sum_is_not_cut_down():
    """Sec. 4.2.2's (+) pads V to the next multiple of T_hat at each new group, so V can pass U(1, L) +
    sum C, the top of the Sec. 5 grid. Here T_hat = 8 and the stages 5 | 4 (special) | 3 | 2 | 1 from the
    end give V = 5, 14, 20, 31 before layer 1: layer 1 is in group ceil((31 + 5) / 8) = 5 and the special
    processor keeps (5 - 1) x 3 = 12 bytes for it (> M = 11), the recurrence's best period is 11. Cutting
    V at the grid's top (27) gave group 4, 9 bytes, and period 9 from a memory estimate below the
    recurrence's."""
    u = np.array([0, 5, 7, 4, 6, 5.0])
    chain = Chain(u, u / 3, np.zeros(6), np.zeros(6), 11.0, 1.0, np.array([0, 3, 1, 0, 3, 3.0]))
    grid = Grid(28, 12, 28)  # integer steps of t_P, m_P and V: no rounding anywhere
    period, stages = madpipe_dp(chain, 4, 8.0, grid)
    assert period == pytest.approx(11.0)


def test_madpipe_names_a_chain_without_compute():
    """A profile whose forward_s and backward_s are all 0 gives U(1, L) = 0, so Algorithm 1 starts at
    T_hat = U(1, L) / P = 0; the error said "processors=2 must be >= 1 and t_hat=0.0 > 0"."""
    zero = Profile(1.0, tuple(LayerCost(f"l{i}", 0.0, 0.0, 1.0, 1.0) for i in range(3)))
    chain = Chain.from_profile(zero, memory=100.0, bandwidth=1.0)
    with pytest.raises(ValueError, match=r"^the chain's compute U\(1, L\) is 0.0 s"):
        madpipe(chain, 2)
    with pytest.raises(ValueError, match=r"^t_hat=0.0 must be > 0$"):
        madpipe_dp(chain, 2, 0.0)
