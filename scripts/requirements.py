"""The requirements of pyproject.toml (with its ``test`` extra and mpi4jax) that a Python lacks, one per line.

For a machine without network (an air-gapped cluster, a container image) that brings its own Python and
JAX: ``scripts/wheelhouse.sh`` asks what to fetch for it (``--have``: that Python's ``pip list --format=freeze``),
and ``scripts/setup.sh`` with ``JAXHYBRID_WHEELS`` asks what to install there (this Python's own packages).
A distribution present at any version counts as present: the offline Python's JAX is the one to use, even
outside the tested ranges, which are noted on stderr.

    python scripts/requirements.py [--have FREEZE_FILE] [--build]

``--build`` adds what building mpi4jax there needs (setuptools, wheel, nanobind, cython). JAX and jaxlib
are never listed: they come with the offline Python (with its CUDA), and a Python without them is an error.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FROM_THE_SITE = ("jax", "jaxlib")  # their CUDA build must match the machine: never fetched
BUILD = ("setuptools>=77", "wheel", "nanobind", "cython")


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement string (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)).lower()


def _quoted(block: str) -> list[str]:
    return re.findall(r'"([^"]+)"', re.sub(r"#[^\n]*", "", block))


def requirements() -> list[str]:
    """pyproject.toml's dependencies, its ``test`` extra and its ``mpi`` extra (mpi4jax), as written there.
    Read with regular expressions: Python 3.10, which the project supports, has no tomllib."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    extras = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[)", text, re.S | re.M).group(1)
    return _quoted(deps) + [r for line in extras.splitlines() if "=" in line for r in _quoted(line)]


def installed(have: Path | None) -> dict[str, str]:
    """Normalised name -> version of this Python's distributions, or of a ``pip list --format=freeze``
    (a line may also name a distribution alone: its version is then unknown, "")."""
    if have is None:
        return {_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()
                if d.metadata["Name"]}  # a broken install can leave a distribution without metadata
    lines = (line.strip() for line in have.read_text().splitlines())
    pairs = (line.split("==", 1) if "==" in line else (line, "") for line in lines
             if line and re.match(r"[A-Za-z0-9]", line) and " @ " not in line)
    return {_name(n): v.strip() for n, v in pairs}


def missing(have: dict[str, str], build: bool = False) -> list[str]:
    """The requirements ``have`` lacks, in pyproject's order; ValueError when JAX itself is missing."""
    wanted = requirements() + (list(BUILD) if build else [])
    absent = [r for r in wanted if _name(r) in FROM_THE_SITE and _name(r) not in have]
    if absent:
        raise ValueError(f"the offline Python has no {' or '.join(_name(r) for r in absent)}: install JAX there "
                         f"first (its CUDA build must match the machine); the wheelhouse does not carry it")
    # mpi4py comes with the MPI it runs on: one the site built against another MPI would not find mpich's.
    # A build tool must be in its range (setuptools 77 reads pyproject's license), a package only there.
    lacking = ({_name(r) for r in wanted if _name(r) not in have}
               | {_name(r) for r in BUILD if build and _name(r) in have and not _tested(r, have[_name(r)])}
               | ({"mpi4py"} if "mpich" not in have else set()))
    return [r for r in wanted if _name(r) in lacking and _name(r) not in FROM_THE_SITE]


def _tested(requirement: str, version: str) -> bool:
    """Whether ``version`` is in the requirement's range (True where it or ``packaging`` cannot tell)."""
    if not version:
        return True
    try:
        from packaging.requirements import Requirement
        from packaging.version import InvalidVersion
    except ImportError:
        return True
    try:
        return Requirement(requirement).specifier.contains(version, prereleases=True)
    except InvalidVersion:
        return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--have", type=Path, help="a `pip list --format=freeze` of the offline Python (default: this one)")
    p.add_argument("--build", action="store_true", help="also what building mpi4jax needs")
    args = p.parse_args(argv)
    have = installed(args.have)
    try:
        lacking = missing(have, args.build)
    except ValueError as e:
        print(f"requirements: {e}", file=sys.stderr)
        return 2
    for r in requirements():
        if _name(r) in have and not _tested(r, have[_name(r)]):
            print(f"requirements: note: {_name(r)} {have[_name(r)]} comes from the offline Python, outside "
                  f"the tested {r}", file=sys.stderr)
    print("\n".join(lacking))
    return 0


if __name__ == "__main__":
    sys.exit(main())
