"""The host-staged mpi4py transport, with receives posted ahead (Myelin Sec. IV-A).

Myelin issues its ``MPI_Irecv``s "preemptively at the beginning of a forward or backward pass to overlap
the reception of the next message with the computation". :class:`Mpi4pyTransport` keeps ``recv_depth``
receives ``Irecv(source=ANY_SOURCE, tag=ANY_TAG)`` posted at all times, each into a fresh host buffer of
the step's message shape, so a message that arrives while the rank computes is matched and copied by
whatever MPI call next makes progress (a send, the next poll's ``Test``, a collective), not left in MPI's
unexpected queue until the loop asks for it. MPI matches an arriving message to the earliest posted
receive that fits, so ``poll`` tests the oldest request only: messages come out in arrival order, each
source's in the order it sent them. Every handed-out buffer becomes the payload (``jnp.asarray`` of a
host array may alias it on CPU) and a new buffer is posted in its place.

The receives stay posted across steps and validation passes (one envelope scheme, the MPI tag): ``flush``
waits for this rank's sends only. ``close`` cancels them, so no posted buffer outlives the transport. A
failing rank needs nothing from here: ``MPI_Abort`` (the excepthook, the watchdog) ends the job with
receives posted, and an MPI_Finalize with receives still posted returns (MPICH 5.0.2 with UCX, tested),
warning that their requests were not returned.

``recv_depth=0`` is the probe-on-demand path (``Improbe`` + ``Mrecv`` when the loop polls): the baseline
that ``scripts/bench_recv_depth.py`` measures pre-posting against.
"""
from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np

from jaxhybrid.parallel.pipeline.mpi_transport import MpiTransportBase
from jaxhybrid.parallel.pipeline.transport import Envelope, Message, MsgKind

_MB_SLOTS = 1 << 12  # microbatches per step a tag can name


def encode_tag(env: Envelope, tag_ub: int) -> int:
    """(stage, microbatch, kind) -> an MPI tag; raises if it exceeds the library's ``MPI_TAG_UB``."""
    tag = ((env.stage * _MB_SLOTS) + env.microbatch) * 2 + (int(env.kind) - 1)
    if env.microbatch >= _MB_SLOTS or tag > tag_ub:
        raise ValueError(f"message {env} does not fit an MPI tag (MPI_TAG_UB={tag_ub}); use fewer than "
                         f"{_MB_SLOTS} microbatches per step or the mpi4jax transport")
    return tag


def decode_tag(tag: int) -> Envelope:
    kind, rest = tag % 2 + 1, tag // 2
    return Envelope(MsgKind(kind), rest % _MB_SLOTS, rest // _MB_SLOTS)


class Mpi4pyTransport(MpiTransportBase):
    """Host-staged buffers: ``Isend`` returns at once; receives are posted ahead (module docstring).

    Args:
      comm: the pipeline row's point-to-point communicator. The transport receives on its own ``Dup()``
        of it (collective over the row: every rank builds its transport together), so its ANY_TAG
        receives never take another user's messages: an mpi4jax transport's payloads on the same
        communicator (the parity driver and ``bench pipeline`` keep both alive) or a tag-7 exchange.
      template: payload shape and dtype (every message of a step has them).
      sharding: the payloads' layout on the rank's tensor mesh, or None.
      recv_depth: receives kept posted. 2 by default: a rank's messages come from at most two
        neighbouring ranks (activations from the previous stage, gradients from the next; with
        interleaved stages still those two ranks), so each can land one while the rank computes; more
        wait in MPI's queue until a poll hands one out and posts again. Costs ``recv_depth`` activations
        of host memory. 0: probe on demand (module docstring).
    """

    def __init__(self, comm: Any, template: jax.ShapeDtypeStruct, sharding: Any = None, recv_depth: int = 2):
        from mpi4py import MPI

        if recv_depth < 0:
            raise ValueError(f"recv_depth={recv_depth} must be >= 0")
        super().__init__(comm.Dup(), template, sharding)
        self.recv_depth = recv_depth
        self._pending: list[tuple[Any, np.ndarray]] = []
        self._tag_ub = int(self.comm.Get_attr(MPI.TAG_UB) or 32767)
        self._nbytes = int(np.prod(template.shape)) * np.dtype(self.wire).itemsize
        # Oldest first: MPI fills posted receives in posting order.
        self._posted: collections.deque[tuple[Any, np.ndarray]] = collections.deque()
        for _ in range(recv_depth):
            self._post()

    def _post(self) -> None:
        from mpi4py import MPI

        buf = np.empty(self.template.shape, dtype=self.wire)  # fresh: the last one may be a payload now
        self._posted.append((self.comm.Irecv(buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG), buf))

    def arrived(self) -> int:
        """How many posted receives already hold a message (landed, not yet handed out by ``poll``).
        Non-destructive (``MPI_Request_get_status``); it drives MPI's progress like any test."""
        return sum(bool(req.Get_status()) for req, _ in self._posted)

    def send(self, x, dest: int, envelope: Envelope) -> None:
        buf = self._host_wire(x)  # waits for x, copies device -> host where they differ
        req = self.comm.Isend(buf, dest=dest, tag=encode_tag(envelope, self._tag_ub))
        self._pending.append((req, buf))  # the buffer must live until the send completes
        self.journal.sent(dest, envelope)
        self._retire()

    def _retire(self) -> None:
        if self._pending:
            self._pending = [(r, b) for r, b in self._pending if not r.Test()]

    def poll(self) -> Message | None:
        from mpi4py import MPI

        self._retire()
        status = MPI.Status()
        if not self.recv_depth:
            handle = self.comm.Improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
            if handle is None:
                return None
            buf = np.empty(self.template.shape, dtype=self.wire)
            handle.Recv(buf)
            return self._message(buf, status)
        req, buf = self._posted[0]
        if not req.Test(status):
            return None
        self._posted.popleft()
        self._post()
        return self._message(buf, status)

    def _message(self, buf: np.ndarray, status: Any) -> Message:
        from mpi4py import MPI

        source, got = status.Get_source(), status.Get_count(MPI.BYTE)
        if got != self._nbytes:  # a longer one fails in MPI (truncation); a shorter one is not ours
            raise RuntimeError(f"pipeline rank {self.rank}: a message of {got} bytes (tag {status.Get_tag()}) "
                               f"from pipeline rank {source}; every message of this step has {self._nbytes}")
        env = decode_tag(status.Get_tag())
        self.journal.received(source, env)
        return Message(env, source, self._to_jax(buf))

    def flush(self) -> None:
        """Wait for this rank's sends (the posted receives stay for the next step)."""
        from mpi4py import MPI

        MPI.Request.Waitall([r for r, _ in self._pending])
        self._pending = []

    def close(self) -> None:
        """Finish the sends, cancel the posted receives, free the communicator (every rank closes)."""
        from mpi4py import MPI

        if self.comm == MPI.COMM_NULL:
            return
        self.flush()
        for req, _ in self._posted:
            req.Cancel()  # a receive that already holds a message completes normally: that message is dropped
        MPI.Request.Waitall([req for req, _ in self._posted])
        self._posted.clear()
        self.comm.Free()
