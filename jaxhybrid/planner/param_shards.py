"""Parameters one device holds, leaf by leaf as the trainer shards them (AxoNN Sec. III-B, Alg. 1).

AxoNN's DIVIDE_WEIGHTS splits a layer's weights over G_d x G_r x G_c, but the trainer's layout
(:func:`jaxhybrid.parallel.tensor.sharding.param_spec`) splits only matrices that way: dense biases and norm scales
are split over one axis and held in full over the others, GPT's learned positions over row only. Dividing
a stage's phi by the grid size therefore undercounts a device's parameter state (2.2% for GPT-2 small on
a 2 x 2 x 2 grid, most of it the positions' table held by 4 devices each). Here each leaf of the model's
abstract parameters (``jax.eval_shape``: no arrays) counts the elements of its own shard under that spec,
so phi per device is what the trainer's memory report counts
(:func:`jaxhybrid.optim.memory_report.params_per_device`) and Myelin's Sec. V-B bytes follow from it.
"""
from __future__ import annotations

import functools
import math

from jaxhybrid.core.config.model import ModelConfig
from jaxhybrid.core.config.schema import TensorConfig

__all__ = ["part_params_per_device", "stage_params_per_device"]


@functools.lru_cache(maxsize=64)
def _abstract_parts(cfg: ModelConfig) -> dict:
    """Shapes of the embedding, one block (all blocks are alike) and the head; a tied head brings the
    embedding table, whose copy a last pipeline stage holds under ``TIED_KEY``."""
    import jax

    from jaxhybrid.model.transformer import TIED_KEY, Model, block_name

    tree = jax.eval_shape(lambda: Model(cfg).init(jax.random.key(0), None, ("embed", block_name(0), "head")))
    tied = {TIED_KEY: tree["embed"]["wte"]} if cfg.tie_embeddings else {}
    return {"embed": {"embed": tree["embed"]}, "block": {block_name(0): tree[block_name(0)]},
            "head": {"head": tree["head"]}, "tied_copy": tied}


def _shard_elements(shape: tuple[int, ...], spec, sizes: dict[str, int]) -> int:
    """Elements of the largest shard of an array of ``shape`` under a PartitionSpec; a dimension the
    axes do not divide leaves its fullest device the ceiling (the trainer refuses such a layout anyway,
    :func:`~jaxhybrid.parallel.tensor.sharding.check_layout`, but the planner may still score it)."""
    n = 1
    for i, dim in enumerate(shape):
        ax = spec[i] if i < len(spec) else None
        names = () if ax is None else (ax,) if isinstance(ax, str) else tuple(ax)
        n *= -(-dim // math.prod(sizes[a] for a in names))
    return n


@functools.lru_cache(maxsize=4096)
def part_params_per_device(cfg: ModelConfig, col: int, row: int, depth: int,
                           letters: str = TensorConfig.optimizations) -> dict[str, int]:
    """Elements one device of a ``col x row x depth`` grid holds of the embedding (``embed``), of one
    block (``block``), of the head's own parameters (``head``: its norm, an untied vocabulary projection)
    and of a pipeline's last-stage copy of a tied table (``tied_copy``, 0 when untied). The specs are
    :func:`~jaxhybrid.parallel.tensor.sharding.param_shardings`' on an abstract mesh (optimization A picks which
    axis splits each bias, so ``letters`` matters when row != col). Cached per (model, grid, letters)."""
    import jax
    from jax.sharding import AbstractMesh

    from jaxhybrid.parallel.tensor.mesh import AXES
    from jaxhybrid.parallel.tensor.sharding import param_shardings

    mesh = AbstractMesh((1, depth, row, col), AXES)
    sizes = dict(mesh.shape)
    out = {}
    for part, tree in _abstract_parts(cfg).items():
        shardings = param_shardings(tree, mesh, letters)
        out[part] = sum(_shard_elements(x.shape, s.spec, sizes)
                        for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))
    return out


def stage_params_per_device(cfg: ModelConfig, parts: tuple[int, ...], col: int = 1, row: int = 1, depth: int = 1,
                            letters: str = TensorConfig.optimizations) -> list[int]:
    """Elements one device of each pipeline stage holds, stage s having ``parts[s]`` blocks: the first adds
    the embedding, the last the head, and with more than one stage a tied table's copy (Megatron's, as
    :class:`~jaxhybrid.parallel.twobp.stage.Stage` keeps it; one stage reads the embedding's own)."""
    c = part_params_per_device(cfg, col, row, depth, letters)
    out = [n * c["block"] for n in parts]
    out[0] += c["embed"]
    out[-1] += c["head"] + (c["tied_copy"] if len(parts) > 1 else 0)
    return out
