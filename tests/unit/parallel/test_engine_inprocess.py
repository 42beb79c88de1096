"""The pipeline event loop over the in-process transport (threads and queues): every schedule, with and
without 2BP, gives the single-device loss and gradients (fp32 parity, leaf by leaf)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid.core.config.model import ModelConfig
from jaxhybrid.model import Model
from jaxhybrid.model.testing import assert_tree_close
from jaxhybrid.parallel.pipeline.event_loop import EventLoop, loop_policy
from jaxhybrid.parallel.pipeline.message_driven import MessageDriven
from jaxhybrid.parallel.pipeline.schedule import make_schedule
from jaxhybrid.parallel.pipeline.topology import partition_blocks
from jaxhybrid.parallel.pipeline.transport import Envelope, InProcessHub, MsgKind, on_threads
from jaxhybrid.parallel.twobp.stage import weight_join
from jaxhybrid.runtime.engines.base import LocalEngine, split_batch

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=2, d_ff=64, max_seq_len=16)
SEQ, M = 8, 4


_STAGES: dict = {}


def _stages(model, p):
    """Stages are built once per pipeline depth, so every schedule reuses their compiled programs."""
    from jaxhybrid.parallel.twobp.stage import Stage

    if (model, p) not in _STAGES:
        _STAGES[(model, p)] = [Stage(model, a, b) for a, b in partition_blocks(model.cfg.n_layers, p)]
    return _STAGES[(model, p)]


def _run_pipeline(model, params, batch, p, name, split, limit=0, budget=0, loops=None, join="sum", **opts):
    stages = _stages(model, p)
    sched = make_schedule(name, p, M, split_backward=split, pipeline_limit=limit, **opts)
    hub = InProcessHub(p)
    mbs = jnp.asarray(split_batch(batch, 0, 1, M))

    def rank(r):
        loop = EventLoop({r: stages[r]}, sched.stage_to_rank, r, hub.transport(r), loop_policy(sched, budget),
                         join=weight_join(join))
        if loops is not None:
            loops[r] = loop
        return loop.run(sched, {r: stages[r].slice_params(params)}, mbs, 1.0 / M)

    return stages, on_threads(p, rank)


@pytest.fixture(scope="module")
def reference():
    model = Model(CFG)
    engine = LocalEngine(model, M)
    params = engine.init_params(jax.random.key(0))  # jitted: eager, op by op, is slower on CPU
    batch = np.random.default_rng(0).integers(0, CFG.vocab_size, (8, SEQ + 1)).astype(np.int32)
    loss, grads = engine.loss_and_grads(params, batch, 1.0)
    return model, params, batch, loss, grads


CASES = [(p, name, split) for p in (2, 4) for name in ("naive", "gpipe", "1f1b", "zb-h1", "myelin")
         for split in (False, True) if not (name == "zb-h1" and not split)]
# At M = 4, 1f1b on 2 stages is 2BP's 1F1B-2 and on 4 stages its 1F1B-1 (the same rows: a 1f1b-K case
# here would repeat one above). MadPipe's 1F1B* with groups other than 1F1B's (stages 0-1 and 2-3 each
# one group: warm-ups 1, 1, 0, 0 instead of 3, 2, 1, 0) is a schedule of its own.
CASES += [(4, "1f1b-star", False), (4, "1f1b-star", True)]
STAR = {"groups": (2, 2, 1, 1)}


# Trailing BWs of several microbatches: summed in one program (``sum``, the CPU default) everywhere above;
# concatenated into one batch (2BP Fig. 2, the accelerator default) here.
CASES_CONCAT = [(2, "gpipe", True, "concat"), (2, "1f1b-2", True, "concat")]


@pytest.mark.parametrize("p,name,split,join", [c + ("sum",) for c in CASES] + CASES_CONCAT)
def test_event_loop_matches_single_device(reference, p, name, split, join):
    from jaxhybrid.parallel.twobp.stage import assemble_grads

    model, params, batch, loss, grads = reference
    stages, results = _run_pipeline(model, params, batch, p, name, split, join=join,
                                    **(STAR if name == "1f1b-star" else {}))
    got_loss = results[-1].loss_sum / M
    assert_tree_close(got_loss, loss, "fp32_parity", f"{name} p={p} split={split} loss")
    got = assemble_grads(stages, [results[r].grads[r] for r in range(p)])
    assert_tree_close(got, grads, "fp32_parity", f"{name} p={p} split={split} grads")
    assert all(res.wall_s > 0 for res in results)


def test_the_loop_keeps_nothing_of_a_step_it_returned(reference):
    """After run() the step's gradients, parameters and losses are the caller's alone: a loop that kept its
    gradient dict held the unreduced tree beside the all-reduced one through the update and any save."""
    model, params, batch, *_ = reference
    loops = [None, None]
    _, results = _run_pipeline(model, params, batch, 2, "1f1b", True, loops=loops)
    for r, loop in enumerate(loops):
        assert results[r].grads and (loop.grads, loop.params, loop.losses) == ({}, None, [])


@pytest.mark.parametrize("p", [1, 2, 4])
def test_forward_only_evaluation_matches_single_device(reference, p):
    """EventLoop.evaluate (validation: Stage.evaluate per stage, activations over the transport, no
    residuals) gives the single-device eval loss; the step's trace is left as it was."""
    model, params, batch, loss, _ = reference
    stages = _stages(model, p)
    hub = InProcessHub(p)
    mbs = split_batch(batch, 0, 1, M)

    def rank(r):
        loop = EventLoop({r: stages[r]}, tuple(range(p)), r, hub.transport(r))
        before = loop.recorder
        out = loop.evaluate({r: stages[r].slice_params(params)}, mbs)
        assert loop.recorder is before and not loop.mailbox
        return out

    sums = on_threads(p, rank)
    assert all(v is None for v in sums[:-1])
    want = LocalEngine(model, M).eval_loss(params, batch)
    assert_tree_close(want, loss, "fp32_parity", "single-device eval loss vs training loss")
    assert_tree_close(sums[-1] / M, want, "fp32_parity", f"p={p} eval loss")


