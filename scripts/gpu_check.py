"""The GPU check behind ``scripts/gpu_check.sh``: what one GPU can show of jaxhybrid, in at most 8 minutes.

Five training runs of the same model, data and batch, each a ``jaxhybrid train`` (or ``launch``) process:

1. ``single``: one GPU, bf16 GPT-2 small: its losses, tokens/s and MFU.
2. ``offload``: the bf16 run again with the fp32 masters and Adam state on the host (Myelin V-B), its
   losses against run 1's and both runs' device bytes from ``memory.json``.
3. ``reference`` and ``pipeline_<transport>``: float32 at full matmul precision, one GPU against a 2-rank
   MPI pipeline (1F1B with 2BP) sharing that GPU, each rank given a share of its memory, over the
   ``mpi4jax`` transport and over ``transfer`` (JAX's transfer server); their losses must agree to
   ``--rtol`` at every step (the pipeline's parity with the single device, Myelin Alg. 1).

A run that fails, or would overrun ``--budget-s``, is recorded as such and the others still run; the
JSON is rewritten after every run, so a check cut off by its time limit keeps what finished.

NCCL refuses two ranks on one GPU, so the data-parallel XLA path (one process per GPU) is not checked
here. Without ``mpirun`` or mpi4py the pipeline is skipped, without mpi4jax its ``mpi4jax`` run, and the
JSON says so. ``--cpu`` runs the same steps on the CPU with a tiny model: the script's own test. Prints
one JSON object (also written to ``OUT/gpu_check.json``); the exit status is 1 if a run or a parity failed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (model, seq_len, global batch, microbatches, steps of the bf16 runs, steps of the parity pair, timeout s,
#  the offloaded run's optim.bucket_size: an eighth of the parameters or less, so that offload saves memory)
SIZES = {"gpu": ("gpt2-small", 1024, 8, 4, 30, 4, 240, 1 << 24), "cpu": ("gpt-tiny", 32, 8, 4, 3, 3, 240, 1 << 15)}


def _train(name: str, out: Path, sets: dict, env: dict, timeout: int, ranks: int = 1) -> dict:
    """One run under ``out/name``: its per-step records, summary and memory report."""
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)  # this script's own run of an earlier check
    sets = {**sets, "run.dir": str(run_dir), "train.log_every": "1",
            "train.eval_every": "0", "checkpoint.at_end": "false"}
    args = ["--config", str(ROOT / "configs/runs/tiny.yaml")]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    cmd = [sys.executable, "-m", "jaxhybrid"]
    cmd += (["launch", "-n", str(ranks), "--timeout", str(timeout), "--", *args] if ranks > 1 else ["train", *args])
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 30)
    if r.returncode != 0:
        raise RuntimeError(f"{name}: `{' '.join(cmd)}` exited {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    memory = json.loads((run_dir / "memory.json").read_text())
    last = records[-1]
    return {"losses": [x["loss"] for x in records], "tokens_per_s": last.get("tokens_per_s"),
            "mfu": last.get("mfu"), "device_bytes": memory.get("device_total"),
            "host_bytes": memory.get("host_total"), "wall_s": round(time.perf_counter() - t0, 1)}


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


class Check:
    """The runs so far, written to ``OUT/gpu_check.json`` after each one, so that a check stopped by its time
    limit keeps what finished; a run that fails or would overrun the budget is recorded, and the rest go on.
    Why: a GPU machine is lent for minutes, and one stuck or failing run must not cost the others' figures."""

    def __init__(self, out: Path, budget_s: float, result: dict):
        self.out, self.deadline, self.result, self.failed = out, time.monotonic() + budget_s, result, False

    def write(self) -> str:
        text = json.dumps(self.result, indent=1)
        (self.out / "gpu_check.json").write_text(text + "\n")
        return text

    def run(self, name: str, sets: dict, env: dict, timeout: int, ranks: int = 1) -> dict:
        """``_train``'s record, or ``{"error": ...}`` / ``{"skipped": ...}`` (the check then fails)."""
        left = self.deadline - time.monotonic() - 40  # the launch's own timeout, then 30 s to end it
        if left < 30:
            record = {"skipped": f"{max(left + 40, 0):.0f} s of the check's --budget-s left"}
        else:
            try:
                record = _train(name, self.out, sets, env, int(min(timeout, left)), ranks)
            except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError) as e:
                record = {"error": str(e)[-3000:]}
        self.failed |= "losses" not in record
        return record

    def compare(self, run: dict, ref: dict, rtol: float) -> dict:
        """``run`` with its largest relative loss difference from ``ref`` and whether it is within ``rtol``."""
        if "losses" not in run or "losses" not in ref:
            return run
        rel = _rel(run["losses"], ref["losses"])
        self.failed |= rel > rtol
        return {**run, "loss_max_rel_diff": rel, "rtol": rtol, "ok": rel <= rtol}


