"""`jaxhybrid launch` before mpiexec starts: the checks every rank would make alike are made once, with
train's own functions; train's options parse with or without ``--``; and the launcher's last line on a
job whose ranks failed with an error names that error. No MPI: nothing here starts a rank."""
import json
import os
import socket
from pathlib import Path

import pytest

from jaxhybrid.cli.commands import launch
from jaxhybrid.cli.launch.checks import check_devices, check_job, train_config
from jaxhybrid.cli.launch.rankwatch import RankWatch, failure_summary
from jaxhybrid.cli.main import build_parser
from jaxhybrid.core.errors import ConfigError

RUNS = Path(__file__).resolve().parents[3] / "configs" / "runs"


def _job(run_dir, *sets: str, config: str = "pipeline_2x2.yaml", flags: tuple[str, ...] = ()):
    args = [*flags, "--config", str(RUNS / config), "--set", f"run.dir={run_dir}"]
    return train_config(args + [a for kv in sets for a in ("--set", kv)])


def test_a_run_dir_another_job_holds_is_refused_before_the_ranks_start(tmp_path):
    """Else every rank of the second job would refuse it on its own, each an aborted rank."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "pid_start": None,
                                              "started": "2026-01-01T00:00:00Z"}))
    with pytest.raises(ConfigError, match=rf"{run} is in use by another job: pid {os.getpid()} on "):
        check_job(*_job(run), 4)
    (run / "run.lock").unlink()
    assert check_job(*_job(run), 4) == 1


def test_run_dir_is_checked_once_before_the_ranks_start(tmp_path):
    """A run.dir holding checkpoints (train refuses to train over them), one that cannot be made, and a
    resume whose checkpoints have another layout fail in the launcher, naming the values."""
    run = tmp_path / "run"
    assert check_job(*_job(run), 4) == 1  # nothing there yet: fine
    (run / "checkpoints" / "rank_0" / "2").mkdir(parents=True)
    with pytest.raises(ConfigError, match=rf"run.dir={run} holds checkpoints of an earlier run \(rank_0: steps 2\)"):
        check_job(*_job(run), 4)
    (run / "config.yaml").write_text("parallel: {pipeline: 2, data: 2}\n")
    with pytest.raises(ConfigError, match=r"--resume in .*another layout \(parallel.data: 2 -> 1\)"):
        check_job(*_job(run, "parallel.data=1", flags=("--resume",)), 2)
    check_job(*_job(run, flags=("--resume",)), 4)  # the same layout resumes
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=rf"run.dir={tmp_path}/file/x cannot be written: {tmp_path}/file is not a "
                                          r"directory; pick another --set run.dir="):
        check_job(*_job(tmp_path / "file" / "x"), 4)
    if Path("/proc/self").exists():  # a read-only place that os.access calls writable for root
        with pytest.raises(ConfigError, match="run.dir=/proc/nope cannot be written"):
            check_job(*_job("/proc/nope"), 4)


def test_a_job_whose_ranks_need_mpi4jax_without_it_is_refused_before_they_start(tmp_path, monkeypatch):
    """mpi4jax is an optional dependency (scripts/setup.sh builds it). Without it the ranks imported it at
    their first receive or all-reduce, after compiling their step, and aborted the job with a
    ModuleNotFoundError; now the launcher (train's own check_run) names what needs it and the fix."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mpi4jax" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^pipeline.transport=mpi4jax \(activations between parallel.pipeline=2 "
                                          r"stages\) and the all-reduce over parallel.data=2 MPI replicas need the "
                                          r"mpi4jax package, which is not installed: run scripts/setup.sh"):
        check_job(*_job(tmp_path / "a"), 4)
    with pytest.raises(ConfigError, match=r"need the mpi4jax package.*; or --set pipeline.transport=mpi4py$"):
        check_job(*_job(tmp_path / "b", "parallel.data=1"), 2)
    with pytest.raises(ConfigError, match=r"^the all-reduce over parallel.data=2 MPI replicas need .*jaxhybrid\[mpi\]'\)$"):
        check_job(*_job(tmp_path / "c", "pipeline.transport=mpi4py"), 4)
    # What never calls it: a pipeline over mpi4py without replicas, one process, a --distributed mesh.
    check_job(*_job(tmp_path / "d", "parallel.data=1", "pipeline.transport=mpi4py"), 2)
    check_job(*_job(tmp_path / "e", config="tiny.yaml"), 1)
    check_job(*_job(tmp_path / "f", "parallel.data=2", "parallel.mesh_data=true", config="tiny.yaml",
                    flags=("--distributed",)), 2)