@pytest.mark.parametrize("budget", [1, M])
def test_message_driven_2bp_weight_budget(reference, budget):
    """Message-driven 2BP never holds more than ``budget`` microbatches of weight residuals: with budget
    1 every BI is followed at once by its BW; the gradients match either way."""
    from jaxhybrid.parallel.twobp.stage import assemble_grads

    model, params, batch, loss, grads = reference
    loops = {}
    stages, results = _run_pipeline(model, params, batch, 2, "myelin", True, limit=2, budget=budget, loops=loops)
    assert_tree_close(results[-1].loss_sum / M, loss, "fp32_parity", "myelin 2bp loss")
    assert_tree_close(assemble_grads(stages, [results[r].grads[r] for r in range(2)]), grads, "fp32_parity",
                      f"myelin 2bp budget {budget} grads")
    for r, loop in loops.items():
        held = peak = 0
        for e in loop.order:
            held += {"BI": 1, "BW": -len(e.microbatches)}.get(e.kind, 0)
            peak = max(peak, held)
        assert held == 0 and peak <= budget, f"rank {r}: held {held} at the end, peak {peak} > budget {budget}"


@pytest.mark.parametrize("budget", [1, 0])
def test_myelin_2bp_on_the_virtual_clock_holds_what_the_simulator_says(reference, budget):
    """Real stages on :mod:`jaxhybrid.parallel.pipeline.virtual_clock` (deterministic virtual time): the engine runs
    the simulated order, holds the simulated peak, and the gradients still match one device."""
    from jaxhybrid.parallel.pipeline.costs import Costs
    from jaxhybrid.parallel.pipeline.simulate import simulate
    from jaxhybrid.parallel.pipeline.virtual_clock import run_engine
    from jaxhybrid.parallel.twobp.stage import assemble_grads

    model, params, batch, loss, grads = reference
    stages, sched, costs = _stages(model, 2), make_schedule("myelin", 2, M, split_backward=True), Costs.uniform(2)
    results, orders, held = run_engine(sched, costs, stages, [st.slice_params(params) for st in stages],
                                       jnp.asarray(split_batch(batch, 0, 1, M)), 1.0 / M, budget, weight_join("sum"),
                                       synced=True)  # real kernels: the CPU's timing must not decide the order
    sim = simulate(sched, costs, weight_budget=budget)
    assert held == [st.peak_stashed for st in sim.per_rank]
    assert [[(e.kind, e.microbatches) for e in row] for row in orders] == \
        [[(t.kind.value, t.microbatches) for t in row] for row in sim.orders]
    assert_tree_close(assemble_grads(stages, [results[r].grads[r] for r in range(2)]), grads, "fp32_parity",
                      f"myelin 2bp budget {budget} on the virtual clock")


