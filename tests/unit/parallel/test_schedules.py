"""Schedule generators against 2BP Table 1, MadPipe 1F1B*, ZB-H1; validator; golden tables."""
import importlib.util
from fractions import Fraction
from pathlib import Path

import pytest

from jaxhybrid.parallel.pipeline.costs import Costs
from jaxhybrid.parallel.pipeline.generators import madpipe_groups
from jaxhybrid.parallel.pipeline.generators import star_pattern
from jaxhybrid.parallel.pipeline.schedule import SCHEDULE_NAMES, make_schedule
from jaxhybrid.parallel.pipeline.simulate import simulate
from jaxhybrid.parallel.pipeline.tasks import Kind, Schedule, task
from jaxhybrid.parallel.pipeline.validate import peak_stashed, validate_schedule

ROOT = Path(__file__).resolve().parents[3]

# 2BP Table 1 (F = BI = BW): name -> (M(N), bubble ratio, 2BP bubble ratio), N = pipeline processes.
TABLE_1 = {
    "naive": (lambda n: 1, lambda n: Fraction(n - 1, n), lambda n: Fraction(2 * (n - 1), 2 * n + 1)),
    "gpipe": (lambda n: n, lambda n: Fraction(n - 1, 2 * n - 1),
              lambda n: Fraction(2 * (n - 1), 2 * (n - 1) + 3 * n)),
    "1f1b-1": (lambda n: n, lambda n: Fraction(n - 1, 2 * n - 1), lambda n: Fraction(n - 1, n - 1 + 3 * n)),
    "1f1b-2": (lambda n: 2 * n, lambda n: Fraction(n - 1, 3 * n - 1),
               lambda n: Fraction(n - 1, n - 1 + 6 * n)),
}


def exact_bubble(res, ranks: int) -> Fraction:
    # unit costs: idle time and makespan are integers, so the Fractions are exact
    return Fraction(res.idle_total) / (Fraction(res.makespan) * ranks)


@pytest.mark.parametrize("name", sorted(TABLE_1))
@pytest.mark.parametrize("split", [False, True])
def test_2bp_table1_exact(name, split):
    m_of, plain, with_2bp = TABLE_1[name]
    for n in range(2, 17):
        res = simulate(make_schedule(name, n, m_of(n), split))
        want = with_2bp(n) if split else plain(n)
        assert exact_bubble(res, n) == want, (name, split, n, res.makespan)
        assert res.bubble_ratio == float(want)
        # throughput gain (1-b)/(1-a) of Table 1 follows from the two columns
    if split:
        n = 4
        gain = (1 - with_2bp(n)) / (1 - plain(n))
        a = simulate(make_schedule(name, n, m_of(n), False)).makespan
        b = simulate(make_schedule(name, n, m_of(n), True)).makespan
        # same work per rank in both (3 units per microbatch), so gain = makespan ratio
        assert Fraction(a) / Fraction(b) == gain


def test_naive_with_several_microbatches():
    n = 4
    for m in (1, 3, 5):
        assert exact_bubble(simulate(make_schedule("naive", n, m)), n) == Fraction(n - 1, n)
        # with 2BP each rank runs BW k while microbatch k+1 travels, so only the last BW is left
        # at the end: makespan 2NM + 1 (M = 1 is Table 1's 2N + 1)
        res = simulate(make_schedule("naive", n, m, True))
        assert res.makespan == 2 * n * m + 1
        assert exact_bubble(res, n) == Fraction(2 * n * m + 1 - 3 * m, 2 * n * m + 1)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_idle_fraction_gpipe_1f1b_arbitrary_m(name):
    for p in (1, 2, 3, 5):
        for m in (1, 2, 3, 7, 12):
            for f, b in ((1, 2), (2, 3), (1, 1)):
                costs = Costs.uniform(p, f, b, 0.0)
                res = simulate(make_schedule(name, p, m), costs)
                assert res.bubble_ratio == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m, f, b)


def test_1f1b_stash_bound_and_gpipe_keeps_all():
    for p in (2, 4, 6):
        for m in (1, p - 1, p, 2 * p + 3):
            one = simulate(make_schedule("1f1b", p, m))
            assert [r.peak_stashed for r in one.per_rank] == [min(p - r, m) for r in range(p)]
            gp = simulate(make_schedule("gpipe", p, m))
            assert [r.peak_stashed for r in gp.per_rank] == [m] * p


