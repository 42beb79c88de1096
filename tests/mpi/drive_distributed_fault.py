"""MPI fault driver (tests/mpi/test_mpi_pipeline.py): ``jaxhybrid train --distributed`` (one tensor-mode
mesh over the processes) whose process ``--victim`` raises at the start of step ``--at``, after the
earlier steps compiled. It writes the wall time of the fault to ``--stamp``; every other argument is
train's."""
from __future__ import annotations

import argparse
import os
import sys
import time

from jaxhybrid.cli import main
from jaxhybrid.train import Trainer

ap = argparse.ArgumentParser()
ap.add_argument("--stamp", required=True)
ap.add_argument("--victim", type=int, default=1)
ap.add_argument("--at", type=int, default=3)
a, train_args = ap.parse_known_args()
if int(os.environ.get("PMI_RANK", "-1")) == a.victim:
    step = Trainer.step

    def failing(self, st):
        if st.step + 1 == a.at:
            with open(a.stamp, "w") as f:
                f.write(repr(time.time()))
            raise RuntimeError(f"injected failure at step {a.at}")
        return step(self, st)

    Trainer.step = failing
sys.exit(main(["train", *train_args]))
