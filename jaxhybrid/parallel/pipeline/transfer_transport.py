"""Stage messages pulled through JAX's transfer server (``pipeline.transport: transfer``).

``jax.experimental.transfer`` gives every process a server from which a peer pulls arrays into its own
device buffers, with no collective. The bytes still cross host memory: the sender's runtime copies the
payload in chunks into pinned host memory and streams them over TCP, and the receiver's writes them into a
device buffer (XLA's socket transfer, built for TPU slices over the data-centre network; there is no
device-to-device path). What it saves against the mpi4jax transport is the sender's blocking copy: those
copies run on the runtime's threads, chunk by chunk, beside the event loop.
:meth:`TransferTransport.send` registers the payload under a fresh id with ``await_pull`` (it returns at
once, keeping a reference until the peer has pulled) and sends a 4-int header (kind, microbatch, stage, id)
on an mpi4py communicator of its own; :meth:`TransferTransport.poll` probes for a header and pulls the
payload it names, laid out as the receiving stage's activation (its device, or its tensor mesh).

Why it cannot deadlock where a device-side ``mpi4jax.send`` did (:mod:`~jaxhybrid.parallel.pipeline.mpi_transport`):
a send is two non-blocking calls, so two neighbours sending to each other at once both return to their
loops, and a pull is served by the sender's server threads whatever its loop is doing. Nor does it hold
the device the way a collective program on the two neighbours' mesh would: XLA runs a process's programs
in order, and one waiting for its peer would stall every kernel queued behind it. Headers of one source
arrive in the order they were sent (MPI's order on one communicator and tag), and each names its own id,
so the order of pulls does not matter.
"""
from __future__ import annotations

import itertools
import socket
from typing import Any

import jax
import numpy as np

from jaxhybrid.parallel.pipeline.mpi_transport import MpiTransportBase
from jaxhybrid.parallel.pipeline.transport import Envelope, Message


def _host_address() -> str:
    """This node's address as its peers reach it: the hostname's, else loopback (one machine)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class TransferTransport(MpiTransportBase):
    """Payloads pulled into device buffers through ``jax.experimental.transfer``; headers over mpi4py.

    Args:
      comm: the pipeline row's communicator; building the transport is collective on it (the servers'
        addresses are exchanged).
      template: payload shape and dtype (any dtype: bytes move as they are).
      sharding: the payloads' layout on this rank's tensor mesh, or None (this process's first device).
    """

    def __init__(self, comm: Any, template: jax.ShapeDtypeStruct, sharding: Any = None):
        from jax.experimental import transfer

        super().__init__(comm, template, sharding)
        device = self.home or jax.local_devices()[0]
        host = _host_address()
        self.server = transfer.start_transfer_server(device.client, f"{host}:0", [f"{host}:0"])
        self.addresses = comm.allgather(self.server.address())
        self.header_comm = comm.Dup()
        self._spec = jax.ShapeDtypeStruct(template.shape, template.dtype,
                                          sharding=sharding or jax.sharding.SingleDeviceSharding(device))
        self._ids = itertools.count()
        self._conns: dict[int, Any] = {}
        self._sends: list[tuple[Any, np.ndarray]] = []  # header requests and their buffers, until flushed

    def _connection(self, source: int) -> Any:
        if source not in self._conns:
            self._conns[source] = self.server.connect(self.addresses[source])
        return self._conns[source]

    def send(self, x, dest: int, envelope: Envelope) -> None:
        uid = next(self._ids)
        self.server.await_pull(uid, self._laid_out(x))
        header = np.array([int(envelope.kind), envelope.microbatch, envelope.stage, uid], np.int64)
        self._sends.append((self.header_comm.Isend(header, dest=dest, tag=0), header))
        self.journal.sent(dest, envelope)

    def poll(self) -> Message | None:
        if (arrived := self._next_header(4, np.int64)) is None:
            return None
        src, env, header = arrived
        payload = self._connection(src).pull(int(header[3]), self._spec)
        self.journal.received(src, env)
        return Message(env, src, payload)

    def flush(self) -> None:
        from mpi4py import MPI

        MPI.Request.Waitall([r for r, _ in self._sends])
        self._sends = []

    def close(self) -> None:
        """Ends the header sends. Not collective: the server goes with this object, and a peer's pull of a payload
        sent here completes asynchronously, so callers close after every peer has used what it received (the
        trainer's step ends in collectives that need it)."""
        self.flush()
        self._conns = {}
        if self.header_comm is not None:
            self.header_comm.Free()
            self.header_comm = None
