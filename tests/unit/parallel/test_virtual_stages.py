"""Several stages per pipeline rank (virtual stages): placements, Megatron-LM's interleaved 1F1B, ZB-V, the
schedules that run over chunks, the validator across chunks, bad input, ``jaxhybrid simulate`` and the Gantt."""
import json
from fractions import Fraction

import pytest

from jaxhybrid.cli.main import main
from jaxhybrid.parallel.pipeline.costs import Costs
from jaxhybrid.parallel.pipeline.schedule import make_schedule, stage_placement
from jaxhybrid.parallel.pipeline.simulate import simulate
from jaxhybrid.parallel.pipeline.tasks import Kind, Schedule, task
from jaxhybrid.parallel.pipeline.trace import _shade, rank_chunks, save_gantt
from jaxhybrid.parallel.pipeline.validate import validate_schedule

ZBV = {"virtual_stages": 2, "placement": "v"}


def exact_bubble(res, ranks: int) -> Fraction:
    # unit costs: idle time and makespan are integers, so the Fraction is exact
    return Fraction(res.idle_total) / (Fraction(res.makespan) * ranks)


def test_stage_placement():
    assert stage_placement(4) == (0, 1, 2, 3)
    assert stage_placement(4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)  # loop: rank r holds r, r + p, ...
    assert stage_placement(3, 3, "loop") == (0, 1, 2) * 3
    assert stage_placement(4, 2, "v") == (0, 1, 2, 3, 3, 2, 1, 0)  # v: r and 2p - 1 - r
    assert stage_placement(1, 2, "v") == (0, 0)
    sch = make_schedule("interleaved-1f1b", 4, 8, virtual_stages=2)
    assert sch.stage_to_rank == stage_placement(4, 2) and sch.num_ranks == 4 and sch.num_stages == 8
    assert make_schedule("zb-v", 3, 3, **ZBV).stage_to_rank == stage_placement(3, 2, "v")
    with pytest.raises(ValueError, match=r"placement='v' .* needs virtual_stages=2, got virtual_stages=3"):
        stage_placement(4, 3, "v")
    with pytest.raises(ValueError, match=r"ranks=0 must be an integer >= 1"):
        stage_placement(0)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_interleaved_bubble_is_exact(p, v):
    """Narayanan et al. SC'21 Sec. 2.2: the bubble shrinks by v; idle over runtime is (p-1) / (v m + p-1)
    with equal costs, and 2BP's variant (BI in the rows, BWs in the idle time) is no worse."""
    for m in (p, 2 * p, 3 * p):
        fused = make_schedule("interleaved-1f1b", p, m, virtual_stages=v)
        validate_schedule(fused)
        res = simulate(fused)
        want = Fraction(p - 1, v * m + p - 1)
        assert exact_bubble(res, p) == want, (p, v, m, res.makespan)
        assert res.bubble_ratio == float(want)
        split = make_schedule("interleaved-1f1b", p, m, True, virtual_stages=v)
        validate_schedule(split)
        assert all(t.kind is not Kind.B for row in split.rows for t in row)
        assert exact_bubble(simulate(split), p) <= want


def test_interleaved_3_over_19():
    res = simulate(make_schedule("interleaved-1f1b", 4, 8, virtual_stages=2))
    assert exact_bubble(res, 4) == Fraction(3, 19) and res.makespan == 57  # 48 units of work + 3 x (F + B)


def test_interleaved_order_is_megatrons():
    """p = 2, v = 2, m = 4, by hand from Megatron-LM's rule: rank 0 warms up with (2-0-1) 2 + (2-1) 2 = 4
    forwards (microbatches 0, 1 on chunk 0, then on chunk 1), rank 1 with 2; backwards take chunk 1 first."""
    def row(text):
        return [task(w.split("@")[0][:-1], int(w.split("@")[0][-1]), int(w.split("@s")[1])) for w in text.split()]

    sch = make_schedule("interleaved-1f1b", 2, 4, virtual_stages=2)
    assert [list(r) for r in sch.rows] == [
        row("F0@s0 F1@s0 F0@s2 F1@s2 F2@s0 B0@s2 F3@s0 B1@s2 F2@s2 B0@s0 F3@s2 B1@s0 B2@s2 B3@s2 B2@s0 B3@s0"),
        row("F0@s1 F1@s1 F0@s3 B0@s3 F1@s3 B1@s3 F2@s1 B0@s1 F3@s1 B1@s1 F2@s3 B2@s3 F3@s3 B3@s3 B2@s1 B3@s1")]


