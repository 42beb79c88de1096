"""MPI driver of the mpi4py transport's pre-posted receives (run by tests/mpi/test_mpi_pipeline.py under
``mpirun -n 2 python -m mpi4py``): two stages, rank 1 sending to rank 0 and back.

- ``landed``: rank 1 sends ``recv_depth`` messages before rank 0 asks for any; rank 0's posted receives
  hold them (``arrived()``, through ``MPI_Request_get_status``) with every probe of its communicator
  made to raise, ``poll`` hands them out in send order without probing, the buffers posted in their
  place take the next round, and the first round's payloads are not overwritten by it.
- ``foreign``: with mpi4py transports posted on the row communicator itself and on ``p2p``, and an mpi4jax
  transport on ``p2p`` (the parity driver keeps both kinds alive), a tag-7 message on the row (as
  tied.py's exchange) and an mpi4jax payload on ``p2p`` reach their own receivers; tied.sum_tied then
  sums the tied gradient right, and the mpi4py transports still carry their own messages.
- ``depth0``: the probe-on-demand path (``recv_depth=0``) moves a round of bfloat16 messages bit-exactly.
Rank 0 prints ``TRANSPORT <case> ok`` per case; an AssertionError ends the job (``python -m mpi4py``).
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxhybrid.core.layout import ParallelDims
from jaxhybrid.model.transformer import TIED_KEY
from jaxhybrid.parallel.pipeline import tied
from jaxhybrid.parallel.pipeline.mpi4py_transport import Mpi4pyTransport
from jaxhybrid.parallel.pipeline.mpi_transport import Mpi4jaxTransport
from jaxhybrid.parallel.pipeline.topology import Topology
from jaxhybrid.parallel.pipeline.transport import Envelope, MsgKind, wait_message

WORLD = MPI.COMM_WORLD
# 1 KiB messages: below every MPI eager limit, so rank 1's sends complete before rank 0 receives.
TEMPLATE = jax.ShapeDtypeStruct((4, 8, 8), jnp.float32)


class NoProbes(MPI.Intracomm):
    """A communicator whose probes raise (mpi4py's ``Dup`` keeps the subclass, so the transport's own
    duplicate raises too)."""

    def _refuse(self, *args, **kwargs):
        raise AssertionError("the transport probed its communicator")

    Improbe = Mprobe = Iprobe = Probe = _refuse


def payload(i: int, dtype=jnp.float32) -> np.ndarray:
    return np.asarray(jnp.full(TEMPLATE.shape, 0.5 + i, dtype) + jnp.arange(TEMPLATE.shape[-1], dtype=dtype))


def quiet_barrier() -> None:
    req = WORLD.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def send_round(t, first: int, count: int, dtype=jnp.float32) -> None:
    for i in range(first, first + count):
        t.send(jnp.asarray(payload(i, dtype)), 0, Envelope(MsgKind.ACT, i, 0))
    t.flush()


def landed(topo: Topology, depth: int) -> None:
    t = Mpi4pyTransport(NoProbes(topo.p2p) if topo.rank == 0 else topo.p2p, TEMPLATE, recv_depth=depth)
    if topo.rank == 1:
        send_round(t, 0, depth)
    quiet_barrier()  # rank 1's sends are done; rank 0 has not polled
    kept = []
    if topo.rank == 0:
        deadline = time.monotonic() + 5
        while t.arrived() < depth and time.monotonic() < deadline:
            time.sleep(1e-3)
        assert t.arrived() == depth, f"{t.arrived()} of {depth} messages landed before the first poll"
        for i in range(depth):
            msg = t.poll()  # no waiting: each is already there
            assert msg is not None and msg.envelope == Envelope(MsgKind.ACT, i, 0) and msg.source == 1, msg
            kept.append(msg.payload)
    quiet_barrier()
    if topo.rank == 1:  # a second round lands in the buffers posted in the first one's place
        send_round(t, depth, depth)
    else:
        for i in range(depth, 2 * depth):
            msg = wait_message(t, timeout=10)
            assert msg is not None and msg.envelope.microbatch == i, msg
            np.testing.assert_array_equal(np.asarray(msg.payload), payload(i))
        for i, x in enumerate(kept):  # a payload's buffer is never posted again
            np.testing.assert_array_equal(np.asarray(x), payload(i))
    t.close()


def foreign(topo: Topology) -> None:
    peer = 1 - topo.rank
    on_row, on_p2p = Mpi4pyTransport(topo.row, TEMPLATE), Mpi4pyTransport(topo.p2p, TEMPLATE)
    device = Mpi4jaxTransport(topo.p2p, TEMPLATE)
    # A tag-7 message on the row, and an mpi4jax payload (tag 0 on p2p): neither is for the posted receives.
    mine = np.full(5, 1.0 + topo.rank, np.float32)
    other = np.empty_like(mine)
    req = topo.row.Isend(mine, dest=peer, tag=tied._TAG)
    if topo.rank == 1:
        device.send(jnp.asarray(payload(7)), 0, Envelope(MsgKind.ACT, 7, 0))
        device.flush()  # an eager payload: sent whoever matches it
    quiet_barrier()
    # Checked before their receivers run, which would wait forever for a swallowed message.
    assert (on_row.arrived(), on_p2p.arrived()) == (0, 0), "a posted receive took another communicator user's message"
    topo.row.Recv(other, source=peer, tag=tied._TAG)
    req.Wait()
    if topo.rank == 0:
        msg = wait_message(device, timeout=30)
        assert msg is not None and msg.envelope.microbatch == 7, msg
        np.testing.assert_array_equal(np.asarray(msg.payload), payload(7))
    np.testing.assert_array_equal(other, np.full(5, 1.0 + peer, np.float32))
    # The real exchange of tied embeddings, with the receives posted on its communicator.
    g = jnp.full((3, 2), 1.0 + topo.rank)
    grads = {"embed": {"wte": g}} if topo.rank == 0 else {TIED_KEY: g}
    out = tied.sum_tied(grads, (0, 1), topo.rank, True, topo.row)
    got = out["embed"]["wte"] if topo.rank == 0 else out[TIED_KEY]
    np.testing.assert_array_equal(np.asarray(got), np.full((3, 2), 3.0, np.float32))
    for t in (on_row, on_p2p):  # and the transports still carry their own messages
        if topo.rank == 1:
            send_round(t, 0, 3)
        else:
            for i in range(3):
                msg = wait_message(t, timeout=10)
                np.testing.assert_array_equal(np.asarray(msg.payload), payload(i))
        t.close()
    device.close()


def depth0(topo: Topology) -> None:
    bf16 = jax.ShapeDtypeStruct(TEMPLATE.shape, jnp.bfloat16)
    t = Mpi4pyTransport(topo.p2p, bf16, recv_depth=0)
    if topo.rank == 1:
        send_round(t, 0, 3, jnp.bfloat16)
    else:
        for i in range(3):
            msg = wait_message(t, timeout=10)
            assert msg is not None and msg.envelope.microbatch == i and msg.payload.dtype == jnp.bfloat16, msg
            np.testing.assert_array_equal(np.asarray(msg.payload).view(np.uint16),
                                          payload(i, jnp.bfloat16).view(np.uint16))
    t.close()


def main() -> None:
    topo = Topology(ParallelDims(pipeline=2, data=1), [(0, 2), (2, 4)])
    for name, case in (("landed depth=2", lambda: landed(topo, 2)), ("landed depth=4", lambda: landed(topo, 4)),
                       ("foreign", lambda: foreign(topo)), ("depth0", lambda: depth0(topo))):
        case()
        quiet_barrier()
        if topo.rank == 0:
            print(f"TRANSPORT {name} ok", flush=True)
    topo.free()


if __name__ == "__main__":
    main()
