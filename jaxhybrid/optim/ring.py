"""A ring all-reduce that moves half-precision gradients as half precision (Myelin Sec. IV-B).

Myelin all-reduces "half-precision parameter gradients ... to reduce communication times" (NCCL). MPI
has no bfloat16/float16 type (facts.md), so :func:`jaxhybrid.optim.allreduce._sum` upcasts to float32
and lets ``MPI_Allreduce`` move twice the bytes. Here the same sum is a ring of ``mpi4jax.sendrecv``
calls in one traced program: a reduce-scatter of ``p - 1`` steps, each sending one ``n / p`` chunk to the
right neighbour as ``uint16`` bit patterns and adding the chunk from the left in float32, rounded back to
the half dtype, then an all-gather of ``p - 1`` steps. Each rank sends ``2 (p - 1) / p`` of the vector
in 2-byte elements, where the float32 path's reduce-scatter + all-gather sends the same count in 4-byte
elements.

Rounding: each partial sum is rounded to the half dtype before it travels, as in NCCL's half-precision
all-reduce. With two replicas there is one rounding of the float32 sum, bit-identical to the float32
path; with more, a chunk's sum is rounded ``p - 1`` times. Every rank ends with the owner's reduced
chunks, so all replicas hold the same bits.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# sendrecv counts are C ints: a chunk of more uint16 elements takes the float32 path instead.
MAX_CHUNK = (1 << 31) - 1


def fits(n: int, p: int) -> bool:
    """Whether a vector of ``n`` elements over ``p`` ranks has chunks that one sendrecv can carry."""
    return -(-n // p) <= MAX_CHUNK


def half_ring_sum(x: jax.Array, comm: Any) -> jax.Array:
    """Traced: the half-precision 1-D ``x`` summed over ``comm`` with half-precision messages.

    Rank ``r`` sends to ``r + 1`` and receives from ``r - 1``. Reduce-scatter step ``k`` sends chunk
    ``r - k`` and adds the received chunk ``r - k - 1``, so after ``p - 1`` steps rank ``r`` owns the full
    sum of chunk ``r + 1``; all-gather step ``k`` forwards chunk ``r + 1 - k`` and stores chunk ``r - k``.
    """
    import mpi4jax

    p, r = comm.Get_size(), comm.Get_rank()
    n, dtype = x.shape[0], x.dtype
    c = -(-n // p)
    chunks = jnp.pad(x, (0, c * p - n)).reshape(p, c)
    right, left = (r + 1) % p, (r - 1) % p
    wire = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)  # noqa: E731  (MPI has no half types)

    def shift(chunk: jax.Array) -> jax.Array:
        got = mpi4jax.sendrecv(wire(chunk), jnp.zeros((c,), jnp.uint16), source=left, dest=right, comm=comm)
        return jax.lax.bitcast_convert_type(got, dtype)

    for k in range(p - 1):
        send, into = (r - k) % p, (r - k - 1) % p
        got = shift(chunks[send])
        chunks = chunks.at[into].set((chunks[into].astype(jnp.float32) + got.astype(jnp.float32)).astype(dtype))
    for k in range(p - 1):
        send, into = (r + 1 - k) % p, (r - k) % p
        chunks = chunks.at[into].set(shift(chunks[send]))
    return chunks.reshape(-1)[:n]