@pytest.mark.parametrize("split", [False, True])
def test_interleaved_with_one_chunk_is_1f1b(split):
    for p, m in ((1, 3), (3, 6), (4, 8)):
        assert make_schedule("interleaved-1f1b", p, m, split).rows == make_schedule("1f1b", p, m, split).rows


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb_v_beats_zb_h1_and_interleaved_within_1f1b_memory(p):
    """ZB-V (Qi et al.) with F = BI = BW per chunk: every rank works 6m units, and rank p-1's first input
    arrives after p-1 forwards, so 6m + p - 1 is the least makespan; the greedy list schedule reaches it here.
    Its bubble is below ZB-H1's and interleaved 1F1B's at the same p and m, and a rank never holds more
    than 1F1B's peak: p microbatches of the whole rank, 2p chunk activations of half its size."""
    for m in (p, p + 1, 2 * p, 3 * p):
        sch = make_schedule("zb-v", p, m, **ZBV)
        validate_schedule(sch)
        res = simulate(sch, Costs.uniform(2 * p, activation_bytes=0.5))
        assert res.makespan == 6 * m + p - 1, (p, m)
        bubble = exact_bubble(res, p)
        assert bubble < exact_bubble(simulate(make_schedule("zb-h1", p, m)), p)
        if m % p == 0:
            assert bubble < exact_bubble(simulate(make_schedule("interleaved-1f1b", p, m, virtual_stages=2)), p)
        one_f_one_b = simulate(make_schedule("1f1b", p, m))
        assert max(r.peak_stashed for r in res.per_rank) <= 2 * max(r.peak_stashed for r in one_f_one_b.per_rank)
        assert max(r.peak_bytes for r in res.per_rank) <= max(r.peak_bytes for r in one_f_one_b.per_rank)


def test_zb_v_always_splits_and_follows_its_costs():
    sch = make_schedule("zb-v", 3, 6, **ZBV)
    assert sch.split_backward and sch == make_schedule("zb-v", 3, 6, True, **ZBV)
    assert sch.name == "zb-v" and sch.policy == "static"
    for f, bi, bw in ((1, 2, 1), (2, 1, 0.5), (1, 1, 2)):  # rows from the given costs; still valid, still capped
        costs = Costs.uniform(6, f, bi, bw)
        other = make_schedule("zb-v", 3, 6, costs=costs, **ZBV)
        validate_schedule(other, costs=costs)
        assert max(r.peak_stashed for r in simulate(other, costs).per_rank) <= 6
    for m in (1, 2):  # fewer microbatches than ranks: valid, only the bubble grows
        validate_schedule(make_schedule("zb-v", 4, m, **ZBV))
    with pytest.raises(ValueError, match="zb-v places its own weight gradients"):
        make_schedule("zb-v", 3, 6, memory_saving=True, **ZBV)


@pytest.mark.parametrize("name", ["naive", "gpipe", "myelin"])
@pytest.mark.parametrize("chunks", [{"virtual_stages": 2}, {"virtual_stages": 3}, ZBV])
def test_chunked_naive_gpipe_myelin(name, chunks):
    v = chunks["virtual_stages"]
    for p, m in ((1, 2), (2, 2), (3, 5), (4, 8)):
        for split in (False, True):
            sch = make_schedule(name, p, m, split, **chunks)
            validate_schedule(sch)
            assert sch.num_stages == p * v and sch.num_ranks == p
            if name == "gpipe" and chunks.get("placement", "loop") == "loop" and m >= p and not split:
                # a rank's later chunk gets microbatch 0 back after p forwards, while m >= p keep it busy
                assert exact_bubble(simulate(sch), p) == Fraction(p - 1, v * m + p - 1)
    assert make_schedule("myelin", 4, 8, **chunks).pipeline_limit == 4  # Myelin V-A: G_inter, the ranks


