"""The MPI tests' xdist scopes (tests/mpi/xdist_scopes.py) keep each shared run's tests together."""
from __future__ import annotations

from pathlib import Path

import pytest
from test_mpi_resume import STREAMED_2X2
from xdist_scopes import SharedRunScheduling, shared_run


def _collected() -> list:
    """Every test of tests/mpi, collected in this process whatever this session selected."""
    class Keep:
        items: list = []

        def pytest_collection_finish(self, session):
            Keep.items = list(session.items)

    assert pytest.main(["--collect-only", "-qq", str(Path(__file__).parent)],
                       plugins=[Keep()]) == 0
    return Keep.items


def test_every_test_of_a_shared_run_is_in_its_scope():
    """Each parity test's scope is its job, the streamed 2 x 2 run's two tests share one, and every other
    test is alone: a test left out of its run's scope would run that job again on the other worker."""
    jobs, streamed = {}, []
    for item in _collected():
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if "parity_job" in item.fixturenames:
            assert shared_run(item.nodeid) == f"parity_job:{params['job']}", item.nodeid
            jobs.setdefault(params["job"], []).append(item.nodeid)
        elif item.originalname == "test_streamed_allreduce_matches_reduce_then_update" or (  # run A: the fixture's
                item.originalname == "test_mpi_resume_is_bit_exact" and params["sets"] is STREAMED_2X2):
            assert shared_run(item.nodeid) == "streamed_2x2", item.nodeid
            streamed.append(item.nodeid)
        else:
            assert shared_run(item.nodeid) is None, item.nodeid
    assert len(jobs) >= 5 and all(len(ids) > 1 for ids in jobs.values()) and len(streamed) == 2, (jobs, streamed)
    assert SharedRunScheduling._split_scope(None, "tests/mpi/x.py::test_y[z]") == "tests/mpi/x.py::test_y[z]"