def test_zb_h1_idle_and_memory():
    for p in (2, 3, 4, 6):
        for m in (p, p + 1, 2 * p, 3 * p + 1):
            for f, bi, bw in ((1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 0.5), (3, 2, 1), (2, 3, 2)):
                res = simulate(make_schedule("zb-h1", p, m), Costs.uniform(p, f, bi, bw))
                for r in res.per_rank:  # ZB eq.: (p-1)(T_F + T_B - T_W), valid for T_W <= T_F
                    assert r.idle == pytest.approx((p - 1) * (f + bi - bw), abs=1e-9), (p, m, f, bi, bw)
                assert max(r.peak_stashed for r in res.per_rank) == p  # 1F1B's peak (its stage 0)
    sch = make_schedule("zb-h1", 4, 8)  # split_backward=False: zb-h1 splits all the same
    assert sch.split_backward and all(t.kind is not Kind.B for row in sch.rows for t in row)
    assert sch == make_schedule("zb-h1", 4, 8, True)


def test_1f1b_star_groups_and_memory():
    stage_costs = [(1, 2), (2, 3), (1, 1), (3, 4), (1, 2)]
    # by hand, T = 8: loads 3,5,2,7,3; from the end: {s4} (3), s3 -> 10 > 8: {s3} (7),
    # s2 -> 9 > 8: {s2, s1} (7), s0 -> 10 > 8: {s0}
    assert madpipe_groups(stage_costs, 8) == (4, 3, 3, 2, 1)
    assert madpipe_groups(stage_costs, 7) == (4, 3, 3, 2, 1)  # s1 + s2 = 7 still fit one group
    assert madpipe_groups([(1, 2)] * 4, 3) == (4, 3, 2, 1)  # equal loads, T = load: plain 1F1B
    assert madpipe_groups(stage_costs, 100) == (1, 1, 1, 1, 1)
    costs = Costs(tuple(f for f, _ in stage_costs), tuple(b for _, b in stage_costs), (0.0,) * 5)
    for period, m in ((8, 12), (10, 9), (7, 6), (100, 4)):
        groups = madpipe_groups(stage_costs, period)
        sch = make_schedule("1f1b-star", 5, m, stage_costs=stage_costs, period=period)
        validate_schedule(sch)
        res = simulate(sch, costs)
        assert [r.peak_stashed for r in res.per_rank] == [min(g, m) for g in groups]
        assert peak_stashed(sch) == [min(g, m) for g in groups]
        # ASAP execution of the pattern's order is never later than the periodic pattern itself
        assert res.makespan <= (m + max(groups) - 1) * period + 1e-9
    with pytest.raises(ValueError, match="period 6"):
        make_schedule("1f1b-star", 5, 4, stage_costs=stage_costs, period=6)
    with pytest.raises(ValueError, match="groups"):
        make_schedule("1f1b-star", 3, 4, groups=(3, 1, 1))
    explicit = make_schedule("1f1b-star", 3, 6, groups=(2, 1, 1))
    assert peak_stashed(explicit) == [2, 1, 1]


def test_1f1b_star_default_loads_are_the_costs():
    """Without ``stage_costs``, 1F1B*'s stage loads U = F + BI + BW come from ``costs``, the same units as
    its links (``2 x message_time``, MadPipe 4.1). They were (1, 2) whatever the costs: ``jaxhybrid simulate
    --schedule 1f1b-star --costs 10,10,10 --latency 5`` failed with "period 3 is below the largest stage or
    link load 10", a period nobody gave, and uneven stages got plain 1F1B's groups."""
    heavy = Costs.uniform(3, 10.0, 10.0, 10.0, latency=5.0)  # T = U = 30, links 10: each its own group
    assert peak_stashed(make_schedule("1f1b-star", 3, 6, costs=heavy)) == [5, 3, 1]
    uneven = Costs((1.0, 1.0, 4.0), (1.0, 1.0, 3.0), (0.0, 0.0, 1.0))  # loads 2, 2, 8; T = 8: {s0, s1} {s2}
    assert peak_stashed(make_schedule("1f1b-star", 3, 6, costs=uneven)) == [2, 2, 1]
    assert peak_stashed(make_schedule("1f1b-star", 3, 6)) == [3, 2, 1]  # unit costs, free links: 1F1B


def test_1f1b_star_default_period_covers_the_links():
    """Without ``period``, T is the largest load of any resource, a link's (2 x message time) included: a
    round trip of 4 against stages of 3 failed with "period 3 is below the largest stage or link load 4".
    At T = 4 the links (4) and the stages (3) each fill a group of their own: 1F1B* holds 5, 3, 1."""
    slow_links = Costs.uniform(3, 1.0, 1.0, 1.0, latency=2.0)
    assert peak_stashed(make_schedule("1f1b-star", 3, 6, costs=slow_links)) == [5, 3, 1]


