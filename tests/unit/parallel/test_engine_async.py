"""The event loop's asynchronous dispatch (Myelin Sec. IV-A, jaxhybrid/parallel/pipeline/event_loop.py): an unsynced
step never waits for a kernel, a synced step times every task and only its events reach a trace, the
message-driven gap fill keeps at most one weight pass in flight, and the trainer times the step it traces."""
import math
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid.core.config.model import ModelConfig
from jaxhybrid.model import Model, compiled_init
from jaxhybrid.model.testing import assert_tree_close
from jaxhybrid.parallel.pipeline.event_loop import EventLoop
from jaxhybrid.parallel.pipeline.message_driven import MessageDriven
from jaxhybrid.parallel.pipeline.schedule import make_schedule
from jaxhybrid.parallel.pipeline.topology import partition_blocks
from jaxhybrid.parallel.pipeline.trace import Timeline
from jaxhybrid.parallel.pipeline.transport import InProcessHub, on_threads
from jaxhybrid.parallel.twobp.stage import Stage

M = 4


class Pending:
    """A kernel's output on :class:`FakeDevice`: ready at ``ready_at`` (perf_counter seconds)."""

    def __init__(self, device: "FakeDevice", ready_at: float):
        self.device, self.ready_at = device, ready_at

    def is_ready(self) -> bool:
        return time.perf_counter() >= self.ready_at

    def is_deleted(self) -> bool:
        return False

    def block_until_ready(self):  # what the loop must not call unsynced (jax.block_until_ready calls it)
        self.device.forced += 1
        time.sleep(max(0.0, min(self.ready_at, time.perf_counter() + 1.0) - time.perf_counter()))
        return self

    def __add__(self, other):  # the loop sums the microbatch losses
        return self.device.run("add", self, other)


class FakeDevice:
    """One rank's device: kernels run one after another, ``seconds`` each, once dispatched and their inputs
    are ready (``math.inf``: never, until the test looks). ``log`` holds (kind, output, how many kernels
    before it had not finished when it was dispatched)."""

    def __init__(self, seconds: float):
        self.seconds, self.free, self.forced, self.log = seconds, 0.0, 0, []

    def run(self, kind, *inputs):
        now = time.perf_counter()
        start = max([now, self.free] + [x.ready_at for x in inputs if isinstance(x, Pending)])
        out = Pending(self, start + self.seconds)
        self.free = out.ready_at
        self.log.append((kind, out, sum(not p.is_ready() for _, p, _ in self.log)))
        return out


class FakeStage:
    """The Stage API on a :class:`FakeDevice` (no model: every output is a :class:`Pending`)."""

    def __init__(self, device: FakeDevice):
        self.d = device

    def forward(self, params, x, targets):
        return self.d.run("F", x), "activations"

    def backward(self, res, dy, acc):
        out = self.d.run("B", dy)
        return out, self.d.run("acc", out, acc)

    def backward_input(self, res, dy):
        return self.d.run("BI", dy), "weight residuals"

    def backward_weight(self, params, wres, acc):
        return self.d.run("BW", acc)


class WhenReady:
    """The in-process transport delivering each message once its payload is computed, as the MPI transports
    do (their sender waits for the payload before the message leaves); sends stay non-blocking and ordered."""

    def __init__(self, inner):
        self.inner, self.rank, self.journal = inner, inner.rank, inner.journal
        self.queue = queue.Queue()
        threading.Thread(target=self._sender, daemon=True).start()

    def _sender(self):
        while True:
            x, dest, env = self.queue.get()
            while isinstance(x, Pending) and not x.is_ready():
                time.sleep(1e-4)
            self.inner.send(x, dest, env)
            self.queue.task_done()

    def send(self, x, dest, env):
        self.queue.put((x, dest, env))

    def poll(self):
        return self.inner.poll()

    def flush(self):
        self.queue.join()

    def close(self):
        return None


def test_unsynced_step_returns_before_its_kernels_run():
    """The loop dispatches every task and returns without forcing any: on a device that never finishes,
    the step still ends, with every task in flight (the old loop waited for each task and hung here)."""
    dev = FakeDevice(math.inf)
    loop = EventLoop({0: FakeStage(dev)}, (0,), 0, InProcessHub(1).transport(0))
    res = loop.run(make_schedule("gpipe", 1, M, split_backward=True), {0: jnp.zeros(())},
                   np.zeros((M, 1, 3), np.int32), 1.0)
    assert dev.forced == 0 and isinstance(res.loss_sum, Pending) and isinstance(res.grads[0], Pending)
    assert [t.kind.value for t in loop.order] == ["F"] * M + ["BI"] * M + ["BW"]
    assert loop.inflight.count() == 0  # the step's outputs are not held beyond it
    assert {e.kind for e in loop.recorder.events} <= {"dispatch", "wait"}
    with pytest.raises(RuntimeError, match="dispatch spans, not kernel times"):
        loop.recorder.check_timed("rank 0")


@pytest.fixture(scope="module")
def real():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16)
    model = Model(cfg)
    params = compiled_init(model, jax.random.key(0))
    stages = [Stage(model, a, b) for a, b in partition_blocks(cfg.n_layers, 2)]
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (M, 2, 9)).astype(np.int32)
    return stages, [st.slice_params(params) for st in stages], tokens


