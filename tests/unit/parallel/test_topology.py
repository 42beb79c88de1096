"""Layer partitions (pure, no MPI), plus the launcher's command line."""
import subprocess
import sys
from pathlib import Path

import pytest

from jaxhybrid.cli.commands.launch import HEAVY_YIELD, build_command, rank_environment
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.parallel.pipeline.topology import partition_blocks


@pytest.mark.parametrize("n,p,expected", [
    (4, 2, [(0, 2), (2, 4)]),
    (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (5, 3, [(0, 2), (2, 4), (4, 5)]),  # extras: middle stages first, then stage 0, the head's last
    (7, 3, [(0, 2), (2, 5), (5, 7)]),
    (3, 1, [(0, 3)]),
])
def test_even_partition(n, p, expected):
    assert partition_blocks(n, p) == expected


def test_explicit_partition_and_errors():
    assert partition_blocks(6, 3, (1, 2, 3)) == [(0, 1), (1, 3), (3, 6)]
    with pytest.raises(ConfigError, match="parallel.pipeline=5 stages exceed model.n_layers=4"):
        partition_blocks(4, 5)
    with pytest.raises(ConfigError, match=r"parallel.partition=\[1, 2\] must have 3 positive entries"):
        partition_blocks(6, 3, (1, 2))
    with pytest.raises(ConfigError, match="summing to model.n_layers=6"):
        partition_blocks(6, 2, (2, 2))


def test_the_timer_slack_the_launcher_sets_is_what_its_processes_start_with():
    """``coarsen_timer_slack`` (what `jaxhybrid launch` does for ranks sharing cores, and tests/conftest.py for
    the test jobs) reaches the processes started after it: mpiexec, and through it each rank."""
    code = ("import subprocess; from jaxhybrid.cli.commands.launch import coarsen_timer_slack as c; "
            "assert c(2_000_000); print(subprocess.run(['cat', '/proc/self/timerslack_ns'], capture_output=True, "
            "text=True).stdout)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "2000000", r.stdout + r.stderr


def test_launch_command_and_thread_environment(tmp_path):
    cmd = build_command(4, ["--", "--config", "c.yaml"], "/x/mpiexec")
    assert cmd[:3] == ["/x/mpiexec", "-n", "4"]
    assert cmd[4:] == ["-m", "mpi4py", "-m", "jaxhybrid", "train", "--config", "c.yaml"]
    env = rank_environment(4, [0, 1], 30, base={})
    assert env["OMP_NUM_THREADS"] == "1" and env["MPIEXEC_TIMEOUT"] == "30"
    assert "--xla_cpu_multi_thread_eigen=false" in env["XLA_FLAGS"]
    env = rank_environment(2, list(range(16)), 0, base={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert env["OMP_NUM_THREADS"] == "8" and "MPIEXEC_TIMEOUT" not in env
    # More ranks than cores: mpich's waits sleep instead of spinning on a core that a peer computes on.
    assert rank_environment(4, [0, 1], 30, base={})[HEAVY_YIELD] == "1" and HEAVY_YIELD not in env
    assert rank_environment(4, [0, 1], 30, base={HEAVY_YIELD: "0"})[HEAVY_YIELD] == "0"  # the user's wins
    assert env["XLA_FLAGS"].startswith("--xla_force_host_platform_device_count=2 ")
    with pytest.raises(ValueError, match="-n 0"):
        rank_environment(0, [0, 1], 0)
    # A hybrid layout's ranks get their tensor mesh's CPU devices; a user's own count wins.
    from jaxhybrid.cli.launch.checks import check_job, devices_per_rank, train_config
    from jaxhybrid.core.errors import ConfigError

    runs = Path(__file__).resolve().parents[3] / "configs" / "runs"
    hybrid = train_config(["--", "--config", str(runs / "hybrid.yaml"), "--set", "parallel.tensor_row=2"])
    grid = train_config(["--config", str(runs / "pipeline_2x2.yaml")])
    assert devices_per_rank(*hybrid, 4) == 4 and devices_per_rank(*grid, 4) == 1
    with pytest.raises(ConfigError, match="config file not found: /nonexistent.yaml"):  # once, not per rank
        train_config(["--config", "/nonexistent.yaml"])
    # --distributed: the one tensor-mode mesh is split over the n processes.
    mesh8 = train_config(["--distributed", "--config", str(runs / "tiny.yaml"), "--set", "parallel.data=2",
                          "--set", "parallel.tensor_row=2", "--set", "parallel.tensor_col=2",
                          "--set", f"run.dir={tmp_path}"])
    assert devices_per_rank(*mesh8, 2) == 4 and devices_per_rank(*mesh8, 8) == 1
    # The launcher checks the job once, before any rank starts (each rank would repeat the same error).
    check_job(*mesh8, 2)
    with pytest.raises(ValueError, match=r"over 3 processes: the mesh's 8 devices"):
        check_job(*mesh8, 3)
    with pytest.raises(ConfigError, match=r"parallel.pipeline\(2\) x parallel.data\(2\) = 4 != world size 3"):
        check_job(*grid, 3)
    env = rank_environment(4, [0, 1], 0, base={}, devices=4)
    assert "--xla_force_host_platform_device_count=4" in env["XLA_FLAGS"]
    env = rank_environment(4, [0, 1], 0, base={"XLA_FLAGS": "--xla_force_host_platform_device_count=3"}, devices=4)
    assert env["XLA_FLAGS"].count("device_count") == 1 and "device_count=3" in env["XLA_FLAGS"]


def test_bench_theoretical_gain_is_2bp_table1():
    """The bench's theoretical gain for 1F1B-1 is 2BP Table 1's 3(2N-1) / (N-1+3N)."""
    from jaxhybrid.bench.pipeline import default_microbatches, theoretical_gain

    for n in (2, 4):
        m = default_microbatches("1f1b-1", n)
        assert m == n and default_microbatches("1f1b-2", n) == 2 * n and default_microbatches("naive", n) == 1
        assert theoretical_gain("1f1b-1", n, m) == pytest.approx(3 * (2 * n - 1) / (n - 1 + 3 * n))


def test_bench_expected_gain_uses_the_measured_kernels():
    """The bench's expected gain simulates the schedules with the kernel times the run recorded: medians per
    (stage, kind), a joined BW spread over its microbatches; equal kernels give Table 1 again."""
    from jaxhybrid.bench.pipeline import kernel_seconds, measured_costs, theoretical_gain
    from jaxhybrid.parallel.pipeline.trace import Event

    def ev(stage, kind, dur, mbs):
        return Event(stage, f"{kind}{mbs}", kind, 1.0, 1.0 + dur, mbs, stage)

    rank0 = kernel_seconds([ev(0, "F", 3.0, (0,)), ev(0, "F", 5.0, (1,)), ev(0, "B", 6.0, (0,)),
                            ev(0, "BI", 4.0, (0,)), ev(0, "BW", 4.0, (0, 1)), ev(0, "send", 9.0, (0,))])
    assert rank0 == {(0, "F"): [3.0, 5.0], (0, "B"): [6.0], (0, "BI"): [4.0], (0, "BW"): [2.0, 2.0]}
    rank1 = {(1, k): [v] for k, v in (("F", 4.0), ("B", 6.0), ("BI", 4.0), ("BW", 2.0))}
    costs = measured_costs([rank0, rank1], 2)
    assert costs.forward == (4.0, 4.0) and costs.backward == (6.0, 6.0) and costs.backward_weight == (2.0, 2.0)
    uniform = measured_costs([{(s, k): [1.0] for s in range(2) for k in ("F", "BI", "BW")} |
                              {(s, "B"): [2.0] for s in range(2)}], 2)
    assert theoretical_gain("1f1b-1", 2, 2, uniform) == pytest.approx(theoretical_gain("1f1b-1", 2, 2))
    # A fused B cheaper than BI + BW (fusion the split loses) lowers what 2BP can gain.
    assert theoretical_gain("1f1b-1", 2, 2, costs) < theoretical_gain("1f1b-1", 2, 2)
    with pytest.raises(ValueError, match=r"no timed kernels for \(stage, kind\) \[\(1, 'F'\)"):
        measured_costs([rank0], 2)


@pytest.mark.parametrize("argv,match", [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--layers", "1"], "parallel.pipeline=2 stages exceed model.n_layers=1"),
    (["--seq", "100000"], r"--seq 100000 .* would stash about \d+\.\d GiB of activations, more than"),
])
def test_bench_pipeline_checks_its_arguments_before_launching(monkeypatch, argv, match):
    """Bad arguments fail once, in the launching process, not on every rank after mpiexec started (an
    out-of-memory abort there, for a sequence whose activations no machine holds)."""
    import argparse

    from jaxhybrid.bench import pipeline as bp

    monkeypatch.setattr(bp, "_launch", lambda *a: pytest.fail("launched"))
    p = argparse.ArgumentParser()
    bp.add_arguments(p)
    with pytest.raises(ValueError, match=match):
        bp.run(p.parse_args(["--stages", "2", *argv]))


def test_a_gpu_machine_counts_its_gpus_only_where_jax_computes_on_them(monkeypatch):
    """Two ranks on a one-GPU machine: an error naming the count where JAX computes on the GPU, nothing to
    check where it computes on the CPU (the CPU tests on a developer's GPU workstation)."""
    from jaxhybrid.parallel.tensor import local

    monkeypatch.setattr(local.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    with pytest.raises(ValueError, match=r"node-local rank 1 needs GPUs 1..1 .* the node has 1 \(/dev/nvidia<N>\)"):
        local.gpu_block(1, {"MPI_LOCALRANKID": "1", "JAX_PLATFORMS": "cuda"})
    assert local.gpu_block(1, {"MPI_LOCALRANKID": "1", "JAX_PLATFORMS": "cpu"}) == [1]


@pytest.mark.parametrize("platform, env, reads", [
    ("cpu", {}, True),  # host memory: the payload's own buffer, no copy
    ("gpu", {}, False),  # nobody said the MPI reads GPU memory: a host copy first
    ("gpu", {"MPI4JAX_USE_CUDA_MPI": "1"}, True),  # a CUDA-aware MPI, declared as mpi4jax takes it
    ("gpu", {"MPI4JAX_USE_CUDA_MPI": "off"}, False),
    ("tpu", {"MPI4JAX_USE_CUDA_MPI": "1"}, False),
])
def test_the_mpi4jax_transport_sends_in_place_only_what_mpi_can_read(platform, env, reads):
    """The mpi4jax transport hands MPI the payload's own buffer where MPI can read it (Myelin's CUDA-aware
    sends on GPUs); the MPI parity tests send every CPU payload that way."""
    from jaxhybrid.core.launch_env import mpi_reads

    assert mpi_reads(platform, env) is reads


def test_each_mpi_rank_sees_its_own_node_local_gpus():
    """gpu_block: rank r of a node gets GPUs [r k, (r+1) k) (k per rank), or the k a launcher already gave
    it; too few GPUs for the rank's block is an error naming the counts."""
    from jaxhybrid.parallel.tensor.local import gpu_block

    assert gpu_block(1, {"MPI_LOCALRANKID": "3"}, node_gpus=8) == [3]  # mpich/hydra, all GPUs visible
    assert gpu_block(2, {"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, node_gpus=4) == [2, 3]  # Open MPI, hybrid
    assert gpu_block(1, {"MPI_LOCALRANKID": "3"}, node_gpus=0) == [3]  # no GPU files (CPU): nothing to check
    with pytest.raises(ValueError, match=r"node-local rank 1 needs GPUs 1..1 .* the node has 1 "):
        gpu_block(1, {"MPI_LOCALRANKID": "1"}, node_gpus=1)  # two ranks on a one-GPU machine
    assert gpu_block(1, {"SLURM_LOCALID": "2", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == [2]  # positions
    assert gpu_block(2, {"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "6,7"}) == [0, 1]  # srun --gpus-per-task
    # One process per node over the node's 4 GPUs (tensor mode, --distributed), not JAX's [SLURM_LOCALID].
    assert gpu_block(4, {"SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == [0, 1, 2, 3]
    assert gpu_block(1, {}) is None  # not launched by MPI or Slurm: one process keeps every device
    with pytest.raises(ValueError, match=r"node-local rank 2 needs GPUs 4..5 .* lists 4"):
        gpu_block(2, {"MPI_LOCALRANKID": "2", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})


def test_launcher_environment_is_read_in_one_place():
    """launch_env: world size, MPI rank presence and node-local rank from mpich/hydra, Open MPI, PMIx and
    srun variables; an sbatch script's SLURM_NTASKS (no SLURM_PROCID) is not a rank's world."""
    from jaxhybrid.core import launch_env as le

    assert le.world_size({}) == 1 and le.local_rank({}) is None and not le.mpi_rank_set({})
    assert le.world_size({"PMI_SIZE": "4", "PMI_RANK": "1"}) == 4 and le.mpi_rank_set({"PMI_RANK": "1"})
    assert le.world_size({"OMPI_COMM_WORLD_SIZE": "8"}) == 8 and le.mpi_rank_set({"PMIX_RANK": "0"})
    assert le.world_size({"SLURM_NTASKS": "16"}) == 1  # inside sbatch, before srun
    srun = {"SLURM_NTASKS": "16", "SLURM_PROCID": "3", "SLURM_LOCALID": "3"}
    assert le.world_size(srun) == 16 and le.slurm_task(srun) and le.local_rank(srun) == 3
    assert le.local_rank({"MPI_LOCALRANKID": "2", "SLURM_LOCALID": "5"}) == 2  # the MPI launcher's wins


def test_mpirun_inside_a_slurm_shell_is_not_taken_for_srun_tasks(monkeypatch):
    """`jaxhybrid launch -n 2 -- --distributed` from an `srun --pty bash` step (or an sbatch script, task 0):
    every rank inherits SLURM_PROCID=0 and SLURM_NTASKS, and read as srun tasks each process started JAX's
    runtime alone (4 != 2 devices) or waited for peers that never came. hydra's PMI_RANK/PMI_SIZE name the
    job; srun --mpi=pmi2 sets both alike, and stays srun's."""
    from jaxhybrid.core import launch_env as le
    from jaxhybrid.runtime import distributed

    shell = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    for rank in ("0", "1"):
        env = {**shell, "PMI_RANK": rank, "PMI_SIZE": "2", "MPI_LOCALRANKID": rank}
        assert not le.slurm_task(env) and le.world_size(env) == 2 and le.local_rank(env) == int(rank)
    assert le.slurm_task({**shell, "PMI_RANK": "0", "PMI_SIZE": "1"})  # srun -n 1 --mpi=pmi2
    assert le.slurm_task({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "PMIX_RANK": "3"})  # srun --mpi=pmix
    mpi = {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1}
    monkeypatch.setattr(distributed, "_from_mpi", lambda: mpi)  # the MPI job's peers, not JAX's Slurm reading
    assert distributed.peer_arguments(env={**shell, "PMI_RANK": "1", "PMI_SIZE": "2"}) == mpi


@pytest.mark.parametrize("cpus,n,expected", [
    ([0, 1], 4, [[0], [1], [0], [1]]),  # more ranks than CPUs: one each, round-robin
    ([0, 1, 2, 3, 4, 5, 6], 3, [[0, 1, 2], [3, 4], [5, 6]]),  # blocks as even as possible
    ([4, 5, 8, 9], 2, [[4, 5], [8, 9]]),  # the CPUs the launcher may use, not 0..n-1
])
def test_each_launched_rank_gets_its_share_of_the_cpus(cpus, n, expected):
    from jaxhybrid.core.launch_env import rank_cpus

    assert [rank_cpus(cpus, r, n) for r in range(n)] == expected
    with pytest.raises(ValueError, match="rank 2 of 2"):
        rank_cpus(cpus, 2, 2)


def test_launched_rank_pins_itself_before_jax_starts():
    """`jaxhybrid launch` hands the ranks the CPUs to share; a rank (hydra's MPI_LOCALRANKID) pins all its
    threads to its part; without the variable nothing is pinned."""
    import json
    import os
    import subprocess
    import sys

    from jaxhybrid.cli.commands.launch import job_cpus
    from jaxhybrid.core.launch_env import RANK_CPUS_ENV, rank_cpus

    allowed = job_cpus()
    probe = ("import json, os; from jaxhybrid.core.launch_env import bind_rank_cpus; "
             "print(json.dumps([bind_rank_cpus(), sorted(os.sched_getaffinity(0))]))")
    base = {k: v for k, v in os.environ.items() if k != RANK_CPUS_ENV}
    rank1 = dict(base, **{RANK_CPUS_ENV: ",".join(map(str, allowed)), "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    for env, want in ((rank1, rank_cpus(allowed, 1, 2)), (base, None)):
        run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        mine, seen = json.loads(run.stdout)
        assert mine == want and seen == (want or allowed)
    assert rank_environment(2, allowed, 0, base={})[RANK_CPUS_ENV] == ",".join(map(str, allowed))
    assert RANK_CPUS_ENV not in rank_environment(2, allowed, 0, base={}, bind=False)  # --no-bind
    with pytest.raises(ValueError, match="--cores 99999"):
        job_cpus(99999)
    from jaxhybrid.core.launch_env import bind_rank_cpus

    for spec, size in (("0,x", "2"), ("0,1", "1")):  # not a CPU list; a rank beyond the local count
        with pytest.raises(ValueError, match=f"JAXHYBRID_RANK_CPUS='{spec}' for local rank 1"):
            bind_rank_cpus({RANK_CPUS_ENV: spec, "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": size})


def test_rank_watch_names_the_first_rank_to_end_abnormally(tmp_path):
    """The launcher's failure report: hydra may name a bystander, so the watcher keeps the order in which
    the ranks' PIDs ended; a rank that left its normal-exit marker is never blamed."""
    import subprocess
    import sys
    import time

    from jaxhybrid.cli.launch.rankwatch import RankWatch, bystanders, name_hydra_pids

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    try:
        for r, p in enumerate(procs):
            (tmp_path / f"rank{r}.pid").write_text(f"{p.pid} rank {r} (stage {r % 2}, replica {r // 2})")
        watch = RankWatch(tmp_path, len(procs), period_s=0.01)
        watch.start()
        time.sleep(0.1)
        (tmp_path / "rank0.exit").touch()  # rank 0 finished normally first: not the culprit
        procs[0].kill(), procs[0].wait()
        time.sleep(0.2)
        procs[2].kill(), procs[2].wait()  # then rank 2 was killed,
        time.sleep(0.2)
        procs[1].kill(), procs[1].wait()  # and rank 1 went down with the job
        time.sleep(0.2)
        watch.stop()
        assert [pid for _, pid, _ in watch.ended] == [procs[0].pid, procs[2].pid, procs[1].pid]
        rank = {r: f"rank {r} (stage {r % 2}, replica {r // 2}) (pid {p.pid})" for r, p in enumerate(procs)}
        hydra = [f"=   PID {procs[1].pid} RUNNING AT node7", "=   EXIT CODE: 9"]  # a bystander
        assert watch.first_abnormal() == [rank[2]]
        assert name_hydra_pids(hydra, tmp_path) == [rank[1]]
        # Two ranks ended before one wake-up: both are named.
        watch.ended = [(5, p.pid, f"rank {r} (stage {r % 2}, replica {r // 2})") for r, p in enumerate(procs[1:], 1)]
        assert watch.first_abnormal() == [rank[1], rank[2]]
        # A rank that MPI aborted when its peer vanished (mpich's "Abort(c) on node R") is passed over
        # while another ended abnormally; one that reported its own failure is not a bystander.
        out = ["copy_iovs(224).........: process_vm_readv failed (errno 3) - aborting",
               "Abort(606246415) on node 1 (rank 0 in comm 464): application called MPI_Abort(...) - process 0",
               "Abort(1) on node 0 (rank 0 in comm 496): application called MPI_Abort(comm=0x84000002, 1) - process 0",
               "jaxhybrid: rank 0 (stage 0, replica 0) failed: ValueError: bad batch; aborting the job"]
        assert bystanders(out) == {1}
        watch.ended = [(4, procs[1].pid, "rank 1 (stage 1, replica 0)"), (5, procs[2].pid, "rank 2 (stage 0, replica 1)")]
        assert watch.first_abnormal(bystanders(out)) == [rank[2]] and watch.first_abnormal() == [rank[1]]
        assert watch.first_abnormal({1, 2}) == [rank[1]]  # all bystanders: the first to end after all
    finally:
        for p in procs:
            p.kill()


def test_rank_watch_takes_a_closed_alive_fifo_as_the_end(tmp_path):
    """A rank's files close before its exit is reported to a pidfd (the last thread may still be freeing
    the address space), and hydra reacts to the closing: a rank whose ``.alive`` FIFO hung up has ended,
    though its PID is still there. A rank that never opened its FIFO is still watched by its PID."""
    import subprocess
    import sys
    import time

    from jaxhybrid.cli.launch.rankwatch import RankWatch, alive_fifo

    watch = RankWatch(tmp_path, 2, period_s=0.01)
    holds = ("import os, sys, time; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK); "
             "open(sys.argv[2], 'w').close(); sys.stdin.readline(); os.close(fd); time.sleep(60)")
    fifo_rank = subprocess.Popen([sys.executable, "-c", holds, str(alive_fifo(tmp_path, 0)), str(tmp_path / "r0")],
                                 stdin=subprocess.PIPE, text=True)
    pid_rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for r, p in enumerate((fifo_rank, pid_rank)):
            (tmp_path / f"rank{r}.pid").write_text(f"{p.pid} rank {r} (stage {r}, replica 0)")
        watch.start()
        deadline = time.time() + 60
        while not (tmp_path / "r0").exists():  # it holds its FIFO's write end
            assert time.time() < deadline and fifo_rank.poll() is None, "the FIFO holder did not start"
            time.sleep(0.01)
        time.sleep(0.1)
        assert watch.ended == []  # a connected FIFO is quiet
        fifo_rank.stdin.write("\n"), fifo_rank.stdin.flush()  # closes its FIFO, its PID lives on
        time.sleep(0.3)
        pid_rank.kill(), pid_rank.wait()
        time.sleep(0.3)
        watch.stop()
        assert fifo_rank.poll() is None
        assert [(pid, who) for _, pid, who in watch.ended] == [
            (fifo_rank.pid, "rank 0 (stage 0, replica 0)"), (pid_rank.pid, "rank 1 (stage 1, replica 0)")]
        assert watch.ended[0][0] < watch.ended[1][0]
    finally:
        for p in (fifo_rank, pid_rank):
            p.kill()


def test_failure_summary_prefers_a_rank_that_reported_its_failure(tmp_path):
    """The rank that aborted the job is named even when MPI_Abort ended another rank before it."""
    from jaxhybrid.cli.launch.rankwatch import RankWatch, failure_summary

    watch = RankWatch(tmp_path, 2)
    watch.ended = [(3, 101, "rank 0 (stage 0, replica 0)"), (4, 102, "rank 1 (stage 1, replica 0)")]
    report = ["jaxhybrid watchdog: rank 1 (stage 1, replica 0) made no progress for 2.0 s (deadline 2 s); now: ...",
              "Abort(3) on node 1 (rank 1 in comm 496): application called MPI_Abort(comm=0x84000001, 3) - process 1"]
    assert failure_summary(watch, report) == "rank 1 (stage 1, replica 0) reported the failure first (its message is above)"
    assert failure_summary(watch, report[1:]) == "rank 0 (stage 0, replica 0) (pid 101) ended abnormally, the first rank to end"
    # A rank whose watchdog fired while it waited for a peer's message blames that peer (a SIGSTOPped rank
    # was caught by its neighbour's watchdog, and the launcher named the neighbour).
    waited = ["jaxhybrid watchdog: rank 0 (stage 0, replica 0) made no progress for 10.6 s (deadline 10 s); now: "
              "waiting for activation mb2->s1 from rank 1 (stage 1, replica 0); last receives: ..."]
    assert failure_summary(watch, waited) == ("rank 1 (stage 1, replica 0) made no progress: rank 0 (stage 0, "
                                              "replica 0) waited for it past its watchdog deadline (its report is "
                                              "above)")
    # A rank of several virtual stages is named with all of them, and blamed alike.
    waited_v = ["jaxhybrid watchdog: rank 0 (stages 0+3, replica 0) made no progress for 10.6 s (deadline 10 s); "
                "now: waiting for activation mb2->s2 from rank 1 (stages 1+2, replica 0); last receives: ..."]
    assert failure_summary(watch, waited_v) == ("rank 1 (stages 1+2, replica 0) made no progress: rank 0 (stages "
                                                "0+3, replica 0) waited for it past its watchdog deadline (its "
                                                "report is above)")
    # The first watchdog to fire may be a rank idle in a collective; a later one names the stuck peer.
    idle = ["jaxhybrid watchdog: rank 0 (stage 0, replica 0) made no progress for 2.0 s (deadline 2 s); now: ran B1@s0"]
    stuck = ["jaxhybrid watchdog: rank 2 (stage 0, replica 1) made no progress for 2.1 s (deadline 2 s); now: "
             "waiting for GRAD mb0->s0 from rank 3 (stage 1, replica 1); last sends: ..."]
    assert failure_summary(watch, idle + stuck).startswith("rank 3 (stage 1, replica 1) made no progress: rank 2 ")
    # A rank that failed is named before any wait on it.
    failed = ["jaxhybrid: rank 1 (stage 1, replica 0) failed: RuntimeError: injected failure; aborting the job"]
    assert failure_summary(watch, waited + failed) == ("rank 1 (stage 1, replica 0) reported the failure first "
                                                       "(its message is above)")
    watch.ended = []
    hydra = ["=   PID 102 RUNNING AT node7"]
    (tmp_path / "rank1.pid").write_text("102 rank 1 (stage 1, replica 0)")
    assert failure_summary(watch, hydra) == "rank 1 (stage 1, replica 0) (pid 102) ended abnormally (hydra's report)"


def test_watchdog_gives_each_phase_its_compile_deadline_once():
    """The first time a phase is armed its ranks compile (and wait for each other's compiles): it gets
    pipeline.watchdog_compile_s; the next time the plain deadline, so a hang is still caught fast."""
    import time

    from jaxhybrid.parallel.pipeline.watchdog import Watchdog

    fired = []
    dog = Watchdog("rank 0", 0.2, on_fire=fired.append, compile_deadline_s=30.0)
    try:
        dog.arm("pipeline phase")
        time.sleep(0.6)
        assert fired == []  # compiling: within the first deadline
        dog.disarm()
        dog.arm("pipeline phase")
        time.sleep(0.6)
        assert len(fired) == 1 and "(deadline 0.2 s); now: pipeline phase" in fired[0], fired
        dog.arm("validation forward")  # another phase's first time
        time.sleep(0.6)
        assert len(fired) == 1
    finally:
        dog.close()
