"""Collective bytes read from compiled HLO, and the volumes AxoNN eqs. 4-8 predict for the same program.

The compiled (post-SPMD-partitioning) HLO text of a jitted program lists every collective with its
result shape and ``replica_groups``; a group's members are device positions in the mesh, so the mesh
axes a collective runs over are the coordinates that vary inside one group. The size reported per
collective is the *buffer* of AxoNN eqs. 1-3 (what ``jaxhybrid.planner.comm_model`` calls
``buffer_elems``): the operand each device contributes, i.e. result / p for an all-gather, result x p
for a reduce-scatter and the result for an all-reduce. Groups of one device move nothing and are dropped.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from jaxhybrid.parallel.tensor.mesh import AXES
from jaxhybrid.planner.comm_model import layer_comm_volumes

_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8}
_OPS = {"all-gather": "all_gather", "reduce-scatter": "reduce_scatter", "all-reduce": "all_reduce",
        "all-to-all": "all_to_all", "collective-permute": "collective_permute"}
_LINE = re.compile(r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>all-gather|reduce-scatter|all-reduce|all-to-all|"
                   r"collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_OPNAME = re.compile(r'op_name="([^"]*)"')
# XLA's mesh form (combined all-reduces): replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(0,2,1))
# {'axis_0'}: device ids laid out on the named mesh, one group per value of the axes not in the braces.
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*"
                   r"\{([^}]*)\}")


@dataclass(frozen=True)
class MeasuredCollective:
    """One collective of a compiled program: kind, mesh axes, group size p, buffer bytes, op_name."""

    op: str
    axes: tuple[str, ...]
    group_size: int
    buffer_bytes: int
    op_name: str


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * _BYTES.get(dtype, 4)
    return total


def _mesh_groups(m: re.Match) -> list[list[int]]:
    names = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    sizes = [int(n) for _, n in names]
    ids = np.arange(int(np.prod(sizes)))
    if m.group(2):
        ids = ids.reshape([int(d) for d in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(p) for p in m.group(3).split(",")])
    ids = ids.reshape(sizes)
    grouped = [i for i, (n, _) in enumerate(names) if f"'{n}'" in m.group(4)]
    rest = [i for i in range(len(names)) if i not in grouped]
    size = int(np.prod([sizes[i] for i in grouped]))
    return ids.transpose(rest + grouped).reshape(-1, size).tolist()


def _groups(line: str) -> list[list[int]]:
    m = _MESH.search(line)
    if m:
        return _mesh_groups(m)
    m = _IOTA.search(line)
    if m:
        g, s = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return ids.reshape(g, s).tolist()
    m = _EXPLICIT.search(line)
    if m:
        return [[int(i) for i in grp.split(",") if i] for grp in re.findall(r"\{([\d,]*)\}", m.group(1))]
    if "collective-permute" in line:
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(1) + "}")] if pairs else []
    return []


def _axes(group: list[int], mesh_shape: tuple[int, ...], names=AXES) -> tuple[str, ...]:
    coords = np.array(np.unravel_index(np.asarray(group), mesh_shape)).T
    return tuple(n for i, n in enumerate(names) if len(set(coords[:, i])) > 1)


def collectives(hlo_text: str, mesh_shape: tuple[int, ...]) -> list[MeasuredCollective]:
    """Every collective in compiled HLO text with p > 1 (``mesh_shape``: sizes of data, depth, row, col)."""
    out = []
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if not m or "-done" in line.split("=")[0]:
            continue
        op = _OPS[m.group("op")]
        groups = _groups(line)
        p = len(groups[0]) if groups else 1
        if p <= 1:
            continue
        shape = m.group("shape")
        if shape.startswith("(") and "-start(" in line and op == "all_gather":
            shape = _ARRAY.findall(shape)[-1]  # async all-gather-start returns (operand, result)
            shape = f"{shape[0]}[{shape[1]}]"
        res = _shape_bytes(shape)
        buf = {"all_gather": res // p, "reduce_scatter": res * p}.get(op, res)
        name = _OPNAME.search(line)
        out.append(MeasuredCollective(op, _axes(groups[0], mesh_shape), p, buf, name.group(1) if name else ""))
    return out


def totals(measured: list[MeasuredCollective], scope: str | None = None) -> dict[tuple[str, str], int]:
    """Buffer bytes summed by ``(op, "+".join(axes))``, optionally only ops whose op_name has ``scope``."""
    t: dict[tuple[str, str], int] = defaultdict(int)
    for c in measured:
        if scope is None or scope in c.op_name:
            t[(c.op, "+".join(c.axes))] += c.buffer_bytes
    return dict(t)


def is_tensor_layer_key(key: tuple[str, str]) -> bool:
    """Keys of eqs. 4-7: gathers/scatters over depth and all-reduces over row or column. All-reduces over
    data and/or depth are gradient reductions (eq. 8 and the bias gradients, which eqs. 4-8 do not model)
    that XLA combines across layers into one op, so they cannot be attributed to a single layer."""
    op, ax = key
    return not (op == "all_reduce" and ("data" in ax or "depth" in ax))


def predicted_layer(m_rows: int, k: int, n: int, sizes: dict[str, int], transposed: bool,
                    bytes_per_elem: int = 4) -> dict[tuple[str, str], int]:
    """AxoNN eqs. 4-8 for one layer, keyed like :func:`totals` (collectives with p > 1 only).

    ``m_rows`` is the rows of X per data replica (tokens of one microbatch / G_data), as in the paper.
    """
    vols = layer_comm_volumes(m_rows, k, n, sizes["col"], sizes["row"], sizes["depth"], sizes["data"],
                              transposed)
    t: dict[tuple[str, str], int] = defaultdict(int)
    for c in vols.values():
        if c.group_size > 1:
            t[(c.op, c.axis)] += int(round(c.buffer_elems * bytes_per_elem))
    return dict(t)


def add(*dicts: dict) -> dict:
    out: dict = defaultdict(int)
    for d in dicts:
        for k, v in d.items():
            out[k] += v
    return dict(out)


_START = re.compile(r"%(\S+) = .*?(all-gather|reduce-scatter|all-reduce|collective-permute)-start\(")
_DONE = re.compile(r"(all-gather|reduce-scatter|all-reduce|collective-permute)-done\(.*?%(\S+?)\)")
_COMPUTE = re.compile(r"\s(fusion|dot|convolution|custom-call)\(")


def async_overlap(scheduled_hlo: str) -> list[tuple[str, int]]:
    """For each async collective (``*-start`` .. ``*-done``) in a scheduled module, the number of compute
    instructions (fusions, dots, convolutions, custom calls) the schedule places between the two: > 0 means
    the collective overlaps computation. Compiled HLO is printed in schedule order.

    The CPU backend emits no async collectives (every collective is synchronous), so on CPU this is
    empty; on GPU the latency-hiding scheduler produces the pairs that optimizations B-D rely on.
    """
    open_: dict[str, tuple[str, int]] = {}
    count = 0
    out = []
    for line in scheduled_hlo.splitlines():
        s = _START.search(line)
        if s:
            open_[s.group(1)] = (_OPS[s.group(2)], count)
            continue
        d = _DONE.search(line)
        if d and d.group(2) in open_:
            op, at = open_.pop(d.group(2))
            out.append((op, count - at))
            continue
        if _COMPUTE.search(line):
            count += 1
    return out