def test_a_gpu_pipeline_over_an_mpi4jax_without_its_cuda_bridge_is_refused_before_compiling(tmp_path, monkeypatch):
    """On a GPU the mpi4jax transport receives into device buffers, which needs mpi4jax's CUDA bridge; a
    build without it (no CUDA found at setup) failed at the first receive, after every rank had compiled."""
    from types import SimpleNamespace

    import mpi4jax

    from jaxhybrid.cli.commands.train import check_mpi4jax_device

    _, cfg = _job(tmp_path / "a")
    gpu, cpu = SimpleNamespace(platform="gpu", device_kind="NVIDIA H200"), SimpleNamespace(platform="cpu")
    monkeypatch.setattr(mpi4jax, "has_cuda_support", lambda: False)
    with pytest.raises(ConfigError, match=r"^pipeline.transport=mpi4jax receives into NVIDIA H200 buffers, but "
                                          r"this mpi4jax was built without its CUDA bridge: .*transfer"):
        check_mpi4jax_device(cfg, 4, gpu)
    check_mpi4jax_device(cfg, 4, cpu)  # on CPU mpi4jax moves host buffers
    check_mpi4jax_device(_job(tmp_path / "b", "pipeline.transport=transfer")[1], 4, gpu)  # no mpi4jax there
    monkeypatch.setattr(mpi4jax, "has_cuda_support", lambda: True)
    check_mpi4jax_device(cfg, 4, gpu)


@pytest.mark.parametrize("config,sets,flags,n,needle", [
    ("pipeline_2x2.yaml", ("parallel.tensor_depth=2", "train.global_batch=4", "pipeline.microbatches=2"), (), 4,
     r"batch of 1 sequences per microbatch is not divisible by data\(1\) x depth\(2\) = 2"),
    ("hybrid.yaml", ("model.vocab_size=255",), (), 4, r"model.vocab_size=255 not divisible by col\(2\)"),
    ("tiny.yaml", ("parallel.data=2", "parallel.tensor_depth=2", "train.global_batch=6", "pipeline.microbatches=3"),
     ("--distributed",), 2, r"batch of 2 sequences per microbatch is not divisible by data\(2\) x depth\(2\) = 4"),
])
def test_a_mesh_that_cannot_split_the_model_is_refused_before_the_ranks_start(tmp_path, config, sets, flags, n,
                                                                               needle):
    """A pipeline x tensor layout whose local mesh cannot split the microbatch or the vocabulary passed the
    launcher: each rank built its mesh after MPI had made its communicators, printed the same ValueError with
    a traceback and aborted the job (and --distributed processes after joining the runtime)."""
    with pytest.raises(ConfigError, match=r"^tensor layout: .*" + needle):
        check_job(*_job(tmp_path / "run", *sets, config=config, flags=flags), n)


@pytest.mark.parametrize("sets,needle", [
    (("model.vocab_size=200",), "model.vocab_size=200 is smaller than the built-in corpus's 256 byte symbols "
                                "(data.tokenizer=byte); set model.vocab_size >= 256"),
    (("model.vocab_size=200", "data.tokenizer=bpe"),
     "data.tokenizer=bpe trains a BPE of model.vocab_size=200 tokens on the built-in corpus, and a byte-level BPE "
     "holds at least the 256 byte symbols; set model.vocab_size >= 256"),
])
def test_a_vocabulary_below_the_built_in_corpus_is_refused_before_the_ranks_start(tmp_path, sets, needle):
    """The built-in corpus was left to the ranks: each prepared it after mpiexec started and failed, BPE's
    error asking for prepare-data's ``--vocab-size``, which the run does not take."""
    with pytest.raises(ConfigError) as e:
        check_job(*_job(tmp_path / "run", *sets), 4)
    assert str(e.value) == needle