@pytest.mark.parametrize("args, kw, match", [
    (("gpipe", 4, 8), {"placement": "zigzag"}, r"placement='zigzag'; choose one of loop, v"),
    (("gpipe", 4, 8), {"virtual_stages": 3, "placement": "v"}, r"needs virtual_stages=2, got virtual_stages=3"),
    (("gpipe", 4, 8), {"placement": "v"}, r"needs virtual_stages=2, got virtual_stages=1"),
    (("gpipe", 4, 8), {"virtual_stages": 0}, r"virtual_stages=0 must be an integer >= 1"),
    (("zb-v", 4, 8), {}, r"'zb-v' .* needs virtual_stages=2 and placement='v', got virtual_stages=1"),
    (("zb-v", 4, 8), {"virtual_stages": 2}, r"got virtual_stages=2, placement='loop'"),
    (("1f1b", 4, 8), {"virtual_stages": 2},
     r"'1f1b' runs one stage per rank; it cannot run virtual_stages=2 .*use 'interleaved-1f1b'"),
    (("1f1b-2", 4, 8), {"virtual_stages": 2}, r"'1f1b-2' .* virtual_stages=2"),
    (("zb-h1", 4, 8), {"virtual_stages": 3}, r"'zb-h1' .* virtual_stages=3"),
    (("1f1b-star", 4, 8), {"virtual_stages": 2}, r"'1f1b-star' .* virtual_stages=2"),
    (("interleaved-1f1b", 4, 6), {"virtual_stages": 2}, r"microbatches=6 with stages=4; use a multiple of 4"),
    (("interleaved-1f1b", 4, 8), ZBV, r"'interleaved-1f1b' is Megatron-LM's loop placement"),
    (("interleaved-1f1b", 4, 8), {"virtual_stages": 2, "costs": Costs.uniform(4)},
     r"costs cover 4 stages, the schedule has 8 \(4 ranks x 2 virtual stages\)"),
])
def test_bad_input(args, kw, match):
    with pytest.raises(ValueError, match=match):
        make_schedule(*args, **kw)


def _sched(rows, stage_to_rank, m=1, split=False):
    return Schedule("hand", tuple(tuple(r) for r in rows), tuple(stage_to_rank), m, split)


def _v2(rank0, rank1):
    """Two ranks, V placement: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2."""
    return _sched([[task(w[0], 0, int(w[1])) for w in row.split()] for row in (rank0, rank1)], (0, 1, 1, 0))


def test_validator_across_chunks():
    validate_schedule(_v2("F0 F3 B3 B0", "F1 F2 B2 B1"))
    with pytest.raises(ValueError, match=r"task F0@s2 is in rank 1's row, but stage 2 runs on rank 0"):
        validate_schedule(_sched([[task("F", 0, 0), task("B", 0, 0)],
                                  [task("F", 0, 1), task("F", 0, 2), task("F", 0, 3), task("B", 0, 3),
                                   task("B", 0, 2), task("B", 0, 1)]], (0, 1, 0, 1)))
    with pytest.raises(ValueError, match=r"rank 1 task F0@s3 waits for the output of F0@s2, which no rank runs"):
        validate_schedule(_sched([[task("F", 0, 0), task("B", 0, 0)],  # loop placement, F0@s2 left out
                                  [task("F", 0, 1), task("F", 0, 3), task("B", 0, 3), task("B", 0, 1)]],
                                 (0, 1, 0, 1)))
    # the two stages of one rank depend on each other: the order within the row is checked
    with pytest.raises(ValueError, match=r"task F0@s2 on rank 1 comes before F0@s1, which it needs"):
        validate_schedule(_v2("F0 F3 B3 B0", "F2 F1 B2 B1"))
    with pytest.raises(ValueError, match=r"task B0@s1 on rank 1 comes before B0@s2, which it needs"):
        validate_schedule(_v2("F0 F3 B3 B0", "F1 F2 B1 B2"))
    with pytest.raises(ValueError, match=r"task B0@s3 on rank 0 comes before F0@s3, which it needs"):
        validate_schedule(_v2("F0 B3 F3 B0", "F1 F2 B2 B1"))  # the last stage's backward needs its own forward


