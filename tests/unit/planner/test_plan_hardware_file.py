"""A hardware file as the planner reads it: its keys checked when read (each wrong value named with its file),
and its measured ``compute_model`` (an efficiency of peak plus a fixed time per block pass,
planner/step_model.Machine) and what that changes in the ranking."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from jaxhybrid.cli.main import main
from jaxhybrid.core.config.model import PRESETS
from jaxhybrid.core.layout import ParallelDims
from jaxhybrid.planner.costs import load_hardware
from jaxhybrid.planner.plan import machine_from_hardware
from jaxhybrid.planner.step_model import Layout, evaluate

# ``jaxhybrid plan --hardware FILE``: the planner's keys of a hardware file are checked when it is read,
# each wrong value named with its file. Before, a negative ``memory_bytes`` ranked against "-9e-10 GB
# usable", text where a number belongs ended in Python's bare "could not convert string to float",
# ``gpus_per_node: 0`` was blamed on ``--gpus-per-node`` ("must be in [1, 0]"), ``2.5`` and negative
# bandwidths were used as they were, and a zero or missing ``host_to_device`` crashed the offload model
# with a ZeroDivisionError traceback.

H100 = Path(__file__).resolve().parents[3] / "configs" / "hardware" / "h100-node.yaml"


def _plan(tmp_path, capsys, edit) -> tuple[int, str]:
    hw = yaml.safe_load(H100.read_text())
    edit(hw)
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(hw))
    rc = main(["plan", "--model", "gpt-tiny", "--gpus", "2", "--gpus-per-node", "2", "--hardware", str(path),
               "--global-batch", "16", "--top", "1"])
    return rc, capsys.readouterr().err


def _set(*keys, value):
    def edit(hw):
        d = hw
        for k in keys[:-1]:
            d = d[k]
        if value is None:
            del d[keys[-1]]
        else:
            d[keys[-1]] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_set("memory_bytes", value=-1), "memory_bytes=-1 must be a finite number > 0"),
    (_set("memory_bytes", value="lots"), "memory_bytes='lots' must be a finite number > 0"),
    (_set("gpus_per_node", value=0), "gpus_per_node=0 must be an integer >= 1"),
    (_set("gpus_per_node", value=2.5), "gpus_per_node=2.5 must be an integer >= 1"),
    (_set("bandwidth", "inter_node", value=-5), "bandwidth.inter_node=-5 must be a finite number > 0"),
    (_set("bandwidth", "host_to_device", value=0), "bandwidth.host_to_device=0 must be a finite number > 0"),
    (_set("bandwidth", "host_to_device", value=None), "bandwidth.host_to_device is missing"),
    (_set("bandwidth", "intra_node", value=[{"span": 0, "bytes_per_s": 1e9}]),
     "bandwidth.intra_node[0].span=0 must be an integer >= 1"),
    (_set("bandwidth", "intra_node", value=[{"span": 8, "bytes_per_s": "abc"}]),
     "bandwidth.intra_node[0].bytes_per_s='abc' must be a finite number > 0"),
    (_set("bandwidth", "intra_node", value=450e9), "bandwidth.intra_node=450000000000.0 must be a list of "),
])
def test_a_wrong_planner_value_is_named_with_its_file(tmp_path, capsys, edit, message):
    rc, err = _plan(tmp_path, capsys, edit)
    assert rc == 2, err
    assert err.startswith(f"jaxhybrid plan: error: hardware file {tmp_path / 'hw.yaml'}: "), err
    assert message in err, err


def test_the_shipped_file_as_it_is_plans(tmp_path, capsys):
    assert _plan(tmp_path, capsys, lambda hw: None)[0] == 0


# The planner's compute curve: a hardware file's measured ``compute_model`` (an efficiency of peak plus a fixed
# time per block pass, planner/step_model.Machine) and what it changes in the ranking.

def test_the_hardware_files_compute_model_sets_the_efficiency_and_the_block_overheads():
    h = load_hardware("h200-node")
    m = machine_from_hardware(h, 8, "bfloat16")
    assert m.flops_per_s == pytest.approx(989e12 * 0.61) and m.block_overhead_s == (8.1e-5, 2.11e-4)
    # An unmeasured dtype, or a file without the curve: the constant default, no overhead.
    assert machine_from_hardware(h, 8, "float32").flops_per_s == pytest.approx(67e12 * 0.5)
    assert machine_from_hardware(h, 8, "float32").block_overhead_s == (0.0, 0.0)
    assert machine_from_hardware(load_hardware("h100-node"), 8, "bfloat16").block_overhead_s == (0.0, 0.0)
    # Explicit values win. An efficiency alone is a flat curve: the file's overheads belong to its own fit.
    m = machine_from_hardware(h, 8, "bfloat16", 0.5)
    assert m.flops_per_s == pytest.approx(989e12 * 0.5) and m.block_overhead_s == (0.0, 0.0)
    m = machine_from_hardware(h, 8, "bfloat16", block_overhead_s=(0.0, 0.0))
    assert m.flops_per_s == pytest.approx(989e12 * 0.61) and m.block_overhead_s == (0.0, 0.0)
    assert machine_from_hardware(h, 8, "bfloat16", 0.5, block_overhead_s=(1e-4, 2e-4)).block_overhead_s == (1e-4, 2e-4)
    # Numbers as YAML reads them: a float with no dot (``2e-05``, as json.dumps prints it) is a string.
    h = {**h, **yaml.safe_load("compute_model: {bfloat16: {efficiency: 2e-01, block_overhead_s: [8e-05, 2e-04]}}")}
    m = machine_from_hardware(h, 8, "bfloat16")
    assert m.flops_per_s == pytest.approx(989e12 * 0.2) and m.block_overhead_s == (8e-5, 2e-4)


@pytest.mark.parametrize("entry", [{"efficiency": 1.5, "block_overhead_s": [0, 0]},
                                   {"efficiency": 0.6, "block_overhead_s": [1e-4]},
                                   {"efficiency": 0.6, "block_overhead_s": [-1e-4, 0]}, "fast",
                                   {"efficiency": True, "block_overhead_s": [0, 0]}])
def test_a_malformed_compute_model_is_refused_naming_it(entry):
    h = {**load_hardware("h200-node"), "compute_model": {"bfloat16": entry}}
    with pytest.raises(ValueError, match=r"hardware 'h200-node': compute_model.bfloat16=.* must be"):
        machine_from_hardware(h, 8, "bfloat16")
    with pytest.raises(ValueError, match=r"hardware 'h200-node': compute_model='fast' must map a dtype"):
        machine_from_hardware({**h, "compute_model": "fast"}, 8, "bfloat16")
    with pytest.raises(ValueError, match=r"block overhead \(0.1, -1.0\) must be two seconds per block"):
        machine_from_hardware(load_hardware("h100-node"), 8, "bfloat16", block_overhead_s=(0.1, -1.0))


@pytest.mark.parametrize("remat, forwards", [("none", 1), ("full", 2)])
def test_block_overheads_add_their_time_to_every_block_pass(remat, forwards):
    """One stage runs its M microbatches in turn, so the step's compute is M x (F + BI + BW) exactly; each
    block's forward (run again in the backward under remat full) and backward add their overheads."""
    cfg, h = PRESETS["gpt2-small"], load_hardware("h200-node")
    lay = Layout(ParallelDims(1, 8, 1, 1, 1), 2, 4, "1f1b", False, False, remat)
    plain = evaluate(cfg, lay, machine_from_hardware(h, 8, "bfloat16", 0.6, block_overhead_s=(0, 0)), 1024)
    o_f, o_b = 1e-4, 3e-4
    with_over = evaluate(cfg, lay, machine_from_hardware(h, 8, "bfloat16", 0.6, block_overhead_s=(o_f, o_b)), 1024)
    added = with_over["pipeline_s"] - plain["pipeline_s"]
    assert added == pytest.approx(4 * cfg.n_layers * (forwards * o_f + o_b))