def test_only_synced_steps_wait_for_kernels_and_reach_the_trace(real, monkeypatch):
    """Real stages, 2 ranks, 1F1B with 2BP: unsynced, ``jax.block_until_ready`` is never called and no
    event counts as compute; synced, it is called once per task and the trace's compute events are the
    tasks run, in order. The gradients are the same either way."""
    stages, params, tokens = real
    calls = []
    original = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: calls.append(1) or original(x))
    sched = make_schedule("1f1b", 2, M, split_backward=True)
    runs = {}
    for synced in (False, True):
        hub, loops = InProcessHub(2), [None, None]
        calls.clear()

        def rank(r):
            loops[r] = EventLoop({r: stages[r]}, (0, 1), r, hub.transport(r), synced=synced)
            return loops[r].run(sched, {r: params[r]}, tokens, 1.0 / M)

        results = on_threads(2, rank)
        waits = len(calls)  # the loops' own (the line below waits too)
        runs[synced] = [jax.block_until_ready(res.grads[r]) for r, res in enumerate(results)]
        tasks = sum(len(loop.order) for loop in loops)
        timeline = Timeline.merge([loop.recorder.events for loop in loops])
        if synced:
            assert waits == tasks
            for r, loop in enumerate(loops):
                loop.recorder.check_timed(f"rank {r}")
                assert [(e.kind, e.microbatches) for e in timeline.compute() if e.rank == r] == \
                    [(t.kind.value, t.microbatches) for t in loop.order]
        else:
            assert waits == 0 and timeline.compute() == ()
            assert sum(e.kind == "dispatch" for e in timeline.events) == tasks
    assert_tree_close(runs[False], runs[True], "fp32_parity", "async vs synced grads")


def test_message_driven_gap_fill_keeps_one_weight_pass_in_flight():
    """Myelin 2BP on 2 ranks, the second 5x slower: the first rank waits for gradients and fills that time
    with weight passes. Each is dispatched only once every kernel before it has finished, so at most one is
    ever in flight, and none is forced by a wait (the budget is out of reach: no forced passes)."""
    devs = [FakeDevice(0.002), FakeDevice(0.010)]
    hub = InProcessHub(2)
    sched = make_schedule("myelin", 2, M, split_backward=True)

    def rank(r):
        loop = EventLoop({r: FakeStage(devs[r])}, (0, 1), r, WhenReady(hub.transport(r)), MessageDriven(M + 1))
        return loop.run(sched, {r: jnp.zeros(())}, np.zeros((M, 1, 3), np.int32), 1.0)

    on_threads(2, rank)
    fills = 0
    for dev in devs:
        kinds = [k for k, _, _ in dev.log]
        last_bi = max(i for i, k in enumerate(kinds) if k == "BI")
        gap_fills = [busy for k, _, busy in dev.log[:last_bi] if k == "BW"]
        assert gap_fills == [0] * len(gap_fills), f"kernels unfinished at each gap-filling BW: {gap_fills}"
        assert dev.forced == 0
        fills += len(gap_fills)
    assert fills >= 1  # the first rank did wait for gradients (the check above ran on something)


@pytest.mark.parametrize("timed_before", [False, True])
def test_trainer_times_the_step_it_traces(tmp_path, timed_before):
    """metrics.trace: the trainer asks the engine to time its tasks before the last step only, then writes
    that step's trace (an engine without time_tasks, one device, is left alone). Where the steps before
    were dispatched asynchronously, the summary's steady state leaves the timed step out."""
    from jaxhybrid.runtime.config_load import load_config
    from jaxhybrid.runtime.trainer import Trainer

    cfg = load_config(None, ["model.name=gpt-tiny", "model.n_layers=2", "data.seq_len=16", "train.global_batch=2",
                             "train.steps=3", "metrics.trace=true", "metrics.progress=false",
                             "metrics.tensorboard=false", "metrics.plot=false", f"run.dir={tmp_path / 'run'}"])
    t = Trainer(cfg)
    seen, inner = [], t.engine

    class Engine:
        def __getattr__(self, name):
            return getattr(inner, name)

        tasks_timed = timed_before

        def time_tasks(self, on=True):
            seen.append(("time_tasks", on))

        def loss_and_grads(self, *args):
            seen.append("step")
            return inner.loss_and_grads(*args)

        def write_trace(self, run_dir):
            seen.append("write_trace")

    t.engine = Engine()
    summary = t.run()
    assert seen == ["step", "step", ("time_tasks", True), "step", "write_trace"]
    assert summary["steady_steps"] == (2 if timed_before else 1)  # steps 2-3, or step 2 alone


def test_dispatch_setting_waits_on_cpu_by_default_and_obeys_a_forced_mode():
    """``pipeline.dispatch``: auto waits for every task on CPU (polling shares the rank's core with the
    kernels: ``dispatch.synced_dispatch``) and dispatches asynchronously on an accelerator."""
    from jaxhybrid.parallel.pipeline.dispatch import synced_dispatch

    assert synced_dispatch("auto", "cpu") and not synced_dispatch("auto", "gpu")
    assert synced_dispatch("sync", "gpu") and not synced_dispatch("async", "cpu")
    with pytest.raises(ValueError, match="pipeline.dispatch='eager'; choose auto, async or sync"):
        synced_dispatch("eager", "cpu")


def test_in_flight_holds_only_what_the_device_still_computes():
    """``InFlight`` drops finished outputs as it goes: a held leaf keeps its buffer (an activation already
    sent, an input gradient) alive, which through a static schedule's M microbatches was every one."""
    from jaxhybrid.parallel.pipeline.dispatch import InFlight

    dev, track = FakeDevice(0.0), InFlight()
    done = [dev.run("F") for _ in range(5)]
    for out in done:
        track.add(out)
    assert track._pending == [done[-1]]  # each add dropped the ones before, finished
    slow = FakeDevice(math.inf)
    track.add(slow.run("F"))
    track.add(slow.run("F"))
    assert track.count() == 2 and not track.drained()
