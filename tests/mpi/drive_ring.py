"""MPI driver for the half-precision ring all-reduce (run by tests/mpi/test_offload_mpi.py under
``mpirun -n 3 python -m mpi4py``; three ranks so chunks are padded and each sum is rounded twice).

For bfloat16 and float16 vectors of several lengths (shorter than the rank count, not a multiple of it,
a multiple of it), ``allreduce_tree`` and ``iter_reduced_chunks`` with ``half_wire`` must give, on every
rank, exactly the bits of a numpy replay of the ring's order: chunk ``j`` starts as rank ``j``'s slice,
then ranks ``j + 1``, ``j + 2``, ... each add theirs in float32 and round to the half dtype. Rank 0 prints
``CASE ring ok`` or the failure; the exit code is 1 if it failed.
"""
from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxhybrid.optim.allreduce import allreduce_tree, iter_reduced_chunks

WORLD = MPI.COMM_WORLD


def ring_replay(xs: list[np.ndarray], dtype) -> np.ndarray:
    """What the ring computes for the vectors ``xs`` of ranks 0..p-1 (module docstring)."""
    p, n = len(xs), xs[0].shape[0]
    c = -(-n // p)
    out = np.zeros(c * p, dtype)
    for j in range(p):
        lo, hi = j * c, min((j + 1) * c, n)
        acc = xs[j][lo:hi]
        for step in range(1, p):
            acc = (xs[(j + step) % p][lo:hi].astype(np.float32) + acc.astype(np.float32)).astype(dtype)
        out[lo:hi] = acc
    return out[:n]


def check() -> None:
    comm = WORLD.Split(0, WORLD.rank)
    rng = np.random.default_rng(WORLD.rank)
    for dtype in (jnp.bfloat16, jnp.float16):
        for n in (2, 10, 12, 1001):
            x = np.asarray(rng.normal(size=n) * 3.0, dtype)
            xs = comm.allgather(x)
            want = ring_replay(xs, dtype)
            got = np.asarray(allreduce_tree({"g": jnp.asarray(x)}, comm, 4, half_wire=True)["g"])
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (dtype, n, got, want)
            # The streamed path (V-C) reduces chunks of 7: each is a ring of its own.
            chunks = [(s, e, np.asarray(r)) for s, e, r in iter_reduced_chunks(jnp.asarray(x), comm, 7, half_wire=True)]
            assert [(s, e) for s, e, _ in chunks] == [(s, min(s + 7, n)) for s in range(0, n, 7)]
            for s, e, r in chunks:
                assert r.tobytes() == ring_replay([v[s:e] for v in xs], dtype).tobytes(), (dtype, n, s)
            # Every replica holds the same bits (each chunk comes from its one owner).
            assert all(a.tobytes() == got.tobytes() for a in comm.allgather(got)), (dtype, n)
            # Against the float32 sum: p - 1 roundings of a half-precision partial sum at most.
            f32 = [v.astype(np.float32) for v in xs]
            bound = (len(xs) - 1) * float(jnp.finfo(dtype).eps) * np.sum(np.abs(f32), axis=0)
            assert np.all(np.abs(got.astype(np.float32) - np.sum(f32, axis=0)) <= bound), (dtype, n)
    comm.Free()


if __name__ == "__main__":
    from drive_offload import run_cases  # this folder is the script's: on sys.path

    sys.exit(run_cases((("ring", check),)))
