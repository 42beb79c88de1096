"""``jaxhybrid bench pipeline --virtual-stages v``: several stages per rank (interleaved 1F1B, Narayanan et al.
SC'21; ZB-V, Qi et al. ICLR'24) against fused 1F1B over one stage per rank. The pure parts, without MPI:
bad input refused before the launch, the configs of both engines, the simulated gains."""
from __future__ import annotations

import argparse

import pytest

from jaxhybrid.bench import pipeline as bp
from jaxhybrid.parallel.pipeline.costs import Costs
from jaxhybrid.parallel.pipeline.trace import Event


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bp.add_arguments(p)
    return p.parse_args(["--stages", "2", *argv])


@pytest.mark.parametrize("argv, match", [
    (["--schedule", "zb-v", "--virtual-stages", "3"], r"placement='v' .* needs virtual_stages=2, got virtual_stages=3"),
    (["--schedule", "zb-v", "--virtual-stages", "2", "--placement", "loop"],
     r"'zb-v' is the V shape: it needs virtual_stages=2 and placement='v', got virtual_stages=2, placement='loop'"),
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--microbatches", "3"],
     r"'interleaved-1f1b' needs microbatches a multiple of the pipeline ranks, got microbatches=3 with stages=2"),
    (["--schedule", "zb-v", "--virtual-stages", "2", "--layers", "3"],
     r"parallel.pipeline=2 x pipeline.virtual_stages=2 = 4 stages exceed model.n_layers=3"),
    (["--schedule", "1f1b", "--virtual-stages", "2"], r"'1f1b' runs one stage per rank; .* use 'interleaved-1f1b'"),
])
def test_bad_chunked_input_fails_before_the_launch(monkeypatch, argv, match):
    monkeypatch.setattr(bp, "_launch", lambda *a: pytest.fail("launched"))
    with pytest.raises(ValueError, match=match):
        bp.run(_args(*argv))


def test_both_engines_run_the_same_model_and_batch(monkeypatch):
    """The schedule's config cuts P x v stages (placement v for ZB-V, split backward), 1F1B's P, over the
    same layers (at least P x v), microbatches (2P by default) and global batch."""
    launched = []
    monkeypatch.setattr(bp, "_launch", lambda args, argv: launched.append(args) or 0)
    args = _args("--schedule", "zb-v", "--virtual-stages", "2", "--model", "gpt-tiny", "--stages", "4")
    assert bp.run(args) == 0 and launched
    m = bp.default_microbatches("zb-v", 4, 2)
    assert m == 8 and bp.default_microbatches("interleaved-1f1b", 2, 2) == 4
    cfg, base = bp._cfg(args, m, "mpi4jax"), bp._cfg(args, m, "mpi4jax", base=True)
    assert (cfg.pipeline.schedule, cfg.pipeline.virtual_stages, cfg.pipeline.placement, cfg.pipeline.split_backward) == \
        ("zb-v", 2, "v", True)
    assert (base.pipeline.schedule, base.pipeline.virtual_stages, base.pipeline.placement, base.pipeline.split_backward) == \
        ("1f1b", 1, "loop", False)
    assert cfg.model == base.model and cfg.model.n_layers == 8  # gpt-tiny's 4 blocks raised to 4 x 2
    assert cfg.train.global_batch == base.train.global_batch == m * args.microbatch_size
    inter = _args("--schedule", "interleaved-1f1b", "--virtual-stages", "2")
    assert (bp.placement_of(inter), bp.split_of(inter), bp.split_of(_args("--schedule", "interleaved-1f1b",
                                                                         "--split"))) == ("loop", False, True)


def test_theoretical_gain_over_1f1b_at_two_ranks():
    """P = 2, v = 2, M = 4, unit chunk costs (a 1F1B stage: F = 2, B = 4): 1F1B takes (M + P - 1) x 6 =
    30; interleaved 1F1B's bubble shrinks v-fold, M x 6 + (P - 1) x 6 / v = 27; ZB-V's (split backward) is
    down to one chunk's F: 24 + 1 = 25. With 2BP, interleaved 1F1B matches ZB-V here."""
    assert bp.chunked_gain("interleaved-1f1b", 2, 4, 2, "loop", False) == pytest.approx(30 / 27)
    assert bp.chunked_gain("interleaved-1f1b", 2, 4, 2, "loop", True) == pytest.approx(30 / 25)
    assert bp.chunked_gain("zb-v", 2, 4, 2, "v", True) == pytest.approx(30 / 25)
    assert bp.makespan("1f1b", 2, 4, Costs.uniform(2, 2, 2, 2)) == pytest.approx(30)


def test_expected_gain_uses_each_engines_costs():
    """Each engine's own per-stage kernel medians: chunks 1.5 x slower than half a 1F1B stage cut the gain
    1.5-fold (messages free, makespans scale); the 1F1B run times only F and a fused B, ZB-V's only F, BI, BW."""
    base = Costs.uniform(2, 2, 2, 2)
    assert bp.chunked_gain("zb-v", 2, 4, 2, "v", True, Costs.uniform(4), base) == pytest.approx(1.2)
    assert bp.chunked_gain("zb-v", 2, 4, 2, "v", True, Costs.uniform(4, 1.5, 1.5, 1.5), base) == pytest.approx(0.8)

    def ev(stage, kind, dur):
        return Event(stage % 2, f"{kind}0", kind, 0.0, dur, (0,), stage)

    fused = bp.measured_costs([bp.kernel_seconds([ev(s, k, d) for s in range(2) for k, d in (("F", 2.0), ("B", 4.0))])], 2)
    assert fused.forward == (2.0, 2.0) and fused.fused_backward(0) == 4.0 and fused.backward_weight == (0.0, 0.0)
    split = bp.measured_costs([bp.kernel_seconds([ev(s, k, 1.0) for s in range(4) for k in ("F", "BI", "BW")])], 4)
    assert split.backward is None and split.fused_backward(3) == 2.0
    assert bp.chunked_gain("zb-v", 2, 4, 2, "v", True, split, fused) == pytest.approx(1.2)
    assert bp.kernel_ms(split, ("F", "BI", "BW")) == {k: [1e3] * 4 for k in ("F", "BI", "BW")}
    with pytest.raises(ValueError, match=r"no timed kernels for \(stage, kind\) \[\(3, 'F'\)"):
        bp.measured_costs([bp.kernel_seconds([ev(s, k, 1.0) for s in range(3) for k in ("F", "BI", "BW")])], 4)