def test_the_measured_curve_makes_larger_microbatches_pay_off():
    """The known limit it answers: at a constant fraction of peak the smallest microbatch (the smallest
    bubble) always won. With the H200's measured curve, a 7B model's 2-stage pipeline runs faster with 4
    sequences per microbatch than with 1 (``jaxhybrid plan`` then ranks mb 4 first: README)."""
    cfg, h = PRESETS["2bp-transformer-7b"], load_hardware("h200-node")
    dims = ParallelDims(2, 8, 1, 1, 1)
    step = lambda m, mb: evaluate(cfg, Layout(dims, mb, 32 // mb, "1f1b", True, False, "none"), m,  # noqa: E731
                                  1024)["predicted_step_s"]
    flat = machine_from_hardware(h, 8, "bfloat16", 0.5, block_overhead_s=(0.0, 0.0))
    curve = machine_from_hardware(h, 8, "bfloat16")
    assert step(flat, 1) < step(flat, 4)
    assert step(curve, 4) < step(curve, 1)


def test_plan_cli_prints_the_curve_and_refuses_bad_overheads(capsys):
    base = ["plan", "--model", "gpt-tiny", "--gpus", "2", "--gpus-per-node", "8", "--hardware", "h200-node",
            "--top", "1", "--no-tensor", "--global-batch", "8", "--no-offload"]
    assert main(base) == 0
    assert "bfloat16 at 61% of peak + 81 / 211 us per block forward / backward" in capsys.readouterr().out
    assert main(base + ["--json", "--efficiency", "0.4", "--block-overhead", "1e-4,2e-4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["efficiency"] == pytest.approx(0.4) and out["block_overhead_s"] == [1e-4, 2e-4]
    for bad in ("1e-4", "a,b", "1e-4,inf", "-1,0"):
        with pytest.raises(SystemExit) as e:
            main(base + [f"--block-overhead={bad}"])
        assert e.value.code == 2
        assert "give two seconds per block, forward and backward" in capsys.readouterr().err


def test_the_fit_recovers_a_known_curve_and_needs_both_passes():
    from jaxhybrid.planner.machine import fit_compute_model

    peak, eff, o_f, o_b = 1e15, 0.6, 8e-5, 2e-4
    pts = [(f, f / (eff * peak) + o_f, 0) for f in (1e10, 1e11, 1e12)]
    pts += [(2 * f, 2 * f / (eff * peak) + o_b, 1) for f in (1e10, 1e11, 1e12)]
    fit = fit_compute_model(pts, peak)
    assert fit["efficiency"] == pytest.approx(eff) and fit["max_rel_err"] < 1e-9
    assert fit["block_overhead_s"] == pytest.approx([o_f, o_b])
    with pytest.raises(ValueError, match="needs forward and backward passes"):
        fit_compute_model(pts[:3], peak)


def test_bench_curve_prints_a_line_the_planner_reads(capsys):
    """On the CPU the times are wall times (no device timeline); the fitted line, pasted into a hardware
    file, is a compute_model that ``jaxhybrid plan`` accepts."""
    assert main(["bench", "curve", "--case", "gpt-tiny:1", "--case", "gpt-tiny:16", "--blocks", "1", "--seq-len",
                 "32", "--repeats", "1", "--peak-tflops", "1000"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["timing"] == "wall" and out["dtype"] == "float32"
    assert [(r["model"], r["microbatch_size"]) for r in out["rows"]] == [("gpt-tiny", 1), ("gpt-tiny", 16)]
    assert all(r["forward_s_per_block"] > 0 and r["backward_s_per_block"] > 0 for r in out["rows"])
    hw = {**load_hardware("h200-node"), "peak_tflops": {"float32": 1000.0}, **yaml.safe_load(out["hardware_file_line"])}
    m = machine_from_hardware(hw, 8, "float32")
    assert m.flops_per_s == pytest.approx(1000e12 * out["fit"]["efficiency"], rel=1e-2)
    with pytest.raises(SystemExit):
        main(["bench", "curve", "--case", "gpt-tiny"])
    assert "give MODEL:MICROBATCH" in capsys.readouterr().err
    for bad, message in ((["--blocks", "3"], r"--blocks 3: a middle stage of gpt-tiny \(4 blocks\) has at most 2"),
                         (["--peak-tflops", "0"], r"--peak-tflops 0.0 must be a positive number")):
        assert main(["bench", "curve", "--case", "gpt-tiny:1", *bad]) != 0
        assert re.search(message, capsys.readouterr().err)
