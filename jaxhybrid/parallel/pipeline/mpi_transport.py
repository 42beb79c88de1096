"""MPI transports for the pipeline event loop (see :mod:`jaxhybrid.parallel.pipeline.transport`).

Both send bfloat16/float16 payloads as uint16 bit patterns (MPI has no such types) and rebuild them
bit-exactly on arrival. Every message of one step has the shape and dtype of ``template`` (the
activation between stages: ``[mb, seq, d_model]`` in the compute dtype).

:class:`Mpi4jaxTransport` receives into a device buffer with ``mpi4jax.recv`` inside cached ``jax.jit``
functions (eager mpi4jax recompiles on every call), and only once ``Iprobe`` has seen the 3-int header
sent just before the payload, so it never waits for a message not yet sent. mpi4jax has no non-blocking
receive, so it cannot post receives ahead as Myelin Sec. IV-A does; ``Mpi4pyTransport``
(:mod:`jaxhybrid.parallel.pipeline.mpi4py_transport`) does, through host numpy buffers and ``Isend``.

Sends leave on a sender thread with a blocking ``MPI_Send`` of mpi4py, header first, not with
``mpi4jax.send``. Why: mpi4jax's calls carry an ordered effect (JAX runs a rank's MPI programs in dispatch
order) and mpi4jax has no non-blocking send, so two neighbours sending to each other above MPI's eager
limit each queue their receive behind their own blocked send and the pipeline hangs; on XLA:CPU a rank
pinned to one core also runs such programs on its one worker thread, which a blocked call stalls. With
the payload written before its header leaves, every receive a rank starts has its sender already in
``MPI_Send``, so receives always complete; the receive program holds the MPI call alone (the half-float
bitcast runs apart), so it runs inline on the main thread.

What MPI sends is the payload's own buffer where MPI can read it (``launch_env.mpi_reads``): host memory
on the CPU, and GPU memory with a CUDA-aware MPI (``MPI4JAX_USE_CUDA_MPI=1``, under which mpi4jax's
receives land in device memory too: device to device both ways, Myelin's CUDA-aware MPI). Elsewhere it is
copied to the host first.

With tensor parallelism (AxoNN 4D) a stage's activations are sharded over the rank's local mesh and
mpi4jax refuses multi-device arrays: given the activation ``sharding``, both transports stage through
host memory (the mpi4jax one receives on the mesh's first device) and lay a received payload out with
that sharding before the next stage's kernels read it.
"""
from __future__ import annotations

import queue
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.core.launch_env import mpi_reads
from jaxhybrid.parallel.pipeline.transport import Envelope, Journal, Message, MsgKind
from jaxhybrid.parallel.twobp.stage_costs import compiled_cost

_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def wire_dtype(dtype: Any) -> Any:
    """The dtype a payload travels as: uint16 for half floats (bit-exact), else itself."""
    return jnp.uint16 if jnp.dtype(dtype) in _HALF else jnp.dtype(dtype)


class MpiTransportBase:
    """What both MPI transports share: the wire dtype, the journal, the payloads' layout."""

    def __init__(self, comm: Any, template: jax.ShapeDtypeStruct, sharding: Any = None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.template = template
        self.wire = wire_dtype(template.dtype)
        self.journal = Journal()
        self._error: BaseException | None = None
        self.sharding = sharding  # multi-device layout of payloads (hybrid pipeline x tensor) or None
        self.home = min(sharding.device_set, key=lambda d: d.id) if sharding is not None else None

    def _laid_out(self, x: jax.Array) -> jax.Array:
        return x if self.sharding is None else jax.device_put(x, self.sharding)

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"pipeline rank {self.rank}: send failed: {self._error!r}") from self._error

    def _next_header(self, length: int, dtype: Any) -> tuple[int, Envelope, np.ndarray] | None:
        """The next header on ``self.header_comm`` (kind, microbatch, stage, then the transport's own
        ints): its source row rank, envelope and ints; None when none has arrived."""
        from mpi4py import MPI

        status = MPI.Status()
        if not self.header_comm.Iprobe(source=MPI.ANY_SOURCE, tag=0, status=status):
            return None
        src = status.Get_source()
        header = np.empty(length, dtype)
        self.header_comm.Recv(header, source=src, tag=0)
        return src, Envelope(MsgKind(int(header[0])), int(header[1]), int(header[2])), header

    def _host_wire(self, x) -> np.ndarray:
        """``x`` as a contiguous host buffer in the wire dtype: waits for ``x``, gathers its shards."""
        buf = np.asarray(x)
        return np.ascontiguousarray(buf if buf.dtype == self.wire else buf.view(np.uint16))

    def _to_jax(self, buf: np.ndarray) -> jax.Array:
        x = buf if self.wire == self.template.dtype else buf.view(np.dtype(self.template.dtype))  # bit-exact
        return jnp.asarray(x) if self.sharding is None else jax.device_put(x, self.sharding)