def test_in_process_transport_rejects_bad_destination():
    hub = InProcessHub(2)
    with pytest.raises(ValueError, match="bad destination rank 5"):
        hub.transport(0).send(jnp.zeros(2), 5, Envelope(MsgKind.ACT, 0, 1))


def test_receives_and_journal_name_peers_as_the_waits_do(reference):
    """A replica-1 row of a 2 x 2 grid (world ranks 2, 3): waits named a peer by world rank, stage and
    replica, but the watchdog's "now: received ... from rank 0" and its journal of last sends and
    receives ("to rank 1") by row rank, which reads as ranks of replica 0. All use the one naming now."""
    import functools
    import re
    from types import SimpleNamespace

    from jaxhybrid.core.layout import ParallelDims
    from jaxhybrid.parallel.pipeline.topology import Topology

    model, params, batch, _, _ = reference
    stages, sched = _stages(model, 2), make_schedule("1f1b", 2, M)
    hub, mbs, said = InProcessHub(2), jnp.asarray(split_batch(batch, 0, 1, M)), {0: [], 1: []}
    # The runner's naming, sans MPI.
    name = functools.partial(Topology.name, SimpleNamespace(dims=ParallelDims(2, 2), replica=1, held=[[0], [1]]))

    def rank(r):
        loop = EventLoop({r: stages[r]}, sched.stage_to_rank, r, hub.transport(r), progress=said[r].append,
                         waiting=said[r].append, peer_name=name)
        loop.run(sched, {r: stages[r].slice_params(params)}, mbs, 1.0 / M)
        return loop.report()

    reports = on_threads(2, rank)
    for r, other in ((0, 1), (1, 0)):
        peer = f"rank {2 + other} (stage {other}, replica 1)"
        named = [x.split(" from ", 1)[1] for x in said[r] if " from " in x]  # waits and receives
        assert any(x.startswith("received") for x in said[r]) and set(named) == {peer}, said[r]
        assert re.fullmatch(rf"last sends: (\S+ mb\d->s{other} to {re.escape(peer)} \(\d+\.\ds ago\)(, )?)+; "
                            rf"last receives: (\S+ mb\d->s{r} from {re.escape(peer)} \(\d+\.\ds ago\)(, )?)+",
                            reports[r]), reports[r]


def test_unfinished_schedule_is_reported(reference):
    """A schedule row that leaves residuals behind (a forward with no backward) raises, naming them."""
    from jaxhybrid.parallel.pipeline.tasks import Schedule, task

    model, params, batch, _, _ = reference
    stages = _stages(model, 1)
    sched = Schedule("broken", ((task("F", 0, 0),),), (0,), 1)
    loop = EventLoop({0: stages[0]}, (0,), 0, InProcessHub(1).transport(0))
    with pytest.raises(RuntimeError, match="left work undone"):
        loop.run(sched, {0: stages[0].slice_params(params)}, jnp.asarray(split_batch(batch, 0, 1, 1)), 1.0)


