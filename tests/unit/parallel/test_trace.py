"""Timelines -> Chrome trace JSON and Gantt PNG; the ``jaxhybrid simulate`` command."""
import json

import pytest

from jaxhybrid.cli.main import main
from jaxhybrid.parallel.pipeline.schedule import make_schedule
from jaxhybrid.parallel.pipeline.simulate import simulate
from jaxhybrid.parallel.pipeline.trace import (Event, Timeline, exposed_reduction, save_gantt, steady_period,
                                               to_chrome_trace, write_chrome_trace)


def test_merge_per_rank_events_with_clock_offsets():
    rank0 = [Event(0, "F0@s0", "F", 100.0, 101.0, (0,), 0), Event(0, "B0@s0", "B", 103.0, 105.0, (0,), 0)]
    rank1 = [Event(1, "wait", "wait", 50.5, 51.0), Event(1, "F0@s1", "F", 51.0, 52.0, (0,), 1),
             Event(1, "B0@s1", "B", 52.0, 54.0, (0,), 1)]
    tl = Timeline.merge([rank0, rank1], offsets=[0.0, 50.0])
    assert tl.num_ranks == 2
    assert [e.start for e in tl.events] == sorted(e.start for e in tl.events)
    assert tl.events[0].name == "F0@s0" and tl.events[0].start == 0.0
    assert tl.makespan == pytest.approx(5.0)
    assert tl.busy(1) == pytest.approx(3.0)  # waits are not busy
    with pytest.raises(ValueError, match="2 clock offsets for 1 ranks"):
        Timeline.merge([rank0], offsets=[0.0, 1.0])
    with pytest.raises(ValueError, match="ends"):
        Event(0, "x", "F", 2.0, 1.0)


def test_chrome_trace_of_a_simulation(tmp_path):
    res = simulate(make_schedule("1f1b", 3, 4, True), latency=0.25)
    trace = to_chrome_trace(res.timeline)
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(res.timeline.events)
    compute = [e for e in slices if e["cat"] in ("F", "B", "BI", "BW")]
    assert sum(e["dur"] for e in compute if e["tid"] == 0) == pytest.approx(res.per_rank[0].busy * 1e6)
    assert {e["tid"] for e in slices if e["cat"] == "send"} <= {1000, 1001, 1002}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"rank 0", "rank 2"} <= names
    path = write_chrome_trace(res.timeline, tmp_path / "t.json")
    assert json.loads(path.read_text())["traceEvents"]


def test_gantt_png(tmp_path):
    res = simulate(make_schedule("1f1b-2", 3, 6, True))
    path = save_gantt(res.timeline, tmp_path / "g.png", title="1F1B-2 + 2BP")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_cli_json_trace_png(tmp_path, capsys):
    out_json, out_png = tmp_path / "t.json", tmp_path / "g.png"
    rc = main(["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "4",
               "--split-backward", "--costs", "1,1,1", "--json", "--trace", str(out_json),
               "--png", str(out_png)])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    assert got["makespan"] == 15.0 and got["bubble_ratio"] == pytest.approx(3 / 15)  # 2BP 1F1B-1
    assert [r["peak_stashed"] for r in got["per_rank"]] == [4, 4, 4, 4]
    assert all({"busy", "idle", "peak_stashed"} <= set(r) for r in got["per_rank"])
    assert out_json.exists() and out_png.exists()


def test_cli_errors_list_choices(capsys):
    assert main(["simulate", "--schedule", "bogus", "--stages", "2", "--microbatches", "2"]) == 2
    err = capsys.readouterr().err
    assert "valid choices: naive, gpipe, 1f1b, 1f1b-1, 1f1b-2, zb-h1, 1f1b-star, myelin" in err
    assert main(["simulate", "--schedule", "gpipe", "--stages", "0", "--microbatches", "2"]) == 2
    assert main(["simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches", "2",
                 "--costs", "1,x,1"]) == 2
    assert main(["simulate", "--schedule", "1f1b-star", "--stages", "3", "--microbatches", "6",
                 "--period", "9", "--json"]) == 0
    assert [r["peak_stashed"] for r in json.loads(capsys.readouterr().out)["per_rank"]] == [1, 1, 1]


def test_the_measured_period_is_the_last_stages_median_gap_between_forwards():
    """MadPipe's period in a traced step: one period between the last stage's forwards in the steady state;
    the first gap (its warm-up) and the other stages' back-to-back forwards do not count."""
    last = [Event(1, f"F{m}", "F", start, start + 0.1, (m,), 1) for m, start in enumerate((0.2, 0.3, 0.8, 1.3, 1.8))]
    first = [Event(0, f"F{m}", "F", 0.1 * m, 0.1 * m + 0.1, (m,), 0) for m in range(5)]
    assert steady_period(first + last) == pytest.approx(0.5)
    assert steady_period(first[:1]) is None and steady_period([]) is None


def test_exposed_reduction_is_the_reduce_time_that_nothing_else_covers():
    """The trace's exposed data-parallel reduction: per rank the union of its reductions less what its
    kernels, optimizer updates and the pipeline's message waits cover (a reduction started during the phase
    runs beside waits the rank has anyway); the longest rank's; None with no reduction recorded. A send
    in flight covers nothing: it leaves from a thread of its own."""
    events = [Event(0, "all-reduce a", "reduce", 0.0, 6.0), Event(0, "all-reduce b", "reduce", 5.0, 10.0),
              Event(0, "update", "update", 2.0, 5.0), Event(0, "F", "F", 8.0, 12.0),
              Event(1, "all-reduce", "reduce", 0.0, 4.0), Event(1, "wait", "wait", 0.0, 3.0),
              Event(1, "send", "send", 0.0, 4.0)]
    assert exposed_reduction(events) == pytest.approx(5.0)  # rank 0: 10 - 3 - 2
    assert exposed_reduction([e for e in events if e.rank == 1]) == pytest.approx(1.0)  # 4 - 3
    assert exposed_reduction([e for e in events if e.kind != "reduce"]) is None
