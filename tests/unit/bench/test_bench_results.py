"""What the benchmarks print and time: ``bench stage``'s JSON and ``bench offload --tensor``'s
compile-once warm-up. Timings are not asserted (shared, noisy machines); the JSON contract, the correctness
figures and the compile counts are."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxhybrid.model.testing import TOLERANCES

ARGS = ["bench", "stage", "--model", "gpt-tiny", "--blocks", "2", "--microbatch-size", "2", "--seq-len", "16",
        "--concat", "3", "--repeats", "2", "--json"]


@pytest.mark.slow
def test_bench_stage_prints_the_kernels_side_by_side(capsys):
    from jaxhybrid.cli.main import main

    assert main(ARGS) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for k in ("forward_s", "backward_fused_s", "backward_split_s", "backward_input_s", "backward_weight_s",
              "backward_weight_concat_s", "backward_weight_sum_s", "concat_s"):
        assert out[k] > 0, k
    # The goal's ratio: one microbatch's two passes under one sync, as the fused pass runs under one;
    # and the same two passes each synchronised on its own.
    assert out["split_over_fused"] == pytest.approx(out["backward_split_s"] / out["backward_fused_s"])
    assert out["split_over_fused_per_call"] == pytest.approx(
        (out["backward_input_s"] + out["backward_weight_s"]) / out["backward_fused_s"])
    # The K-microbatch ratios count what the pipeline pays per microbatch: the copy too for concat.
    assert out["split_concat_over_fused"] == pytest.approx(
        (out["backward_input_s"] + out["concat_s"] + out["backward_weight_concat_s"]) / out["backward_fused_s"])
    assert out["split_sum_over_fused"] == pytest.approx(
        (out["backward_input_s"] + out["backward_weight_sum_s"]) / out["backward_fused_s"])
    for state in ("cold", "warm"):  # the same ratio from a known cache state
        t = out["cache_state_s"][state]
        assert min(t.values()) > 0, state
        assert set(t) == {"backward_fused", "backward_input", "backward_weight"}
        assert out[f"split_over_fused_{state}"] == pytest.approx(
            (t["backward_input"] + t["backward_weight"]) / t["backward_fused"])
    costs = out["xla_costs"]  # XLA's count of the compiled kernels: deterministic, asserted exactly
    for key, field in (("flops", "split_flops_over_fused"), ("bytes_accessed", "split_bytes_over_fused")):
        assert out[field] == pytest.approx(
            (costs["backward_input"][key] + costs["backward_weight"][key]) / costs["backward"][key])
    assert all(c["entry_ops"] > 0 for c in costs.values()), costs
    # The host's side of a call: a trivial program's, and each backward's enqueueing from an idle device.
    assert out["noop_call_s"] > 0
    assert set(out["dispatch_s"]) == {"backward_fused", "backward_input", "backward_weight"}
    assert min(out["dispatch_s"].values()) > 0
    assert out["grad_max_rel_err"] <= TOLERANCES["fp32_kernel"]
    assert out["concat_sum_max_rel_err"] <= TOLERANCES["fp32_kernel"]
    assert out["list_sum_max_rel_err"] <= TOLERANCES["fp32_kernel"]
    assert out["blocks"] == [1, 3] and out["concat_k"] == 3
    # auto's join for the K = 3 microbatches, by its rule (stage.auto_weight_join)
    r, g, k = out["weight_residual_bytes"], out["param_bytes"], out["concat_k"]
    assert out["weight_join_auto"] == ("concat" if 2 * k * r + g < k * g and k * r <= g else "sum")
    malloc = out["host_malloc"]  # said either way: the settings, or why none
    assert (malloc["applied"] and malloc["M_MMAP_MAX"] == 0) or (not malloc["applied"] and malloc["reason"])


def test_bench_stage_bad_block_range_names_the_values(capsys):
    from jaxhybrid.cli.main import main

    assert main(ARGS[:5] + ["3:9"] + ARGS[6:]) != 0
    assert "stage block range [3, 9) is empty or outside the model's 4 blocks" in capsys.readouterr().err
    assert main(ARGS[:5] + ["a:b"] + ARGS[6:]) == 2
    assert "--blocks 'a:b': give N (a stage of N blocks) or LO:HI" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_stage_set_changes_a_presets_width(capsys):
    """``--set`` overrides as train's (a preset at another width); with ``--model`` they would be lost."""
    from jaxhybrid.cli.main import main

    rest = ["--blocks", "1", "--microbatch-size", "1", "--seq-len", "8", "--concat", "2", "--repeats", "1", "--json"]
    assert main(["bench", "stage", "--set", "model.name=llama-tiny", "--set", "model.d_model=32",
                 "--set", "model.d_ff=64"] + rest) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["model"], out["d_model"], out["d_ff"]) == ("llama-tiny", 32, 64)
    assert out["grad_max_rel_err"] <= TOLERANCES["fp32_kernel"]
    assert main(["bench", "stage", "--model", "gpt-tiny", "--set", "model.d_model=32"] + rest) != 0
    assert "--model gpt-tiny replaces the whole model config, so model.d_model=32 would be lost" in \
        capsys.readouterr().err


def test_entry_ops_counts_the_instructions_that_launch_work():
    """Only the ENTRY computation counts (not the fused computations it calls), and parameters, constants,
    tuples (a tuple-typed result too) and bitcasts launch nothing."""
    from jaxhybrid.parallel.twobp.stage_costs import entry_ops

    hlo = """HloModule m

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %e = f32[4]{0} exponential(%p)
}

ENTRY %main.2 (a.1: f32[4], b.1: f32[4]) -> (f32[4], f32[]) {
  %a.1 = f32[4]{0} parameter(0), metadata={op_name="a"}
  %b.1 = f32[4]{0} parameter(1)
  %c = f32[] constant(1)
  %f = f32[4]{0} fusion(%a.1), kind=kLoop, calls=%fused_computation
  %g = (f32[4]{0}, s8[16]{0}) custom-call(%f, %b.1), custom_call_target="__cublas$gemm"
  %h = f32[4]{0} get-tuple-element(%g), index=0
  %i = f32[2,2]{1,0} bitcast(%h)
  %j = f32[4]{0} copy(%b.1)
  ROOT %t = (f32[4]{0}, f32[]) tuple(%j, %c)
}
"""
    assert entry_ops(hlo) == 3  # the fusion, the custom call and the copy


# ``jaxhybrid bench offload --tensor``: the on-device baseline's update compiles once, in the untimed
# warm-up step. Its optimizer state was left uncommitted (the trainer commits it: ``build.committed``), so
# the update compiled again on its second call, inside the first timed round, and with ``--rounds 1`` the
# baseline's step time and the offload ratio were off by several times.

@pytest.mark.slow
def test_baseline_update_compiles_once():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_LOG_COMPILES="1", JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "jaxhybrid", "bench", "offload", "--tensor", "1,1,1,2",
                        "--steps", "1", "--rounds", "1", "--json"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # DeviceUpdater.apply is the baseline's one jit(apply); the offloaded updater's buckets run jit(update).
    compiles = [line for line in r.stderr.splitlines() if "Compiling jit(apply)" in line]
    assert len(compiles) == 1, f"{len(compiles)} compiles of the baseline's update:\n" + "\n".join(
        c[:300] for c in compiles)
