"""A fault suite: what used to lose data or train on silently is caught, named and stopped.

Damaged checkpoint contents (orbax keeps no checksum), runs whose steps stay non-finite (float16 and
float32), token ids beyond the model's vocabulary and two jobs on one run directory. One process, the tiny model, a few steps each.
"""
import json
import os
import re
import shutil
import socket
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid.cli.main import main
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.runtime import run_lock
from jaxhybrid.runtime.checkpoint.store import Checkpointer, DamagedStep, committed_steps
from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.data.prepare import prepare_data
from jaxhybrid.runtime.data.splits import open_dataset
from jaxhybrid.runtime.nonfinite import NonFiniteStop
from jaxhybrid.runtime.trainer import Trainer

FAST = ["model.name=gpt-tiny", "model.n_layers=2", "data.seq_len=32", "train.global_batch=4",
        "metrics.progress=false", "metrics.tensorboard=false", "metrics.plot=false"]
# bfloat16 too: its numpy buffer has no format memoryview takes, which the digest met in offloaded runs.
STEP = {"a": np.arange(1000, dtype=np.float32), "b": {"c": np.ones((3, 4), np.int32), "h": np.ones(8, jnp.bfloat16)}}


def _cfg(run, *extra):
    return load_config(None, FAST + [f"run.dir={run}", *extra])


def _train(tmp_path, *sets):
    return main(["train"] + [a for kv in FAST + [f"run.dir={tmp_path / 'run'}", *sets] for a in ("--set", kv)])


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# -- checkpoint integrity ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-step run with steps 2 and 4 saved."""
    root = tmp_path_factory.mktemp("saved") / "run"
    Trainer(_cfg(root, "train.steps=4", "checkpoint.every=2")).run()
    return root


def _damage_largest(step):
    """4 KiB of random bytes in the middle of the largest file of ``step``'s state: the size stays, orbax's
    metadata too, so without a digest the arrays restored as whatever the bytes now say."""
    big = max((f for f in (step / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(big.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4096] = np.random.default_rng(0).bytes(len(data[mid:mid + 4096]))
    big.write_bytes(bytes(data))
    return big


def test_damaged_contents_are_named_and_the_resume_falls_back(saved, tmp_path, capfd):
    """The issue's case: the run resumed from the damaged step, skipped every step as non-finite, saved, and
    checkpoint.keep deleted the last good step. Now the step is named, set aside, and step 2 resumes."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    _damage_largest(run / "checkpoints" / "rank_0" / "4")
    Trainer(_cfg(run, "train.steps=5", "checkpoint.every=2", "run.resume=true")).run()
    err = capfd.readouterr().err
    assert f"{run / 'checkpoints' / 'rank_0' / '4'} cannot be read" in err
    assert "resumes from step 2, the previous step every rank saved" in err
    recs = _records(run)
    assert [r["step"] for r in recs][-3:] == [3, 4, 5] and not any(r["skipped"] for r in recs)
    assert (run / "checkpoints" / "damaged" / "rank_0" / "4" / "state").is_dir()
    assert Checkpointer(run).steps() == [4, 5]  # step 4 saved again by the resumed run


def _truncate_largest(step):
    big = max((f for f in (step / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    big.write_bytes(big.read_bytes()[:100])
    return big


# Damaged bytes are caught by the digests, or first by tensorstore where they break a compressed chunk.
@pytest.mark.parametrize("damage, said", [(_damage_largest, r"its contents differ from the digests saved with it|"
                                                            r"FAILED_PRECONDITION: Error reading"),
                                          (_truncate_largest, "OUT_OF_RANGE")], ids=["bytes", "truncated"])
def test_export_of_a_damaged_step_is_one_line(saved, tmp_path, capsys, damage, said):
    """Export read damaged bytes without a word and exported the garbage; a truncated file printed
    TensorStore's whole spec in a traceback. Now one line names the step's folder and the reason."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    damage(run / "checkpoints" / "rank_0" / "4")
    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxhybrid export: error: {run / 'checkpoints' / 'rank_0' / '4' / 'state'} holds no "
                          f"readable checkpoint (") and re.search(said, err) and err.count("\n") == 1, err
    assert "TensorStore" not in err and not (tmp_path / "out").exists()
    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "out2"), "--step", "2"]) == 0


