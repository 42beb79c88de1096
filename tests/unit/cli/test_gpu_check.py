"""scripts/gpu_check.py's bookkeeping: a run that fails or would overrun the budget is recorded and the
check goes on. Its runs themselves are tests/mpi/test_mpi_pipeline.py's self-test (``--cpu``)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failing_or_late_run_is_recorded_and_the_check_goes_on(tmp_path, monkeypatch):
    """A GPU is lent for minutes: one run that fails (a transport that does not start) or one stuck until
    its timeout must not cost the other runs' figures, and the JSON on disk holds every run that ended."""
    gpu_check = _script()
    outcomes = {"ok": {"losses": [2.0, 1.0]}, "close": {"losses": [2.0, 1.00001]}, "far": {"losses": [2.0, 1.5]}}

    def train(name, out, sets, env, timeout, ranks=1):
        if name == "broken":
            raise RuntimeError("broken: `jaxhybrid launch` exited 1")
        if name == "stuck":
            raise subprocess.TimeoutExpired("jaxhybrid", timeout)
        return outcomes[name]

    monkeypatch.setattr(gpu_check, "_train", train)
    check = gpu_check.Check(tmp_path, budget_s=600, result={"platform": "gpu"})
    ref = check.run("ok", {}, {}, 240)
    assert check.compare(check.run("close", {}, {}, 240), ref, 1e-4)["ok"] and not check.failed
    assert check.compare(check.run("far", {}, {}, 240), ref, 1e-4)["ok"] is False and check.failed

    check = gpu_check.Check(tmp_path, budget_s=600, result={"platform": "gpu"})
    broken = check.result["broken"] = check.compare(check.run("broken", {}, {}, 240), ref, 1e-4)
    assert "exited 1" in broken["error"] and check.failed
    assert "timed out" in check.run("stuck", {}, {}, 240)["error"]
    check.result["after"] = check.run("ok", {}, {}, 240)  # the runs after a failure still run
    check.write()
    assert json.loads((tmp_path / "gpu_check.json").read_text())["after"] == outcomes["ok"]

    late = gpu_check.Check(tmp_path, budget_s=50, result={})  # 50 s left: less than a run's timeout margins
    assert "s of the check's --budget-s left" in late.run("ok", {}, {}, 240)["skipped"] and late.failed
