"""MPI tests of the pipeline engine: one ``mpirun`` per world size and device count runs its grids'
(schedule x 2BP x transport) parity cases in sequence (tests/mpi/drive_parity.py), each case a test of its
own; one job checks the mpi4py transport's pre-posted receives (drive_transport.py), and fault jobs check
that a failing, killed or stuck rank ends the job within 10 s with a message naming the rank
(tests/mpi/drive_fault.py via ``jaxhybrid launch``; drive_train_fault.py for ``jaxhybrid train`` itself)."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxhybrid.cli.commands.launch import HEAVY_YIELD
from jaxhybrid.model.testing import assert_tree_close
from jaxhybrid.runtime import compile_once

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
BIN = Path(sys.executable).parent
SCHEDULES = ["naive", "gpipe", "1f1b-1", "1f1b-2", "zb-h1", "myelin", "1f1b"]

pytestmark = pytest.mark.mpi


def _env(timeout: int, devices: int = 1) -> dict:
    """The environment of the MPI tests' jobs: a timeout, fake CPU devices, one thread per rank, XLA's
    backend optimisation off (it takes a large share of a parity job's cold compile; what these tests
    compare, parity and bit-exactness, does not depend on it), and as the launcher sets them for more ranks
    than cores: mpich's waits sleeping, and each program compiled by one rank (``compile_once``).

    The jobs keep their XLA cache apart, in $JAXHYBRID_CACHE/mpi: they compile under these flags, so the unit
    tests' entries never hit, and JAX's bounded cache scans its whole folder on every write, under the lock
    that every rank's read waits for, which slowed the jobs markedly beside the unit tests' large cache."""
    env = dict(os.environ)
    if "JAXHYBRID_CACHE" in env:
        env["JAXHYBRID_CACHE"] = os.path.join(env["JAXHYBRID_CACHE"], "mpi")
    env.update({"MPIEXEC_TIMEOUT": str(timeout), "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu", HEAVY_YIELD: "1",
                compile_once.ENV: "1",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} "
                             "--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0 "
                             "--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false",
                "PYTHONPATH": str(ROOT)})
    return env


def _mpirun(n: int, script: str, *args: str, timeout: int = 400, devices: int = 1) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "mpirun"), "-n", str(n), sys.executable, "-m", "mpi4py", str(HERE / script), *args]
    return subprocess.run(cmd, env=_env(timeout, devices), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout + 30)


def _cases(schedules: list[str], mpi4py: tuple[str, ...] = (), tied: bool = False) -> list[str]:
    """drive_parity.py's case tokens: each schedule fused and with 2BP (zb-h1 always splits its backward),
    then the ``mpi4py`` schedules over the mpi4py transport and a tied-embedding 1F1B case."""
    return ([s + split for s in schedules for split in ("", ":2bp") if not (s == "zb-h1" and not split)]
            + [f"{s}:2bp:mpi4py" for s in mpi4py] + (["1f1b:2bp:tied"] if tied else []))


# Every schedule with and without 2BP on 4 stages. drive_parity.py runs 1f1b-1 with M = P and every other
# schedule with M = 2P, so there 1f1b IS 1f1b-2 (the same rows; the other grids run it as 1f1b). One stage
# x 2 replicas, where naive, 1f1b and 1f1b-2 are one schedule too, runs the static and the message-driven
# loop on a stage that is first and last. 2 stages (with the bad-input, trace, tied-embedding and
# mpi4py-transport cases) and the 2 x 2 grid (pipeline and data parallel together) run one schedule of
# each kind: static (GPipe on 2 stages, 1F1B), Myelin's message-driven policy (arrival order decides) and
# ZB-H1's split backward.
# The hybrid pipeline x tensor grids (AxoNN-4D item 5): every rank runs its stage on a local (depth, row,
# col) mesh of fake CPU devices; stage boundaries are device-staged (mpi4jax) or host-staged (mpi4py),
# data-parallel gradients are all-reduced shard by shard. On 2 x 1 also LLaMA and a case without
# optimization A (each new variant compiles every rank's kernels again, and tests/parity already runs
# both on every mesh shape), on 2 x 2 embeddings tied across the stages.
# Grids of one world size and device count share a job (one mpirun: one start-up and JAX init per rank,
# the single-device references computed once): {job: (devices per rank, [(p, d, extra flags, cases)])}.
KINDS = ["1f1b", "myelin", "zb-h1"]
DEEP = [s for s in SCHEDULES if s != "1f1b"]
# Virtual stages (two per rank): interleaved 1F1B fused and with 2BP and Myelin's loop over the chunks of the
# loop placement, ZB-V and Myelin on the V placement with the tied embedding's two copies on one rank.
CHUNKED = ["interleaved-1f1b:v2", "interleaved-1f1b:2bp:v2", "myelin:2bp:v2", "zb-v:2bp:vee:tied",
           "myelin:2bp:vee:tied"]
# A MadPipe allocation (`jaxhybrid partition --out` of tests/golden/madpipe_special_profile.json): the special
# processor, rank 0, holds the first and the last stage, and the ILP's periodic pattern orders them.
ALLOCATION = ["periodic:alloc", "periodic:2bp:alloc:tied"]
# optim.shard_optimizer (ZeRO-1) on 2 x 2: AdamW on the device with the tied embedding's copies in two stages'
# shards, and the host-offloaded buckets of each replica's shard under Myelin's loop.
ZERO = ["1f1b:2bp:zero:tied", "myelin:2bp:zero:offload"]
# pipeline.transport=transfer (JAX's transfer server) runs every schedule with and without 2BP
# on 4 stages, Myelin's loop over two stages per rank on the 2 x 2 grid, and a stage on a local tensor mesh; the
# other grids keep the mpi4jax (and mpi4py) transports.
# The mpi replicas' sum after the pipeline phase (optim.overlap_grad_reduce off); the other 2 x 2 mpi cases start
# each stage's sum during the phase, in buckets, as soon as its last gradient pass has run.
AFTER = ["1f1b:2bp:tied:after"]
PARTITION_ARGS = ("--profile", str(ROOT / "tests/golden/madpipe_special_profile.json"), "--processors", "2",
                  "--memory", "6e8", "--bandwidth", "1e9")
PARITY_JOBS = {
    "2-ranks": (1, [(2, 1, ["--bad-input", "--trace"],
                     _cases(["gpipe", *KINDS], ("1f1b", "myelin"), tied=True) + CHUNKED),
                    (2, 1, ["--plan", "ALLOCATION"], ALLOCATION),
                    (1, 2, [], _cases(["1f1b", "myelin"]))]),
    "4-ranks": (1, [(2, 2, [], _cases(KINDS, ("myelin",)) + CHUNKED[1:4] + ZERO + AFTER + ["myelin:2bp:v2:xfer"]),
                    (4, 1, [], [f"{c}:xfer" for c in _cases(DEEP)])]),
    "2-ranks-depth2-col2": (4, [(2, 1, ["--tensor", "2,1,2"],
                                 [*_cases(["1f1b"]), "1f1b:2bp:llama", "1f1b:2bp:mpi4py:BCDE", "1f1b:2bp:xfer"])]),
    "4-ranks-row2": (2, [(2, 2, ["--tensor", "1,2,1"], [*_cases(["myelin"]), "1f1b:2bp:tied"])]),
    # optim.allreduce_backend=xla: the job joins jax.distributed and each data column sums over a JAX mesh of
    # its processes (gloo on CPU): the static and the message-driven loop, and the sharded optimizer's
    # reduce-scatter and all-gather as XLA collectives; then every rank on a local tensor mesh of its two
    # devices, the column one (data, depth, row, col) mesh of the replicas' meshes, with the offloaded optimizer
    # (both grids report as 2x2: their case tokens must differ).
    "4-ranks-xla": (2, [(2, 2, ["--allreduce-backend", "xla"], ["1f1b", "myelin:2bp", *ZERO]),
                        (2, 2, ["--allreduce-backend", "xla", "--tensor", "1,2,1"], ["1f1b:2bp", "myelin:2bp:offload"])]),
}
PARITY_CASES = [(job, p, d, case) for job, (_, grids) in PARITY_JOBS.items() for p, d, _, cases in grids
                for case in cases]
# A job reports each case as "CASE grid=PxD token": two grids of one shape must not share a token.
assert len(set(PARITY_CASES)) == len(PARITY_CASES), sorted(c for c in PARITY_CASES if PARITY_CASES.count(c) > 1)


# Session-scoped, not per module: an xdist worker that ran another file between a job's tests would tear a module
# fixture down and run the job again (tests/mpi/xdist_scopes.py keeps a job's tests on one worker).
@pytest.fixture(scope="session")
def parity_job(tmp_path_factory):
    """``parity_job(name)``: PARITY_JOBS[name] run once for the session (on first use), as (the completed
    process, its output, {(grid, case token): the CASE line's status}). A grid's ``ALLOCATION`` flag is the
    plan file that ``jaxhybrid partition --out`` writes for PARTITION_ARGS."""
    done = {}
    plan = tmp_path_factory.mktemp("madpipe") / "alloc.json"

    def run(name):
        if name not in done:
            devices, grids = PARITY_JOBS[name]
            argv = []
            for i, (p, d, flags, cases) in enumerate(grids):
                if "ALLOCATION" in flags and not plan.exists():
                    r = subprocess.run([sys.executable, "-m", "jaxhybrid", "partition", *PARTITION_ARGS, "--out",
                                        str(plan)], env=_env(120), cwd=ROOT, capture_output=True, text=True)
                    assert r.returncode == 0, r.stdout + r.stderr
                flags = [str(plan) if f == "ALLOCATION" else f for f in flags]
                argv += ["--then"] * bool(i) + ["--pipeline", str(p), "--data", str(d), "--cases", ",".join(cases),
                                                *flags]
            ranks = grids[0][0] * grids[0][1]
            try:  # 400 s a grid, the limit each grid had in a job of its own
                r = _mpirun(ranks, "drive_parity.py", *argv, timeout=400 * len(grids), devices=devices)
            except subprocess.TimeoutExpired as e:  # kept as a result: the cases it reported still count
                text = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)]
                r = subprocess.CompletedProcess(e.cmd, -9, *text)
            found = {(g, c): status for g, c, status in
                     re.findall(r"^CASE grid=(\S+) (\S+): (.*?)(?: \([\d.]+ s\))?$", r.stdout, re.MULTILINE)}
            done[name] = (r, r.stdout + r.stderr, found)
        return done[name]

    return run


@pytest.mark.parametrize("job,p,d,case", PARITY_CASES,
                         ids=[f"{job}-{p}x{d}-{case}" for job, p, d, case in PARITY_CASES])
def test_parity(parity_job, job, p, d, case):
    """3 steps of losses, step-1 gradients, final params and the eval loss equal the single-device
    trainer's (fp32_parity, leaf by leaf) for the case (tests/mpi/drive_parity.py's token: schedule, 2BP,
    transport, tied embeddings, model, tensor optimizations) on the job's grid; on the tensor grids every
    kernel is also split over the rank's whole local mesh."""
    r, out, found = parity_job(job)
    status = found.get((f"{p}x{d}", case))
    assert status is not None, f"{p}x{d} {case}: never reported (job {job}, rc {r.returncode}):\n" + out[-6000:]
    assert status == "ok", f"{p}x{d} {case}: {status}\n" + out[-6000:]


@pytest.mark.parametrize("job", list(PARITY_JOBS))
def test_parity_job_ends_cleanly_having_run_every_case(parity_job, job):
    """The job exits 0 with each grid's summary, and ran exactly its cases (none more, none lost); on 2 x 1
    bad layouts are refused alike on every rank, both transports move bfloat16 bit-exactly and the traced
    case's merged trace is written."""
    r, out, found = parity_job(job)
    _, grids = PARITY_JOBS[job]
    assert r.returncode == 0, f"job {job} failed (rc {r.returncode}):\n" + out[-6000:]
    want = {(f"{p}x{d}", c) for p, d, _, cases in grids for c in cases}
    assert set(found) == want and len(re.findall(r"^CASE ", r.stdout, re.MULTILINE)) == len(want), sorted(found)
    for p, d, flags, cases in grids:
        assert f"SUMMARY grid={p}x{d} cases={len(cases)} failures=0" in r.stdout, out[-4000:]
        if "--bad-input" in flags:
            refused = f"parallel.pipeline({p + 1}) x parallel.data({d}) = {(p + 1) * d} != world size {p * d}"
            assert f"BADINPUT ok: {refused}" in r.stdout, out[-4000:]
            assert "BF16 ok" in r.stdout, out[-4000:]
        if "--trace" in flags:
            assert re.search(rf"TRACE grid={p}x{d} bubble_ratio=0\.\d+", r.stdout), out[-2000:]


@pytest.mark.timed  # its receives wait 10 s at most
def test_mpi4py_transport_receives_are_posted_ahead_and_take_only_its_messages():
    """Myelin IV-A on the mpi4py transport (tests/mpi/drive_transport.py): messages sent before the
    receiver polls land in its posted receives, found without a probe and handed out in order; the
    buffers posted in their place take the next ones without overwriting a payload. A tag-7 message on
    the row (tied.py's exchange) and an mpi4jax payload on ``p2p`` are never taken by the posted ANY_TAG
    receives; the probe-on-demand path (``recv_depth=0``) moves bfloat16 bit-exactly."""
    r = _mpirun(2, "drive_transport.py", timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    for case in ("landed depth=2", "landed depth=4", "foreign", "depth0"):
        assert f"TRANSPORT {case} ok" in r.stdout, out[-4000:]


@pytest.mark.timed  # it times how fast the job ends: scripts/test.sh runs it alone
@pytest.mark.parametrize("mode,data,victim,expect", [
    ("exception", 1, 1, r"rank 1 \(stage 1, replica 0\) failed: RuntimeError: injected failure"),
    ("kill", 1, 1, r"rank 1 \(stage 1, replica 0\) \(pid \d+\) ended abnormally"),
    # 2 x 2: hydra named a bystander here (rank 0 or 1, aborted when its peer vanished); the launcher's
    # own watch of the PIDs must name the killed rank.
    ("kill", 2, 3, r"rank 3 \(stage 1, replica 1\) \(pid \d+\)[^\n]* ended abnormally, \w* ?the first rank"),
    ("hang", 1, 1, r"watchdog: rank 1 \(stage 1, replica 0\) made no progress|waiting for .* from rank 1 \(stage 1, "
                   r"replica 0\)"),
    # The watchdog's journal names peers as the waits do (it said "to rank 1", a row rank: in replica 1
    # that is world rank 3).
    ("hang", 2, 3, r"made no progress.*last sends: \S+ mb\d->s\d to rank \d \(stage \d, replica \d\) \(\d"),
    # A rank frozen between steps (its optimizer, a save) leaves its peers in a collective, not in a
    # pipeline phase: the watchdog must cover that wait too (it used to run to MPIEXEC_TIMEOUT).
    ("hang-collective", 1, 1, r"watchdog: rank 0 \(stage 0, replica 0\) made no progress.*now: (sum|max) over"),
], ids=["exception", "kill", "kill-2x2-rank3", "hang", "hang-2x2-rank3", "hang-collective"])
def test_fault_ends_job_naming_the_rank(tmp_path, mode, data, victim, expect):
    stamp = tmp_path / "stamp"
    cmd = [sys.executable, "-m", "jaxhybrid", "launch", "-n", str(2 * data), "--timeout", "120", "--script",
           str(HERE / "drive_fault.py"), "--", "--mode", mode, "--deadline", "2", "--stamp", str(stamp),
           "--data", str(data), "--victim", str(victim)]
    r = subprocess.run(cmd, env=_env(120), cwd=ROOT, capture_output=True, text=True, timeout=180)
    ended = time.time()
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert stamp.exists(), "the fault was never injected:\n" + out[-3000:]
    took = ended - float(stamp.read_text())
    assert took < 10, f"{mode}: the job took {took:.1f} s to end after the fault"
    assert re.search(expect, out), out[-3000:]
    own = re.search(r"jaxhybrid(?: watchdog)?: (rank \d+ \(stage \d+, replica \d+\)) .*?(?:failed|made no progress)", out)
    if mode in ("exception", "hang-collective"):  # the rank that aborted the job is named, though others ended first
        assert own and f"jaxhybrid launch: {own.group(1)} reported the failure first" in out, out[-3000:]
    if mode == "hang":  # the stuck rank is named, whether its own watchdog fired or a peer's did, waiting for it
        stuck = re.escape(f"rank {victim} (stage {victim % 2}, replica {victim // 2})")
        assert re.search(rf"jaxhybrid launch: {stuck} (reported the failure first|made no progress: rank \d+ "
                         rf"\(stage \d, replica \d\) waited for it)", out), out[-3000:]


# `jaxhybrid train` jobs whose process 1 fails in the Trainer (tests/mpi/drive_train_fault.py): (train flags,
# --set values, the driver's fault, what the output must hold). Each used to run until MPIEXEC_TIMEOUT.
TRAIN_FAULTS = {
    # --distributed: the raising process waited for its peer in jax.distributed's shutdown barrier (an exit
    # hook) while the peer waited for it in the step's collectives; nothing ended, the message printed.
    "distributed-raises": (["--distributed"], ["parallel.data=2", "parallel.mesh_data=true"], [],
                           [r"jaxhybrid: process 1 of 2 \(--distributed\) failed: RuntimeError: injected failure",
                            r"jaxhybrid launch: process 1 of 2 \(--distributed\) reported the failure first"]),
    # ... also while its Trainer is built (its data, engine or updater), before its peer's first collective.
    "distributed-raises-in-init": (["--distributed"], ["parallel.data=2", "parallel.mesh_data=true"],
                                   ["--method", "__init__"],
                                   [r"jaxhybrid: process 1 of 2 \(--distributed\) failed: RuntimeError: injected "
                                    r"failure in Trainer.__init__",
                                    r"jaxhybrid launch: process 1 of 2 \(--distributed\) reported the failure first"]),
    # A pipeline rank stuck before the run's first collective (its init, a restore): rank 0 waited in the
    # memory report's gather with no watchdog armed.
    "pipeline-hangs-in-init": ([], ["parallel.pipeline=2", "pipeline.watchdog_s=2", "pipeline.watchdog_compile_s=2"],
                               ["--method", "init_state", "--mode", "hang"],
                               [r"watchdog: rank 0 \(stage 0, replica 0\) made no progress.*now: gathering every "
                                r"rank's memory report"]),
}


@pytest.mark.timed
@pytest.mark.parametrize("case", list(TRAIN_FAULTS))
def test_a_trainer_failing_on_one_process_ends_the_job(tmp_path, case):
    """``jaxhybrid train`` under ``jaxhybrid launch -n 2`` whose process 1 fails in the Trainer: the job
    ends within 10 s of the fault (it ran to the 60 s timeout before), naming the failing or waiting rank."""
    flags, sets, fault, expect = TRAIN_FAULTS[case]
    stamp = tmp_path / "stamp"
    sets = [*sets, "train.steps=6", "train.eval_every=0", "metrics.plot=false", "metrics.tensorboard=false",
            f"run.dir={tmp_path / 'run'}"]
    cmd = [sys.executable, "-m", "jaxhybrid", "launch", "-n", "2", "--timeout", "60", "--script",
           str(HERE / "drive_train_fault.py"), "--", "--stamp", str(stamp), *fault, *flags, "--config",
           str(ROOT / "configs" / "runs" / "tiny.yaml"), *[a for kv in sets for a in ("--set", kv)]]
    r = subprocess.run(cmd, env=_env(60), cwd=ROOT, capture_output=True, text=True, timeout=120)
    ended = time.time()
    out = r.stdout + r.stderr
    assert r.returncode != 0 and stamp.exists(), "the fault was never injected:\n" + out[-3000:]
    took = ended - float(stamp.read_text())
    assert took < 10, f"{case}: the job took {took:.1f} s to end after the fault:\n" + out[-3000:]
    for pattern in expect:
        assert re.search(pattern, out), out[-3000:]


def test_sigterm_to_the_launcher_stops_every_rank_after_a_saved_step(tmp_path):
    """SIGTERM to `jaxhybrid launch` alone (a supervisor, Slurm's time limit): it passes it on, the ranks
    agree to stop after one step, each saves that step, and the job ends with status 130 and one line.
    No rank is cut off: the writer's loss curve (drawn as it closes, after its save) is there, and the run
    resumes. Before the ranks met after closing, rank 1's exit (status 130 under `python -m mpi4py`: an
    MPI abort) killed rank 0 while it drew it."""
    import signal

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxhybrid", "launch", "-n", "2", "--timeout", "120", "--config",
           str(ROOT / "configs" / "runs" / "tiny.yaml"), "--set", "parallel.pipeline=2",
           "--set", "pipeline.microbatches=2", "--set", "train.steps=100000", "--set", f"run.dir={run}",
           "--set", "train.eval_every=0", "--set", "metrics.tensorboard=false"]
    p = subprocess.Popen(cmd, env=_env(120), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None and not (
                (run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2):
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    steps = [sorted(int(d.name) for d in (run / "checkpoints" / f"rank_{r}").iterdir() if d.name.isdigit())
             for r in (0, 1)]
    assert p.returncode == 130 and steps[0] == steps[1] and steps[0], (steps, out[-2000:], err[-2000:])
    assert err.strip().splitlines()[-1] == "jaxhybrid launch: stopped by SIGTERM (exit code 130)", err[-2000:]
    for r in (0, 1):
        assert f"stopped by SIGTERM; rank {r} saved step {steps[0][-1]}" in out, out[-2000:]
    assert (run / "loss_curve.png").is_file(), err[-2000:]


def test_ranks_failing_before_they_join_are_summed_up_by_their_error(tmp_path):
    """A setup error the launcher does not check itself (a CPU list of the user's that each rank parses
    when it pins itself) fails every rank before its topology exists, so no rank leaves a PID file: the
    launcher's last line quotes the first rank's error."""
    cmd = [sys.executable, "-m", "jaxhybrid", "launch", "-n", "2", "--timeout", "60", "--config",
           str(ROOT / "configs" / "runs" / "pipeline_2x2.yaml"), "--set", "parallel.data=1",
           "--set", f"run.dir={tmp_path}"]
    r = subprocess.run(cmd, env={**_env(60), "JAXHYBRID_RANK_CPUS": "x"}, cwd=ROOT, capture_output=True,
                       text=True, timeout=90)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0 and re.fullmatch(
        r"jaxhybrid launch: (every rank|1 of 2 ranks) failed before joining the job: jaxhybrid: error: "
        r"JAXHYBRID_RANK_CPUS='x' for local rank \d.*; the job was stopped \(exit code \d+\)", last), r.stdout + r.stderr


# bfloat16 pipelines with ranks pinned to one core each, as `jaxhybrid launch` pins them (one XLA:CPU
# worker thread per rank). Both hung over the mpi4jax transport while it sent with mpi4jax.send (see
# jaxhybrid/parallel/pipeline/mpi_transport.py): 2 stages on their third microbatch (the bitcast inside the send
# program), and, with the bitcast moved out, the Myelin config's 8 stages (message-driven, offload; it
# hung with train.log_every=1, and trained once in two tries without it). The 2-stage job also runs over
# the mpi4py transport, whose losses the mpi4jax one must reach; the 8-stage job is the hang's regression
# test (its ranks' parity is drive_parity.py's, over both transports), run once; its first loss, taken
# before any update, must still be the model's on the first batch, computed on one device in the job's
# bfloat16 (bf16_loss). At init that loss hardly depends on the activations (about log V): with every
# received activation's position 0 zeroed, the jobs were 2.2e-4 (2 stages) and 8.0e-5 (8 stages) off the
# float32 loss, which bf16_parity (2e-2) let pass.
PINNED_BF16 = {
    "2-stages": (2, "pipeline_2x2.yaml", ["parallel.data=1", "train.global_batch=8"]),
    "8-stages-myelin-offload": (8, "myelin-50b-offload.yaml", [
        "parallel.data=1", "model.name=gpt-tiny", "model.n_layers=8", "pipeline.microbatches=32",
        "train.global_batch=32", "optim.bucket_size=4096"]),
}


@pytest.mark.parametrize("case", list(PINNED_BF16))
def test_bf16_pipeline_trains_with_ranks_pinned_to_one_core(case, tmp_path):
    """The job trains over the mpi4jax transport (and for 2 stages reaches the mpi4py transport's losses);
    its first loss is the single-device model's on the sampler's batch 0, both in bfloat16 compute."""
    n, config, sets = PINNED_BF16[case]
    sets = sets + ["precision.compute_dtype=bfloat16", "train.steps=2", "train.log_every=1", "data.seq_len=64",
                   "train.eval_every=0", "pipeline.watchdog_s=60", "metrics.trace=false", "metrics.tensorboard=false", "metrics.plot=false",
                   "checkpoint.at_end=false"]

    def run(transport):
        over = [a for kv in sets + [f"pipeline.transport={transport}", f"run.dir={tmp_path / transport}"]
                for a in ("--set", kv)]
        cmd = [sys.executable, "-m", "jaxhybrid", "launch", "-n", str(n), "--timeout", "150", "--config",
               str(ROOT / "configs" / "runs" / config), *over]
        env = {k: v for k, v in _env(150).items() if k != "XLA_FLAGS"}  # the launcher's own, as a user runs it
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=200)
        assert r.returncode == 0, f"{transport}:\n" + (r.stdout + r.stderr)[-3000:]
        summary = re.findall(r'\{"run_dir".*?\}', r.stdout)  # ranks' lines interleave, even within a line
        assert len(summary) == 1, r.stdout[-3000:]
        return json.loads(summary[0])

    device = run("mpi4jax")
    assert np.isfinite([device["first_loss"], device["last_loss"]]).all(), device
    assert_tree_close(np.float32(device["first_loss"]), _first_loss(tmp_path / "mpi4jax"), "bf16_loss",
                      f"{case}: first loss vs one device in bfloat16 ")
    if n == 2:
        host = run("mpi4py")
        assert (device["first_loss"], device["last_loss"]) == (host["first_loss"], host["last_loss"])


def _first_loss(run_dir) -> np.float32:
    """The single-device Model.loss, in the run's compute dtype, of its initial parameters (``train.seed``)
    on its batch 0."""
    import jax

    from jaxhybrid.model import Model, compiled_init
    from jaxhybrid.runtime.data import Sampler
    from jaxhybrid.runtime.data.splits import open_dataset
    from jaxhybrid.runtime.run_dir import saved_config

    cfg = saved_config(run_dir)
    batch = Sampler(open_dataset(cfg), cfg.data.seq_len, cfg.train.global_batch, cfg.train.seed).batch(0)
    model = Model(cfg.model, compute_dtype=cfg.precision.compute_dtype)
    params = compiled_init(model, jax.random.key(cfg.train.seed))
    return np.float32(jax.jit(model.loss)(params, batch[:, :-1], batch[:, 1:]))


def test_bench_pipeline_prints_side_by_side_json():
    """`jaxhybrid bench pipeline` relaunches itself under mpiexec and prints the measured ratios (values
    are machine-dependent: only their presence and consistency are checked, never timings)."""

    cmd = [sys.executable, "-m", "jaxhybrid", "bench", "pipeline", "--stages", "2", "--schedule", "1f1b-1",
           "--model", "gpt-tiny", "--seq", "16", "--microbatch-size", "2", "--rounds", "1", "--warmup", "1",
           "--weight-join", "concat", "--json"]
    r = subprocess.run(cmd, env=_env(300), cwd=ROOT, capture_output=True, text=True, timeout=330)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("throughput_fused", "throughput_split", "gain", "theoretical_gain", "event_loop_overhead"):
        assert key in out, out
    assert out["gain"] == pytest.approx(out["throughput_split"] / out["throughput_fused"])
    assert out["weight_join"] == "concat"  # reached the ranks' pipeline config
    assert set(out["weight_join_chosen"]) == {"stage0", "stage1"}
    assert all(v == "concat" for j in out["weight_join_chosen"].values() for v in j.values())
    assert out["theoretical_gain"] == pytest.approx(9 / 7)  # 2BP Table 1, 1F1B-1, N = 2
    assert 0 <= out["event_loop_overhead"] < 1
    # The schedules simulated with this run's own kernel times (F, fused B, BI, BW per stage).
    assert set(out["kernel_ms"]) == {"F", "B", "BI", "BW"} and all(
        len(v) == 2 and min(v) > 0 for v in out["kernel_ms"].values())
    assert out["gain_over_expected"] == pytest.approx(out["gain"] / out["expected_gain"])
    # Timed tasks (every kernel waited for) and training's asynchronous dispatch, side by side.
    med = out["step_s_median"]
    assert set(out["async_over_sync"]) == {"fused", "split"} and min(med.values()) > 0
    assert all(out["async_over_sync"][k] == pytest.approx(med[f"{k}_async"] / med[k]) for k in ("fused", "split"))


def test_bench_pipeline_with_data_replicas_reports_each_backends_exposed_reduction():
    """`jaxhybrid bench pipeline --data 2` runs the schedule on a 2 x 2 grid with the gradient reduction on
    both backends and prints each one's step time and exposed reduction (presence and consistency only)."""
    cmd = [sys.executable, "-m", "jaxhybrid", "bench", "pipeline", "--stages", "2", "--data", "2", "--model",
           "gpt-tiny", "--seq", "16", "--microbatch-size", "2", "--rounds", "1", "--warmup", "0", "--json"]
    r = subprocess.run(cmd, env=_env(300), cwd=ROOT, capture_output=True, text=True, timeout=330)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["data"] == 2 and set(out["reductions"]) == {"mpi", "mpi_after", "xla"}
    red = out["reductions"]
    for w, row in red.items():
        assert set(row["step_s"]) == {"fused", "split"}
        for k in ("fused", "split"):
            # A reduction was recorded (None would fail the float); no more of it exposed than the step took.
            assert 0 < row["exposed_reduction_s"][k] < row["step_s"][k] * 1.5, (w, row)
    for k in ("fused", "split"):
        assert out["xla_over_mpi"][k] == pytest.approx(red["xla"]["step_s"][k] / red["mpi"]["step_s"][k])
        assert out["overlapped_over_after"][k] == pytest.approx(red["mpi"]["step_s"][k] / red["mpi_after"]["step_s"][k])


def test_bench_allreduce_prints_both_backends_and_the_vc_overlap():
    """`jaxhybrid bench allreduce` starts its own ranks and prints, per size, both backends' all-reduce and
    the sharded optimizer's reduce-scatter + all-gather (their sums checked equal before timing), and the
    V-C step streamed against apart on each backend (presence and consistency only, never timings; the ratios are of unrounded medians, the times
    rounded to the microsecond)."""
    cmd = [sys.executable, "-m", "jaxhybrid", "bench", "allreduce", "--ranks", "2", "--sizes", "64K", "--rounds", "1",
           "--warmup", "0", "--vc-elements", "64K", "--bucket-size", "8192", "--json"]
    r = subprocess.run(cmd, env=_env(300), cwd=ROOT, capture_output=True, text=True, timeout=330)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    (row,) = out["results"]
    assert row["elements"] == 65536 and row["xla_over_mpi"] == pytest.approx(row["xla_s"] / row["mpi_s"], rel=0.05)
    for k in ("mpi", "xla"):
        assert row[f"{k}_zero_over_allreduce"] == pytest.approx(row[f"{k}_zero_s"] / row[f"{k}_s"], rel=0.05)
        vc = out["vc"][k]
        assert min(vc["streamed_s"], vc["apart_s"]) > 0
        assert vc["streamed_over_apart"] == pytest.approx(vc["streamed_s"] / vc["apart_s"], rel=0.05)
    assert out["vc"]["elements"] == 65536 and out["vc"]["bucket_size"] == 8192


def test_reduce_scatter_on_gloo_gives_every_rank_its_exact_sum():
    """ZeRO-1's reduce-scatter over a data column of processes, and a tensor mesh's within one process, under
    JAX's distributed runtime on CPU (gloo): 20 rounds of 32 MiB chunks, each exactly the sum. gloo's own
    reduce-scatter failed this on rank 0 within a few rounds (``drive_reduce_scatter.py --raw``)."""
    r = _mpirun(2, "drive_reduce_scatter.py", timeout=120, devices=2)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert {"REDUCE_SCATTER column ok", "REDUCE_SCATTER local ok"} <= set(r.stdout.splitlines()), r.stdout


def test_vc_trace_shows_the_reduction_beside_the_update(tmp_path):
    """Myelin V-C in the trainer (2 replicas, the offloaded optimizer without clipping, chunks of one
    bucket): the traced step's Chrome trace has an all-reduce lane and an optimizer lane per rank, and on
    each rank some chunk's reduction runs while an earlier chunk's buckets update."""
    run = tmp_path / "vc"
    sets = ["parallel.data=2", "optim.offload=true", "optim.bucket_size=20000", "optim.grad_clip=0",
            "metrics.trace=true", "train.steps=2", "train.eval_every=0", "checkpoint.at_end=false",
            "metrics.tensorboard=false", f"run.dir={run}"]
    cmd = [sys.executable, "-m", "jaxhybrid", "launch", "-n", "2", "--timeout", "150", "--config",
           str(ROOT / "configs" / "runs" / "tiny.yaml"), *[a for kv in sets for a in ("--set", kv)]]
    r = subprocess.run(cmd, env=_env(150), cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "exposed data-parallel reduction" in r.stdout + r.stderr, r.stdout[-3000:]  # the trace line
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    assert {"rank 0 all-reduce", "rank 0 optimizer", "rank 1 all-reduce", "rank 1 optimizer"} <= lanes, lanes
    for rank in (0, 1):
        spans = {k: [(e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("cat") == k and e["tid"] % 1000 == rank]
                 for k in ("reduce", "update")}
        assert len(spans["reduce"]) == len(spans["update"]) > 2, spans
        assert any(rs < ue and us < re for rs, re in spans["reduce"] for us, ue in spans["update"]), spans


def test_gpu_check_self_test_runs_every_step_on_the_cpu(tmp_path):
    """`scripts/gpu_check.sh --cpu`: the GPU check's runs on the CPU with a tiny model. The 2-rank
    pipeline's float32 losses over both transports match the single device and the offloaded optimizer's the on-device one, as
    the script itself checks; its JSON is printed and written."""
    env = _env(300)
    env["PYTHON"] = sys.executable  # the test's venv, installed already
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", "--out", str(tmp_path)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=480)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert out["platform"] == "cpu" and len(out["single"]["losses"]) == 3
    for transport in ("mpi4jax", "transfer"):  # the two transports the GPU check runs
        run = out["pipeline"][transport]
        assert run["ok"] and len(run["losses"]) == 3 and run["loss_max_rel_diff"] <= 1e-4, run
    assert out["offload"]["ok"] and out["offload"]["host_bytes"] > 0
