"""xdist scheduling of the MPI tests (scripts/test.sh runs them on three workers with ``--dist loadscope``).

A scope here is a run that several tests read: a parity job's cases and its clean-end check (the session
fixture ``parity_job``), the streamed 2 x 2 run's two tests (``streamed_2x2``). One worker gets the whole
scope, so the run happens once; every other test is a scope of its own. (xdist's own ``xdist_group`` marks
are not applied under pytest 9: its loadgroup rewrites a node id attribute pytest no longer reads.)"""
from __future__ import annotations

import re

from xdist.scheduler import LoadScopeScheduling

SHARED_RUNS = [
    # test_parity[JOB-PxD-CASE] and test_parity_job_ends_cleanly_having_run_every_case[JOB]
    (re.compile(r"test_mpi_pipeline\.py::test_parity(?:_job_ends_cleanly_having_run_every_case)?"
                r"\[(?P<run>.+?)(?:-\d+x\d+-.*)?\]$"), None),
    (re.compile(r"test_mpi_resume\.py::(?:test_streamed_allreduce_matches_reduce_then_update|"
                r"test_mpi_resume_is_bit_exact\[pipeline-2x2-offload\])$"), "streamed_2x2"),
]


def shared_run(nodeid: str) -> str | None:
    """The run a test shares with others, or None."""
    for pattern, name in SHARED_RUNS:
        if m := pattern.search(nodeid):
            return name or "parity_job:" + m.group("run")
    return None


class SharedRunScheduling(LoadScopeScheduling):
    """loadscope whose scopes are :func:`shared_run`'s runs, and each other test alone (so the tests
    balance over the workers; scopes go out largest first)."""

    def _split_scope(self, nodeid: str) -> str:
        return shared_run(nodeid) or nodeid
