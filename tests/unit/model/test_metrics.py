"""Metrics: model and hardware flops against hand arithmetic and Narayanan et al., MFU / HFU / time to
train, hardware files, and the run writer (metrics.jsonl lines, TensorBoard events, progress output,
resume, loss-curve PNG)."""
import dataclasses
import io
import json

import numpy as np
import pytest

from jaxhybrid.core import hardware as H
from jaxhybrid.core.config.model import PRESETS, ModelConfig
from jaxhybrid.model import flops as M
from jaxhybrid.runtime.metrics.writer import MetricsWriter


def _narayanan(b, s, l, h, v, recompute):
    """Narayanan et al. (2021) eq. 3, the closed form the trainer used before: GPT shapes only."""
    if recompute:
        return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
    return 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))


def _gpt(d, layers, heads, vocab, d_ff=None, seq=1024):
    return ModelConfig(name="t", kind="gpt2", vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads,
                       d_ff=4 * d if d_ff is None else d_ff, max_seq_len=seq)


def test_flops_hand_computed_per_remat():
    # B=2, s=8, l=2, h=16 (d_ff=64, 2 heads), V=32; T = 16 tokens.
    # Block forward: 2 T (16*48 + 16*16 + 16*64 + 64*16) = 32 * 3072 = 98304, attention core 4*2*64*16 = 8192
    #   -> 106496 per block, 212992 for both; head 2*16*16*32 = 16384; forward 229376.
    cfg = _gpt(16, 2, 2, 32, seq=8)
    assert M.forward_flops(cfg, 2, 8) == 229376.0
    assert M.model_flops_per_step(cfg, 2, 8) == 3 * 229376.0 == 688128.0  # = Narayanan's 72x form
    assert M.hardware_flops_per_step(cfg, 2, 8, "none") == 688128.0
    assert M.hardware_flops_per_step(cfg, 2, 8, "dots") == 688128.0 + 2 * 8192  # the attention cores again
    assert M.hardware_flops_per_step(cfg, 2, 8, "full") == 688128.0 + 212992  # the blocks' forward again
    assert 688128.0 + 212992 == 901120.0  # = Narayanan's 96x form (4 passes of the blocks, 3 of the head)
    with pytest.raises(ValueError, match="remat='selective'"):
        M.hardware_flops_per_step(cfg, 2, 8, "selective")
    with pytest.raises(ValueError, match="batch=0"):
        M.model_flops_per_step(cfg, 0, 8)


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt2-small", "myelin-12b", "axonn-gpt-80b"])
def test_gpt2_shapes_give_narayanan_exactly(name):
    """d_ff = 4d and full multi-head attention: the count from the matmul shapes is Narayanan's closed form,
    72x without recomputation and 96x with full recomputation, to float rounding (relative 1e-12)."""
    cfg = PRESETS[name]
    assert cfg.d_ff == 4 * cfg.d_model and cfg.kv_heads == cfg.n_heads
    b, s, l, h, v = 3, cfg.max_seq_len, cfg.n_layers, cfg.d_model, cfg.vocab_size
    assert M.model_flops_per_step(cfg, b, s) == pytest.approx(_narayanan(b, s, l, h, v, False), rel=1e-12)
    assert M.hardware_flops_per_step(cfg, b, s, "full") == pytest.approx(_narayanan(b, s, l, h, v, True), rel=1e-12)


def test_flops_follow_d_ff_and_llama_gqa_swiglu():
    # The audit's case: gpt-tiny (d=64, 4 blocks, V=256) with d_ff=1024 at 16 x 128 tokens (T=2048).
    # Block: 2T (4*64^2 + 2*64*1024) = 603979776, attention 4*16*128^2*64 = 67108864; x4 = 2684354560;
    # head 2T*64*256 = 67108864; 3 x 2751463424 = 8254390272, 2.41x the 72x form's 3422552064 (d_ff=4d).
    wide = dataclasses.replace(PRESETS["gpt-tiny"], d_ff=1024)
    assert M.model_flops_per_step(wide, 16, 128) == 8254390272.0
    assert _narayanan(16, 128, 4, 64, 256, False) == pytest.approx(3422552064.0, rel=1e-12)
    # llama-tiny: d=64, 4 heads of 16, 2 k/v heads (width 32), SwiGLU d_ff=192, V=256; B=2, s=8, T=16.
    # Matmuls: 64*(64+2*32) + 64*64 + 64*(2*192) + 192*64 = 8192 + 4096 + 24576 + 12288 = 49152.
    # Block 2*16*49152 + 4*2*64*64 = 1572864 + 32768 = 1605632; x4 = 6422528; head 2*16*64*256 = 524288;
    # 3 x 6946816 = 20840448. (Its shapes sum to 12 d^2, GPT's, so this equals the 72x form by coincidence.)
    llama = PRESETS["llama-tiny"]
    assert M.model_flops_per_step(llama, 2, 8) == 20840448.0
    assert M.model_flops_per_step(llama, 2, 8) == pytest.approx(_narayanan(2, 8, 4, 64, 256, False), rel=1e-12)
    # One k/v head (width 16) and d_ff=256: 64*96 + 4096 + 64*512 + 256*64 = 59392 per token and block;
    # 2*16*59392 + 32768 = 1933312, x4 = 7733248, + 524288 = 8257536; x3 = 24772608 (the 72x form: 20840448).
    mqa = dataclasses.replace(llama, n_kv_heads=1, d_ff=256)
    assert M.model_flops_per_step(mqa, 2, 8) == 24772608.0
    # dots recomputes the attention cores only, whatever the k/v heads: 4 x 4*2*64*64.
    assert M.hardware_flops_per_step(mqa, 2, 8, "dots") - 24772608.0 == 4 * 32768


