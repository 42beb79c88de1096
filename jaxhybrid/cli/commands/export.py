"""``jaxhybrid export --run-dir RUN --out DIR [--step N]``: a run's weights, from the checkpoints of all
its ranks in any layout, as one single-device checkpoint (``jaxhybrid.runtime.checkpoint.export``). Evaluate it on
one device (``checkpoint_export.load_export`` gives the dict ``Model.loss`` takes), or start a run of any
layout from it with ``--set train.init_from=DIR``."""
from __future__ import annotations

import argparse

from jaxhybrid.core.argtypes import check_writable, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="the run.dir of a jaxhybrid train run (its config.yaml, "
                   "checkpoints/rank_*)")
    p.add_argument("--out", required=True, help="new folder for the export (params/<part>, export.json)")
    p.add_argument("--step", type=positive_int, default=None,
                   help="the checkpointed step to export (default: the newest one every rank saved)")


def run(args: argparse.Namespace) -> int:
    from jaxhybrid.runtime.checkpoint.export import export_run

    check_writable(args.out, "--out", directory=True)  # before every rank's checkpoint is read
    meta = export_run(args.run_dir, args.out, args.step)
    lay = meta["layout"]
    print(f"exported step {meta['step']} of {meta['source']} ({meta['model']['name']}, {meta['params']:,} "
          f"parameters in float32; trained on pipeline={lay['pipeline']} data={lay['data']} tensor col x row x "
          f"depth={'x'.join(map(str, lay['tensor']))}{' offload' if lay['offload'] else ''}) to {args.out}; "
          f"start a run from it with --set train.init_from={args.out}")
    return 0
