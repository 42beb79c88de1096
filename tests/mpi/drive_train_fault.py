"""MPI fault driver (tests/mpi/test_mpi_pipeline.py): ``jaxhybrid train`` (any layout, ``--distributed``
too) whose process ``--victim`` fails in ``Trainer.<--method>``: ``step`` at the start of step ``--at``
(the earlier steps compiled), ``init_state`` before the run's first collective, ``__init__`` while the
Trainer is built. ``--mode raise`` raises, ``hang`` sleeps for an hour. It writes the wall time of the
fault to ``--stamp``; every other argument is train's."""
from __future__ import annotations

import argparse
import os
import sys
import time

from jaxhybrid.cli.main import main
from jaxhybrid.runtime.trainer import Trainer

ap = argparse.ArgumentParser()
ap.add_argument("--stamp", required=True)
ap.add_argument("--victim", type=int, default=1)
ap.add_argument("--method", choices=("step", "init_state", "__init__"), default="step")
ap.add_argument("--at", type=int, default=3)
ap.add_argument("--mode", choices=("raise", "hang"), default="raise")
a, train_args = ap.parse_known_args()
if int(os.environ.get("PMI_RANK", "-1")) == a.victim:
    original = getattr(Trainer, a.method)

    def failing(self, *args):
        if a.method != "step" or args[0].step + 1 == a.at:
            with open(a.stamp, "w") as f:
                f.write(repr(time.time()))
            if a.mode == "hang":
                time.sleep(3600)
            raise RuntimeError(f"injected failure in Trainer.{a.method}")
        return original(self, *args)

    setattr(Trainer, a.method, failing)
sys.exit(main(["train", *train_args]))