def test_flops_gpt3_scale_matches_6nd_rule():
    # Sanity at scale: the model flops are ~ 6 * params * tokens (+ attention), so for GPT-3 175B
    # (l=96, h=12288, s=2048, V=51200; 12 l h^2 = 174.0e9 params) they lie within 5% of 6 N D.
    b, s, l, h, v = 1, 2048, 96, 12288, 51200
    six_nd = 6 * 12 * l * h * h * b * s
    assert 1.0 < M.model_flops_per_step(_gpt(h, l, 96, v, seq=s), b, s) / six_nd < 1.05


def test_step_flop_rates():
    # 4e12 model and 5e12 hardware flops in 0.5 s over 2 devices: 4 and 5 TFLOP/s per device; peak 10.
    r = M.step_flop_rates(4e12, 5e12, 0.5, 2, 10e12)
    assert r == pytest.approx({"tflops_per_device": 4.0, "mfu": 0.4, "hw_tflops_per_device": 5.0, "hfu": 0.5})
    r = M.step_flop_rates(4e12, 5e12, 0.5, 2, None)  # no peak for the device: null ratios
    assert r["mfu"] is None and r["hfu"] is None and r["hw_tflops_per_device"] == pytest.approx(5.0)


def test_rates_and_time_to_train():
    # Myelin VI-D: 3e11 * t / (b s) with t = 1.5 s, b = 16, s = 512 -> 3e11 * 1.5 / 8192 s.
    assert M.time_to_train_s(1.5, 16, 512) == pytest.approx(54_931_640.625)
    assert M.tokens_per_s(16, 512, 2.0) == 4096.0
    assert M.tflops_per_device(2e12, 0.5, n_devices=2) == pytest.approx(2.0)  # 4e12 flop/s over 2 devices
    assert M.mfu(2e12, 0.5, 2, peak_tflops=10.0) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="peak_tflops=0"):
        M.mfu(1.0, 1.0, 1, 0.0)


def test_load_hardware():
    hw = H.load_hardware("cpu")
    assert hw["name"] == "cpu" and H.peak_tflops(hw, "float32") == pytest.approx(0.1)
    with pytest.raises(FileNotFoundError, match="available: .*cpu"):
        H.load_hardware("no-such-machine")
    with pytest.raises(ValueError, match="no peak_tflops for 'int4'"):
        H.peak_tflops(hw, "int4")