@pytest.mark.parametrize("p,budget", [(1, M + 1), (2, M + 1)])
def test_message_driven_2bp_joins_trailing_weight_passes(reference, p, budget):
    """2BP Sec. 3.2 / Fig. 2 (and the simulator's MessageDrivenPolicy): the weight passes still pending
    after a rank's last input-gradient pass run as ONE weight pass over those microbatches, not one per
    microbatch. On one stage nothing arrives, so the engine's order is exactly the simulated row."""
    from jaxhybrid.parallel.pipeline.simulate import simulate
    from jaxhybrid.parallel.twobp.stage import assemble_grads

    model, params, batch, loss, grads = reference
    loops = {}
    stages, results = _run_pipeline(model, params, batch, p, "myelin", True, budget=budget, loops=loops)
    assert_tree_close(assemble_grads(stages, [results[r].grads[r] for r in range(p)]), grads, "fp32_parity",
                      f"myelin 2bp p={p} grads")
    for r, loop in loops.items():
        work = loop.order
        last_bi = max(i for i, e in enumerate(work) if e.kind == "BI")
        trailing = work[last_bi + 1:]
        assert len(trailing) <= 1, f"rank {r}: {len(trailing)} weight passes after the last BI: {[str(e) for e in trailing]}"
    if p == 1:
        sim = simulate(make_schedule("myelin", 1, M, split_backward=True), weight_budget=budget)
        got = [(e.kind, e.microbatches) for e in loops[0].order]
        assert got == [(t.kind.value, t.microbatches) for t in sim.orders[0]]


def test_loop_runs_only_schedules_of_its_policy():
    """The policy is chosen when the loop is built: a message-driven schedule on a loop built with the
    fixed order (or the reverse) is refused before any task, naming both."""
    myelin, fixed = make_schedule("myelin", 2, M), make_schedule("1f1b", 2, M)
    assert isinstance(loop_policy(myelin, 3), MessageDriven) and loop_policy(myelin, 3).weight_budget == 3
    assert loop_policy(fixed).name == "static"
    tokens = np.zeros((M, 1, 3), np.int32)
    for sched, policy in ((myelin, None), (fixed, MessageDriven())):
        loop = EventLoop({0: None}, (0, 1), 0, InProcessHub(2).transport(0), policy)
        with pytest.raises(ValueError, match=f"is {sched.policy}; this loop was built with the {loop.policy.name}"):
            loop.run(sched, {0: None}, tokens, 1.0)
        assert loop.order == []


@pytest.mark.parametrize("name,split", [("interleaved-1f1b", False), ("interleaved-1f1b", True), ("myelin", True)])
def test_on_final_gets_each_stages_last_gradient_sum_once_in_the_rows_order(reference, name, split):
    """The data-parallel reduction starts from ``on_final``: called once per stage, after the stage's last
    backward (2BP: its last weight pass), with the gradient sum the step returns; under a static policy in
    the order ``Schedule.grads_final`` gives every replica. Two stages per rank, so the calls interleave
    with the rest of the schedule."""
    model, params, batch, *_ = reference
    p, v = 2, 2
    stages = _stages(model, p * v)
    sched = make_schedule(name, p, M, split_backward=split, virtual_stages=v)
    hub = InProcessHub(p)
    mbs = jnp.asarray(split_batch(batch, 0, 1, M))
    calls: dict[int, list] = {0: [], 1: []}

    def rank(r):
        mine = [s for s in range(p * v) if sched.stage_to_rank[s] == r]
        loop = EventLoop({s: stages[s] for s in mine}, sched.stage_to_rank, r, hub.transport(r), loop_policy(sched))
        loop.on_final = lambda s, g: calls[r].append((s, g, len(loop.order)))
        return loop.run(sched, {s: stages[s].slice_params(params) for s in mine}, mbs, 1.0 / M)

    results = on_threads(p, rank)
    for r in range(p):
        assert sorted(s for s, *_ in calls[r]) == sorted(results[r].grads)  # each stage once
        assert all(g is results[r].grads[s] for s, g, _ in calls[r])  # the sum the step returns
        if sched.policy == "static":
            assert tuple(s for s, *_ in calls[r]) == sched.grads_final(r)
        assert calls[r][0][2] < len(sched.rows[r])  # the first came before the rank's last task
