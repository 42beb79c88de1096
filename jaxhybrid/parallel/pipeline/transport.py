"""Moving activations and activation-gradients between pipeline stages (Myelin Alg. 2 SEND/RECEIVE).

A :class:`Transport` gives the event loop three things: a ``send`` that never blocks the loop (1F1B's
steady state has neighbours sending to each other at once, which deadlocks two blocking sends above
MPI's eager limit), a non-blocking ``poll`` that returns the next arrived message whole, and ``flush`` at the
end of a step. The message's envelope (kind, microbatch, destination stage) is what Myelin's
message-driven dispatch reads (Alg. 2 lines 13 and 21).

Implementations:

- :class:`InProcessTransport` (threads and queues): the same event loop in unit tests, no MPI.
- ``jaxhybrid.parallel.pipeline.mpi_transport.Mpi4jaxTransport``: payloads arrive through a cached jitted
  ``mpi4jax.recv``; a sender thread sends from host buffers, so sends never block the loop; a small
  header on a dedicated communicator is what ``Iprobe`` sees, so dispatch needs no per-tag compilation.
- ``jaxhybrid.parallel.pipeline.mpi4py_transport.Mpi4pyTransport``: host-staged numpy buffers, ``Isend`` and
  receives posted ahead (Myelin Sec. IV-A; the faster one on CPU; ``pipeline.transport=mpi4py``).
"""
from __future__ import annotations

import collections
import enum
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import jax


class MsgKind(enum.IntEnum):
    """ACT: a forward activation for stage s (from s-1). GRAD: dL/d(output of stage s) (from s+1)."""

    ACT = 1
    GRAD = 2


@dataclass(frozen=True)
class Envelope:
    kind: MsgKind
    microbatch: int
    stage: int  # destination stage (a rank may run several stages)

    def __str__(self) -> str:
        return f"{self.kind.name} mb{self.microbatch}->s{self.stage}"


@dataclass(frozen=True)
class Message:
    envelope: Envelope
    source: int  # sending rank in the pipeline row
    payload: Any


class Transport(Protocol):
    """Point-to-point messages inside one pipeline row. Ranks are row ranks (= stage owners)."""

    rank: int

    def send(self, x: jax.Array, dest: int, envelope: Envelope) -> None:
        """Start sending ``x`` to row rank ``dest``; returns without waiting for the receiver."""
        ...

    def poll(self) -> Message | None:
        """The next arrived message, received whole, or None if none has arrived."""
        ...

    def flush(self) -> None:
        """Wait until every send of this rank has completed (end of a step)."""
        ...

    def close(self) -> None: ...


class Journal:
    """The last sends and receives of a rank, for the watchdog's report (a bounded ring)."""

    def __init__(self, size: int = 8):
        self.sends: collections.deque = collections.deque(maxlen=size)
        self.recvs: collections.deque = collections.deque(maxlen=size)
        self.lock = threading.Lock()

    def sent(self, dest: int, env: Envelope) -> None:
        with self.lock:
            self.sends.append((time.monotonic(), dest, str(env)))

    def received(self, source: int, env: Envelope) -> None:
        with self.lock:
            self.recvs.append((time.monotonic(), source, str(env)))

    def report(self, name: Callable[[int], str] = lambda r: f"pipeline rank {r}") -> str:
        """The ring as text, each peer (a row rank, as the transport sees it) named by ``name``: under MPI
        the event loop's ``Topology.name`` (world rank, stage, replica), as its waits say; a bare "rank 0"
        read as world rank 0 in a replica other than the first."""
        now = time.monotonic()
        with self.lock:
            s = ", ".join(f"{e} to {name(d)} ({now - t:.1f}s ago)" for t, d, e in self.sends) or "none"
            r = ", ".join(f"{e} from {name(d)} ({now - t:.1f}s ago)" for t, d, e in self.recvs) or "none"
        return f"last sends: {s}; last receives: {r}"


# Polling back-off, first and longest nap in seconds: sleeping yields the core to other ranks on
# oversubscribed machines, where spinning starves them. Also the message-driven gap fill's.
NAP, MAX_NAP = 5e-6, 2e-4


def wait_message(transport: Transport, timeout: float | None = None, max_sleep: float = MAX_NAP) -> Message | None:
    """Poll with exponential back-off (:data:`NAP` to ``max_sleep``). None after ``timeout`` seconds."""
    start = time.perf_counter()
    nap = NAP
    while True:
        msg = transport.poll()
        if msg is not None:
            return msg
        if timeout is not None and time.perf_counter() - start > timeout:
            return None
        time.sleep(nap)
        nap = min(nap * 2, max_sleep)


def on_threads(n: int, body: Callable[[int], Any], timeout: float = 120.0) -> list:
    """``body(r)`` for ranks ``0..n-1`` of an :class:`InProcessHub`, each on its own thread (unit tests of
    the event loop without MPI); returns their results and re-raises the first rank's exception."""
    results, errors = [None] * n, []

    def rank(r: int) -> None:
        try:
            results[r] = body(r)
        except BaseException as e:  # re-raised below, with the rank's traceback
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank-{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    if errors:
        raise errors[0]
    hung = [t.name for t in threads if t.is_alive()]
    if hung:  # a rank still waiting (for a message never sent) is a failure, not a result of None
        raise TimeoutError(f"{', '.join(hung)} still running after {timeout} s")
    return results


class InProcessHub:
    """Queues between ``n`` in-process ranks; ``hub.transport(r)`` is rank ``r``'s endpoint."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"InProcessHub needs n >= 1 ranks, got {n}")
        self.queues = [queue.Queue() for _ in range(n)]

    def transport(self, rank: int) -> "InProcessTransport":
        return InProcessTransport(self, rank)


class InProcessTransport:
    """Threads-and-queues transport; sends never block (unbounded queues)."""

    def __init__(self, hub: InProcessHub, rank: int):
        self.hub, self.rank = hub, rank
        self.journal = Journal()

    def send(self, x, dest: int, envelope: Envelope) -> None:
        if not 0 <= dest < len(self.hub.queues) or dest == self.rank:
            raise ValueError(f"rank {self.rank}: bad destination rank {dest} for {envelope}")
        self.journal.sent(dest, envelope)
        self.hub.queues[dest].put(Message(envelope, self.rank, x))

    def poll(self) -> Message | None:
        try:
            msg = self.hub.queues[self.rank].get_nowait()
        except queue.Empty:
            return None
        self.journal.received(msg.source, msg.envelope)
        return msg

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None