def test_plan_file_and_train_arguments_are_read_once(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="plan file not found: nope.json"):
        _job(tmp_path, "plan.file=nope.json")
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error, before any rank starts
        train_config(["--config", str(RUNS / "tiny.yaml"), "--bogus"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "jaxhybrid train: error: unrecognized arguments: --bogus"


@pytest.mark.parametrize("env,fails", [
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"},
     r"--xla_force_host_platform_device_count=1 \(kept by the launcher\) gives each of the 4 ranks 1 CPU "
     r"device\(s\): .*needs parallel.tensor_depth x tensor_row x tensor_col = 2 local devices and sees 1"),
    ({"JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"}, "your JAX_NUM_CPU_DEVICES=1"),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}, None),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cuda"}, None),  # GPUs: theirs
])
def test_devices_the_ranks_will_see_are_checked_on_cpu(tmp_path, env, fails):
    ns, cfg = _job(tmp_path, config="hybrid.yaml")
    if fails:
        with pytest.raises(ValueError, match=fails):
            check_devices(cfg, 4, env, 2)
    else:
        check_devices(cfg, 4, env, 2)
    # --distributed: one mesh of 8 devices over 2 processes of 1 device each.
    ns, cfg = _job(tmp_path, "parallel.data=2", "parallel.tensor_row=2", "parallel.tensor_col=2",
                   config="tiny.yaml", flags=("--distributed",))
    one = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    with pytest.raises(ValueError, match=r"= 8 != 2 devices.*the launcher gives each rank 4"):
        check_devices(cfg, 2, one, 4)


def test_a_users_device_count_is_what_the_ranks_get_and_is_checked(tmp_path):
    """JAX_NUM_CPU_DEVICES wins over the launcher's device flag in JAX: the launcher leaves the flag out and
    checks the user's count (it added the flag, counted 2, and every rank then saw 1 and failed)."""
    from jaxhybrid.cli.commands.launch import rank_environment

    ns, cfg = _job(tmp_path, config="hybrid.yaml")
    env = rank_environment(4, [0, 1], 0, base={"JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"}, devices=2)
    assert "device_count" not in env["XLA_FLAGS"]
    with pytest.raises(ValueError, match="your JAX_NUM_CPU_DEVICES=1"):
        check_devices(cfg, 4, env, 2)


def test_rank_count_is_checked_first(tmp_path):
    """-n 0 is named as such, not as a world size the config's grid does not match."""
    _, args = build_parser(["launch", "-n", "0", "--config", str(RUNS / "pipeline_2x2.yaml")])
    with pytest.raises(ValueError, match=r"^-n 0: need at least one rank$"):
        launch.run(args)


def test_more_ranks_than_the_cores_can_run_are_refused(tmp_path, capsys):
    """``launch -n 512`` on 2 cores started 512 ranks that made no progress until MPIEXEC_TIMEOUT ended
    them; now it is refused before mpiexec, with the numbers, unless --oversubscribe."""
    common = ["--cores", "1", "--mpiexec", str(_fake_mpiexec(tmp_path)), "--dry-run", "--script", __file__]
    _, args = build_parser(["launch", "-n", str(launch.RANKS_PER_CORE + 1), *common])
    with pytest.raises(ValueError, match=rf"^-n {launch.RANKS_PER_CORE + 1} ranks on 1 cores is "
                                         rf"{launch.RANKS_PER_CORE + 1} ranks per core, over {launch.RANKS_PER_CORE}: "
                                         rf"use at most {launch.RANKS_PER_CORE} ranks here"):
        launch.run(args)
    for n, extra in ((launch.RANKS_PER_CORE, []), (launch.RANKS_PER_CORE + 1, ["--oversubscribe"])):
        _, args = build_parser(["launch", "-n", str(n), *extra, *common])
        assert launch.run(args) == 0
    assert f"-n {launch.RANKS_PER_CORE + 1}" in capsys.readouterr().out


