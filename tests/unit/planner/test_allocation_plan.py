"""MadPipe's allocations trained from a plan file: `jaxhybrid partition --out` writes the stages, their
processors and the valid schedule's periodic pattern; `plan.file` turns them into the pipeline's stage map,
partition and `periodic` schedule; bad allocations and patterns are refused naming the layers and passes.
(The MPI parity of such a run: tests/mpi/test_mpi_pipeline.py's ALLOCATION cases.)"""
import json
import re
from pathlib import Path

import pytest

from jaxhybrid.cli.main import build_parser
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.parallel.pipeline import generators as gen
from jaxhybrid.parallel.pipeline.schedule import configured_schedule, make_schedule
from jaxhybrid.parallel.pipeline.tasks import Kind
from jaxhybrid.parallel.pipeline.validate import peak_stashed
from jaxhybrid.planner.chain import Chain
from jaxhybrid.planner.costs import load_profile
from jaxhybrid.planner.ilp import schedule_allocation
from jaxhybrid.planner.madpipe import madpipe
from jaxhybrid.planner.pattern import pattern_entries, pattern_to_schedule
from jaxhybrid.planner.pipedream import pipedream, stage_groups
from jaxhybrid.planner.plan import trace_line
from jaxhybrid.runtime.config_load import load_config

PROFILE = Path(__file__).resolve().parents[2] / "golden" / "madpipe_special_profile.json"
ARGS = ("--processors", "2", "--memory", "6e8", "--bandwidth", "1e9")
# The model the MPI parity cases train (tests/mpi/drive_parity.py): 4 blocks, one per profiled layer.
MODEL = ("model.name=gpt-tiny", "model.n_layers=4", "model.vocab_size=64", "model.d_model=32", "model.n_heads=2",
         "model.d_ff=64", "model.max_seq_len=16", "data.seq_len=8", "train.global_batch=8", "pipeline.microbatches=4")


def _run(*argv: str) -> int:
    _, args = build_parser(list(argv))
    return args._run(args)


@pytest.fixture(scope="module")
def allocation(tmp_path_factory):
    out = tmp_path_factory.mktemp("alloc") / "alloc.json"
    assert _run("partition", "--profile", str(PROFILE), *ARGS, "--out", str(out)) == 0
    return out


def test_partition_out_writes_the_special_processor_and_its_pattern(allocation, capsys):
    data = json.loads(allocation.read_text())
    assert data["kind"] == "allocation" and data["algorithm"] == "madpipe"
    assert [s["layers"] for s in data["stages"]] == [[0, 0], [1, 2], [3, 3]]
    assert [s["processor"] for s in data["stages"]] == [0, 1, 0]  # the special processor: first and last stage
    # The ILP's pattern: every stage's forward and backward once, in start order, with index shifts.
    ops = gen.parse_pattern(data["pattern"], 3)
    assert sorted((k, s) for k, s, _ in ops) == sorted((k, s) for s in range(3) for k in "FB")
    assert data["valid_period_s"] <= data["period_s"] * 1.5


def test_a_plan_file_allocation_becomes_the_runs_stage_map_partition_and_schedule(allocation):
    cfg = load_config(None, [*MODEL, f"plan.file={allocation}"])
    assert cfg.parallel.pipeline == 2 and cfg.parallel.partition == (1, 2, 1)
    pl = cfg.pipeline
    assert pl.schedule == "periodic" and pl.stage_to_rank == (0, 1, 0) and pl.virtual_stages == 1
    sch = configured_schedule(pl, 2)
    assert sch.stage_to_rank == (0, 1, 0) and {t.stage for t in sch.rows[0]} == {0, 2}
    # 2BP over the same pattern: B becomes BI, the weight passes fill the idle time.
    split = configured_schedule(pl, 2, split_backward=True)
    assert {t.kind for row in split.rows for t in row} == {Kind.F, Kind.BI, Kind.BW}


def test_the_ilp_pattern_unrolled_is_the_engines_periodic_schedule():
    chain = Chain.from_profile(load_profile(PROFILE), 6e8, 1e9)
    alloc = madpipe(chain, 2, 6)
    pat = schedule_allocation(chain, list(alloc.stages))
    entries, placed = pattern_entries(pat)
    assert entries == alloc.pattern and placed == (0, 1, 0)
    sch = pattern_to_schedule(pat, 5)  # validated by make_schedule: dependencies, coverage, no deadlock
    assert sch.name == "periodic" and len(sch.rows[0]) == 2 * 2 * 5


def test_the_1f1b_star_pattern_of_a_contiguous_partition_is_its_1f1b_star_rows():
    chain = Chain.from_profile(load_profile(PROFILE), 1e9, 1e9)
    alloc = pipedream(chain, 2)
    groups = stage_groups(chain, list(alloc.stages), alloc.valid_period)
    assert alloc.pattern == gen.star_pattern(groups)
    rows = gen.periodic_rows(gen.parse_pattern(alloc.pattern, 2), (0, 1), 6, Kind.B)
    assert rows == gen.one_f_one_b_star_rows(groups, 6, Kind.B)
    # A stage of group g stores g microbatches (MadPipe Sec. 4.1).
    sch = make_schedule("periodic", 2, 6, stage_to_rank=(0, 1), pattern=alloc.pattern)
    assert peak_stashed(sch) == list(groups)