def test_auto_hardware_follows_the_device(tmp_path):
    """``metrics.hardware: auto``: the CPU file on a CPU, the file whose device_kinds names the GPU (against
    the CPU file a GPU run reports an MFU far over 100%), and no MFU for a device no file names."""
    from types import SimpleNamespace as Dev

    assert H.hardware_for_device(Dev(platform="cpu", device_kind="cpu"))["name"] == "cpu"
    h100 = Dev(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    assert H.hardware_for_device(h100)["name"] == "h100-node"
    assert H.hardware_for_device(Dev(platform="gpu", device_kind="NVIDIA H200"))["name"] == "h200-node"
    assert H.run_peak_flops("auto", "bfloat16", h100) == (989e12,
                                                         "mfu against h100-node: 989 TFLOP/s bfloat16 per device")
    assert H.run_peak_flops("cpu", "float32", h100)[0] == pytest.approx(0.1e12)  # a named file wins
    peak, why = H.run_peak_flops("auto", "bfloat16", Dev(platform="gpu", device_kind="Imaginary X1"))
    assert peak is None and "mfu not reported" in why and "'Imaginary X1'" in why
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ndevice_kinds: H100\npeak_tflops: {float32: 1.0}\n")
    with pytest.raises(ValueError, match="device_kinds must be a list of non-empty strings, got 'H100'"):
        H.load_hardware(str(bad))


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
        w.log(step, {**rec, "val_loss": 4.5, "val_ppl": 90.0171313, "eval_time_s": 0.25} if step == 5 else rec)
    w.close(plot=True)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    recs = [_strict(l) for l in lines]
    assert [r["step"] for r in recs] == list(range(1, 8))
    assert recs[2]["loss_scale"] is None and recs[2]["skipped"] is True  # inf is not JSON: null
    assert recs[0]["tokens_per_s"] == 1000.0 and recs[6]["loss"] == pytest.approx(4.3)
    printed = out.getvalue().splitlines()
    assert [l.split()[1] for l in printed] == ["1/7", "3/7", "5/7", "6/7", "7/7"]
    # The validation loss, its perplexity and the evaluation's time are on the console too.
    assert "val_loss 4.5000  val_ppl 90.02  eval 0.25 s" in printed[2]
    assert "loss 4.7000" in printed[1] and "SKIPPED" in printed[1]
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    png = (tmp_path / "run" / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def _tb_events(logdir):
    """(file, step, {tag: value}, session_start) of every record of the event files in ``logdir``."""
    import struct

    from tensorboardX.proto.event_pb2 import Event, SessionLog

    out = []
    for f in sorted(logdir.glob("events.out.tfevents.*")):
        b, i = f.read_bytes(), 0
        while i + 12 <= len(b):
            (n,) = struct.unpack("<Q", b[i:i + 8])
            e = Event()
            e.ParseFromString(b[i + 12:i + 12 + n])
            out.append((f.name, e.step, {v.tag: v.simple_value for v in e.summary.value},
                        e.session_log.status == SessionLog.START))
            i += 12 + n + 4
    return out


def test_tensorboard_holds_every_logged_step_before_close_and_tags_eval_under_val(tmp_path):
    """A killed run (no close) keeps in TensorBoard every step metrics.jsonl has (they were flushed only
    every log_every steps, and tensorboardX's queue held the newest even then); the evaluation's figures,
    eval_time_s included, are under val/; hfu is on the console line."""
    out = io.StringIO()
    w = MetricsWriter(tmp_path, total_steps=7, tensorboard=True, progress=True, log_every=3, stream=out)
    for step, rec in _records(7):
        rec = {**rec, "hw_tflops_per_device": 0.02, "hfu": 0.1}
        w.log(step, {**rec, "val_loss": 4.5, "val_ppl": 90.0, "eval_time_s": 0.25} if step == 5 else rec)
    events = _tb_events(tmp_path / "tensorboard")  # before close: as a SIGKILL would leave it
    steps = {step: tags for _, step, tags, _ in events if tags}
    assert sorted(steps) == list(range(1, 8))
    assert steps[5]["val/loss"] == 4.5 and steps[5]["val/ppl"] == 90.0 and steps[5]["val/time_s"] == 0.25
    assert not any(t.startswith("train/val") or t == "train/eval_time_s" for tags in steps.values() for t in tags)
    assert steps[7]["train/hfu"] == pytest.approx(0.1) and steps[7]["train/mfu"] == pytest.approx(0.05)
    assert "mfu 5.0%  hfu 10.0%" in out.getvalue().splitlines()[-1]
    w.close(plot=False)
    # A resumed run writes a new file (the old one kept) that starts a session at its first step, so
    # TensorBoard hides the first run's events of steps 5 to 7.
    w = MetricsWriter(tmp_path, total_steps=7, tensorboard=True, progress=False, start_step=4)
    w.log(5, dict(next(_records(1, start=5))[1]))
    events = _tb_events(tmp_path / "tensorboard")
    assert len({f for f, *_ in events}) == 2
    assert [(step, bool(tags)) for _, step, tags, start in events if start] == [(5, False)]
    w.close(plot=False)


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


def test_loss_curve_title_is_the_run_name_else_the_directory(tmp_path, monkeypatch):
    import jaxhybrid.runtime.metrics.writer as mwmod

    titles = []
    monkeypatch.setattr(mwmod, "plot_loss", lambda points, path, title="", val=(): titles.append(title))
    for name, title in (("a", "gpt-tiny sweep 3"), ("b", "")):
        with MetricsWriter(tmp_path / name, total_steps=1, tensorboard=False, progress=False, title=title) as w:
            w.log(1, {"loss": 1.0})
            w.close(plot=True)
    assert titles == ["gpt-tiny sweep 3", "b"]