@pytest.mark.parametrize("cores", ["0", "-3"])
def test_cores_must_be_at_least_one(cores, capsys):
    """--cores 0 used to mean all cores (JAXHYBRID_RANK_CPUS listed every CPU) and -3 got "this process
    may use N CPUs"; both are argparse errors naming the flag, the value and the bound."""
    with pytest.raises(SystemExit) as e:
        build_parser(["launch", "-n", "1", "--cores", cores, "--dry-run", "--config", str(RUNS / "tiny.yaml")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"jaxhybrid launch: error: argument --cores: must be an integer >= 1 (got '{cores}')" in err


@pytest.mark.parametrize("given, why", [("nope.py", "does not exist"), (".", "is a folder")])
def test_a_script_that_cannot_run_is_refused_before_the_ranks_start(tmp_path, capsys, given, why):
    """A missing --script started the job anyway: every rank printed runpy's FileNotFoundError traceback
    and the launcher ended with 'no rank was seen to end first'."""
    from jaxhybrid.cli.main import main

    rc = main(["launch", "-n", "2", "--mpiexec", str(_fake_mpiexec(tmp_path)), "--script", given])
    assert (rc, capsys.readouterr().err) == (2, f"jaxhybrid launch: error: --script {given} {why}: give the "
                                                f"Python file every rank runs\n")


def _fake_mpiexec(tmp_path) -> Path:
    exe = tmp_path / "mpiexec"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    return exe


def test_cores_picks_the_first_allowed_cpus(tmp_path, capsys):
    first = launch.job_cpus()[0]
    for extra, want in ((["--cores", "1"], str(first)), ([], ",".join(map(str, launch.job_cpus())))):
        _, args = build_parser(["launch", "-n", "1", *extra, "--mpiexec", str(_fake_mpiexec(tmp_path)), "--dry-run",
                                "--config", str(RUNS / "tiny.yaml"), "--set", f"run.dir={tmp_path}"])
        assert launch.run(args) == 0
        assert f"JAXHYBRID_RANK_CPUS='{want}'" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"^--cores 99999 must be in \[1, "):
        launch.job_cpus(99999)


@pytest.mark.parametrize("given,why", [
    ("/nonexistent/mpiexec", "does not exist"), ("no-such-mpiexec-xyz", "is not on PATH"),
    ("{tmp}", "is a folder"), ("{tmp}/plain", "is not executable"),
])
def test_an_mpiexec_that_cannot_run_is_one_error_naming_it(tmp_path, capsys, given, why):
    """--mpiexec was used as typed: a missing one gave Popen's bare "[Errno 2] No such file or directory",
    a folder or a file without execute permission a PermissionError traceback, after the job's checks
    (and --dry-run printed a command that could not run). Now one line naming it, exit code 2."""
    from jaxhybrid.cli.main import main

    (tmp_path / "plain").write_text("#!/bin/sh\n")
    given = given.format(tmp=tmp_path)
    rc = main(["launch", "-n", "1", "--mpiexec", given, "--dry-run", "--config", str(RUNS / "tiny.yaml"),
               "--set", f"run.dir={tmp_path / 'run'}"])
    assert (rc, capsys.readouterr().err) == (2, f"jaxhybrid launch: error: --mpiexec {given} {why}: give an MPI "
                                                f"launcher (mpiexec or mpirun), or leave --mpiexec out to use the "
                                                f"one next to this Python\n")
    assert launch.find_mpiexec(str(_fake_mpiexec(tmp_path))) == str(tmp_path / "mpiexec")  # a runnable one: as given


@pytest.mark.parametrize("argv,expected", [
    (["--config", "c.yaml", "--set", "a=1"], ["--config", "c.yaml", "--set", "a=1"]),
    (["--", "--config", "c.yaml", "--resume"], ["--config", "c.yaml", "--resume"]),
    (["--config", "c.yaml", "--distributed", "--", "--set", "a=1"],
     ["--config", "c.yaml", "--distributed", "--set", "a=1"]),
    (["train", "--config", "c.yaml"], ["train", "--config", "c.yaml"]),
])
def test_train_arguments_with_or_without_the_separator(argv, expected):
    _, args = build_parser(["launch", "-n", "4", "--timeout", "5", *argv])
    assert launch.train_arguments(args) == expected and args.timeout == 5


def test_two_ranks_reports_on_one_line_are_split():
    merged = "jaxhybrid train: error: plan file not found: nope.jsonjaxhybrid train: error: plan file not found: x\n"
    assert launch.split_reports(merged) == ["jaxhybrid train: error: plan file not found: nope.json\n",
                                            "jaxhybrid train: error: plan file not found: x\n"]
    assert launch.split_reports("see `jaxhybrid launch -n 4`\n") == ["see `jaxhybrid launch -n 4`\n"]


def test_failure_summary_names_the_error_of_ranks_that_failed_at_setup(tmp_path):
    """Ranks that fail before they make their topology leave no PID file: the last line quotes the first
    rank error instead of "no rank was seen to end first"."""
    watch = RankWatch(tmp_path, 4)
    error = "jaxhybrid train: error: data path not found: /nope; create it with `jaxhybrid prepare-data --out DIR`"
    abort = "Abort(2) on node 3 (rank 3 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 2) - process 3"
    assert failure_summary(watch, [error + "\n"] * 4 + [abort]) == f"every rank failed before joining the job: {error}"
    assert failure_summary(watch, [error + "\n"] * 2) == f"2 of 4 ranks failed before joining the job: {error}"
    assert failure_summary(watch, [abort]) == "no rank was seen to end first"
    timeout = "[mpiexec@vm] APPLICATION TIMED OUT, TIMEOUT = 90s\n"  # hydra's line when MPIEXEC_TIMEOUT ran out
    assert failure_summary(watch, [abort, timeout]).startswith(
        "the job ran past its time limit ([mpiexec@vm] APPLICATION TIMED OUT, TIMEOUT = 90s); no rank failed first")
    # Ranks that made their topology and then exited with such an error left their exit marker.
    (tmp_path / "rank0.pid").write_text("101 rank 0 (stage 0, replica 0)")
    assert failure_summary(watch, [error + "\n"]) == f"1 of 4 ranks failed: {error}"


def test_a_compilation_cache_that_cannot_be_made_is_found_once(tmp_path, monkeypatch):
    """Each rank made the folder after mpiexec started: a file there failed every rank with a FileExistsError
    traceback, /proc/x with a bare '[Errno 2] ... /proc/x' naming no key."""
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=rf"run.compilation_cache={tmp_path}/file is a file; give a directory"):
        check_job(*_job(tmp_path / "run", f"run.compilation_cache={tmp_path / 'file'}"), 4)
    monkeypatch.setenv("JAXHYBRID_CACHE", str(tmp_path / "file"))  # auto: $JAXHYBRID_CACHE/xla
    with pytest.raises(ConfigError, match=rf"run.compilation_cache=auto \({tmp_path}/file/xla\) cannot be written: "
                                          rf"{tmp_path}/file is not a directory; set JAXHYBRID_CACHE or "):
        check_job(*_job(tmp_path / "run"), 4)
    check_job(*_job(tmp_path / "run", "run.compilation_cache="), 4)  # off: nothing to make