def test_cli_interleaved_prints_3_over_19(capsys):
    assert main(["simulate", "--schedule", "interleaved-1f1b", "--stages", "4", "--virtual-stages", "2",
                 "--microbatches", "8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["bubble_ratio"] == float(Fraction(3, 19)) == 3 / 19 and got["makespan"] == 57
    assert (got["stages"], got["virtual_stages"], got["placement"]) == (4, 2, "loop")
    assert [r["busy"] for r in got["per_rank"]] == [48.0] * 4
    # --costs are per chunk: twice the cost per chunk, twice the makespan
    assert main(["simulate", "--schedule", "interleaved-1f1b", "--stages", "4", "--virtual-stages", "2",
                 "--microbatches", "8", "--costs", "2,2,2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] == 114


def test_cli_zb_v_and_its_errors(tmp_path, capsys):
    png = tmp_path / "zbv.png"
    assert main(["simulate", "--schedule", "zb-v", "--stages", "4", "--virtual-stages", "2", "--placement", "v",
                 "--microbatches", "8", "--activation-bytes", "0.5", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "zb-v + 2BP: stages=4 virtual_stages=2 placement=v microbatches=8 makespan=51" in out
    assert "peak_stashed=8 peak_bytes=4" in out and png.read_bytes()[:4] == b"\x89PNG"
    assert main(["simulate", "--schedule", "zb-v", "--stages", "4", "--microbatches", "8"]) == 2
    assert "--schedule zb-v is the V shape: it needs --virtual-stages 2 --placement v, got --virtual-stages 1 " \
           "--placement loop" in capsys.readouterr().err
    assert main(["simulate", "--schedule", "gpipe", "--stages", "4", "--placement", "v", "--microbatches", "8"]) == 2
    assert "--placement v puts stages r and 2P-1-r on rank r: it needs --virtual-stages 2, got 1" in \
           capsys.readouterr().err
    assert main(["simulate", "--schedule", "1f1b", "--stages", "4", "--virtual-stages", "2",
                 "--microbatches", "8"]) == 2
    assert "'1f1b' runs one stage per rank" in capsys.readouterr().err
    # per-stage lists count the logical stages
    assert main(["simulate", "--schedule", "gpipe", "--stages", "2", "--virtual-stages", "2",
                 "--microbatches", "2", "--activation-bytes", "1,2"]) == 2
    assert "give one value, or 4 (one per stage), not 2" in capsys.readouterr().err


def test_gantt_tells_the_chunks_apart(tmp_path):
    res = simulate(make_schedule("zb-v", 3, 3, **ZBV))
    chunk = rank_chunks(res.timeline)
    assert chunk == {(0, 0): 0, (0, 5): 1, (1, 1): 0, (1, 4): 1, (2, 2): 0, (2, 3): 1}
    assert _shade("#4c78a8", 0, 2) != _shade("#4c78a8", 1, 2)
    assert all(a >= b for a, b in zip(_shade("#4c78a8", 1, 2), _shade("#4c78a8", 0, 2)))  # lighter
    path = save_gantt(res.timeline, tmp_path / "g.png", title="zb-v")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb_v_builds_its_rows_when_messages_take_time(p):
    """With messages that cost, a rank's lower chunk could fill its memory cap while a microbatch is on its
    way back up the V; the rank keeps its last slot for the upper chunk, so the greedy schedule never stalls
    (make_schedule raises on a generator deadlock) and stays capped at 1F1B's peak."""
    for m in (2, p, 2 * p + 1):
        for latency in (0.05, 0.5, 3.0):
            for f, bi, bw in ((1, 1, 1), (1, 2, 0.5), (2, 1, 1)):
                costs = Costs.uniform(2 * p, f, bi, bw, latency=latency)
                sch = make_schedule("zb-v", p, m, costs=costs, **ZBV)
                validate_schedule(sch, max_stashed=2 * p, costs=costs)


@pytest.mark.parametrize("name,split,kw", [("interleaved-1f1b", False, {"virtual_stages": 2}),
                                           ("interleaved-1f1b", True, {"virtual_stages": 2}),
                                           ("zb-v", True, ZBV), ("1f1b", True, {})])
def test_grads_final_orders_a_ranks_stages_by_their_last_gradient_pass(name, split, kw):
    """The order every replica of a rank starts its stages' data-parallel sums in: by the row position of
    each stage's last B (2BP: last BW); fused, with several stages per rank, a deeper stage is done first
    (2BP's deferred weight passes may finish them in another order)."""
    sched = make_schedule(name, 2, 4, split_backward=split, **kw)
    for r, row in enumerate(sched.rows):
        order = sched.grads_final(r)
        assert sorted(order) == [s for s in range(sched.num_stages) if sched.stage_to_rank[s] == r]
        last = [max(i for i, t in enumerate(row) if t.stage == s and t.kind == (Kind.BW if split else Kind.B))
                for s in order]
        assert last == sorted(last)
    if name == "interleaved-1f1b" and not split:
        assert sched.grads_final(0) == (2, 0) and sched.grads_final(1) == (3, 1)