def test_a_digest_mismatch_names_the_step_and_the_leaf(tmp_path):
    """Bytes that orbax reads without complaint (the array file's data, not its index) fail the digest."""
    ck = Checkpointer(tmp_path, keep=3)
    ck.save(1, STEP, {"step": 1})
    ck.save(2, STEP, {"step": 2})
    ck.close()
    # Change one value through orbax itself: the saved digests stay those of the original bytes.
    meta = json.loads((tmp_path / "checkpoints" / "rank_0" / "2" / "meta" / "metadata").read_text())
    ck = Checkpointer(tmp_path, keep=3)
    ck.manager.delete(2)
    import orbax.checkpoint as ocp

    changed = {"a": STEP["a"] + np.float32(1), "b": STEP["b"]}
    ck.manager.save(2, args=ocp.args.Composite(state=ocp.args.PyTreeSave(changed), meta=ocp.args.JsonSave(meta)))
    ck.manager.wait_until_finished()
    with pytest.raises(DamagedStep, match=r"checkpoints/rank_0/2 cannot be read \(its contents differ from the "
                                          r"digests saved with it: state/a \(1000,\) float32: crc32 ") as e:
        ck.restore(2, STEP)
    assert e.value.step == 2
    state, got = ck.restore(1, STEP)  # the earlier step verifies
    assert np.array_equal(state["a"], STEP["a"]) and got["step"] == 1
    ck.close()