def test_a_missing_data_path_is_found_once(tmp_path):
    with pytest.raises(FileNotFoundError, match="/nonexistent/tokens"):
        check_job(*_job(tmp_path, "data.path=/nonexistent/tokens"), 4)


def test_a_train_split_shorter_than_one_sequence_is_found_once(tmp_path):
    """Every rank's sampler would refuse it after the job started: four errors and an abort."""
    from jaxhybrid.runtime.data import prepare_data

    (tmp_path / "tiny.txt").write_text("hi")
    data = prepare_data(tmp_path / "tiny", [tmp_path / "tiny.txt"])
    with pytest.raises(ValueError, match=r"train split of .* has 3 tokens; one sequence needs data.seq_len \+ 1"):
        check_job(*_job(tmp_path / "run", f"data.path={data}", "train.eval_every=0"), 4)


def test_a_val_fraction_or_tokenizer_a_prepared_dataset_cannot_honour_is_an_error(tmp_path):
    """data.val_fraction and data.tokenizer shape the built-in corpus only; with data.path they were ignored
    without a word (prepare-data fixed the split and the ids). A value other than the data's and the default
    fails, naming both, in the launcher and where a train process opens the data."""
    from jaxhybrid.runtime.data import prepare_data
    from jaxhybrid.runtime.data.splits import open_dataset

    (tmp_path / "t.txt").write_text("some text to split\n" * 1000)
    data = prepare_data(tmp_path / "d", [tmp_path / "t.txt"], val_fraction=0.1)
    ns, cfg = _job(tmp_path / "run", f"data.path={data}", "data.val_fraction=0.3")
    msg = (rf"^data.val_fraction=0.3 has no effect: data.path={data} was prepared with val_fraction 0.1 \(1900 "
           r"val tokens\), which fixed its split; leave data.val_fraction out or set it to 0.1, or prepare the "
           r"data again with --val-fraction 0.3$")
    with pytest.raises(ConfigError, match=msg):
        check_job(ns, cfg, 4)
    with pytest.raises(ConfigError, match=msg):
        open_dataset(cfg)
    for same in ("0.1", "0.02"):  # the data's own, or the default (which cannot be told from one left out)
        check_job(*_job(tmp_path / "run", f"data.path={data}", f"data.val_fraction={same}"), 4)
    ns, cfg = _job(tmp_path / "run", f"data.path={data}", "data.tokenizer=bpe")  # byte ids, prepared so
    with pytest.raises(ConfigError, match=rf"^data.tokenizer=bpe has no effect: data.path={data} holds byte token "
                                          r"ids \(prepare-data fixed them\); leave data.tokenizer out or set it to byte"):
        check_job(ns, cfg, 4)


