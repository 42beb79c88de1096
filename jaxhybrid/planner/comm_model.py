"""AxoNN's communication model (AxoNN-4D Sec. V, eqs. 1-9) with its bandwidth hierarchy.

Ring collectives without latency (Assumptions 1 and 3):

* eq. 1  all-reduce      t = 2/beta * (p-1)/p * buff
* eq. 2  reduce-scatter  t = 1/beta * (p-1)/p * buff   (buff = the full input on each GPU)
* eq. 3  all-gather      t = 1/beta * (p-1) * buff     (buff = the shard each GPU contributes)

For one fully-connected layer ``Y = X W`` with ``X: m x k``, ``W: k x n`` on a ``G_c x G_r x G_d`` tensor
grid and ``G_data`` replicas (Agarwal's 3D algorithm as modified by AxoNN, Alg. 1):

* eq. 4  forward all-gather of the weight shard over depth: buff = kn / (G_c G_r G_d), p = G_d
* eq. 5  backward reduce-scatter of the weight gradient over depth: buff = kn / (G_c G_r), p = G_d
* eq. 6  forward all-reduce of partial outputs over row: buff = mn / (G_d G_c), p = G_r
* eq. 7  backward all-reduce of input gradients over column: buff = mk / (G_d G_r), p = G_c
* eq. 8  data-parallel all-reduce of the local weight-gradient shard: buff = kn / (G_c G_r G_d), p = G_data
  (the paper's printed eq. 8 reads ``mk``; its text and Alg. 1 say the weight shard ``kn``, used here)
* eq. 9  the layer's time is the sum of eqs. 4-8.

A layer transposed by optimization A (Sec. IV-A) swaps G_r and G_c, and with them the groups (and thus the
bandwidths) of eqs. 6 and 7. Bandwidths follow Sec. V's hierarchy: column innermost, then row, depth, data.
A group whose ranks all lie in one node uses an intra-node bandwidth from the hardware file; otherwise
``beta_inter / min(cumulative product of the inner group sizes, GPUs per node)``.
"""
from __future__ import annotations

from dataclasses import dataclass

AXES = ("col", "row", "depth", "data")  # innermost first (AxoNN Sec. V)


@dataclass(frozen=True)
class Collective:
    """One collective of a layer.

    Attributes:
      op: ``all_gather`` | ``reduce_scatter`` | ``all_reduce``.
      axis: the process group it runs on (one of :data:`AXES`).
      group_size: p, the number of ranks in that group.
      buffer_elems: the per-GPU buffer of eqs. 1-3 (for an all-gather: the shard each GPU contributes;
        for a reduce-scatter / all-reduce: the full input on each GPU). This is the operand size of the
        collective in compiled HLO.
      wire_elems: elements each GPU sends in the ring: eq.'s factor times the buffer (0 when p = 1).
      equation: the AxoNN equation number.
    """

    op: str
    axis: str
    group_size: int
    buffer_elems: float
    wire_elems: float
    equation: int


def _factor(op: str, p: int) -> float:
    """Ring volume factor of eqs. 1-3 (times the buffer, over the bandwidth)."""
    if p <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (p - 1) / p
    if op == "reduce_scatter":
        return (p - 1) / p
    if op == "all_gather":
        return float(p - 1)
    raise ValueError(f"unknown collective op {op!r}; choose all_reduce, reduce_scatter or all_gather")


def _check_sizes(**sizes: int) -> None:
    bad = {k: v for k, v in sizes.items() if not (isinstance(v, (int, float)) and v >= 1)}
    if bad:
        raise ValueError(f"comm model sizes must be >= 1, got {bad}")


def layer_comm_volumes(m_rows: int, k: int, n: int, G_c: int, G_r: int, G_d: int, G_data: int = 1,
                       transposed: bool = False) -> dict[str, Collective]:
    """Per-GPU collective volumes of one FC layer ``(m x k) @ (k x n)``, AxoNN eqs. 4-8.

    Args:
      m_rows: rows of X (tokens of one microbatch: batch x sequence) before any sharding.
      k, n: input and output features of the layer.
      G_c, G_r, G_d: the tensor grid (column, row, depth).
      G_data: data-parallel replicas (eq. 8).
      transposed: the layer is stored transposed (optimization A): G_r and G_c swap, and so do the
        groups of eqs. 6 and 7.

    Returns:
      ``{"all_gather": eq4, "reduce_scatter": eq5, "all_reduce_fwd": eq6, "all_reduce_bwd": eq7,
      "all_reduce_data": eq8}`` as :class:`Collective` (element counts; multiply by the dtype size).
    """
    _check_sizes(m_rows=m_rows, k=k, n=n, G_c=G_c, G_r=G_r, G_d=G_d, G_data=G_data)
    gc, gr, col, row = (G_r, G_c, "row", "col") if transposed else (G_c, G_r, "col", "row")
    shard = k * n / (gc * gr * G_d)
    specs = {
        "all_gather": ("all_gather", "depth", G_d, shard, 4),
        "reduce_scatter": ("reduce_scatter", "depth", G_d, k * n / (gc * gr), 5),
        "all_reduce_fwd": ("all_reduce", row, gr, m_rows * n / (G_d * gc), 6),
        "all_reduce_bwd": ("all_reduce", col, gc, m_rows * k / (G_d * gr), 7),
        "all_reduce_data": ("all_reduce", "data", G_data, shard, 8),
    }
    return {name: Collective(op, axis, p, buf, _factor(op, p) * buf, eq)
            for name, (op, axis, p, buf, eq) in specs.items()}


