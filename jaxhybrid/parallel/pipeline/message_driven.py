"""Myelin Alg. 2, the message-driven policy of the pipeline event loop (:mod:`.event_loop`).

Stage 0 injects ``pipeline_limit`` forwards; then every arriving message picks the work: an activation
from the previous stage runs a forward (on the last stage the backward at once), a gradient from the next
stage runs a backward, after which stage 0 injects the next microbatch (Alg. 2 lines 4-6, 24-26). With
2BP the backward is the input-gradient pass only; weight passes wait in a queue and run while no message
is waiting, or at once when ``weight_budget`` microbatches of weight residuals are held (memory bound);
those still pending after the last backward run as one weight pass (2BP Sec. 3.2, Fig. 2). The
simulator's :class:`~jaxhybrid.parallel.pipeline.policies.MessageDrivenPolicy` models this order, budget included
(``simulate(..., weight_budget=...)``); tests/unit/parallel/test_engine_vs_simulator.py holds the two to the same
order and peak on :mod:`~jaxhybrid.parallel.pipeline.virtual_clock`. Change them together.

With asynchronous dispatch (:mod:`.dispatch`) "no message is waiting" is not yet idle time: the kernels
already dispatched may still be running. A gap-filling weight pass is dispatched only once they have all
finished, and the next one only once it has finished too, the loop polling for messages meanwhile; the
budget's forced pass and the trailing joined pass are work that must run anyway and are only dispatched.
"""
from __future__ import annotations

import time

from jaxhybrid.parallel.pipeline.tasks import Schedule
from jaxhybrid.parallel.pipeline.transport import MAX_NAP, NAP, MsgKind


class MessageDriven:
    """The policy a :class:`~jaxhybrid.parallel.pipeline.event_loop.EventLoop` holds for message-driven
    schedules: it drives the loop's task methods (``forward``, ``backward``, ``weight_pass``) from the loop's
    mailbox; the order of work is the only thing it decides.

    Args:
      weight_budget: with 2BP, the most microbatches whose weight pass may wait (0: the number of stages).
    """

    name = "message-driven"

    def __init__(self, weight_budget: int = 0):
        self.weight_budget = weight_budget

    def run(self, loop, schedule: Schedule) -> None:
        own = sorted(loop.stages)  # one stage, or several (virtual stages): messages name theirs
        m = schedule.num_microbatches
        limit = schedule.pipeline_limit or loop.num_stages
        budget = self.weight_budget or loop.num_stages
        split = schedule.split_backward
        last = loop.num_stages - 1
        pending_w: list[tuple[int, int]] = []  # (stage, microbatch) of the weight passes not yet run
        injected = first_backwards = backwards = 0

        def backward(s: int, mb: int) -> None:
            nonlocal backwards, first_backwards
            loop.backward(s, mb, split)
            backwards += 1
            first_backwards += s == 0
            if split:
                pending_w.append((s, mb))
                if len(pending_w) >= budget:  # memory bound reached: pay the weight pass now
                    ws, wm = pending_w.pop(0)
                    loop.weight_pass(ws, (wm,))

        def forward(s: int, mb: int) -> None:
            loop.forward(s, mb)  # to a stage of this rank's own, the activation lands in the mailbox
            if s == last:  # Alg. 2 lines 15-17: the loss stage turns straight around
                backward(s, mb)

        def inject() -> None:  # stage 0 keeps `limit` microbatches in flight (Alg. 2 lines 4-6, 24-26)
            nonlocal injected
            while 0 in loop.stages and injected < m and injected - first_backwards < limit:
                forward(0, injected)
                injected += 1

        inject()
        nap = NAP
        while backwards < m * len(own):
            if not loop.mailbox and not loop.receive(block=False):
                if pending_w and loop.inflight.drained():  # nothing arrived, device idle: fill it (2BP)
                    ws, wm = pending_w.pop(0)
                    loop.weight_pass(ws, (wm,))
                    nap = NAP
                    continue
                if pending_w:
                    # Why poll rather than dispatch the weight pass now or block on it: queued behind running
                    # kernels, it (and with it every weight pass pending) would sit in the device queue
                    # ahead of the forward or backward that the next message brings, on the critical path
                    # (it is interruptible only at kernel granularity once queued). Blocking on it would
                    # keep that message unheard until the pass ends and then idle the device while the
                    # host dispatches; polling hears it at once and queues its task behind the one pass.
                    if nap == NAP:
                        loop.waiting("waiting for the device to idle (a weight pass) or for a message")
                    time.sleep(nap)  # yields the core to the kernels on an oversubscribed CPU
                    nap = min(2 * nap, MAX_NAP)
                    continue
                loop.receive(block=True)
            nap = NAP
            env = next(iter(loop.mailbox))
            if env.kind is MsgKind.ACT:
                forward(env.stage, env.microbatch)
            else:
                backward(env.stage, env.microbatch)
                inject()
        # 2BP Sec. 3.2 / Fig. 2: the weight passes left after the last BI run as one per stage
        for s in own:
            mbs = tuple(mb for ws, mb in pending_w if ws == s)
            if mbs:
                loop.weight_pass(s, mbs)