def test_metrics_settings_are_checked_before_the_ranks_start(tmp_path, monkeypatch):
    """A metrics.hardware file that is missing or has no peak for the compute dtype, and TensorBoard
    without tensorboardX, fail before anything is built (they used to fail after the first compilation)."""
    with pytest.raises(ConfigError, match="metrics.hardware='nope': hardware 'nope' not found"):
        check_job(*_job(tmp_path / "a", "metrics.hardware=nope"), 4)
    hw = tmp_path / "fp32only.yaml"
    hw.write_text("name: fp32only\npeak_tflops: {float32: 1.0}\n")
    with pytest.raises(ConfigError, match="fp32only' has no peak_tflops for 'bfloat16'"):
        check_job(*_job(tmp_path / "b", f"metrics.hardware={hw}", "precision.compute_dtype=bfloat16"), 4)
    check_job(*_job(tmp_path / "c", f"metrics.hardware={hw}"), 4)  # float32: fine
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorboardX" else real(n, *a))
    with pytest.raises(ConfigError, match="metrics.tensorboard=true needs the tensorboardX package"):
        check_job(*_job(tmp_path / "d"), 4)
    check_job(*_job(tmp_path / "e", "metrics.tensorboard=false"), 4)


def test_a_resume_that_cannot_continue_fails_in_the_launcher(tmp_path):
    """A resume of a run.dir without checkpoints, or with another data order than its checkpoints' sampler
    (seed, global batch, sequence length), fails once before the ranks start, not on every rank after
    each built its model."""
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=rf"--resume \(run.resume=true\): run.dir={run} holds no checkpoint to "
                                          r"continue .* start a new run without --resume \(it starts from "
                                          r"train.init_from=w, which a resume ignores\)"):
        check_job(*_job(run, "train.init_from=w", flags=("--resume",)), 4)
    (run / "checkpoints" / "rank_0" / "2").mkdir(parents=True)
    (run / "config.yaml").write_text("parallel: {pipeline: 2, data: 2}\n")
    with pytest.raises(ConfigError, match=r"--resume in .*another data order \(train.global_batch: 16 -> 32; "
                                          r"data.seq_len: 128 -> 64\)"):
        check_job(*_job(run, "train.global_batch=32", "data.seq_len=64", flags=("--resume",)), 4)
    check_job(*_job(run, "train.steps=300", flags=("--resume",)), 4)


