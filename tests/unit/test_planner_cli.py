"""The planner commands' flags: partition's profile sources and processor count, plan's hardware, GPU
counts and latency note, simulate's flag errors. Commands run in-process (no JAX start) unless they
profile a model."""
import json
import re

import numpy as np
import pytest

from jaxhybrid.cli import build_parser
from jaxhybrid.planner.chain import Chain
from jaxhybrid.planner.costs import LayerCost, Profile, load_hardware, save_profile
from jaxhybrid.planner.madpipe import madpipe
from jaxhybrid.planner.pipedream import pipedream
from jaxhybrid.planner.plan import machine_from_hardware, rank_plans


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
    from jaxhybrid.model import Model
    from jaxhybrid.model.config import resolve_model
    from jaxhybrid.model.stage import Stage

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

    monkeypatch.setattr("jaxhybrid.planner.profile.profile_model", no_profiling)
    with pytest.raises(ValueError, match=r"--processors=8 must be in \[1, 4\]"):
        _run("partition", "--profile-model", "gpt-tiny", "--processors", "8", "--memory", "1e9",
             "--bandwidth", "1e10", "--algorithm", algorithm)


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
    monkeypatch.setattr("jaxhybrid.commands.plan.rank_plans", lambda *a, **k: pytest.fail("ranked anyway"))
    with pytest.raises(ValueError, match=match):
        _run("plan", "--model", "gpt-tiny", "--gpus", gpus, "--gpus-per-node", gpn, "--hardware", "h100-node")


def test_whole_nodes_or_a_divisor_of_one_are_accepted_and_suggested():
    from jaxhybrid.planner.plan import check_gpus

    for g, n in ((2, 8), (8, 8), (16, 8), (6, 6), (3, 6), (12, 6)):
        check_gpus(g, n)
    with pytest.raises(ValueError, match="neither a multiple"):
        rank_plans(None, 12, machine_from_hardware(load_hardware("h100-node"), 8, "bfloat16", 0.5), 8, 8)
    from jaxhybrid.model.config import PRESETS

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