def _pipeline_missing(transport: str) -> str | None:
    """Why the 2-rank pipeline over ``transport`` cannot start here, or None. The transfer transport
    sends its headers with mpi4py and needs no mpi4jax."""
    venv = ROOT / ".venv/bin"
    if not (shutil.which("mpiexec") or shutil.which("mpirun") or (venv / "mpiexec").exists()):
        return "no mpiexec/mpirun on this machine (scripts/setup.sh installs MPICH)"
    for mod in ("mpi4py", "mpi4jax") if transport == "mpi4jax" else ("mpi4py",):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (scripts/setup.sh builds it)"
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the same steps on the CPU with a tiny model (a self-test)")
    p.add_argument("--out", default=str(ROOT / "runs/gpu_check"), help="where the runs and gpu_check.json go")
    p.add_argument("--rtol", type=float, default=1e-4, help="loss parity tolerance of the float32 pipeline")
    p.add_argument("--offload-rtol", type=float, default=2e-2,
                   help="bf16 losses with the optimizer on the host against on the device")
    p.add_argument("--budget-s", type=float, default=450,
                   help="seconds for all runs (scripts/gpu_check.sh ends the check at 480); a run that would "
                   "overrun it is skipped, and the check fails")
    args = p.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # This process only asks which device there is: without this its GPU client would preallocate most of
    # the GPU's memory for the check's whole length, and every run it starts would run out of memory.
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax

    device = jax.devices()[0]
    if not args.cpu and device.platform != "gpu":
        print(f"gpu_check: jax sees {device.platform} ({device.device_kind}), no GPU; --cpu runs the self-test",
              file=sys.stderr)
        return 2
    model, seq, batch, mbs, steps, parity_steps, timeout, bucket = SIZES["cpu" if args.cpu else "gpu"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        env["JAX_PLATFORMS"] = "cpu"
    base = {"model.name": model, "data.seq_len": str(seq), "train.global_batch": str(batch),
            "pipeline.microbatches": str(mbs)}
    bf16 = {**base, "precision.compute_dtype": "bfloat16", "train.steps": str(steps)}
    check = Check(out, args.budget_s, {"device": device.device_kind, "platform": device.platform,
                                       "jax": jax.__version__, "model": model, "seq_len": seq, "global_batch": batch})
    result = check.result

    # The most telling runs first: the single GPU and the offloaded optimizer, then the pipeline's parity.
    single = result["single"] = check.run("single", bf16, env, timeout)
    check.write()
    off = check.run("offload", {**bf16, "optim.offload": "true", "optim.bucket_size": str(bucket)}, env, timeout)
    off = result["offload"] = check.compare(off, single, args.offload_rtol)
    if "device_bytes" in off and "device_bytes" in single:
        off["device_bytes_over_on_device"] = off["device_bytes"] / single["device_bytes"]
    check.write()

    if missing := _pipeline_missing("transfer"):  # what both transports need
        result["pipeline"] = {"skipped": missing}
    else:
        # float32 at full precision: the parity of the pipeline, not of TF32 or bf16 rounding orders.
        exact = {**base, "train.steps": str(parity_steps)}
        penv = dict(env, JAX_DEFAULT_MATMUL_PRECISION="highest")
        ref = check.run("reference", exact, penv, timeout)
        result["pipeline"] = {"reference": ref, "rtol": args.rtol}
        check.write()
        # Two ranks on one GPU: each a share of its memory (the launcher's default is most of it, per rank),
        # and that GPU the only one both see; else rank 1 would take its node-local rank's GPU, number 1.
        # Over the default transport, then JAX's transfer server.
        gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        share = dict(penv, XLA_PYTHON_CLIENT_MEM_FRACTION="0.4", CUDA_VISIBLE_DEVICES=gpu)
        for transport in ("mpi4jax", "transfer"):
            if missing := _pipeline_missing(transport):
                result["pipeline"][transport] = {"skipped": missing}
                continue
            pipe = check.run(f"pipeline_{transport}", {
                **exact, "parallel.pipeline": "2", "pipeline.schedule": "1f1b", "pipeline.split_backward": "true",
                "pipeline.transport": transport}, share, timeout, ranks=2)
            result["pipeline"][transport] = check.compare(pipe, ref, args.rtol)
            check.write()

    print(check.write(), flush=True)
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
