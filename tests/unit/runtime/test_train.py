"""Single-device trainer: loss falls on real text, bit-exact resume, overflow skipping, CLI bad input."""
import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid.cli.main import main
from jaxhybrid.model.testing import assert_tree_close
from jaxhybrid.runtime import data as data_lib
from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.data.splits import open_dataset, validation_batches
from jaxhybrid.runtime.trainer import Trainer

FAST = ["model.name=gpt-tiny", "model.n_layers=2", "data.seq_len=32", "train.global_batch=4",
        "metrics.progress=false", "metrics.tensorboard=false", "metrics.plot=false", "optim.warmup_steps=2"]


def _cfg(tmp_path, *extra, name="run"):
    return load_config(None, FAST + [f"run.dir={tmp_path / name}"] + list(extra))


def _losses(run_dir):
    return [json.loads(l)["loss"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_loss_falls_on_real_text(tmp_path):
    cfg = _cfg(tmp_path, "train.steps=40", "optim.lr=3e-3", "train.global_batch=8", "metrics.plot=true",
               "train.eval_every=15", "train.eval_batches=2")
    t = Trainer(cfg)
    out = t.run()
    losses = _losses(tmp_path / "run")
    assert len(losses) == 40
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert last < first - 1.0, (first, last)  # byte-level text: from ~ln(256)=5.5 to well below
    recs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for key in ("step", "loss", "tokens_per_s", "tflops_per_device", "mfu", "step_time_s", "loss_scale"):
        assert key in recs[-1]
    assert (tmp_path / "run" / "config.yaml").is_file() and (tmp_path / "run" / "loss_curve.png").is_file()
    assert out["last_loss"] == losses[-1]
    # Validation every 15 steps and at the end, on the held-out split, with the parameters after the step.
    val = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    assert sorted(val) == [15, 30, 40] and val[40] < val[15] and out["last_val_loss"] == val[40]
    batches = validation_batches(cfg)
    held_out = open_dataset(cfg, "val").tokens
    assert len(batches) == 2 and all(b.shape == (8, 33) for b in batches)
    starts = data_lib.Sampler(open_dataset(cfg, "val"), 32, 8, cfg.train.seed).starts(0)
    assert np.array_equal(batches[0], np.stack([held_out[i:i + 33] for i in starts]))
    model, params = t.model, t.final_state.params
    want = np.mean([float(model.loss(params, b[:, :-1], b[:, 1:])) for b in batches])
    assert_tree_close(np.float32(val[40]), np.float32(want), "fp32_parity", "val_loss at the last step")


def test_mfu_over_the_devices_peak_or_null(tmp_path, monkeypatch, capsys):
    """``metrics.hardware: auto`` on a CPU divides by cpu.yaml's peak (and says so); a device that no
    hardware file names records ``mfu: null`` instead of a ratio against another machine's peak."""
    from jaxhybrid.runtime import trainer as trainer_module

    Trainer(_cfg(tmp_path, "train.steps=2", name="cpu")).run()
    rec = json.loads((tmp_path / "cpu" / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["mfu"] == pytest.approx(rec["tflops_per_device"] / 0.1)
    assert "mfu against cpu: 0.1 TFLOP/s float32 per device" in capsys.readouterr().err
    monkeypatch.setattr(trainer_module, "run_peak_flops", lambda *a: (None, "mfu not reported: test"))
    Trainer(_cfg(tmp_path, "train.steps=2", name="unknown")).run()
    rec = json.loads((tmp_path / "unknown" / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["mfu"] is None and rec["tflops_per_device"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_mfu_counts_model_flops_and_hfu_what_remat_recomputes(tmp_path, remat):
    """tflops_per_device and mfu count the model's flops from its matmul shapes (here d_ff=96, not 4d),
    whatever the remat: a dots run that recomputes more no longer reports a higher mfu for a slower step.
    hw_tflops_per_device and hfu add the recomputation: dots the attention cores, full the blocks' forward."""
    from jaxhybrid.model import flops as metrics_lib

    cfg = _cfg(tmp_path, "train.steps=1", "model.d_ff=96", f"train.remat={remat}")
    Trainer(cfg).run()
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    m, b, s = cfg.model, cfg.train.global_batch, cfg.data.seq_len  # gpt-tiny, 2 blocks, 4 x 32 tokens
    flops = rec["step_time_s"] * 1e12  # TFLOP/s per device (one device) -> flops of the step
    # Block: 2*128*(64*192 + 64*64 + 64*96 + 96*64) + 4*4*32^2*64 = 7340032 + 1048576; head 2*128*64*256.
    fwd = 2 * (7340032 + 1048576) + 4194304
    assert metrics_lib.model_flops_per_step(m, b, s) == 3 * fwd
    assert rec["tflops_per_device"] * flops == pytest.approx(3 * fwd, rel=1e-9)
    extra = {"none": 0, "dots": 2 * 1048576, "full": 2 * (7340032 + 1048576)}[remat]
    assert rec["hw_tflops_per_device"] * flops == pytest.approx(3 * fwd + extra, rel=1e-9)
    assert rec["mfu"] == pytest.approx(rec["tflops_per_device"] / 0.1)  # cpu.yaml: 0.1 TFLOP/s
    assert rec["hfu"] == pytest.approx(rec["hw_tflops_per_device"] / 0.1)


def test_run_summary_is_the_steady_state_of_the_logged_steps(tmp_path):
    """The run's summary averages the steps after the first (which compiles), as Myelin VI-D averages the
    last 10 of 11 batches: its time to train and flop columns are the per-step formulas at the mean step
    time, recomputed here from the logged per-step values (remat full: hfu differs from mfu)."""
    from jaxhybrid.model import flops as metrics_lib

    cfg = _cfg(tmp_path, "train.steps=4", "train.remat=full")
    out = Trainer(cfg).run()
    recs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steady = recs[1:]
    t = float(np.mean([r["step_time_s"] for r in steady]))
    b, s = cfg.train.global_batch, cfg.data.seq_len
    assert out["steady_steps"] == 3 and out["mean_step_time_s"] == pytest.approx(t, rel=1e-12)
    assert out["time_to_train_s"] == pytest.approx(3e11 * t / (b * s), rel=1e-12)
    assert out["time_to_train_s"] == pytest.approx(np.mean([r["time_to_train_s"] for r in steady]), rel=1e-9)
    assert out["tokens_per_s"] == pytest.approx(b * s / t, rel=1e-12)
    for key in ("tflops_per_device", "mfu", "hw_tflops_per_device", "hfu"):
        # flops per step are the same every step: rate x own time / mean time, from any logged step
        for r in recs:
            assert out[key] == pytest.approx(r[key] * r["step_time_s"] / t, rel=1e-9), (key, r["step"])
    assert out["hfu"] > out["mfu"] and out["mfu"] == pytest.approx(out["tflops_per_device"] / 0.1)
    hw = metrics_lib.hardware_flops_per_step(cfg.model, b, s, "full")
    assert out["hw_tflops_per_device"] == pytest.approx(hw / t / 1e12, rel=1e-12)
    # Not the first step's time (compilation), nor a mean of the per-step rates.
    assert out["mean_step_time_s"] != pytest.approx(np.mean([r["step_time_s"] for r in recs]), rel=1e-6)


class _World:
    """A stand-in for the pipeline engine's MPI world communicator: rank 0 gathers its own entry and
    another rank's (pipeline stage 1, holding more parameters)."""

    def __init__(self, other):
        self.other, self.calls = other, 0

    def gather(self, obj, root=0):
        self.calls += 1
        assert root == 0 and obj["rank"] == 0
        return [obj, self.other]


def test_memory_report_is_the_fullest_ranks(tmp_path, capsys):
    """memory.json and the console line report the rank holding the most model state (what runs out of
    memory first), named, not rank 0's: the trainer gathers every rank's phi over the engine's world."""
    from types import SimpleNamespace

    from jaxhybrid.optim.memory_report import report_from_config, report_over_ranks, summary_line

    t = Trainer(_cfg(tmp_path, "train.steps=1"))
    mine = t.model.cfg.param_count()
    world = _World({"rank": 1, "stage": 1, "replica": 0, "params": 3 * mine})
    t.engine.topo = SimpleNamespace(world=world)
    watched = []  # the pipeline engine's watchdog, which the gather runs under (a peer may never come)
    t.engine.watchdog = SimpleNamespace(watching=lambda what: watched.append(what) or contextlib.nullcontext())
    t.run()
    rep = json.loads((tmp_path / "run" / "memory.json").read_text())
    assert world.calls == 1 and watched == ["gathering every rank's memory report"]
    assert (rep["params"], rep["rank"], rep["stage"], rep["ranks"]) == (3 * mine, 1, 1, 2)
    assert rep["device_total"] == report_from_config(t.cfg, 3 * mine)["device_total"]
    assert [(r["rank"], r["params"]) for r in rep["per_rank"]] == [(0, mine), (1, 3 * mine)]
    err = capsys.readouterr().err
    assert "model state per device (largest of 2 ranks: rank 1, pipeline stage 1): device" in err
    assert f"phi={3 * mine}" in err
    # One process: the line reads as before; ties go to the lowest rank.
    one = report_over_ranks(t.cfg, [{"rank": 0, "stage": None, "replica": None, "params": mine}])
    assert summary_line(one).startswith("model state per device: device ") and one["rank"] == 0
    tie = report_over_ranks(t.cfg, [{"rank": r, "stage": r % 2, "replica": r // 2, "params": 5} for r in range(4)])
    assert (tie["rank"], tie["stage"]) == (0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("optim.offload=true", "optim.bucket_size=5000",
                                           "precision.compute_dtype=bfloat16"),
                                   ("parallel.data=2", "parallel.tensor_row=2", "parallel.tensor_col=2"),
                                   ("parallel.data=2", "parallel.tensor_row=2", "parallel.tensor_col=2", "optim.offload=true",
                                    "optim.bucket_size=3000", "precision.compute_dtype=bfloat16")],
                         ids=["device", "offload-bf16", "tensor-2x2x2", "tensor-offload-bf16"])
def test_resume_is_bit_exact(tmp_path, extra):
    """A 6-step run saves step 3 only, as one that crashed after step 3's save would leave its folder; resumed
    there, it logs the uninterrupted run's losses 4-6 and ends with its params and optimizer state, bit for
    bit. Step 3 is past the 2 warmup steps: the resumed steps run on the cosine part of the schedule, from
    the restored step (the sampler's batch index), Adam count and moments."""
    from jaxhybrid.runtime.checkpoint.store import committed_steps

    sets = ("train.steps=6", "checkpoint.every=3", "checkpoint.at_end=false", *extra)
    straight = Trainer(_cfg(tmp_path, *sets))
    straight.run()
    assert committed_steps(tmp_path / "run") == {"rank_0": [3]}
    want = [(r["step"], r["loss"]) for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open())]
    for name in ("metrics.jsonl", "memory.json"):  # so that what is there after the resume, the resume wrote
        (tmp_path / "run" / name).unlink()
    resumed = Trainer(_cfg(tmp_path, *sets, "run.resume=true"))
    resumed.run()
    got = [(r["step"], r["loss"]) for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open())]
    assert [s for s, _ in want] == [1, 2, 3, 4, 5, 6]
    assert got == want[3:], "steps 4-6: (step, loss) resumed vs uninterrupted"
    assert_tree_close(resumed.final_state.params, straight.final_state.params, "exact", "params after resume")
    state = resumed.updater.state_dict
    assert_tree_close(state(resumed.final_state.opt_state), state(straight.final_state.opt_state), "exact",
                      "optimizer state (host-resident when offloaded)")
    assert (tmp_path / "run" / "memory.json").is_file()


def test_reused_run_dir_is_refused_and_resume_checks_the_layout(tmp_path):
    """A new run into a folder holding checkpoints would save none of its own (orbax keeps the newest step),
    and a resume with another layout would die in orbax's tree matching: both are ConfigErrors first."""
    from jaxhybrid.core.errors import ConfigError

    Trainer(_cfg(tmp_path, "train.steps=2")).run()  # checkpoints step 2 at the end
    with pytest.raises(ConfigError, match=r"holds checkpoints of an earlier run \(rank_0: steps 2\); continue it "
                                          r"with --resume"):
        Trainer(_cfg(tmp_path, "train.steps=2"))
    with pytest.raises(ConfigError, match=r"another layout \(model.n_layers: 2 -> 3; optim.offload: False -> True"):
        Trainer(_cfg(tmp_path, "train.steps=3", "run.resume=true", "model.n_layers=3", "optim.offload=true"))
    Trainer(_cfg(tmp_path, "train.steps=3", "run.resume=true", "optim.lr=1e-3")).run()  # schedule changes are fine
    assert [json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


@pytest.mark.slow
def test_resume_drops_steps_not_every_rank_saved_and_keeps_the_earlier_config(tmp_path, capsys):
    """A job that died mid-save leaves ranks a step apart: the resume takes the newest step all have and
    deletes the newer ones here (kept, they would stay the old run's while the other ranks save the resumed
    run's). config.yaml records run.resume false, so it starts a fresh run as it is; a resume that changed
    settings lists them and keeps the config the earlier steps trained with as config.step<N>.yaml."""
    from jaxhybrid.runtime.checkpoint.store import committed_steps

    run = tmp_path / "run"
    Trainer(_cfg(tmp_path, "train.steps=4", "checkpoint.every=2", "checkpoint.keep=3")).run()
    assert committed_steps(run) == {"rank_0": [2, 4]}
    t = Trainer(_cfg(tmp_path, "train.steps=5", "checkpoint.every=2", "checkpoint.keep=3", "run.resume=true",
                     "optim.lr=2e-3"))
    t.engine.global_max = lambda v: jnp.maximum(v, -2.0)  # another rank's newest checkpoint is step 2
    capsys.readouterr()
    t.run()
    err = capsys.readouterr().err
    assert "rank 0 resumes from step 2, the newest every rank saved; deleted its newer checkpoints [4]" in err
    assert "resuming at step 2 with changed settings: train.steps: 4 -> 5; optim.lr: 0.001 -> 0.002 (the " \
           "earlier config is kept as config.step2.yaml)" in err
    assert [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
    old, new = load_config(run / "config.step2.yaml"), load_config(run / "config.yaml")
    assert (old.train.steps, new.train.steps, new.optim.lr, new.run.resume) == (4, 5, 2e-3, False)


def test_resume_names_a_step_not_every_rank_holds_and_deletes_nothing(tmp_path):
    """keep=1 on one rank, whose save of step 4 deleted step 2, while another rank's newest is step 2: no
    step is common, and the error says so before anything is deleted (it used to delete step 4 first and
    then fail in orbax with a missing folder)."""
    from jaxhybrid.runtime.checkpoint.store import committed_steps

    run = tmp_path / "run"
    Trainer(_cfg(tmp_path, "train.steps=4", "checkpoint.every=2", "checkpoint.keep=1")).run()
    assert committed_steps(run) == {"rank_0": [4]}
    t = Trainer(_cfg(tmp_path, "train.steps=5", "checkpoint.keep=1", "run.resume=true"))
    t.engine.global_max = lambda v: jnp.maximum(v, -2.0)  # another rank's newest checkpoint is step 2
    with pytest.raises(ValueError, match=r"rank 0 holds checkpoints \[4\] .* but not step 2, the newest that "
                                         r"every rank saved"):
        t.run()
    assert committed_steps(run) == {"rank_0": [4]}


def test_a_save_cut_off_mid_write_leaves_no_checkpoint_behind(tmp_path):
    """A job killed while orbax wrote step 3 leaves ``3.orbax-checkpoint-tmp-<time>``. When the resumed run
    saved step 3 again, orbax's clean-up of that step later deleted the stale temporary folder instead of
    ``3``, which stayed on disk beyond checkpoint.keep (a whole checkpoint per rank) and came back at the
    next resume. The checkpointer now removes unfinished saves when it opens the folder."""
    from jaxhybrid.runtime.checkpoint.store import Checkpointer, committed_steps

    ck = Checkpointer(tmp_path, 0, keep=2)
    for s in (1, 2):
        ck.save(s, {"w": np.full(3, s, np.float32)}, {"step": s})
    ck.close()
    rank_dir = tmp_path / "checkpoints" / "rank_0"
    (rank_dir / "3.orbax-checkpoint-tmp-1700000000000" / "state").mkdir(parents=True)  # killed mid-save
    ck = Checkpointer(tmp_path, 0, keep=2)
    for s in (3, 4, 5):
        ck.save(s, {"w": np.full(3, s, np.float32)}, {"step": s})
    ck.close()
    assert sorted(p.name for p in rank_dir.iterdir()) == ["4", "5"]
    assert committed_steps(tmp_path) == {"rank_0": [4, 5]}


@pytest.mark.slow
def test_interrupt_stops_after_the_step_with_it_saved(tmp_path, monkeypatch, capsys):
    """Ctrl-C mid-step: the step finishes (it donated the state before it, which can no longer be saved),
    is saved, and the command ends with one line and status 130, no traceback."""
    import os
    import signal

    from jaxhybrid.runtime.checkpoint.store import committed_steps

    calls = {"n": 0}
    real = Trainer.step

    def step(self, st):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # arrives while the third step runs
        return real(self, st)

    monkeypatch.setattr(Trainer, "step", step)
    before = signal.getsignal(signal.SIGINT)  # default_int_handler; SIG_IGN on a pytest-xdist worker
    args = ["train", "--set", f"run.dir={tmp_path / 'run'}", "--set", "train.steps=6", "--set", "checkpoint.every=2"]
    assert main(args + [a for kv in FAST for a in ("--set", kv)]) == 130
    err = capsys.readouterr().err
    assert f"stopped by SIGINT; rank 0 saved step 3 in {tmp_path / 'run'}" in err and "Traceback" not in err
    assert err.rstrip().endswith("jaxhybrid train: interrupted")
    assert committed_steps(tmp_path / "run") == {"rank_0": [2, 3]}
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are put back


def test_overflow_skips_step_and_halves_scale(tmp_path):
    t = Trainer(_cfg(tmp_path, "train.steps=4", "train.inject_overflow_step=3",  # the third step, as logged
                     "precision.dynamic_loss_scale=true", "precision.loss_scale_init=1024"))
    st = t.init_state()
    st, _ = t.step(st)
    st, _ = t.step(st)
    before = jax.tree.map(np.asarray, (st.params, st.opt_state))
    st, info = t.step(st)
    assert info["skipped"] and st.loss_scale.scale == 512.0
    assert_tree_close((st.params, st.opt_state), before, "exact", "state after a skipped step")
    st, info = t.step(st)
    assert not info["skipped"] and st.loss_scale.scale == 512.0


@pytest.mark.parametrize("args,needle", [
    (["--set", "data.path=/nonexistent/tokens"], "/nonexistent/tokens"),
    (["--set", "train.bogus=1"], "unknown config key 'train.bogus'"),
    (["--set", "train.global_batch=6", "--set", "pipeline.microbatches=4"], "global_batch=6"),
    (["--config", "MALFORMED"], "malformed YAML"),
    (["--set", "train.eval_every=-5"], "train.eval_every=-5"),
    (["--set", "train.eval_every=10", "--set", "data.val_fraction=0"], "data.val_fraction=0"),
    (["--set", "train.eval_every=10", "--set", "train.eval_batches=0"], "train.eval_batches=0"),
    (["--set", "train.eval_every=10", "--set", "data.val_fraction=-0.1"], "data.val_fraction=-0.1 must be in [0, 1)"),
    (["--set", "data.val_fraction=1.5"], "data.val_fraction=1.5 must be in [0, 1)"),
    (["--set", "train.seed=-1"], "train.seed=-1 must be >= 0"),
    (["--set", "checkpoint.keep=0"], "checkpoint.keep=0 must be >= 1"),
])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, args, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: [1,\n")
    args = [str(bad) if a == "MALFORMED" else a for a in args]
    rc = main(["train", "--set", f"run.dir={tmp_path / 'out'}"] + args)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing written half-way


def test_cudnn_attention_on_another_device_is_refused_before_the_engine_is_built(tmp_path, monkeypatch):
    """model.attention=cudnn on a CPU: each MPI rank traced its first attention, failed and aborted the job."""
    import jaxhybrid.runtime.engines.build as build
    from jaxhybrid.core.errors import ConfigError

    monkeypatch.setattr(build, "LocalEngine", None)  # reached only past the check
    with pytest.raises(ConfigError, match=r"model.attention=cudnn needs an NVIDIA GPU; this process's device is "
                                          r"'cpu': set model.attention=auto"):
        Trainer(_cfg(tmp_path, "model.attention=cudnn", "precision.compute_dtype=bfloat16"))


def _train_cli(tmp_path, *sets, flags=()):
    return main(["train", *flags] + [a for kv in FAST + [f"run.dir={tmp_path / 'run'}", *sets] for a in ("--set", kv)])


def test_resume_with_nothing_left_to_train_says_so(tmp_path, capsys):
    assert _train_cli(tmp_path, "train.steps=2") == 0
    capsys.readouterr()
    assert _train_cli(tmp_path, "train.steps=2", flags=("--resume",)) == 0  # complete, not an error
    out = capsys.readouterr()
    assert (f"run.dir={tmp_path / 'run'} is already at step 2 >= train.steps=2; nothing to train "
            f"(raise train.steps to continue)") in out.err
    assert json.loads(out.out.strip().splitlines()[-1])["first_loss"] is None


def test_plan_file_settings_are_printed_once(tmp_path, capsys):
    """A plan sets more than the layout (dtype, batch, remat, offload): the writer lists what it set,
    not the keys the command line sets itself."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": "gpt-tiny", "config": {
        "parallel": {"pipeline": 1, "data": 1, "partition": []}, "pipeline": {"microbatches": 2},
        "optim": {"offload": False}, "train": {"global_batch": 8, "remat": "dots"},
        "precision": {"compute_dtype": "float32"}}}))
    assert _train_cli(tmp_path, "train.steps=1", f"plan.file={plan}") == 0
    lines = [l for l in capsys.readouterr().err.splitlines() if "sets:" in l]
    assert lines == [f"jaxhybrid: plan {plan} sets: parallel.pipeline=1, parallel.data=1, parallel.partition=[], "
                     f"pipeline.microbatches=2, optim.offload=False, train.remat=dots, "
                     f"precision.compute_dtype=float32"]  # train.global_batch is FAST's --set, not the plan's


def test_cli_version_and_unknown_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("jaxhybrid 0.1.0 (jax ")
    with pytest.raises(SystemExit) as e:
        main(["trian"])
    assert e.value.code == 2 and "invalid choice: 'trian'" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_step_prints_ratio(tmp_path, capsys):
    """Side by side in one run; the plain baseline compiles once (its inputs committed as the trainer's:
    else its first timed round compiled again). A run.dir with an earlier run's checkpoints does not stop
    it: the benchmark writes nothing there."""
    (tmp_path / "b" / "checkpoints" / "rank_0" / "200").mkdir(parents=True)
    rc = main(["bench", "step", "--rounds", "1", "--steps", "2", "--set", f"run.dir={tmp_path / 'b'}"]
              + [a for kv in FAST for a in ("--set", kv)])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ratio"] > 0 and out["trainer_step_s"] > 0 and out["plain_step_s"] > 0
    assert out["plain_compiles"] == 1
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["checkpoints"]
    lo, hi = out["ratio_rounds"]  # one round: its ratio is the median's
    assert lo == hi == pytest.approx(out["ratio"])


def test_step_compiles_once(tmp_path):
    """Fresh arrays are uncommitted and jit keys on that: the trainer commits them so step 2 reuses step 1."""
    t = Trainer(_cfg(tmp_path, "train.steps=3", "model.n_layers=1"))
    st = t.init_state()
    for _ in range(3):
        st, _ = t.step(st)
    assert t.engine._step._cache_size() == 1
    assert t.updater._apply._cache_size() == 1


def test_evaluation_without_a_validation_split_is_refused(tmp_path):
    """A prepared dataset with no held-out tokens and eval_every > 0: a ConfigError naming both,
    raised by the Trainer before any compilation or file is written."""
    from jaxhybrid.core.errors import ConfigError
    from jaxhybrid.runtime.data import prepare_data

    src = tmp_path / "text.txt"
    src.write_text("In the beginning was the word. " * 200)
    data_dir = prepare_data(tmp_path / "data", [src], "byte", val_fraction=0.0)
    with pytest.raises(ConfigError, match=r"train.eval_every=5 .* has 0 tokens"):
        Trainer(_cfg(tmp_path, f"data.path={data_dir}", "train.eval_every=5"))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_compilation_cache_serves_a_rerun(tmp_path):
    """``jaxhybrid train`` with ``run.compilation_cache=DIR`` writes the step's executable there and a
    second run of the same job loads it instead of compiling (JAX's cache-hit log line). Subprocesses:
    the cache is process-wide state, read once, which must not leak into the other tests."""
    import os
    import subprocess
    import sys

    cache = tmp_path / "xla"
    env = dict(os.environ, JAX_DEBUG_LOG_MODULES="jax._src.compiler,jax._src.compilation_cache",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")

    def train(name):
        sets = FAST + ["train.steps=2", f"run.dir={tmp_path / name}", f"run.compilation_cache={cache}"]
        cmd = [sys.executable, "-m", "jaxhybrid", "train"] + [a for s in sets for a in ("--set", s)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stderr

    first = train("a")
    assert "Writing jit_step to persistent compilation cache" in first and any(cache.iterdir())
    second = train("b")
    assert "Persistent compilation cache hit for 'jit_step'" in second, second[-3000:]


def test_bare_command_is_a_usage_error(capsys):
    """No command: the help on stderr and argparse's usage-error status, not a silent success."""
    assert main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "COMMAND" in out.err


def test_a_closed_output_pipe_ends_quietly(monkeypatch, capfd):
    """`jaxhybrid plan ... | head`: the reader leaving ends the command with status 1 and no traceback."""
    import jaxhybrid.cli.commands.simulate as sim

    def run(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sim, "run", run)
    assert main(["simulate", "--stages", "2", "--schedule", "gpipe", "--microbatches", "2"]) == 1
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.slow
def test_sigterm_keeps_the_last_finished_step(tmp_path):
    """Slurm's time limit sends SIGTERM before SIGKILL: train ends as on Ctrl-C, its last step saved."""
    import os
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    args = ["--set", f"run.dir={run}", "--set", "train.steps=100000", "--set", "train.eval_every=0"]
    p = subprocess.Popen([sys.executable, "-m", "jaxhybrid", "train", *args, *[a for kv in FAST for a in ("--set", kv)]],
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and
                                              len((run / "metrics.jsonl").read_text().splitlines()) >= 2):
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "jaxhybrid: stopped by SIGTERM; rank 0 saved step" in err and "Traceback" not in err
    from jaxhybrid.runtime.checkpoint.store import committed_steps

    assert committed_steps(run)["rank_0"][-1] >= 2


@pytest.mark.parametrize("extra", [(), ("optim.offload=true", "optim.bucket_size=5000")], ids=["device", "offload"])
def test_data_parallel_on_one_mesh_matches_one_device(tmp_path, extra):
    """``parallel.mesh_data``: data replicas as the axis of one process's mesh (XLA's all-reduce, NCCL on
    GPUs), no tensor axis and no MPI; each step's loss and gradient norm equal the single device's."""
    from jaxhybrid.runtime.engines.tensor import TensorEngine

    Trainer(_cfg(tmp_path, "train.steps=3", "train.global_batch=8", name="one")).run()
    mesh = Trainer(_cfg(tmp_path, "train.steps=3", "train.global_batch=8", "parallel.data=8", "parallel.mesh_data=true",
                        *extra, name="mesh"))  # the 8 fake devices of the test process
    assert isinstance(mesh.engine, TensorEngine) and mesh.engine.dims.data == 8
    mesh.run()
    rec = lambda d: [(r["loss"], r["grad_norm"]) for r in map(json.loads, (tmp_path / d / "metrics.jsonl").open())]  # noqa: E731
    assert_tree_close(np.array(rec("mesh")), np.array(rec("one")), "fp32_parity", "loss and grad norm per step ")


def test_overlap_note_says_why_myelin_v_c_is_partial_or_off():
    """A pipeline with data replicas and the offloaded optimizer says when the update cannot stream with
    the all-reduce (a tensor mesh per rank: nothing overlaps it) or waits for every chunk (global-norm
    clipping: only the first fetches are issued before the reductions)."""
    def note(streamed, *sets):
        t = Trainer.__new__(Trainer)  # the rule reads the config and whether the engine streams (needs MPI)
        t.cfg = load_config(None, ["parallel.pipeline=2", "parallel.data=2", "pipeline.microbatches=2",
                                   "optim.offload=true", *sets])
        t.streamed = streamed
        return t.overlap_note()

    hybrid = note(False, "parallel.tensor_col=2")
    assert "waits for the whole all-reduce" in hybrid and "one device per rank" in hybrid
    # Not streamed, the all-reduce ends in the engine before the updater fetches its first bucket.
    assert "its bucket fetches start after it, so nothing overlaps it" in hybrid and "prefetch overlaps" not in hybrid
    assert "allreduce_coarsening" not in hybrid  # the default: nothing to say
    assert note(False, "parallel.tensor_col=2", "optim.allreduce_coarsening=4").endswith(
        "; optim.allreduce_coarsening=4 is unused")  # it sizes the streamed chunks only
    clipped = note(True)
    assert clipped.startswith("optim.grad_clip=1.0: the global norm needs every reduced chunk")
    assert "only the first buckets' fetches are issued before the all-reduce" in clipped
    assert "full overlap" not in clipped  # grad_clip=0 updates chunk by chunk, not beside the reductions
    assert note(True, "optim.grad_clip=0") is None
    assert note(False, "optim.stream_allreduce=false") is None and note(False, "optim.offload=false") is None


def test_the_summary_on_stdout_is_strict_json_when_a_loss_is_not_finite(tmp_path, capsys):
    """metrics.jsonl writes a non-finite loss as null (JSON has no NaN); the summary printed NaN, which strict
    parsers (jq, JavaScript, Go) refuse. An injected overflow makes the single-device step's loss non-finite."""
    assert _train_cli(tmp_path, "train.steps=1", "train.inject_overflow_step=1",
                      "precision.compute_dtype=float16") == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]

    def refuse(name):
        raise ValueError(f"{name} is not JSON: {line}")

    summary = json.loads(line, parse_constant=refuse)
    assert summary["first_loss"] is None and summary["last_loss"] is None


def test_a_finished_run_closes_its_engine(tmp_path):
    """A pipeline rank's engine closes its transport (the mpi4py one cancels its posted receives, the
    mpi4jax one frees its header communicator) and its watchdog. The trainer never called it: every
    mpi4py job's ranks ended with UCX warning that the posted receives' requests were not returned."""
    t = Trainer(_cfg(tmp_path, "train.steps=1"))
    closed = []
    t.engine.close = lambda: closed.append(True)
    t.run()
    assert closed == [True]
