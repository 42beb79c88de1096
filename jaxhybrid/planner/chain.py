"""A layer chain with the prefix sums MadPipe's formulas need (MadPipe Sec. 3 and 4.2.1).

Layers are numbered 1..L as in the paper (profile layer i is chain layer i + 1); a[0] is the input.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxhybrid.planner.costs import Profile


def check_platform(memory: float, bandwidth: float, names: tuple[str, str] = ("memory", "bandwidth")) -> None:
    """M and beta of MadPipe Sec. 3 must be positive (``names``: how the caller spells them)."""
    if not memory > 0 or not bandwidth > 0:
        raise ValueError(f"{names[0]}={memory} and {names[1]}={bandwidth} must be > 0 (bytes, bytes/s)")


def check_processors(processors: int, layers: int, name: str = "processors") -> None:
    """At most one processor per layer: in MadPipe's and PipeDream's allocations (MadPipe Sec. 3-4) every
    processor holds a stage (the special one possibly several) and every stage at least one layer, so a
    chain of L layers can keep at most L processors busy; more would be silently left idle."""
    if processors < 1 or processors > layers:
        raise ValueError(f"{name}={processors} must be in [1, {layers}]: the chain has {layers} layers and each "
                         f"processor needs a stage of at least one layer, so at most {layers} can be used")


@dataclass(frozen=True)
class Chain:
    """Costs of a chain and the platform (memory M per processor, bandwidth beta).

    Attributes:
      u: u_F + u_B per layer, index 1..L (u[0] = 0).
      W: weight bytes per layer, index 1..L.
      a: activation bytes, index 0..L.
      memory: M, bytes per processor.
      bandwidth: beta, bytes/s of every link.
      stored: bytes each layer keeps per microbatch for its backward, index 1..L (stored[0] = 0);
        MadPipe's a_{l-1} unless the profile gives ``stored_bytes``.
    """

    u: np.ndarray
    uF: np.ndarray
    W: np.ndarray
    a: np.ndarray
    memory: float
    bandwidth: float
    stored: np.ndarray

    @classmethod
    def from_profile(cls, profile: Profile, memory: float, bandwidth: float) -> "Chain":
        check_platform(memory, bandwidth)
        uF = np.array([0.0] + [lc.forward_s for lc in profile.layers])
        uB = np.array([0.0] + [lc.backward_s for lc in profile.layers])
        W = np.array([0.0] + [lc.weight_bytes for lc in profile.layers])
        a = np.array([profile.input_bytes] + [lc.activation_bytes for lc in profile.layers])
        stored = np.array([0.0] + [a[i] if lc.stored_bytes is None else lc.stored_bytes
                                   for i, lc in enumerate(profile.layers)])
        return cls(uF + uB, uF, W, a, float(memory), float(bandwidth), stored)

    @property
    def L(self) -> int:
        return len(self.u) - 1

    def U(self, k, l):
        """Total compute of layers k..l (vectorised over numpy arrays of k and l)."""
        s = np.cumsum(self.u)
        return s[l] - s[np.asarray(k) - 1]

    def C(self, k):
        """MadPipe's C(k) = 2 a_k / beta for the boundary after layer k; 0 at the chain ends."""
        k = np.asarray(k)
        c = 2 * self.a[np.clip(k, 0, self.L)] / self.bandwidth
        return np.where((k >= 1) & (k < self.L), c, 0.0)

    def mem(self, k, l, g):
        """MadPipe's M(k, l, g): 3 W_i + g a_{i-1} over the stage (a_{i-1}: ``stored[i]``), plus
        2 (a_{k-1} + a_l) of buffers.

        Buffers are omitted at the chain's ends. Vectorised over broadcastable k, l, g.
        """
        k, l = np.asarray(k), np.asarray(l)
        sw = np.cumsum(self.W)
        ss = np.cumsum(self.stored)
        weights = 3 * (sw[l] - sw[k - 1])
        acts = ss[l] - ss[k - 1]  # stored_k + ... + stored_l (MadPipe: a_{k-1} + ... + a_{l-1})
        buf = 2 * (np.where(k > 1, self.a[k - 1], 0.0) + np.where(l < self.L, self.a[l], 0.0))
        return weights + np.asarray(g) * acts + buf

    def total_period_bound(self) -> float:
        """Algorithm 1's initial upper bound U(1, L) + sum of C."""
        return float(self.u.sum() + self.C(np.arange(1, self.L)).sum())


@dataclass(frozen=True)
class Stage:
    """Layers first..last (1-based, inclusive) on processor ``processor``."""

    first: int
    last: int
    processor: int


def chain_ranks(stages) -> dict[int, int]:
    """``{processor: rank}`` numbering processors as they first appear along the chain (rank 0 holds the
    input layers), the order the engine's ranks take; MadPipe's DP numbers its special processor last
    wherever its layers are."""
    rank: dict[int, int] = {}
    for s in sorted(stages, key=lambda s: s.first):
        rank.setdefault(s.processor, len(rank))
    return rank
