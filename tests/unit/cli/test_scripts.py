"""The helpers in scripts/: the GPU check's bookkeeping (a run that fails or would overrun the budget is
recorded and the check goes on; its runs themselves are tests/mpi/test_mpi_pipeline.py's self-test,
``--cpu``), and requirements.py, which says what a machine without network lacks, for wheelhouse.sh to
fetch and setup.sh (``JAXHYBRID_WHEELS``) to install. The whole offline path, wheelhouse to the GPU
check's self-test on another Python, is run by hand (docs/launching.md): it needs a package index."""
from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _script(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failing_or_late_run_is_recorded_and_the_check_goes_on(tmp_path, monkeypatch):
    """A GPU is lent for minutes: one run that fails (a transport that does not start) or one stuck until
    its timeout must not cost the other runs' figures, and the JSON on disk holds every run that ended."""
    gpu_check = _script("gpu_check")
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


def test_pyproject_is_read_whole():
    """The regular expressions (Python 3.10 has no tomllib) find what tomllib finds."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for group in project["optional-dependencies"].values() for r in group]
    assert _script("requirements").requirements() == project["dependencies"] + extras


def test_what_an_offline_python_lacks():
    """Its own JAX (any version) is used; mpi4py comes with MPICH; a build tool below its range is fetched;
    a Python without JAX is an error naming it."""
    req = _script("requirements")
    names = {req._name(r) for r in req.requirements()}
    site = {n: "1.0" for n in names if n not in ("mpich", "mpi4py", "tensorboardx", "mpi4jax")}
    site |= {"jax": "0.11.2", "jaxlib": "0.11.2", "setuptools": "70.0", "wheel": "0.45", "nanobind": "2.9",
             "cython": "3.1"}
    assert req.missing(site) == ["mpi4py>=4.0,<5", "mpich>=4.2", "tensorboardX>=2.6", "mpi4jax>=0.9,<0.10"]
    assert req.missing(site | {"mpich": "5.0", "mpi4py": "4.1"}) == ["tensorboardX>=2.6", "mpi4jax>=0.9,<0.10"]
    assert req.missing(site, build=True)[-1] == "setuptools>=77"  # 70 cannot read pyproject's license
    without_jax = {n: v for n, v in site.items() if n != "jaxlib"}
    with pytest.raises(ValueError, match="the offline Python has no jaxlib: install JAX there first"):
        req.missing(without_jax)
    assert req.installed(None)["jax"]  # this Python's own distributions, by normalised name


def test_a_freeze_file_is_read_by_normalised_name(tmp_path):
    have = tmp_path / "have.txt"
    have.write_text("Orbax_Checkpoint==0.11.0\ntensorboardX==2.6.5\n-e git+https://example/x#egg=x\n"
                    "x @ file:///tmp/x\nnanobind\n")  # a name alone: a package list without versions
    assert _script("requirements").installed(have) == {"orbax-checkpoint": "0.11.0", "tensorboardx": "2.6.5",
                                                        "nanobind": ""}