def test_a_changed_host_state_fails_its_digest(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.save(1, STEP, {"step": 1, "sampler": {"epoch": 0}})
    f = tmp_path / "checkpoints" / "rank_0" / "1" / "meta" / "metadata"
    f.write_text(f.read_text().replace('"epoch": 0', '"epoch": 7'))
    with pytest.raises(DamagedStep, match=r"meta \(the step's host state"):
        ck.restore(1, STEP)
    ck.close()


def test_rotation_keeps_the_newest_step_saved_after_finite_training(tmp_path):
    ck = Checkpointer(tmp_path, keep=1)
    ck.save(1, STEP, {"step": 1})
    ck.save(2, STEP, {"step": 2}, finite=False)
    ck.save(3, STEP, {"step": 3}, finite=False)
    assert ck.steps() == [1, 3]  # orbax's max_to_keep=1 deleted step 1 here
    ck.save(4, STEP, {"step": 4})
    assert ck.steps() == [4]
    ck.close()


def test_a_damaged_step_on_its_own_is_refused_naming_it(saved, tmp_path):
    """No earlier step to fall back to: one error naming the step, nothing deleted."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    shutil.rmtree(run / "checkpoints" / "rank_0" / "2")
    _damage_largest(run / "checkpoints" / "rank_0" / "4")
    with pytest.raises(DamagedStep, match=r"rank_0/4 cannot be read .*start a new run \(this rank holds no earlier"):
        Trainer(_cfg(run, "train.steps=5", "run.resume=true")).run()
    assert Checkpointer(run).steps() == [4]


# -- non-finite runs --------------------------------------------------------------------------------

def test_float16_run_that_stays_non_finite_stops(tmp_path, capfd):
    """The issue's case: 78 of 80 steps skipped at loss scale 1.0, status 0 and a 'final' checkpoint. Now it
    stops at the floor of the loss scale (15 halvings from 2^15), status 1, one line, nothing saved."""
    rc = _train(tmp_path, "train.steps=60", "optim.lr=0.99", "optim.warmup_steps=0", "optim.grad_clip=0",
                "precision.compute_dtype=float16")
    err = capfd.readouterr().err
    assert rc == 1
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "the loss scale is at its floor 1 and the step still overflowed" in lines[0]
    assert "the last finite loss was" in lines[0] and "optim.lr" in lines[0]
    recs = _records(tmp_path / "run")
    assert recs[-1]["skipped"] and recs[-1]["loss_scale"] == 1.0 and len(recs) < 60
    assert f"stopped at step {recs[-1]['step']}:" in lines[0]
    assert not (tmp_path / "run" / "checkpoints" / "rank_0").exists() or not Checkpointer(tmp_path / "run").steps()


def _poisoned(monkeypatch):
    """Parameters that are NaN from the start: every step's gradients are non-finite through the real path."""
    init = Trainer.init_state

    def init_state(self):
        st = init(self)
        st.params = jax.tree.map(lambda x: x * jnp.nan, st.params)
        return st

    monkeypatch.setattr(Trainer, "init_state", init_state)


def test_float32_run_that_stays_non_finite_stops_after_the_limit(tmp_path, monkeypatch):
    """float32 has no loss scale to back off: the count of skipped steps alone stops it."""
    _poisoned(monkeypatch)
    run = tmp_path / "run"
    with pytest.raises(NonFiniteStop, match=r"stopped at step 3: train.max_nonfinite_steps=3 steps in a row had "
                                            r"non-finite gradients \(3 skipped; no step of this run updated"):
        Trainer(_cfg(run, "train.steps=10", "train.max_nonfinite_steps=3", "checkpoint.every=1")).run()
    assert [r["step"] for r in _records(run)] == [1, 2, 3]
    # Steps 1 and 2 were saved as checkpoint.every asks, marked as non-finite; step 3, the stop, was not.
    assert Checkpointer(run).steps() == [1, 2]


def test_the_guard_is_off_at_zero(tmp_path, monkeypatch):
    _poisoned(monkeypatch)
    Trainer(_cfg(tmp_path / "run", "train.steps=3", "train.max_nonfinite_steps=0")).run()
    assert all(r["skipped"] for r in _records(tmp_path / "run"))


def test_an_isolated_overflow_does_not_stop(tmp_path):
    Trainer(_cfg(tmp_path / "run", "train.steps=3", "train.max_nonfinite_steps=2", "train.inject_overflow_step=2",
                 "precision.compute_dtype=float16")).run()
    assert [r["skipped"] for r in _records(tmp_path / "run")] == [False, True, False]


# -- token ids --------------------------------------------------------------------------------------

def test_prepare_data_records_the_largest_id_of_each_split(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("abc~" * 50)
    meta = json.loads((prepare_data(tmp_path / "out", [src], val_fraction=0.1) / "meta.json").read_text())
    assert meta["max_id"] == {"train": ord("~"), "val": ord("~")}


def _out_of_vocab(tmp_path, recorded: bool):
    """The issue's dataset: uint16 ids, a meta.json that passes every check, a train.bin of 65535s."""
    src = tmp_path / "in.txt"
    src.write_text("some text to tokenize\n" * 40)
    out = prepare_data(tmp_path / "data", [src], val_fraction=0.1)
    meta = json.loads((out / "meta.json").read_text())
    meta["dtype"] = "uint16"
    n = meta["splits"]["train"]
    np.full(n, 65535, np.uint16).tofile(out / "train.bin")
    np.full(meta["splits"]["val"], 7, np.uint16).tofile(out / "val.bin")
    if recorded:
        meta["max_id"]["train"] = 65535
    else:
        del meta["max_id"]  # prepared before max_id was recorded: scanned
    (out / "meta.json").write_text(json.dumps(meta))
    return out


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "scanned"])
def test_token_ids_beyond_the_vocabulary_are_refused_before_training(tmp_path, recorded):
    data = _out_of_vocab(tmp_path, recorded)
    with pytest.raises(ConfigError, match=r"train.bin holds token id 65535, but model.vocab_size=512 embeds ids "
                                          r"0..511 \(meta.json says vocab_size 256\)"):
        Trainer(_cfg(tmp_path / "run", f"data.path={data}", "model.vocab_size=512", "train.steps=2"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_scan_reads_in_chunks(tmp_path, monkeypatch):
    from jaxhybrid.runtime.data import dataset

    monkeypatch.setattr(dataset, "SCAN_CHUNK", 7)
    data = _out_of_vocab(tmp_path, recorded=False)
    cfg = _cfg(tmp_path / "run", f"data.path={data}", "model.vocab_size=65536")
    assert open_dataset(cfg).max_id() == 65535 and open_dataset(cfg, "val").max_id() == 7


# -- one job per run directory ----------------------------------------------------------------------

def _hold(run, pid, host=None):
    run.mkdir(parents=True, exist_ok=True)
    holder = {"host": host or socket.gethostname(), "pid": pid, "pid_start": run_lock._start_ticks(pid),
              "started": "2026-01-01T00:00:00Z"}
    (run / run_lock.LOCK).write_text(json.dumps(holder))


def test_a_second_job_on_a_run_dir_is_refused_naming_the_holder(tmp_path):
    """Two jobs on one run dir interleaved their checkpoints and one lost its metrics."""
    run = tmp_path / "run"
    with subprocess.Popen(["sleep", "60"]) as other:
        _hold(run, other.pid)
        try:
            with pytest.raises(ConfigError, match=rf"{run} is in use by another job: pid {other.pid} on "
                                                  rf"{socket.gethostname()}, started 2026-01-01T00:00:00Z"):
                Trainer(_cfg(run, "train.steps=1")).run()
        finally:
            other.kill()
    assert not (run / "metrics.jsonl").exists() and (run / run_lock.LOCK).exists()


def test_a_lock_on_another_host_is_named_with_the_file_to_delete(tmp_path):
    run = tmp_path / "run"
    _hold(run, 1, host="elsewhere.invalid")
    with pytest.raises(ConfigError, match=r"pid 1 on elsewhere.invalid \(another host: it cannot be probed from "
                                          rf"here\).*delete {run / run_lock.LOCK}"):
        run_lock.RunLock(run).acquire()


def test_a_dead_holders_lock_is_taken_over_and_released_at_the_end(tmp_path, capfd):
    run = tmp_path / "run"
    gone = subprocess.Popen(["true"])
    gone.wait()
    _hold(run, gone.pid)
    Trainer(_cfg(run, "train.steps=1")).run()
    assert f"took over {run / run_lock.LOCK} from pid {gone.pid}" in capfd.readouterr().err
    assert len(_records(run)) == 1 and not (run / run_lock.LOCK).exists()


def test_a_reused_pid_is_told_by_its_start_time(tmp_path):
    run = tmp_path / "run"
    _hold(run, os.getpid())
    holder = json.loads((run / run_lock.LOCK).read_text())
    holder["pid_start"] -= 1  # this PID, but a process started at another time held it
    (run / run_lock.LOCK).write_text(json.dumps(holder))
    lock = run_lock.RunLock(run).acquire()
    assert json.loads((run / run_lock.LOCK).read_text())["pid_start"] == holder["pid_start"] + 1
    lock.release()
    assert not (run / run_lock.LOCK).exists()


# -- a run directory holding an earlier run's records --------------------------------------------------

def test_an_earlier_runs_metrics_are_not_trained_over(tmp_path, capsys):
    """A run.dir with a previous run's metrics but no checkpoints was trained over: metrics.jsonl was replaced
    without a word and TensorBoard mixed both runs' event files. Now it is refused before anything is built,
    and run.overwrite=true replaces both."""
    tb = ["metrics.tensorboard=true", "checkpoint.at_end=false"]
    assert _train(tmp_path, "train.steps=3", *tb) == 0
    run = tmp_path / "run"
    first_events = {p.name: p.read_bytes() for p in (run / "tensorboard").glob("events.out.tfevents.*")}
    assert first_events and not committed_steps(run)
    capsys.readouterr()
    assert _train(tmp_path, "train.steps=2", *tb) == 2
    err = capsys.readouterr().err
    assert err == (f"jaxhybrid train: error: run.dir={run} holds the records of an earlier run (metrics.jsonl of 3 "
                   f"steps, 1 TensorBoard event file) but no checkpoint to resume; train into another run.dir, or "
                   f"replace them with --set run.overwrite=true\n")
    assert [r["step"] for r in _records(run)] == [1, 2, 3]
    assert _train(tmp_path, "train.steps=2", *tb, "run.overwrite=true") == 0
    assert [r["step"] for r in _records(run)] == [1, 2]
    # One file, not the first run's (a file's name holds the second it was made in: both runs can share it).
    (events,) = (run / "tensorboard").glob("events.out.tfevents.*")
    assert first_events.get(events.name) != events.read_bytes()


# -- sizes that cannot fit -----------------------------------------------------------------------------

@pytest.mark.parametrize("size, named", [
    ("train.global_batch=1000000000000", "the global batch of token ids, 122,934.6 GiB: train.global_batch="
                                         "1000000000000 x (data.seq_len=32 + 1) x 4 bytes"),
    ("model.d_model=1048576", "the model state on the CPU devices"),
], ids=["batch", "d_model"])
def test_sizes_that_cannot_fit_are_refused_before_anything_is_built(tmp_path, capsys, size, named):
    """A global_batch of 1e12 ended in a raw numpy MemoryError and a d_model of 1048576 in XLA's
    RESOURCE_EXHAUSTED; now one line names the memory needed and the memory there is."""
    assert _train(tmp_path, size) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxhybrid train: error: this job needs at least ") and named in err, err
    assert " GiB is available; use a smaller model or batch" in err and err.count("\n") == 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_device_too_small_for_the_model_state_is_refused_naming_both(tmp_path, capsys, monkeypatch):
    """On an accelerator, the model state that must fit on each device is set against the memory XLA may use
    there, once the backend is up and before the model is built (the CPU's is host memory, checked above)."""
    from jaxhybrid.runtime import memory_check

    class Device:
        platform, device_kind, id = "gpu", "NVIDIA H200", 0

        def memory_stats(self):
            return {"bytes_limit": 8 << 30}

    cfg = _cfg(tmp_path / "run", "model.d_model=8192", "model.n_layers=48", "precision.compute_dtype=bfloat16")
    with pytest.raises(ConfigError) as e:
        memory_check.check_device_memory(cfg, Device())
    assert re.fullmatch(r"this job needs at least [\d,.]+ GiB on each device \([\d,]+ parameters over "
                        r"parallel.pipeline=1 x 1 tensor ranks, .*\) but NVIDIA H200 0 has 8.00 GiB for XLA; use .*"
                        r"optim.offload=true", str(e.value)), e.value
    memory_check.check_device_memory(_cfg(tmp_path / "run"), Device())  # a tiny model fits
    assert memory_check.device_capacity(jax.devices()[0]) is None  # the CPU: host memory, checked before

    monkeypatch.setattr(memory_check, "device_capacity", lambda device: 1 << 20)  # the train command calls it
    assert _train(tmp_path) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxhybrid train: error: this job needs at least ") and err.count("\n") == 1, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- a full disk -----------------------------------------------------------------------------------------

def test_a_checkpoint_larger_than_the_disk_is_refused_before_training(tmp_path, capsys, monkeypatch):
    from jaxhybrid.runtime import memory_check

    monkeypatch.setattr(memory_check, "free_disk_bytes", lambda path: 1 << 20)
    assert _train(tmp_path) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"jaxhybrid train: error: a checkpoint of this job needs at least [\d.]+ MiB \([\d,]+ "
                        r"parameters x 12 bytes: .*\) but the disk holding run.dir=\S+ has 1.0 MiB free; free some "
                        r"space or set run.dir on a larger disk\n", err), err
    assert _train(tmp_path, "checkpoint.at_end=false") == 0  # a run that saves nothing needs no room for it


def test_a_disk_full_at_a_save_is_one_line_and_keeps_the_steps_before(tmp_path, capsys, monkeypatch):
    """The disk fills up between two saves: the second is refused before it writes a byte, naming the bytes it
    needs, those free and the steps kept; the step saved before still resumes."""
    from jaxhybrid.runtime.checkpoint import store

    free = iter([1 << 40, 1 << 10])  # room for step 2, not for step 4
    monkeypatch.setattr(store, "free_disk_bytes", lambda path: next(free))
    assert _train(tmp_path, "train.steps=4", "checkpoint.every=2") == 2
    err = capsys.readouterr().err.splitlines(keepends=True)[-1]  # after the run's start-up lines
    assert re.fullmatch(r"jaxhybrid train: error: cannot save step 4 in \S+/rank_0: its arrays need [\d.]+ MiB and "
                        r"the disk has 0.0 MiB free; free some space or set run.dir on a larger disk, then resume "
                        r"\(the steps saved before, \[2\], are kept\)\n", err), err
    assert committed_steps(tmp_path / "run") == {"rank_0": [2]}
    assert not list((tmp_path / "run" / "checkpoints" / "rank_0").glob("4*"))


def test_a_disk_that_fills_up_during_a_save_is_one_line_and_leaves_no_partial_step(tmp_path, capfd, monkeypatch):
    """Other writers (a peer rank's save, another job) can fill the disk after the check: tensorstore's write
    error, which orbax wraps without its errno and logs from every writer thread, becomes one line, and the
    half-written step folder is removed."""
    import logging

    ckpt = Checkpointer(tmp_path / "run")
    ckpt.save(1, STEP, {"step": 1})

    def fill_up(step, args):
        (ckpt.dir / f"{step}.orbax-checkpoint-tmp-0").mkdir()
        logging.getLogger("absl").error("_SignalingThread.run() raised an exception: RESOURCE_EXHAUSTED: Failed "
                                        "to write 4096 bytes: No space left on device [os_error_code='28']")
        raise Exception("writing the state failed") from ValueError(  # noqa: TRY002 (as orbax raises it)
            "RESOURCE_EXHAUSTED: Error writing \"a/0\" in OCDBT database: No space left on device [os_error_code='28']")

    monkeypatch.setattr(ckpt.manager, "save", fill_up)
    with pytest.raises(OSError) as e:
        ckpt.save(2, STEP, {"step": 2})
    assert re.fullmatch(r"cannot save step 2 in \S+: the disk filled up while writing its [\d.]+ MiB \([\d,.]+ [MG]iB "
                        r"free now\); free some space or set run.dir on a larger disk, then resume \(the steps saved "
                        r"before, \[1\], are kept\)", str(e.value)), e.value
    assert "No space left" not in capfd.readouterr().err  # orbax's record of it is dropped
    assert [p.name for p in ckpt.dir.iterdir()] == ["1"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small tmpfs needs root")
def test_a_real_small_disk_ends_the_run_with_one_line(tmp_path, capfd):
    """On a 1 MiB tmpfs: the tiny model's checkpoint (a few MiB) does not fit, and the run says so before training
    (the fakes above cover the saves; this is the same on a real filesystem, where the machine allows a mount)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1024k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("this machine refuses to mount a tmpfs")
    try:
        rc = main(["train"] + [a for kv in FAST + [f"run.dir={disk / 'run'}"] for a in ("--set", kv)])
        err = capfd.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and "MiB free; free some space" in err, err
    finally:
        subprocess.run(["umount", str(disk)], check=False)