def test_a_resume_on_another_built_in_corpus_fails_in_the_launcher(tmp_path):
    """data.val_fraction and data.tokenizer shape the built-in corpus's train split, and leaving data.path
    trains on it instead of the prepared data: each changes the tokens a checkpoint's sampler position
    counts in. The data check compared only a data.path's tokens, so these passed the launcher and every
    rank failed alike in its sampler after building its model."""
    run = tmp_path / "run"
    (run / "checkpoints" / "rank_0" / "2").mkdir(parents=True)
    (run / "config.yaml").write_text("parallel: {pipeline: 2, data: 2}\ndata: {path: /data/mine}\n")
    with pytest.raises(ConfigError, match=r"--resume in .*: its checkpoints trained on other data than this run's "
                                          r"built-in corpus \(data.path: /data/mine -> ; data.val_fraction: 0.02 -> "
                                          r"0.05\); resume with the settings of .*config.yaml"):
        check_job(*_job(run, "data.val_fraction=0.05", flags=("--resume",)), 4)
    (run / "config.yaml").write_text("parallel: {pipeline: 2, data: 2}\nmodel: {vocab_size: 512}\n")
    with pytest.raises(ConfigError, match=r"built-in corpus \(data.tokenizer: byte -> bpe\)"):
        check_job(*_job(run, "data.tokenizer=bpe", "model.vocab_size=512", flags=("--resume",)), 4)
    check_job(*_job(run, "train.steps=300", "model.vocab_size=512", flags=("--resume",)), 4)


def test_an_error_on_a_rank_that_joined_the_job_names_the_rank(tmp_path):
    """ValueError and FileNotFoundError are one-line setup errors (`jaxhybrid train: error: ...`), but on
    a rank that joined an MPI job (its abort hook installed) they are that rank's failure in mid-job: its
    traceback and `jaxhybrid: rank R (...) failed`, which the launcher names, then the abort."""
    import subprocess
    import sys

    code = ("import sys; from jaxhybrid.parallel.pipeline.watchdog import install_abort_on_exception; "
            "install_abort_on_exception('rank 1 (stage 1, replica 0)'); from jaxhybrid.cli.main import main; "
            f"sys.exit(main(['prepare-data', '--out', {str(tmp_path / 'out')!r}, '--input', 'nope.txt']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "Traceback" in r.stderr and r.stderr.strip().splitlines()[-1] == (
        "jaxhybrid: rank 1 (stage 1, replica 0) failed: FileNotFoundError: input file not found: nope.txt; "
        "aborting the job"), r.stderr


def test_a_resume_on_other_data_fails_in_the_launcher(tmp_path):
    """A resume from a prepared dataset compares the checkpoint's sampler with this run's train split: other
    data of the same length (only its fingerprint differs) and of another length are both named before the
    ranks start; the data that wrote the checkpoint resumes."""
    import json

    from jaxhybrid.runtime.data import Sampler, TokenDataset, prepare_data

    def data(name, text):
        (tmp_path / f"{name}.txt").write_text(text)
        return prepare_data(tmp_path / name, [tmp_path / f"{name}.txt"])

    a, same_len, longer = data("a", "abcdefgh" * 200), data("b", "hgfedcba" * 200), data("c", "abcdefgh" * 300)
    run = tmp_path / "run"
    step = run / "checkpoints" / "rank_0" / "2" / "meta"
    step.mkdir(parents=True)
    sets = ["data.seq_len=16", "train.eval_every=0"]
    state = Sampler(TokenDataset(a), 16, 16, 0).state_dict(2)  # the defaults: global_batch 16, seed 0
    (step / "metadata").write_text(json.dumps({"step": 2, "sampler": state, "param_layout": 2}))  # as Trainer.save
    (run / "config.yaml").write_text("parallel: {pipeline: 2, data: 2}\ndata: {seq_len: 16}\n")
    check_job(*_job(run, f"data.path={a}", *sets, flags=("--resume",)), 4)
    with pytest.raises(ConfigError, match=r"--resume in .*: its checkpoints trained on other data than data.path=.*/b "
                                          r"\(the train tokens differ \(fingerprint [0-9a-f]{16} != [0-9a-f]{16}\)\)"):
        check_job(*_job(run, f"data.path={same_len}", *sets, flags=("--resume",)), 4)
    with pytest.raises(ConfigError, match=r"n_tokens: checkpoint \d+ != current \d+"):
        check_job(*_job(run, f"data.path={longer}", *sets, flags=("--resume",)), 4)
