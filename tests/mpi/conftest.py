"""The MPI tests' xdist scheduler: scopes that keep the tests of one shared run on one worker (xdist_scopes.py)."""
from __future__ import annotations

from xdist_scopes import SharedRunScheduling


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadscope":
        return SharedRunScheduling(config, log)
    return None
