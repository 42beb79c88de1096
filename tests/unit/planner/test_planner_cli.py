"""The planner commands' flags: partition's profile sources and processor count, plan's hardware, GPU
counts and latency note, simulate's flag errors. Commands run in-process (no JAX start) unless they
profile a model."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from jaxhybrid.cli.main import build_parser
from jaxhybrid.planner.chain import Chain
from jaxhybrid.planner.costs import LayerCost, Profile, load_hardware, save_profile
from jaxhybrid.planner.madpipe import madpipe
from jaxhybrid.planner.pipedream import pipedream
from jaxhybrid.planner.plan import machine_from_hardware, rank_plans

RUNS = Path(__file__).resolve().parents[3] / "configs" / "runs"


def _run(*argv: str) -> int:
    _, args = build_parser(list(argv))
    return args._run(args)


def _profile(tmp_path, layers=4):
    prof = Profile(1.0, tuple(LayerCost(f"l{i}", 1.0, 2.0, 0.1, 0.5) for i in range(layers)))
    save_profile(prof, tmp_path / "p.json")
    return prof, str(tmp_path / "p.json")


# --- partition ------------------------------------------------------------------------------------------


def test_partition_profile_model_alone_works_and_profile_is_its_optional_output(tmp_path, capsys):
    """README's `partition (--profile FILE | --profile-model CFG)`: --profile-model needs no --profile."""
    common = ("--processors", "2", "--memory", "1e9", "--bandwidth", "1e10", "--seq-len", "16", "--json")
    assert _run("partition", "--profile-model", "gpt-tiny", "--algorithm", "madpipe", *common) == 0
    assert len(json.loads(capsys.readouterr().out)["stages"]) >= 1
    out = tmp_path / "written.json"
    assert _run("partition", "--profile-model", "gpt-tiny", "--profile", str(out), *common) == 0
    layers = json.loads(out.read_text())["layers"]
    assert len(layers) == 4  # gpt-tiny's blocks, saved to reuse
    # Each block's stored bytes are what its forward keeps (Stage.activation_bytes), not MadPipe's input a_{l-1}.
    from jaxhybrid.core.config.model import resolve_model
    from jaxhybrid.model import Model
    from jaxhybrid.parallel.twobp.stage import Stage

    model = Model(resolve_model("gpt-tiny"))
    assert [lc["stored_bytes"] for lc in layers] == [Stage(model, i, i + 1).activation_bytes(1, 16) for i in range(4)]
    assert layers[1]["stored_bytes"] > 10 * layers[0]["activation_bytes"]
    with pytest.raises(ValueError, match="--profile FILE.*--profile-model CFG"):
        _run("partition", "--processors", "2", "--memory", "1e9", "--bandwidth", "1e10")


@pytest.mark.parametrize("algorithm", ["madpipe", "pipedream"])
def test_partition_refuses_more_processors_than_layers_before_profiling(tmp_path, monkeypatch, algorithm):
    _, path = _profile(tmp_path, layers=4)
    with pytest.raises(ValueError, match=r"--processors=8 must be in \[1, 4\].*4 layers"):
        _run("partition", "--profile", path, "--processors", "8", "--memory", "1e9", "--bandwidth", "1e10",
             "--algorithm", algorithm)

    def no_profiling(*a, **k):
        raise AssertionError("profiled before checking --processors")

    monkeypatch.setattr("jaxhybrid.cli.commands.partition.profile_model", no_profiling)
    with pytest.raises(ValueError, match=r"--processors=8 must be in \[1, 4\]"):
        _run("partition", "--profile-model", "gpt-tiny", "--processors", "8", "--memory", "1e9",
             "--bandwidth", "1e10", "--algorithm", algorithm)


