"""An all-reduce that moves half-precision gradients as half precision (Myelin Sec. IV-B).

Myelin all-reduces "half-precision parameter gradients ... to reduce communication times" (NCCL). MPI
has no bfloat16/float16 type, so :func:`jaxhybrid.parallel.data.allreduce._sum` upcasts to float32
and lets ``MPI_Allreduce`` move twice the bytes. Here the same sum is a reduce-scatter and an all-gather
of ``mpi4jax.sendrecv`` calls in one traced program, the vector cut into ``p`` chunks of ``n / p``:

- reduce-scatter, shifts ``s = 1 .. p-1``: rank ``r`` sends its slice of chunk ``r + s`` to rank ``r + s``
  and receives rank ``r - s``'s slice of chunk ``r``, as ``uint16`` bit patterns;
- rank ``r`` sums the ``p`` slices of chunk ``r`` in float32 in rank order ``0 .. p-1`` and rounds once;
- all-gather, the same shifts: rank ``r`` sends its reduced chunk to ``r + s`` and stores chunk ``r - s``.

Each rank sends ``2 (p - 1) / p`` of the vector in 2-byte elements, where the float32 wire's
reduce-scatter + all-gather sends as many 4-byte ones. Why pairwise shifts and not a ring: a ring adds
each partial sum in the order the chunk travels, which starts at the chunk's own rank, so an element's
rounding would depend on where it sits in the vector. A tied embedding sits at different offsets in the
first and the last stage's vectors, whose two copies must stay bit-identical (``pipeline/tied.py``). Here
every element is the float32 sum in rank order, rounded once, wherever it sits: the same bits in every
replica and every copy, and at two replicas the float32 wire's bits.
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


def half_sum(x: jax.Array, comm: Any) -> jax.Array:
    """Traced: the half-precision 1-D ``x`` summed over ``comm`` with half-precision messages (module
    docstring); every rank gets the same bits."""
    import mpi4jax

    p, r = comm.Get_size(), comm.Get_rank()
    n, dtype = x.shape[0], x.dtype
    c = -(-n // p)
    chunks = jnp.pad(x, (0, c * p - n)).reshape(p, c)

    def shift(s: int, chunk: jax.Array) -> jax.Array:
        """Send ``chunk`` to rank ``r + s``; what rank ``r - s`` sent to this one."""
        got = mpi4jax.sendrecv(jax.lax.bitcast_convert_type(chunk, jnp.uint16), jnp.zeros((c,), jnp.uint16),
                               source=(r - s) % p, dest=(r + s) % p, comm=comm)
        return jax.lax.bitcast_convert_type(got, dtype)

    mine = {r: chunks[r]}  # chunk r's slice from every rank, by rank
    for s in range(1, p):
        mine[(r - s) % p] = shift(s, chunks[(r + s) % p])
    total = mine[0].astype(jnp.float32)
    for q in range(1, p):  # rank order, whatever this rank's place: one rounding, same bits everywhere
        total = total + mine[q].astype(jnp.float32)
    reduced = chunks.at[r].set(total.astype(dtype))
    for s in range(1, p):
        reduced = reduced.at[(r - s) % p].set(shift(s, reduced[r]))
    return reduced.reshape(-1)[:n]
