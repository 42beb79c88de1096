"""Metrics: Narayanan et al. flops against hand arithmetic, MFU / time to train, hardware files, and the
run writer (metrics.jsonl lines, TensorBoard events, progress output, resume, loss-curve PNG)."""
import io
import json

import numpy as np
import pytest

from jaxhybrid import metrics as M
from jaxhybrid.metrics_writer import MetricsWriter


def test_flops_formula_hand_computed():
    # B=2, s=8, l=2, h=16, V=32.  B s l h^2 = 2*8*2*256 = 8192.
    # With recomputation: 96 * 8192 = 786432; s/(6h) = 8/96 = 1/12; V/(16 l h) = 32/512 = 1/16
    #   -> 786432 * (1 + 1/12 + 1/16) = 786432 + 65536 + 49152 = 901120.
    assert M.flops_per_step(2, 8, 2, 16, 32, recompute=True) == pytest.approx(901120.0, rel=1e-12)
    # Without: 72 * 8192 = 589824; V/(12 l h) = 32/384 = 1/12
    #   -> 589824 * (1 + 1/12 + 1/12) = 589824 + 49152 + 49152 = 688128.
    assert M.flops_per_step(2, 8, 2, 16, 32, recompute=False) == pytest.approx(688128.0, rel=1e-12)
    with pytest.raises(ValueError, match="hidden=0"):
        M.flops_per_step(2, 8, 2, 0, 32)


def test_flops_gpt3_scale_matches_6nd_rule():
    # Sanity at scale: without recomputation the formula is ~ 6 * params * tokens (+ attention), so for
    # GPT-3 175B (l=96, h=12288, s=2048, V=51200; 12 l h^2 = 174.0e9 params) it lies within 5% of 6 N D.
    b, s, l, h, v = 1, 2048, 96, 12288, 51200
    six_nd = 6 * 12 * l * h * h * b * s
    assert 1.0 < M.flops_per_step(b, s, l, h, v, recompute=False) / six_nd < 1.05


def test_rates_and_time_to_train():
    # Myelin VI-D: 3e11 * t / (b s) with t = 1.5 s, b = 16, s = 512 -> 3e11 * 1.5 / 8192 s.
    assert M.time_to_train_s(1.5, 16, 512) == pytest.approx(54_931_640.625)
    assert M.tokens_per_s(16, 512, 2.0) == 4096.0
    assert M.tflops_per_device(2e12, 0.5, n_devices=2) == pytest.approx(2.0)  # 4e12 flop/s over 2 devices
    assert M.mfu(2e12, 0.5, 2, peak_tflops=10.0) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="peak_tflops=0"):
        M.mfu(1.0, 1.0, 1, 0.0)


def test_load_hardware():
    hw = M.load_hardware("cpu")
    assert hw["name"] == "cpu" and M.peak_tflops(hw, "float32") == pytest.approx(0.1)
    with pytest.raises(FileNotFoundError, match="available: .*cpu"):
        M.load_hardware("no-such-machine")
    with pytest.raises(ValueError, match="no peak_tflops for 'int4'"):
        M.peak_tflops(hw, "int4")


def test_auto_hardware_follows_the_device(tmp_path):
    """``metrics.hardware: auto``: the CPU file on a CPU, the file whose device_kinds names the GPU (an H100
    run once reported mfu 423% against the CPU file), and no MFU for a device no file names."""
    from types import SimpleNamespace as Dev

    assert M.hardware_for_device(Dev(platform="cpu", device_kind="cpu"))["name"] == "cpu"
    h100 = Dev(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    assert M.hardware_for_device(h100)["name"] == "h100-node"
    assert M.hardware_for_device(Dev(platform="gpu", device_kind="NVIDIA H200"))["name"] == "h200-node"
    assert M.run_peak_flops("auto", "bfloat16", h100) == (989e12,
                                                         "mfu against h100-node: 989 TFLOP/s bfloat16 per device")
    assert M.run_peak_flops("cpu", "float32", h100)[0] == pytest.approx(0.1e12)  # a named file wins
    peak, why = M.run_peak_flops("auto", "bfloat16", Dev(platform="gpu", device_kind="Imaginary X1"))
    assert peak is None and "mfu not reported" in why and "'Imaginary X1'" in why
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ndevice_kinds: H100\npeak_tflops: {float32: 1.0}\n")
    with pytest.raises(ValueError, match="device_kinds must be a list of non-empty strings, got 'H100'"):
        M.load_hardware(str(bad))


def _strict(line):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=refuse)


def _records(n, start=1):
    for step in range(start, start + n):
        yield step, {"loss": 5.0 - 0.1 * step, "tokens_per_s": np.float32(1000.0), "tflops_per_device": 0.01,
                     "mfu": 0.05, "step_time_s": 0.2, "loss_scale": float("inf") if step == 3 else 1.0,
                     "skipped": step == 3}


def test_writer_jsonl_tensorboard_plain_progress_and_plot(tmp_path):
    out = io.StringIO()  # not a terminal: plain lines every log_every steps, the first, the last, each eval
    w = MetricsWriter(tmp_path / "run", total_steps=7, tensorboard=True, progress=True, log_every=3, stream=out)
    for step, rec in _records(7):
        w.log(step, {**rec, "val_loss": 4.5} if step == 5 else rec)
    w.close(plot=True)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    recs = [_strict(l) for l in lines]
    assert [r["step"] for r in recs] == list(range(1, 8))
    assert recs[2]["loss_scale"] is None and recs[2]["skipped"] is True  # inf is not JSON: null
    assert recs[0]["tokens_per_s"] == 1000.0 and recs[6]["loss"] == pytest.approx(4.3)
    printed = out.getvalue().splitlines()
    assert [l.split()[1] for l in printed] == ["1/7", "3/7", "5/7", "6/7", "7/7"]
    assert "val_loss 4.5000" in printed[2]  # the validation loss is on the console too
    assert "loss 4.7000" in printed[1] and "SKIPPED" in printed[1]
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    png = (tmp_path / "run" / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_writer_resume_drops_lines_after_the_checkpoint(tmp_path):
    w = MetricsWriter(tmp_path, total_steps=10, tensorboard=False, progress=False)
    for step, rec in _records(6):
        w.log(step, rec)
    w.close(plot=False)
    # Crash after step 6, checkpoint at step 4: steps 5 and 6 will be recomputed by the resumed run.
    w = MetricsWriter(tmp_path, total_steps=10, tensorboard=False, progress=False, start_step=4)
    for step, rec in _records(2, start=5):
        w.log(step, rec)
    w.close(plot=True)
    assert [_strict(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "loss_curve.png").is_file()


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_writer_tty_shows_a_bar_not_lines(tmp_path):
    out = _Tty()
    w = MetricsWriter(tmp_path, total_steps=5, tensorboard=False, progress=True, log_every=1, stream=out)
    for step, rec in _records(5):
        w.log(step, rec)
    w.close(plot=False)
    text = out.getvalue()
    assert "5/5" in text and "\r" in text and "step 1/5" not in text


def test_non_writer_rank_writes_nothing(tmp_path):
    w = MetricsWriter(tmp_path / "rank1", total_steps=3, is_writer=False)
    for step, rec in _records(3):
        w.log(step, rec)
    w.close(plot=True)
    assert not (tmp_path / "rank1").exists()