@dataclass(frozen=True)
class Network:
    """Bandwidths of a machine, bytes/s per direction.

    Attributes:
      gpus_per_node: GPUs (or GCDs) in one node.
      intra_node: ``((span, bandwidth), ...)`` sorted by span: a ring whose members all lie within an
        aligned block of ``span`` consecutive GPUs of one node gets ``bandwidth`` (AxoNN's "offline
        database of pre-profiled results", here from public specifications).
      inter_node: beta_inter, the bandwidth between two nodes (Assumption 5).
      host_to_device: host <-> device copy bandwidth (offloaded optimizer).
    """

    gpus_per_node: int
    intra_node: tuple[tuple[int, float], ...]
    inter_node: float
    host_to_device: float = 0.0

    @classmethod
    def from_hardware(cls, hw: dict, gpus_per_node: int | None = None) -> "Network":
        """Build from a ``configs/hardware/*.yaml`` mapping (see :mod:`jaxhybrid.planner.costs`)."""
        bw = hw.get("bandwidth")
        name = hw.get("name", "?")
        if not isinstance(bw, dict) or "inter_node" not in bw or "intra_node" not in bw:
            raise ValueError(f"hardware {name!r} has no bandwidth.intra_node / bandwidth.inter_node keys; "
                             f"add them (bytes/s) to its configs/hardware file")
        intra = tuple(sorted((int(e["span"]), float(e["bytes_per_s"])) for e in bw["intra_node"]))
        gpn = int(gpus_per_node or hw.get("gpus_per_node", 1))
        return cls(gpn, intra, float(bw["inter_node"]), float(bw.get("host_to_device", 0.0)))

    def intra_bandwidth(self, span: int) -> float:
        for s, b in self.intra_node:
            if span <= s:
                return b
        return self.intra_node[-1][1] if self.intra_node else self.inter_node


def group_bandwidths(net: Network, G_c: int, G_r: int, G_d: int, G_data: int = 1) -> dict[str, float]:
    """Bandwidth of each process group in AxoNN's hierarchy (Sec. V, Figs. 4-5).

    The group at a level has stride ``cp_inner`` (product of the inner sizes) and spans
    ``cp_inner * p`` consecutive GPUs. If that block lies in one node (it is at most, and divides, the
    GPUs per node) the intra-node table is used; otherwise ``beta_inter / min(cp_inner, gpus_per_node)``:
    ``cp_inner`` rings contend for the links between two nodes, and at most ``gpus_per_node`` can cross.
    """
    sizes = {"col": G_c, "row": G_r, "depth": G_d, "data": G_data}
    _check_sizes(**sizes)
    out, cp = {}, 1
    gpn = net.gpus_per_node
    for axis in AXES:
        p = sizes[axis]
        span = cp * p
        if span <= gpn and gpn % span == 0:
            out[axis] = net.intra_bandwidth(span)
        else:
            out[axis] = net.inter_node / min(cp, gpn)
        cp *= p
    return out


def comm_time(volumes: dict[str, Collective], bandwidths: dict[str, float], bytes_per_elem: float = 2.0,
              ) -> dict[str, float]:
    """Seconds per collective and their sum (AxoNN eq. 9): ``wire bytes / group bandwidth``.

    Returns the same keys as ``volumes`` plus ``"total"``.
    """
    out = {}
    for name, c in volumes.items():
        out[name] = 0.0 if c.wire_elems == 0 else c.wire_elems * bytes_per_elem / bandwidths[c.axis]
    out["total"] = sum(out.values())
    return out


def layer_comm_time(m_rows: int, k: int, n: int, G_c: int, G_r: int, G_d: int, G_data: int, net: Network,
                    transposed: bool = False, bytes_per_elem: float = 2.0) -> dict[str, float]:
    """Eq. 9 for one layer with the hierarchy's bandwidths: seconds per collective and ``"total"``."""
    vols = layer_comm_volumes(m_rows, k, n, G_c, G_r, G_d, G_data, transposed)
    return comm_time(vols, group_bandwidths(net, G_c, G_r, G_d, G_data), bytes_per_elem)
