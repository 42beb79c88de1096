"""GPT-2 and LLaMA-style decoders as a list of blocks: embedding, N transformer blocks, head + loss.

The model is a sequence of independently-applied Flax modules so that pipeline stages can own any
contiguous slice. Parameters are a flat dict ``{"embed", "block_000", ..., "head"}``. With tied
embeddings the head reads ``params["embed"]["wte"]``; stages that own the head get a copy and the engine
sums the two gradients (Megatron's tied-embedding all-reduce).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxhybrid.core.config.model import REMATS, ModelConfig
from jaxhybrid.model.layers import DEFAULT_OPS, Dense, LayerNorm, Ops, RMSNorm, _init, gelu, rope, swiglu

Array = jax.Array
Params = dict[str, Any]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# The fused qkv kernel's columns (and bias) are grouped per key/value head: for each of the kv_heads groups,
# its n_heads/kv_heads query heads, then its key head, then its value head ([q_g | k_g | v_g], head_dim wide
# each), as Megatron-LM orders them and AxoNN keeps each shard's [q_i | k_i | v_i]. Why: the tensor-parallel
# qkv layer splits its output columns into contiguous blocks over column; with whole groups in each block the
# split into q, k and v is local, where the [q | k | v] order (layout 1) made the compiler move the k and v
# blocks between shards (a third of a small model's tensor-parallel bytes). Checkpoints and exports record it.
PARAM_LAYOUT = 2


def qkv_groups(c: ModelConfig) -> tuple[int, int, int]:
    """The fused qkv output's last axis (and its bias) as PARAM_LAYOUT groups it: (kv_heads, query heads per
    kv head + 2, head_dim); along the middle axis the queries, then the key (-2), then the value (-1)."""
    return c.kv_heads, c.n_heads // c.kv_heads + 2, c.head_dim


class Embed(nn.Module):
    cfg: ModelConfig
    ops: Any
    dtype: Any

    @nn.compact
    def __call__(self, tokens: Array) -> Array:
        c = self.cfg
        wte = self.param("wte", _init(c.init_std), (c.vocab_size, c.d_model), jnp.float32)
        h = self.ops.embed(tokens, wte.astype(self.dtype))
        if c.kind == "gpt2":
            wpe = self.param("wpe", _init(0.01), (c.max_seq_len, c.d_model), jnp.float32)
            h = h + wpe[: tokens.shape[1]].astype(self.dtype)[None]
        return h


class Block(nn.Module):
    """Pre-norm decoder block. gpt2: LayerNorm, fused qkv with biases, GELU MLP.
    llama: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, no biases."""

    cfg: ModelConfig
    ops: Any
    dtype: Any
    out_std: float = 0.02

    @nn.compact
    def __call__(self, x: Array) -> Array:
        c, ops, dt = self.cfg, self.ops, self.dtype
        gpt = c.kind == "gpt2"
        norm = (lambda n: LayerNorm(ops, c.norm_eps, name=n)) if gpt else (lambda n: RMSNorm(ops, c.norm_eps, name=n))
        b, t, _ = x.shape
        hd, nh, nkv = c.head_dim, c.n_heads, c.kv_heads
        h = norm("ln_attn")(x)
        qkv = Dense(hd * (nh + 2 * nkv), ops, "attn.qkv", gpt, dt, c.init_std, name="qkv")(h)
        qkv = qkv.reshape(b, t, *qkv_groups(c))
        q, k, v = qkv[:, :, :, :-2].reshape(b, t, nh, hd), qkv[:, :, :, -2], qkv[:, :, :, -1]
        if not gpt:
            q, k = rope(q, c.rope_theta), rope(k, c.rope_theta)
        a = ops.attention(q, k, v, c.attention).reshape(b, t, nh * hd)
        x = x + Dense(c.d_model, ops, "attn.out", gpt, dt, self.out_std, name="attn_out")(a)
        h = norm("ln_mlp")(x)
        if gpt:
            u = Dense(c.d_ff, ops, "mlp.up", True, dt, c.init_std, name="mlp_up")(h)
            u = gelu(u)
        else:
            g = Dense(c.d_ff, ops, "mlp.gate", False, dt, c.init_std, name="mlp_gate")(h)
            u = Dense(c.d_ff, ops, "mlp.up", False, dt, c.init_std, name="mlp_up")(h)
            u = swiglu(g, u)
        return x + Dense(c.d_model, ops, "mlp.down", gpt, dt, self.out_std, name="mlp_down")(u)


class Head(nn.Module):
    """Final norm, vocabulary projection and mean next-token loss."""

    cfg: ModelConfig
    ops: Any
    dtype: Any

    @nn.compact
    def __call__(self, h: Array, targets: Array, wte: Array | None = None) -> Array:
        c = self.cfg
        h = (LayerNorm(self.ops, c.norm_eps, name="ln_f") if c.kind == "gpt2"
             else RMSNorm(self.ops, c.norm_eps, name="ln_f"))(h)
        if c.tie_embeddings:
            kernel = wte
        else:
            kernel = self.param("kernel", _init(c.init_std), (c.d_model, c.vocab_size), jnp.float32)
        logits = self.ops.logits(h.astype(self.dtype), kernel.astype(self.dtype), table=c.tie_embeddings)
        return self.ops.cross_entropy(logits, targets)


def block_name(i: int) -> str:
    return f"block_{i:03d}"


@dataclasses.dataclass(frozen=True)
class Model:
    """The whole decoder as ``embed -> blocks -> head``; every piece applies on its own params.

    Attributes:
      cfg: hyper-parameters.
      ops: the injected ops object (default: single-device reference).
      compute_dtype: dtype of activations and matmuls; params stay float32 masters.
    """

    cfg: ModelConfig
    ops: Ops = DEFAULT_OPS
    compute_dtype: str = "float32"

    @property
    def dtype(self):
        return DTYPES[self.compute_dtype]

    @property
    def embed(self) -> Embed:
        return Embed(self.cfg, self.ops, self.dtype)

    @property
    def block(self) -> Block:
        # GPT-2's residual-projection scaling: std / sqrt(2 N).
        return Block(self.cfg, self.ops, self.dtype, out_std=self.cfg.init_std / (2 * self.cfg.n_layers) ** 0.5)

    @property
    def head(self) -> Head:
        return Head(self.cfg, self.ops, self.dtype)

    @property
    def names(self) -> list[str]:
        return ["embed"] + [block_name(i) for i in range(self.cfg.n_layers)] + ["head"]

    def init(self, rng: Array, seq_len: int | None = None, parts=None) -> Params:
        """Float32 parameters, each block from its own folded key (layout-independent init).

        ``parts``: the names (``embed``, ``block_XXX``, ``head``) to materialise, default all. A pipeline
        rank asks only for its stage's parts, so it never holds the whole model (a 7B model is 28 GB of
        float32); the values are those of the whole-model init because every part has its own key. With
        tied embeddings ``head`` also brings ``embed`` (the head's table). Always traced with the
        reference ops: the values do not depend on the layout, whose placement is the caller's jit
        ``out_shardings`` (a sharded op would also need a full batch for its mesh)."""
        if self.ops != DEFAULT_OPS:
            return dataclasses.replace(self, ops=DEFAULT_OPS).init(rng, seq_len, parts)
        return _assemble(self, parts, lambda kind, _, index, wte: _init_part(self, kind, rng, index, wte, seq_len))

    def abstract_params(self, seq_len: int = 8) -> Params:
        """Shapes only, for planning models too large to materialise (``jax.eval_shape``)."""
        return jax.eval_shape(lambda: self.init(jax.random.key(0), seq_len))

    def cast_matrices(self, params: Params) -> Params:
        """``params`` with every matrix (embedding tables, kernels) in the compute dtype and the vectors
        (norm scales, biases) as they are. The layers cast each matrix to the compute dtype where they use
        it, so the model computes exactly the same on this copy; the 2BP forward differentiates it so that
        the casts are inputs of its vjp, not intermediates kept per microbatch (``model.stage_kernels``)."""
        return jax.tree.map(lambda v: v.astype(self.dtype) if v.ndim >= 2 and v.dtype != self.dtype else v, params)

    def apply_embed(self, p: Params, tokens: Array) -> Array:
        return self.embed.apply({"params": p}, tokens)

    def apply_block(self, p: Params, x: Array) -> Array:
        return self.block.apply({"params": p}, x)

    def apply_head(self, p: Params, h: Array, targets: Array, wte: Array | None = None) -> Array:
        return self.head.apply({"params": p} if p else {}, h, targets, wte)

    def apply_blocks(self, ps: list[Params], h: Array, remat: Callable[[Callable], Callable] | None = None,
                     interval: int = 1) -> Array:
        """Blocks in order. With ``remat``, each segment of ``interval`` blocks is checkpointed as one
        unit: only segment inputs stay alive (Myelin Sec. V-A's S_ckp with ac = interval)."""
        def segment(seg_ps, x):
            for p in seg_ps:
                x = self.apply_block(p, x)
            return x

        step = max(1, interval) if remat else len(ps) or 1
        seg = remat(segment) if remat else segment
        for i in range(0, len(ps), step):
            h = seg(ps[i:i + step], h)
        return h

    def loss(self, params: Params, tokens: Array, targets: Array,
             remat: Callable[[Callable], Callable] | None = None, interval: int = 1) -> Array:
        """Mean next-token loss of the whole model; ``remat`` checkpoints segments of ``interval`` blocks."""
        h = self.apply_embed(params["embed"], tokens)
        h = self.apply_blocks([params[block_name(i)] for i in range(self.cfg.n_layers)], h, remat, interval)
        wte = params["embed"]["wte"] if self.cfg.tie_embeddings else None
        return self.apply_head(params["head"], h, targets, wte)


def _assemble(model: Model, parts, make: Callable[..., Params]) -> Params:
    """The params of ``parts`` (default all; a tied head brings the embedding, its table), each from
    ``make(kind, name, index, wte)``: the one walk over the parts that ``Model.init`` and
    :func:`compiled_init` share, with the keys' indices of :func:`_init_part`."""
    c = model.cfg
    want = set(model.names if parts is None else parts)
    unknown = want - set(model.names)
    if unknown:
        raise ValueError(f"Model.init parts {sorted(unknown)} are not among embed, block_000..."
                         f"{block_name(c.n_layers - 1)}, head")
    params: Params = {}
    if "embed" in want or ("head" in want and c.tie_embeddings):
        params["embed"] = make("embed", "embed", 0, None)
    for i in range(c.n_layers):
        if block_name(i) in want:
            params[block_name(i)] = make("block", block_name(i), i + 1, None)
    if "head" in want:
        params["head"] = make("head", "head", c.n_layers + 1, params["embed"]["wte"] if c.tie_embeddings else None)
    return params


def _init_part(model: Model, kind: str, rng: Array, index, wte: Array | None = None,
               seq_len: int | None = None) -> Params:
    """One part's float32 params (``kind``: embed, block or head) from its own key ``fold_in(rng, index)``:
    embed 0, block i at i + 1, head n_layers + 1. ``wte``: the tied head's table."""
    c = model.cfg
    key = jax.random.fold_in(rng, index)
    t = seq_len or min(c.max_seq_len, 8)
    tok = jnp.zeros((1, t), jnp.int32)
    x = jnp.zeros((1, t, c.d_model), model.dtype)
    if kind == "embed":
        return model.embed.init(key, tok)["params"]
    if kind == "block":
        return model.block.init(key, x)["params"]
    return model.head.init(key, x, tok, wte).get("params", {})


_INIT_PROGRAMS: dict = {}  # compiled_init's programs by (model, kind, output shardings)


def compiled_init(model: Model, rng: Array, parts=None, out_shardings: dict | None = None) -> Params:
    """``model.init(rng, None, parts)`` computed by one compiled program per kind of part, bit-identical to
    the jitted ``Model.init`` (test_model).

    A block's program takes the block's index as an argument: every block of the model, every stage and
    every engine of the process share one program (and the persistent compilation cache one entry), where
    a jitted ``Model.init`` holds each block's random initialisers (threefry, the costliest part of its
    compile) once per block, a program that grows with the depth. ``out_shardings``: {part name: that
    part's pytree of shardings}, each part placed as it is computed (jit ``out_shardings``); a part not
    named goes to the default device."""
    if model.ops != DEFAULT_OPS:
        model = dataclasses.replace(model, ops=DEFAULT_OPS)
    placed = out_shardings or {}

    def run(kind: str, name: str, index: int, wte: Array | None) -> Params:
        leaves, tree = jax.tree.flatten(placed.get(name))
        key = (model, kind, tree, tuple(leaves))
        if key not in _INIT_PROGRAMS:
            fn = functools.partial(_init_part, model, kind)
            _INIT_PROGRAMS[key] = jax.jit(fn, out_shardings=placed.get(name))
        return _INIT_PROGRAMS[key](rng, jnp.int32(index), wte)  # the index traced: one program per kind

    return _assemble(model, parts, run)


def remat_policy(name: str, also_save: tuple[str, ...] = ()) -> Callable[[Callable], Callable] | None:
    """The whole-model engines' recomputation wrapper of a segment of blocks: none (no wrapper), dots (save
    the matmul outputs), full (save only the segment's input); ``also_save``: checkpoint names saved as
    well (the tensor engine's gathered weights, AxoNN optimization E). Pipeline stages apply their own
    (:mod:`jaxhybrid.parallel.twobp.residuals`)."""
    if name not in REMATS:
        raise ValueError(f"unknown remat policy {name!r}; choose one of {', '.join(REMATS)}")
    if name == "none":
        return None
    cp = jax.checkpoint_policies
    policy = cp.dots_with_no_batch_dims_saveable if name == "dots" else cp.nothing_saveable
    if also_save:
        policy = cp.save_from_both_policies(policy, cp.save_only_these_names(*also_save))
    return lambda f: jax.checkpoint(f, policy=policy)


TIED_KEY = "embed_wte_copy"