def _usage_error(capsys, *argv: str) -> str:
    """argparse's error line for a flag's value (exit code 2, no traceback)."""
    with pytest.raises(SystemExit) as e:
        build_parser(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


PARTITION = ("partition", "--processors", "2", "--memory", "1e9", "--bandwidth", "1e10")


def test_partition_numbers_processors_in_chain_order(tmp_path, capsys):
    """MadPipe's DP numbers its special processor last, wherever its layers are; the command prints the
    stages in chain order with processors numbered by first appearance (0 holds the input layers), the
    special one's stages sharing a number."""
    rng = np.random.default_rng(0)
    layers = tuple(LayerCost(f"l{i}", *rng.uniform((0.5, 1, 1e7, 1e7), (2, 4, 1e8, 1e8))) for i in range(12))
    save_profile(Profile(1e8, layers), tmp_path / "p.json")
    argv = ("partition", "--profile", str(tmp_path / "p.json"), "--processors", "4", "--memory", "1.5e9",
            "--bandwidth", "1e9", "--json")
    assert _run(*argv) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    procs = [s["processor"] for s in stages]
    assert [s["layers"][0] for s in stages] == sorted(s["layers"][0] for s in stages) and procs[0] == 0
    first_seen = list(dict.fromkeys(procs))
    assert first_seen == list(range(len(first_seen)))
    assert len(procs) > len(first_seen), "expected a special processor holding two separate layer ranges"


@pytest.mark.parametrize("flag", ["--microbatch-size", "--seq-len", "--iterations"])
def test_partition_counts_must_be_at_least_one(capsys, flag):
    """--microbatch-size 0 used to reach the profiler ("microbatch=0, repeats=3 must be >= 1"), --seq-len 0
    to mean max_seq_len."""
    assert _usage_error(capsys, *PARTITION, "--profile-model", "gpt-tiny", flag, "0") == \
        f"jaxhybrid partition: error: argument {flag}: must be an integer >= 1 (got '0')"


def test_partition_checks_the_profile_output_and_sequence_before_profiling(tmp_path, monkeypatch):
    """An unwritable --profile failed with a bare "[Errno 2]" after profiling; a --seq-len beyond the model's
    positions was named as the profiler's internal ``seq``."""
    monkeypatch.setattr("jaxhybrid.cli.commands.partition.profile_model", lambda *a, **k: pytest.fail("profiled first"))
    with pytest.raises(ValueError, match=f"^--profile {tmp_path}/no/p.json cannot be written: {tmp_path}/no "
                                         "does not exist$"):
        _run(*PARTITION, "--profile-model", "gpt-tiny", "--profile", str(tmp_path / "no" / "p.json"))
    with pytest.raises(ValueError, match=f"^--profile {tmp_path} is a directory; give a file$"):
        _run(*PARTITION, "--profile-model", "gpt-tiny", "--profile", str(tmp_path))
    if Path("/proc/self").exists():  # a read-only place that os.access calls writable for root
        with pytest.raises(ValueError, match="^--profile /proc/p.json cannot be written: /proc takes no new file"):
            _run(*PARTITION, "--profile-model", "gpt-tiny", "--profile", "/proc/p.json")
    with pytest.raises(ValueError, match="^--seq-len 1000 must be at most gpt-tiny's max_seq_len=128$"):
        _run(*PARTITION, "--profile-model", "gpt-tiny", "--seq-len", "1000")


def test_partition_profiling_flags_are_refused_with_a_profile_file(tmp_path):
    """They shape the profiling only; a given profile was measured at its own sizes (they used to be ignored)."""
    _, path = _profile(tmp_path)
    with pytest.raises(ValueError, match=r"^--microbatch-size 4 applies only with --profile-model"):
        _run(*PARTITION, "--profile", path, "--microbatch-size", "4")
    with pytest.raises(ValueError, match=r"^--seq-len 16, --dtype bfloat16 apply only with --profile-model .*them"):
        _run(*PARTITION, "--profile", path, "--seq-len", "16", "--dtype", "bfloat16")
    assert _run(*PARTITION, "--profile", path, "--json") == 0


def test_partition_profiles_a_run_config_as_plan_reads_it(monkeypatch, capsys):
    """--profile-model CFG takes a run config as `plan --model` does (the same resolver): its model, microbatch
    size, sequence and compute dtype, each flag overriding; it used to fail with "unknown model"."""
    from jaxhybrid.runtime.config_load import load_config

    seen = []

    def fake_profile(model, microbatch, seq, dtype):
        seen.append((model, microbatch, seq, dtype))
        return Profile(1.0, tuple(LayerCost(f"l{i}", 1.0, 2.0, 0.1, 0.5) for i in range(model.n_layers)))

    monkeypatch.setattr("jaxhybrid.cli.commands.partition.profile_model", fake_profile)
    cfg = load_config(RUNS / "tiny.yaml")
    assert _run(*PARTITION, "--profile-model", str(RUNS / "tiny.yaml"), "--json") == 0
    assert seen.pop() == (cfg.model, cfg.microbatch_size, cfg.data.seq_len, cfg.precision.compute_dtype)
    assert _run(*PARTITION, "--profile-model", str(RUNS / "tiny.yaml"), "--microbatch-size", "2", "--seq-len", "8",
                "--dtype", "bfloat16", "--json") == 0
    assert seen.pop() == (cfg.model, 2, 8, "bfloat16")
    assert _run(*PARTITION, "--profile-model", "gpt-tiny", "--json") == 0
    assert seen.pop()[1:] == (1, 128, "float32")  # a preset's defaults
    assert len(json.loads(capsys.readouterr().out.splitlines()[-1])["stages"]) >= 1
    with pytest.raises(ValueError, match="^--profile-model 'nope.yaml' is neither a preset"):
        _run(*PARTITION, "--profile-model", "nope.yaml")


def test_madpipe_and_pipedream_agree_on_the_processor_limit(tmp_path):
    prof, _ = _profile(tmp_path, layers=3)
    chain = Chain.from_profile(prof, memory=100.0, bandwidth=1.0)
    for fn in (pipedream, madpipe):
        with pytest.raises(ValueError, match=r"processors=4 must be in \[1, 3\]"):
            fn(chain, 4)
    assert len(pipedream(chain, 3).stages) <= 3 and np.isfinite(madpipe(chain, 3).valid_period)


# --- plan -----------------------------------------------------------------------------------------------


def test_plan_lists_only_hardware_with_bandwidths():
    from jaxhybrid.planner.costs import planner_hardware_names

    assert "cpu" not in planner_hardware_names() and "h100-node" in planner_hardware_names()
    with pytest.raises(ValueError, match=r"'cpu' has no bandwidth.*MFU.*planner can use frontier, h100-node"):
        load_hardware("cpu")
    with pytest.raises(FileNotFoundError, match="not found") as e:
        load_hardware("no-such-machine")
    assert "cpu" not in str(e.value) and "perlmutter" in str(e.value)


@pytest.mark.parametrize("gpus,gpn,match", [
    ("3", "2", r"--gpus=3 is neither a multiple of --gpus-per-node=2"),
    ("3", "8", r"--gpus=3 is neither a multiple of --gpus-per-node=8"),
    ("16", "16", r"--gpus-per-node=16 must be in \[1, 8\]: hardware 'h100-node' has gpus_per_node=8"),
])
def test_plan_rejects_partial_nodes_and_oversized_nodes_before_ranking(monkeypatch, gpus, gpn, match):
    monkeypatch.setattr("jaxhybrid.cli.commands.plan.rank_plans", lambda *a, **k: pytest.fail("ranked anyway"))
    with pytest.raises(ValueError, match=match):
        _run("plan", "--model", "gpt-tiny", "--gpus", gpus, "--gpus-per-node", gpn, "--hardware", "h100-node")


PLAN = ("plan", "--gpus", "2", "--gpus-per-node", "8", "--hardware", "h100-node")


@pytest.mark.parametrize("flag,value", [("--global-batch", "0"), ("--seq-len", "0"), ("--top", "0"),
                                        ("--top", "-1"), ("--global-batch", "x")])
def test_plan_counts_must_be_at_least_one(capsys, flag, value):
    """--global-batch 0 and --seq-len 0 used to fall back to the defaults, --top -1 to print all plans but
    the last and --top 0 an empty table."""
    assert _usage_error(capsys, *PLAN, "--model", "gpt-tiny", flag, value) == \
        f"jaxhybrid plan: error: argument {flag}: must be an integer >= 1 (got '{value}')"


@pytest.mark.parametrize("model", ["gpt-tiny", str(RUNS / "tiny.yaml")])
def test_plan_refuses_a_sequence_beyond_the_models_positions_before_ranking(monkeypatch, model):
    """train rejects data.seq_len > model.max_seq_len; plan used to rank layouts for it."""
    monkeypatch.setattr("jaxhybrid.cli.commands.plan.rank_plans", lambda *a, **k: pytest.fail("ranked anyway"))
    with pytest.raises(ValueError, match="^--seq-len 100000 must be at most gpt-tiny's max_seq_len=128$"):
        _run(*PLAN, "--model", model, "--seq-len", "100000")


def test_plan_top_one_prints_one_plan(capsys):
    assert _run(*PLAN, "--model", "gpt-tiny", "--top", "1", "--seq-len", "128", "--json") == 0
    assert len(json.loads(capsys.readouterr().out)["plans"]) == 1


def test_whole_nodes_or_a_divisor_of_one_are_accepted_and_suggested():
    from jaxhybrid.planner.plan import check_gpus

    for g, n in ((2, 8), (8, 8), (16, 8), (6, 6), (3, 6), (12, 6)):
        check_gpus(g, n)
    with pytest.raises(ValueError, match="neither a multiple"):
        rank_plans(None, 12, machine_from_hardware(load_hardware("h100-node"), 8, "bfloat16", 0.5), 8, 8)
    from jaxhybrid.core.config.model import PRESETS

    summit = machine_from_hardware(load_hardware("summit"), 6, "bfloat16", 0.5)
    with pytest.raises(ValueError, match=r"(\d+) GPUs would fit") as e:
        rank_plans(PRESETS["myelin-100b"], 2, summit, global_batch=64, seq=512)
    check_gpus(int(re.search(r"(\d+) GPUs would fit", str(e.value)).group(1)), 6)  # a count plan accepts


def test_plan_notes_that_tiny_collectives_are_not_ranked_meaningfully(capsys):
    """AxoNN's model has no latency term: a model whose collectives take under a few us gets a note."""
    assert _run("plan", "--model", "gpt-tiny", "--gpus", "2", "--gpus-per-node", "8", "--hardware", "h100-node",
                "--top", "3", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert all(0 < p["max_collective_s"] < 5e-6 for p in out["plans"])
    assert len(out["notes"]) == 1 and "bandwidth-only (AxoNN eqs. 1-9)" in out["notes"][0]
    assert _run("plan", "--model", "gpt-tiny", "--gpus", "2", "--gpus-per-node", "8", "--hardware",
                "h100-node", "--top", "3") == 0
    assert "note: every collective of all 3 plans is predicted under 5 us" in capsys.readouterr().out
    assert _run("plan", "--model", "gpt2-small", "--gpus", "8", "--gpus-per-node", "8", "--hardware",
                "h100-node", "--global-batch", "16", "--top", "3", "--json") == 0
    assert json.loads(capsys.readouterr().out)["notes"] == []  # MB-sized collectives: no note
    from jaxhybrid.planner.plan import latency_notes

    assert latency_notes([{"max_collective_s": 1e-3}, {"max_collective_s": 1e-6}, {"max_collective_s": 0.0}]) \
        [0].startswith("every collective of plans #1 is")  # a single GPU (no collective) gets none


# --- simulate -------------------------------------------------------------------------------------------


def test_simulate_errors_name_the_flags(capsys):
    with pytest.raises(ValueError, match="^--memory-saving needs --split-backward"):
        _run("simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--memory-saving")
    with pytest.raises(ValueError, match="--schedule 1f1b needs --microbatches M"):
        _run("simulate", "--schedule", "1f1b", "--stages", "4")
    with pytest.raises(ValueError, match="unknown schedule 'bogus'; valid choices"):
        _run("simulate", "--schedule", "bogus", "--stages", "4")
    assert _run("simulate", "--schedule", "1f1b-2", "--stages", "4", "--json") == 0  # 1f1b-K: M = K x stages
    assert json.loads(capsys.readouterr().out)["microbatches"] == 8


def test_simulate_pipeline_limit_is_for_myelin_only(capsys):
    """Like --period for 1f1b-star: a flag of another schedule is an error, not silently ignored."""
    with pytest.raises(ValueError, match="^--pipeline-limit applies to --schedule myelin only, not 1f1b$"):
        _run("simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--pipeline-limit", "2")
    assert _usage_error(capsys, "simulate", "--schedule", "myelin", "--stages", "4", "--microbatches", "8",
                        "--pipeline-limit", "0") == \
        "jaxhybrid simulate: error: argument --pipeline-limit: must be an integer >= 1 (got '0')"
    assert _run("simulate", "--schedule", "Myelin", "--stages", "4", "--microbatches", "8", "--pipeline-limit", "1",
                "--json") == 0  # schedule names are case-blind, for both flags
    assert json.loads(capsys.readouterr().out)["per_rank"][0]["peak_stashed"] == 1
    assert _run("simulate", "--schedule", "1F1B-STAR", "--stages", "3", "--microbatches", "6", "--period", "9") == 0


def test_simulate_peak_bytes_follow_the_given_activation_and_residual_bytes(capsys):
    """--activation-bytes / --residual-bytes (one value, or one per stage) weigh the stashed microbatches
    (2BP Sec. 4.2): 1F1B's first stage holds P activations at its peak; under 2BP a stage's peak mixes
    activations and the residuals its delayed weight passes still need."""
    base = ("simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--json")
    assert _run(*base, "--activation-bytes", "1e9,2e9,3e9,4e9") == 0
    ranks = json.loads(capsys.readouterr().out)["per_rank"]
    assert [r["peak_bytes"] for r in ranks] == [r["peak_stashed"] * a for r, a in zip(ranks, (1e9, 2e9, 3e9, 4e9))]
    assert ranks[0]["peak_stashed"] == 4
    assert _run(*base, "--split-backward", "--activation-bytes", "3", "--residual-bytes", "1") == 0
    split = json.loads(capsys.readouterr().out)["per_rank"]
    assert _run(*base, "--split-backward") == 0
    unit = json.loads(capsys.readouterr().out)["per_rank"]
    for r, u in zip(split, unit):  # residuals cheaper than activations: below 3 per stashed item, above 1
        assert r["peak_stashed"] == u["peak_stashed"] and u["peak_stashed"] <= r["peak_bytes"] < 3 * u["peak_stashed"]
    with pytest.raises(ValueError, match=r"^--residual-bytes '1,2': give one value, or 4"):
        _run(*base, "--residual-bytes", "1,2")
    with pytest.raises(ValueError, match=r"^--activation-bytes 'x': expected a number of bytes"):
        _run(*base, "--activation-bytes", "x")
