"""The run configs shipped in configs/runs: each passes the checks `jaxhybrid launch` makes before any
rank starts, at the process count its header names, and each written for a cluster (a named
``metrics.hardware``) lays out whole nodes and fits that hardware's memory by the planner's model. No
devices, no compilation: a config that a later change makes invalid or too large fails here, not at a
user's srun."""
import json
import re
from pathlib import Path

import pytest

from jaxhybrid.cli.commands import train as train_command
from jaxhybrid.cli.launch.checks import check_job, train_config
from jaxhybrid.planner.costs import load_hardware
from jaxhybrid.planner.plan import check_gpus, machine_from_hardware, score_config
from jaxhybrid.runtime import memory_check

RUNS = Path(__file__).resolve().parents[3] / "configs" / "runs"
CONFIGS = sorted(RUNS.glob("*.yaml"))


def _processes(cfg, text: str) -> tuple[int, bool]:
    """(processes, --distributed) as the config's header launches it: one process per node in tensor mode
    (`MODE=tensor` in its sbatch line), else one MPI rank per pipeline stage x data replica."""
    if "MODE=tensor" in text:
        nodes = int(re.search(r"--nodes=(\d+)", text).group(1))
        return nodes, True
    return cfg.world_size, False


def test_the_shipped_configs_are_all_found():
    assert {c.name for c in CONFIGS} >= {"tiny.yaml", "pipeline_2x2.yaml", "hybrid.yaml", "gpt2-small-h100.yaml",
                                         "llama-7b-2bp.yaml", "myelin-50b-offload.yaml", "axonn-gpt-10b-4d.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_config_passes_the_launch_checks(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # run.dir is relative: checked (not created) in an empty directory
    text = path.read_text()
    if re.search(r"GPU|H100|H200|--gpus", text):  # checked as on its GPUs: their model state is not host memory (jaxhybrid.runtime.memory_check)
        monkeypatch.setattr(train_command, "accelerator_backend", lambda environ: "the GPU plugin")
        # ... and run.dir on the cluster's filesystem: a 7B model's checkpoint outgrows this machine's disk
        monkeypatch.setattr(memory_check, "free_disk_bytes", lambda path: 1 << 50)
    args = ["--config", str(path), "--set", "metrics.tensorboard=false"]
    ns, cfg = train_config(args)
    n, distributed = _processes(cfg, text)
    if distributed:
        ns, cfg = train_config(["--distributed"] + args)
    per_rank = check_job(ns, cfg, n)
    assert per_rank * n == cfg.num_devices
    # The header's launch line starts that many processes.
    m = re.search(r"launch -n (\d+)|--nodes=(\d+) --ntasks-per-node=(\d+)", text)
    if m and m.group(1):
        assert int(m.group(1)) == n
    elif m:
        assert int(m.group(2)) * int(m.group(3)) == n


HARDWARE = sorted((RUNS.parent / "hardware").glob("*.yaml"))


@pytest.mark.parametrize("path", HARDWARE, ids=lambda p: p.stem)
def test_shipped_hardware_file_serves_mfu_and_the_planner(path):
    """Each configs/hardware file, by name as metrics.hardware takes it: a peak for every compute dtype
    (a run of any dtype can name it), and, where it has bandwidths, a planner machine at every dtype and
    GPU count per node (`jaxhybrid plan --hardware NAME`), so a broken file fails here, not in a run."""
    from jaxhybrid.core.hardware import load_hardware as load_for_mfu
    from jaxhybrid.core.hardware import peak_tflops
    from jaxhybrid.planner.costs import planner_hardware_names
    from jaxhybrid.runtime.config_checks import DTYPES

    hw = load_for_mfu(path.stem)
    assert hw["name"] == path.stem and all(peak_tflops(hw, d) > 0 for d in DTYPES)
    if path.stem == "cpu":
        assert path.stem not in planner_hardware_names()  # no bandwidths: MFU bookkeeping only
        return
    hw = load_hardware(path.stem)
    for dtype in DTYPES:
        for gpn in range(1, int(hw["gpus_per_node"]) + 1):
            assert machine_from_hardware(hw, gpn, dtype, 0.5).memory_bytes > 0


CLUSTER = [p for p in CONFIGS if re.search(r"^metrics:.*hardware: (?!auto)", p.read_text(), re.M)]


@pytest.mark.parametrize("path", CLUSTER, ids=lambda p: p.stem)
def test_cluster_config_fits_its_hardware_by_the_planner(path):
    ns, cfg = train_config(["--config", str(path), "--set", "metrics.tensorboard=false"])
    hw = load_hardware(cfg.metrics.hardware)
    gpn = int(hw["gpus_per_node"])
    check_gpus(cfg.num_devices, gpn)  # whole nodes (or an aligned part of one)
    nodes = re.search(r"--nodes=(\d+)", path.read_text())
    assert nodes and int(nodes.group(1)) == max(1, cfg.num_devices // gpn), "the sbatch line's node count"
    machine = machine_from_hardware(hw, min(gpn, cfg.num_devices), cfg.precision.compute_dtype, 0.5)
    r = score_config(cfg, machine, cfg.data.seq_len)
    assert r["memory_per_device_bytes"] <= machine.memory_bytes, (  # the usable share (planner.plan)
        f"{path.name}: {r['memory_per_device_bytes'] / 1e9:.1f} GB per device by the planner's model, "
        f"{machine.memory_bytes / 1e9:.0f} GB usable on {hw['name']}")


@pytest.mark.slow
def test_plan_scores_a_config_beside_its_plans(capsys):
    """`jaxhybrid plan --model CONFIG` prints the config's own layout with its rank among all feasible
    plans, and a note instead where --gpus differs from the config's device count."""
    from jaxhybrid.cli.main import build_parser

    def plan(*extra):
        _, a = build_parser(["plan", "--model", str(RUNS / "llama-7b-2bp.yaml"), "--gpus-per-node", "8",
                             "--hardware", "h100-node", "--top", "3", "--json", *extra])
        assert a._run(a) == 0
        return json.loads(capsys.readouterr().out)

    out = plan("--gpus", "16")
    own = out["config_layout"]
    assert (own["pipeline"], own["data"], own["schedule"], own["split_backward"]) == (4, 4, "1f1b-2", True)
    assert own["fits"] and own["rank"] >= 0
    assert own["rank"] == 0 or own["predicted_step_s"] >= out["plans"][0]["predicted_step_s"]
    other = plan("--gpus", "8")
    assert other["config_layout"] is None and any("scored only with --gpus 16" in n for n in other["notes"])