def test_1f1b_star_counts_the_links_as_resources():
    """MadPipe 4.1: with messages of 1 time unit each way, a 4-stage chain of U = 3 is 7 resources of
    loads 3, 2, 3, 2, 3, 2, 3; at T = 6 the stages fall in groups 4, 3, 2, 1 and the pattern runs a
    microbatch per period. Grouped on the stages alone (2, 2, 1, 1), stages waited for messages that the
    groups gave no room for: 584 instead of 301 for 64 microbatches."""
    assert madpipe_groups([(1, 2)] * 4, 6, links=[2, 2, 2]) == (4, 3, 2, 1)
    assert madpipe_groups([(1, 2)] * 4, 6) == (2, 2, 1, 1)
    costs = Costs.uniform(4, 1.0, 1.0, 1.0, latency=1.0)
    sch = make_schedule("1f1b-star", 4, 64, stage_costs=[(1, 2)] * 4, period=6, costs=costs)
    assert peak_stashed(sch) == [4, 3, 2, 1]
    assert simulate(sch, costs).makespan == pytest.approx(301)
    with pytest.raises(ValueError, match="2 link loads for 4 stages"):
        madpipe_groups([(1, 2)] * 4, 6, links=[2, 2])


def test_memory_saving_variant_runs_bw_half_way():
    full = make_schedule("1f1b-2", 4, 8, True)
    half = make_schedule("1f1b-2", 4, 8, True, memory_saving=True)
    validate_schedule(half)
    r_full, r_half = simulate(full), simulate(half)
    assert all(h.peak_stashed < f.peak_stashed for h, f in zip(r_half.per_rank, r_full.per_rank))
    assert all(sum(len(t.microbatches) for t in row if t.kind is Kind.BW) == 8 for row in half.rows)
    # the flush after BI3 is one concatenated BW of microbatches 0..3 on every rank
    assert all(task("BW", (0, 1, 2, 3), s) in half.rows[s] for s in range(4))
    with pytest.raises(ValueError, match="split_backward"):
        make_schedule("1f1b", 4, 8, memory_saving=True)
    # Schedules that place their own weight passes refuse it rather than ignore it: `jaxhybrid simulate
    # --schedule myelin --split-backward --memory-saving` printed the plain Myelin + 2BP peaks.
    for name in ("myelin", "zb-h1"):
        for opt in ({"memory_saving": True}, {"bw_flush_every": 2}):
            with pytest.raises(ValueError, match=f"{name} places its own weight gradients"):
                make_schedule(name, 4, 8, True, **opt)


def test_2bp_trailing_bws_are_concatenated():
    sch = make_schedule("1f1b-1", 4, 4, True)
    for r, row in enumerate(sch.rows):
        assert row[-1].kind is Kind.BW and row[-1].stage == r
        assert all(t.kind is not Kind.B for t in row)
    assert sch.rows[3][-1].microbatches == (0, 1, 2, 3)  # last stage never idles: all BWs at the end
    gp = make_schedule("gpipe", 3, 5, True)  # 2BP Sec. 3.2: GPipe runs one BW after all BIs
    assert all(row[-1].microbatches == tuple(range(5)) and sum(t.kind is Kind.BW for t in row) == 1
               for row in gp.rows)


CASES = [(2, 2), (1, 1), (1, 3), (3, 5), (4, 8), (5, 3), (4, 4)]


# zb-h1 and zb-v always split their backward (test_zb_h1_idle_and_memory, test_virtual_stages.py):
# split=False builds the same schedule.
@pytest.mark.parametrize("name,split", [(n, s) for s in (False, True) for n in SCHEDULE_NAMES
                                        if not (n in ("zb-h1", "zb-v") and not s)])
