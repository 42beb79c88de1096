"""Regenerates tests/golden/schedules/*.txt: the task tables of a few schedules.

A change in a generator's ordering shows up as a diff of these files in review; tests/unit/
test_schedules.py fails until they are regenerated on purpose::

    .venv/bin/python scripts/regen_golden.py
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "tests" / "golden" / "schedules"

# file stem -> (name, stages, microbatches, split_backward, options)
GOLDEN_CASES = {
    "naive_p3_m2": ("naive", 3, 2, False, {}),
    "naive_p3_m2_2bp": ("naive", 3, 2, True, {}),
    "gpipe_p4_m4": ("gpipe", 4, 4, False, {}),
    "gpipe_p4_m4_2bp": ("gpipe", 4, 4, True, {}),
    "1f1b-1_p4_2bp": ("1f1b-1", 4, 4, True, {}),
    "1f1b-2_p4": ("1f1b-2", 4, 8, False, {}),
    "1f1b-2_p4_2bp": ("1f1b-2", 4, 8, True, {}),
    "1f1b-2_p4_2bp_memory_saving": ("1f1b-2", 4, 8, True, {"memory_saving": True}),
    "1f1b_p4_m6": ("1f1b", 4, 6, False, {}),
    "zb-h1_p4_m8": ("zb-h1", 4, 8, True, {}),
    "1f1b-star_p5_m8": ("1f1b-star", 5, 8, False,
                        {"stage_costs": [(1, 2), (2, 3), (1, 1), (3, 4), (1, 2)], "period": 8}),
    "myelin_p4_m8": ("myelin", 4, 8, False, {}),
    "myelin_p4_m8_2bp_limit2": ("myelin", 4, 8, True, {"pipeline_limit": 2}),
    # virtual stages: ``stages`` is the ranks, the tables name the logical stages
    "interleaved-1f1b_p4_v2_m8": ("interleaved-1f1b", 4, 8, False, {"virtual_stages": 2}),
    "interleaved-1f1b_p4_v2_m8_2bp": ("interleaved-1f1b", 4, 8, True, {"virtual_stages": 2}),
    "zb-v_p4_m8": ("zb-v", 4, 8, True, {"virtual_stages": 2, "placement": "v"}),
    "gpipe_p2_v2_m4": ("gpipe", 2, 4, False, {"virtual_stages": 2}),
}


def render(stem: str) -> str:
    from jaxhybrid.parallel.pipeline.schedule import make_schedule

    name, p, m, split, opts = GOLDEN_CASES[stem]
    sch = make_schedule(name, p, m, split, **opts)
    head = f"# make_schedule({name!r}, {p}, {m}, split_backward={split}, **{opts!r}) policy={sch.policy}"
    return head + "\n" + sch.table() + "\n"


def main() -> int:
    sys.path.insert(0, str(ROOT))
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for stem in GOLDEN_CASES:
        (GOLDEN_DIR / f"{stem}.txt").write_text(render(stem))
        print(f"wrote {GOLDEN_DIR / stem}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
