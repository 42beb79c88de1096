"""Where every parameter lives on the 4D mesh, and the divisibility rules checked before any compile.

Memory (AxoNN Sec. III-B: "GPUs along the d axis only store gradients and optimizer states of unique
shards"): every dense kernel, the token embedding (and so the tied vocabulary projection) and an untied
head kernel are split over depth x row x col, so their parameter, gradient and optimizer-state bytes per
device are the total over ``G_d G_r G_c``. Vectors (dense biases, norm scales and shifts) are split over
their feature axis only and replicated over the other tensor axes; GPT's learned positions ``[S, d]`` are
split over row (the stream's feature axis). Those are O(d) or O(S d) and do not grow with the model's
width squared; every copy receives the same reduced gradient, so the copies stay identical.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhybrid.core.config.model import ModelConfig
from jaxhybrid.core.layout import ParallelDims
from jaxhybrid.model.transformer import TIED_KEY
from jaxhybrid.parallel.tensor.linear import NORMAL, Layout
from jaxhybrid.parallel.tensor.mesh import BATCH, COL, ROW
from jaxhybrid.parallel.tensor.ops import EMBED_SPEC, STREAM, TensorOps

MODULE_SITE = {"qkv": "attn.qkv", "attn_out": "attn.out", "mlp_up": "mlp.up", "mlp_gate": "mlp.gate",
               "mlp_down": "mlp.down"}


def dense_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """``site -> (k, n)`` of every dense layer of one block, plus the vocabulary projection."""
    shapes = {"attn.qkv": (c.d_model, c.head_dim * (c.n_heads + 2 * c.kv_heads)),
              "attn.out": (c.d_model, c.d_model), "mlp.up": (c.d_model, c.d_ff)}
    if c.kind == "llama":
        shapes["mlp.gate"] = (c.d_model, c.d_ff)
    shapes["mlp.down"] = (c.d_ff, c.d_model)
    shapes["head.logits"] = (c.d_model, c.vocab_size)
    return shapes


def layout_of(site: str, letters: str) -> Layout:
    return TensorOps(letters=letters).layout(site)


def check_layout(c: ModelConfig, dims: ParallelDims, batch_rows: int, letters: str = "ABCDE") -> None:
    """Raise ValueError naming every size that the mesh cannot split evenly (before any compile).

    Args:
      c: the model.
      dims: the layout; its mesh (:attr:`~jaxhybrid.core.layout.ParallelDims.mesh_shape`) is checked.
      batch_rows: sequences per microbatch over all replicas (split over data x depth).
      letters: optimizations (A changes which axis splits which dim).
    """
    s = dims.mesh_sizes()
    errs = []
    data, depth = dims.data, dims.tensor_depth
    if batch_rows % (data * depth):
        errs.append(f"batch of {batch_rows} sequences per microbatch is not divisible by data({data}) x "
                    f"depth({depth}) = {data * depth} (X's rows are split over both)")
    for site, (k, n) in dense_shapes(c).items():
        lay = NORMAL if site == "head.logits" else layout_of(site, letters)
        gk = s[lay.in_ax] * depth
        if k % gk:
            errs.append(f"layer {site}: input features k={k} not divisible by {lay.in_ax}({s[lay.in_ax]}) x "
                        f"depth({depth}) = {gk} (W's rows are split over both)")
        if n % s[lay.out_ax]:
            errs.append(f"layer {site}: output features n={n} not divisible by {lay.out_ax}({s[lay.out_ax]})")
        if "A" not in letters and site != "head.logits" and n % s[STREAM]:
            errs.append(f"layer {site}: output features n={n} not divisible by row({s[ROW]}) (re-layout "
                        f"without optimization A)")
    if c.d_model % s[STREAM]:
        errs.append(f"model.d_model={c.d_model} not divisible by row({s[ROW]}) (the stream's features)")
    if c.vocab_size % s[COL]:
        errs.append(f"model.vocab_size={c.vocab_size} not divisible by col({s[COL]}) (vocabulary-parallel "
                    f"embedding and loss)")
    if errs:
        raise ValueError("tensor layout: " + "; ".join(dict.fromkeys(errs)) + ". Rule: a dim split over "
                         "mesh axes must be a multiple of the product of their sizes; pick other "
                         "parallel.tensor_* sizes or model dims.")


def run_layout_error(c: ModelConfig, pipeline: int, data: int, depth: int, row: int, col: int, microbatch: int,
                     letters: str = "ABCDE") -> str | None:
    """:func:`check_layout`'s message for the mesh a run builds, None when it fits: with one pipeline stage
    (tensor mode) one (data, depth, row, col) mesh over the replicas' rows, else each pipeline rank's
    (1, depth, row, col) mesh over its own microbatch (``microbatch``: sequences per replica)."""
    mesh_data = data if pipeline == 1 else 1
    try:
        check_layout(c, ParallelDims.from_mesh_shape((mesh_data, depth, row, col)), microbatch * mesh_data, letters)
    except ValueError as e:
        return str(e)
    return None


def param_spec(path: tuple[str, ...], letters: str) -> P:
    """PartitionSpec of one parameter from its path in the flat ``Model.init`` dict."""
    if path[0] == "embed":
        return EMBED_SPEC if path[-1] == "wte" else P(None, STREAM)
    if path[0] == TIED_KEY:  # a last pipeline stage's copy of the tied table: laid out as the table
        return EMBED_SPEC
    if path[0] == "head" and path[-1] == "kernel":
        return NORMAL.w_spec
    if len(path) >= 3 and path[-2] in MODULE_SITE:
        lay = layout_of(MODULE_SITE[path[-2]], letters)
        return lay.w_spec if path[-1] == "kernel" else lay.b_spec
    return P(STREAM)  # norm scale / bias


def param_shardings(params: Any, mesh: Mesh, letters: str) -> Any:
    """A pytree of NamedSharding matching ``params`` (arrays or ShapeDtypeStructs)."""
    def one(path, _):
        keys = tuple(getattr(k, "key", str(k)) for k in path)
        return NamedSharding(mesh, param_spec(keys, letters))

    return jax.tree_util.tree_map_with_path(one, params)


def is_fully_sharded(path: tuple[str, ...]) -> bool:
    """True for the parameters split over depth x row x col (the per-device bytes test)."""
    return path[-1] in ("kernel", "wte", TIED_KEY)


def batch_sharding(mesh: Mesh, ndim: int = 3) -> NamedSharding:
    """Token batches ``[M, rows, seq+1]``: rows over data x depth."""
    return NamedSharding(mesh, P(None, BATCH, *[None] * (ndim - 2)))