class Mpi4jaxTransport(MpiTransportBase):
    """mpi4jax payloads in cached jits, a sender thread, and an mpi4py header channel to probe.

    Args:
      comm: the pipeline row's point-to-point communicator (payloads).
      template: payload shape and dtype.
    Header and payload use tag 0 on two communicators; MPI keeps the messages of one (source, tag,
    communicator) in order, so the k-th header from a source names its k-th payload.
    """

    def __init__(self, comm: Any, template: jax.ShapeDtypeStruct, sharding: Any = None):
        super().__init__(comm, template, sharding)
        self.header_comm = comm.Dup()  # collective on the row: every rank builds its transport together
        half, dt = self.wire != template.dtype, template.dtype
        # Half floats arrive as uint16: the bitcast is a program of its own (module docstring).
        self._from_wire = jax.jit(lambda y: jax.lax.bitcast_convert_type(y, dt)) if half else (lambda y: y)
        # One device whose buffers MPI reads in place: sends skip the host copy (module docstring).
        self.in_place = sharding is None and mpi_reads(jax.local_devices()[0].platform)
        if self.in_place:
            from mpi4py.util.dtlib import from_numpy_dtype

            self._wire_type = from_numpy_dtype(np.dtype(self.wire))
        self._sendq: queue.Queue = queue.Queue()
        self._recvs: dict[tuple[int, int], Any] = {}
        self._thread = threading.Thread(target=self._sender, name=f"mpi4jax-sender-{self.rank}", daemon=True)
        self._thread.start()

    # -- cached jitted receives (one per source) --------------------------------------------------------
    def _recv_fn(self, source: int):
        if source not in self._recvs:
            import mpi4jax

            comm, wire, shape = self.comm, self.wire, self.template.shape

            def recv():  # the MPI call alone; the payload is still in the wire dtype
                return mpi4jax.recv(jnp.zeros(shape, wire), source, tag=0, comm=comm)

            # Received on the mesh's first device (mpi4jax moves single-device buffers only).
            home = None if self.home is None else jax.sharding.SingleDeviceSharding(self.home)
            self._recvs[source] = jax.jit(recv, out_shardings=home)
        return self._recvs[source]

    def _in_place(self, x: jax.Array) -> list:
        """MPI's view of ``x``'s own buffer (one device, dense) in the wire dtype, once the kernel writing it
        is done: MPI does not wait on the stream that writes it. ``x`` must outlive the call using it."""
        from mpi4py import MPI

        x.block_until_ready()
        return [MPI.buffer.fromaddress(x.unsafe_buffer_pointer(), x.nbytes), x.size, self._wire_type]

    def recv_flops(self, peer: int) -> float:
        """XLA's flop count of the jitted receive from ``peer``: under XLA:CPU's inline threshold (1000) it
        runs on the calling thread, not on the worker pool (module docstring)."""

        return compiled_cost(self._recv_fn(peer))["flops"]

    def _sender(self) -> None:
        while True:
            item = self._sendq.get()
            try:
                if item is None:
                    return
                x, dest, env = item
                if self._error is None:
                    # The payload is written before its header leaves: a receive the peer starts on that
                    # header finds a sender already in MPI (module docstring).
                    buf = self._in_place(x) if self.in_place else self._host_wire(x)
                    header = np.array([int(env.kind), env.microbatch, env.stage], np.int32)
                    self.header_comm.Send(header, dest=dest, tag=0)
                    self.comm.Send(buf, dest=dest, tag=0)
            except BaseException as e:  # surfaced on the main thread's next poll/flush
                self._error = e
            finally:
                self._sendq.task_done()

    def send(self, x, dest: int, envelope: Envelope) -> None:
        self._raise_pending()
        self.journal.sent(dest, envelope)
        self._sendq.put((x, dest, envelope))

    def poll(self) -> Message | None:
        self._raise_pending()
        if (arrived := self._next_header(3, np.int32)) is None:
            return None
        src, env, _ = arrived
        payload = self._laid_out(self._from_wire(self._recv_fn(src)()))
        self.journal.received(src, env)
        return Message(env, src, payload)

    def flush(self) -> None:
        self._sendq.join()
        self._raise_pending()

    def close(self) -> None:
        self._sendq.put(None)
        self._thread.join(timeout=5)
        if self.header_comm is not None and not self._thread.is_alive():  # a send still stuck uses it
            self.header_comm.Free()
            self.header_comm = None


