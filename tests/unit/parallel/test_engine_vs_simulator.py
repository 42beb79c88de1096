"""The simulator against the real event loop: Myelin Alg. 2 + 2BP's weight passes (and ``weight_budget``)
in :mod:`jaxhybrid.parallel.pipeline.message_driven` must run the order :func:`simulate` predicts and hold the
per-stage peak it reports. The loop runs on :mod:`jaxhybrid.parallel.pipeline.virtual_clock` (deterministic
virtual time at the simulator's costs) over stages that only count, so the order and the held counts are
the engine's own, not a thread race's."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid.parallel.pipeline.costs import Costs
from jaxhybrid.parallel.pipeline.schedule import make_schedule
from jaxhybrid.parallel.pipeline.simulate import simulate
from jaxhybrid.parallel.pipeline.virtual_clock import run_engine


class CountingStage:
    """The Stage API with no model: the gradient counts the microbatches its weight passes covered."""

    def forward(self, params, x, targets):
        return np.ones(2, np.float32), "activations"

    def backward_input(self, res, dy):
        return np.ones(2, np.float32), "weight residuals"

    def backward(self, res, dy, acc):
        return np.ones(2, np.float32), acc + 1

    def backward_weight(self, params, wres, acc):
        return acc + (len(wres) if isinstance(wres, list) else 1)


SKEWED = Costs((1.0, 1.0, 4.0), (1.0, 1.0, 4.0), (1.0, 1.0, 1.0), latency=0.3)  # idle time on ranks 0-1


SHAPES = [(4, 16, 0, None), (4, 16, 2, None), (4, 16, 1, None), (4, 16, 6, None), (3, 7, 5, None),
          (2, 5, 1, None), (1, 4, 2, None), (3, 9, 0, SKEWED), (3, 9, 2, SKEWED),
          (4, 12, 3, Costs.uniform(4, 1.0, 2.0, 0.5, latency=0.25))]
# weight_budget bounds the pending weight passes of 2BP only: without the split a shape that differs from
# one before it by its budget alone runs the same order (4 x 16 and 3 x 9 SKEWED), so it runs once.
FUSED = [s for i, s in enumerate(SHAPES) if not any(s[:2] + s[3:] == t[:2] + t[3:] for t in SHAPES[:i])]


@pytest.mark.parametrize("p,m,budget,costs,split", [(*s, True) for s in SHAPES] + [(*s, False) for s in FUSED])
def test_simulated_peaks_are_what_the_engine_holds(p, m, budget, costs, split):
    costs = costs or Costs.uniform(p)
    sched = make_schedule("myelin", p, m, split, costs=costs)
    sim = simulate(sched, costs, weight_budget=budget)
    tokens = np.zeros((m, 1, 3), np.int32)
    results, orders, held = run_engine(sched, costs, [CountingStage()] * p, [jnp.zeros(())] * p, tokens, 1.0,
                                       weight_budget=budget)
    assert held == [st.peak_stashed for st in sim.per_rank]
    for r in range(p):
        got = [(e.kind, e.microbatches) for e in orders[r]]
        assert got == [(t.kind.value, t.microbatches) for t in sim.orders[r]], f"rank {r}"
        assert float(results[r].grads[r]) == m  # every microbatch's weight gradient exactly once
    if split and budget:  # the bound itself: residuals of one F in flight, `budget` weight residuals
        assert all(h <= budget + p - r for r, h in enumerate(held))


def test_myelin_2bp_holds_weight_budget_not_every_microbatch():
    """The audit's case: 4 stages, 16 microbatches, the engine's default budget (4 = stages). Before the
    simulator modelled the budget it reported [16, 15, 15, 16]; the makespan is the same either way."""
    res = simulate(make_schedule("myelin", 4, 16, True))
    assert [st.peak_stashed for st in res.per_rank] == [7, 6, 5, 4] and res.makespan == 51
    assert [st.peak_stashed for st in simulate(make_schedule("myelin", 4, 16, True), weight_budget=1).per_rank] \
        == [4, 4, 3, 1]