def test_every_generated_schedule_validates(name, split):
    for p, m in CASES:
        if name in ("1f1b-1", "1f1b-2"):
            m = int(name[-1]) * p
        if name == "zb-h1" and m < p:
            continue
        if name == "interleaved-1f1b":
            m = -(-m // p) * p  # Megatron's interleaving takes whole groups of p microbatches
        chunks = {"virtual_stages": 2, "placement": "v"} if name == "zb-v" else {}
        if name == "periodic":  # 1F1B as MadPipe's periodic pattern: stage s in group p - s
            chunks = {"pattern": star_pattern(range(p, 0, -1))}
        sch = make_schedule(name, p, m, split, **chunks)
        validate_schedule(sch)
        v = chunks.get("virtual_stages", 1)
        assert sch.num_stages == p * v and sch.num_microbatches == m and sch.num_ranks == p


def test_1f1b_k_names_and_microbatches():
    assert make_schedule("1f1b-3", 2, 6).num_microbatches == 6
    assert make_schedule("1f1b-2", 3, None).num_microbatches == 6
    with pytest.raises(ValueError, match=r"microbatches must be 2 x stages = 8, got 6"):
        make_schedule("1f1b-2", 4, 6)


@pytest.mark.parametrize("args, match", [
    (("pipedream", 4, 4), "unknown schedule 'pipedream'; valid choices: naive, gpipe, 1f1b"),
    (("1f1b", 0, 4), "stages=0 must be an integer >= 1"),
    (("gpipe", 2, 0), "microbatches=0 must be an integer >= 1"),
    (("zb-h1", 4, 3), "needs microbatches >= stages"),
])
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        make_schedule(*args)
    with pytest.raises(ValueError, match="unknown options"):
        make_schedule("gpipe", 2, 2, period=3)


def _sched(rows, m, split=False, name="hand"):
    return Schedule(name, tuple(tuple(r) for r in rows), tuple(range(len(rows))), m, split)


@pytest.mark.parametrize("rows, m, split, match", [
    ([[task("B", 0, 0), task("F", 0, 0)], [task("F", 0, 1), task("B", 0, 1)]], 1, False,
     r"task B0@s0 on rank 0 comes before F0@s0"),
    ([[task("F", 0, 0), task("B", 0, 0)], [task("F", 0, 1), task("F", 1, 1), task("B", 0, 1),
                                           task("B", 1, 1)]], 2, False,
     r"rank 1 task F1@s1 waits for the output of F1@s0, which no rank runs"),
    ([[task("F", 0, 0), task("B", 0, 0), task("F", 1, 0), task("B", 1, 0)],
      [task("F", 1, 1), task("B", 1, 1), task("F", 0, 1), task("B", 0, 1)]], 2, False,
     r"deadlocks: rank 0 blocked at task B0@s0 .*rank 1 blocked at task F1@s1"),
    ([[task("F", 0, 0), task("BW", 0, 0), task("BI", 0, 0)]], 1, True,
     r"task BW0@s0 on rank 0 comes before BI0@s0"),
    ([[task("F", 0, 0), task("BI", 0, 0), task("BW", 0, 0), task("BW", 0, 0)]], 1, True,
     r"task BW0@s0 on rank 0 repeats work already done by task BW0@s0"),
    ([[task("F", 0, 0), task("BI", 0, 0)]], 1, True, r"no rank runs BW0@s0"),
    ([[task("F", 0, 0), task("B", 0, 0)]], 1, True, r"task B0@s0 on rank 0: split_backward=True"),
    ([[task("F", 0, 1)], [task("F", 0, 0)]], 1, False, r"task F0@s1 is in rank 0's row"),
    ([[task("F", 3, 0), task("B", 3, 0)]], 2, False, r"task F3@s0 on rank 0: microbatches \(3,\)"),
])
def test_broken_schedules_are_rejected_naming_the_task(rows, m, split, match):
    with pytest.raises(ValueError, match=match):
        validate_schedule(_sched(rows, m, split))


def test_memory_limit():
    sch = make_schedule("gpipe", 3, 5)
    validate_schedule(sch, max_stashed=5)
    with pytest.raises(ValueError, match=r"rank 0 stashes 5 microbatches after task F4@s0, above its limit 4"):
        validate_schedule(sch, max_stashed=4)
    validate_schedule(make_schedule("1f1b", 3, 5), max_stashed=[3, 2, 1])


def _golden_module():
    spec = importlib.util.spec_from_file_location("regen_golden", ROOT / "scripts" / "regen_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_golden_tables():
    mod = _golden_module()
    assert mod.GOLDEN_CASES
    for stem in mod.GOLDEN_CASES:
        path = mod.GOLDEN_DIR / f"{stem}.txt"
        assert path.exists(), f"{path} missing: run scripts/regen_golden.py"
        assert mod.render(stem) == path.read_text(), (
            f"schedule table {stem} changed; if intended, run scripts/regen_golden.py and review the diff")


@pytest.mark.parametrize("msg", [0.5, 2.0])
def test_step_model_scores_split_1f1b_star_as_the_engine_runs_it(msg):
    """The engine builds 1F1B* from unit costs and free links, one equal stage per group (plain 1F1B's
    groups); the step model's simulation at these ratios regrouped the stages around its links (at
    messages of 2 it scored 41 where the engine's 1F1B + 2BP takes 55) or failed below the links' load."""
    from jaxhybrid.planner.makespan import pipeline_makespan

    star, plain = (pipeline_makespan(name, 4, 8, True, 1.0, 1.0, msg) for name in ("1f1b-star", "1f1b"))
    assert star == plain