def _edited(allocation, tmp_path, **change) -> Path:
    data = {**json.loads(allocation.read_text()), **change}
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("stages,said", [
    ([[[0, 0], 0], [[2, 2], 1], [[3, 3], 0]], "leaves layer 1 out"),
    ([[[0, 1], 0], [[1, 2], 1], [[3, 3], 0]], "gives layer 1 to two stages"),
    ([[[0, 0], 0], [[1, 2], 1], [[3, 4], 0]], "allocates 5 layers (0..4), but this run's model has model.n_layers=4"),
    ([[[0, 0], 0], [[1, 2], 2], [[3, 3], 0]], "processors [0, 2] must be 0..2, each holding a stage"),
])
def test_a_bad_allocation_is_refused_naming_the_layers(allocation, tmp_path, stages, said):
    path = _edited(allocation, tmp_path, stages=[{"layers": lay, "processor": p} for lay, p in stages])
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(None, [*MODEL, f"plan.file={path}"])


@pytest.mark.parametrize("pattern,said", [
    (["F0+0", "F1+0", "F2+0", "B2+0", "B1+0"], "the pattern has no B0"),
    (["F0+0", "F1+0", "F2+0", "B2+0", "B1+0", "B0+1", "F1+2"], "repeats the F pass of stage 1"),
    (["F0+0", "F1+0", "F3+0", "B2+0", "B1+0", "B0+1"], "names stage 3; the pipeline has stages 0..2"),
    (["F0+0", "F1+0", "F2+0", "B2+0", "B1+1", "B0+0"], "deadlocks"),
    (["F0", "F1+0", "F2+0", "B2+0", "B1+0", "B0+1"], "'F0' is not F<stage>"),
])
def test_a_bad_pattern_is_refused_before_any_rank_starts(allocation, tmp_path, pattern, said):
    path = _edited(allocation, tmp_path, pattern=pattern)
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(None, [*MODEL, f"plan.file={path}"])


@pytest.mark.parametrize("sets,said", [
    (["pipeline.stage_to_rank=[0,0,0]", "parallel.pipeline=2"], "gives rank 1 no stage"),
    (["pipeline.stage_to_rank=[0,1,0]", "parallel.pipeline=2", "pipeline.virtual_stages=2", "pipeline.schedule=gpipe"],
     "places the stages itself"),
    (["pipeline.stage_to_rank=[0,1,0]", "parallel.pipeline=2", "pipeline.schedule=1f1b"], "cannot run stage_to_rank"),
    (["pipeline.stage_to_rank=[0,1,0]", "parallel.pipeline=2", "pipeline.schedule=gpipe", "parallel.partition=[2,2]"],
     "must have pipeline.stage_to_rank's 3"),
    (["parallel.pipeline=2", "pipeline.schedule=periodic"], "needs its pattern"),
    (["parallel.pipeline=2", "pipeline.pattern=[F0+0,B0+0,F1+0,B1+0]"], "read only by pipeline.schedule='periodic'"),
])
def test_stage_maps_and_patterns_set_by_hand_are_checked(sets, said):
    with pytest.raises(ConfigError, match=said):
        load_config(None, [*MODEL, *sets])


def test_gpipe_and_myelin_run_any_stage_map():
    for name in ("gpipe", "myelin", "naive"):
        cfg = load_config(None, [*MODEL, "parallel.pipeline=2", "pipeline.stage_to_rank=[1,0,1,0]",
                                 f"pipeline.schedule={name}"])
        assert configured_schedule(cfg.pipeline, 2).stage_to_rank == (1, 0, 1, 0)


def test_plan_notes_that_an_allocations_own_layout_is_partitions_to_predict(allocation, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(_nested_yaml([*MODEL, f"plan.file={allocation}"]))
    assert _run("plan", "--model", str(cfg), "--gpus", "2", "--gpus-per-node", "2", "--hardware", "h100-node",
                "--top", "1") == 0
    assert "places its stages by pipeline.stage_to_rank (a MadPipe allocation)" in capsys.readouterr().out


def _nested_yaml(pairs) -> str:
    tree: dict = {}
    for pair in pairs:
        key, value = pair.split("=", 1)
        section, name = key.split(".")
        tree.setdefault(section, {})[name] = value
    return "".join(f"{s}: {{{', '.join(f'{k}: {v}' for k, v in kv.items())}}}\n" for s, kv in tree.items())


def test_a_traced_step_prints_its_period_beside_the_allocations(allocation):
    line = trace_line({"makespan_s": 0.18, "bubble_ratio": 0.3, "period_s": 0.019}, str(allocation))
    predicted = json.loads(allocation.read_text())["valid_period_s"]
    assert "period 0.019 s per microbatch" in line and f"predicted a period of {predicted:.4g} s (madpipe" in line
    assert "predicted" not in trace_line({"makespan_s": 0.18, "bubble_ratio": 0.3, "period_s": None})
