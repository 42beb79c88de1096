"""Model hyper-parameters and the named presets of the four papers.

Presets: tiny CPU models, GPT-2 small (124M), Myelin Table I (12B-100B), AxoNN Table III (GPT 5B-80B)
and 2BP's Transformer-7b (LLaMA-style, context 1024, d_model 4096).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jaxhybrid.core.errors import ConfigError

# Activation recomputation (``train.remat``): none keeps every activation; dots keeps the weighted sites'
# outputs (matmul + bias) and the norms' statistics; full keeps each segment's input (Myelin V-A).
REMATS = ("none", "dots", "full")

@dataclass(frozen=True)
class ModelConfig:
    name: str = "gpt-tiny"  # preset this config started from
    kind: str = "gpt2"  # gpt2 (learned positions, LayerNorm, GELU, biases) | llama (RoPE, SwiGLU, RMSNorm)
    vocab_size: int = 256  # token ids the embedding and the head cover; a dataset's largest id must be below it
    d_model: int = 64  # hidden size: each block's input and output width
    n_layers: int = 4  # transformer blocks (cut into parallel.pipeline x pipeline.virtual_stages stages)
    n_heads: int = 4  # attention (query) heads; d_model must be a multiple of it
    n_kv_heads: int = 0  # grouped-query attention (either kind: one block code path); 0 = n_heads
    d_ff: int = 256  # MLP hidden size (SwiGLU's gate and up projections each, for llama)
    max_seq_len: int = 128  # positions the model covers (gpt2's learned table); data.seq_len must not exceed it
    tie_embeddings: bool = False  # head reuses the token embedding table (GPT-2)
    rope_theta: float = 10000.0  # llama: RoPE's base frequency
    norm_eps: float = 1e-5  # LayerNorm / RMSNorm epsilon
    init_std: float = 0.02  # standard deviation of the normal initialisation of the weights and the token embedding
    attention: str = "auto"  # attention kernel: auto | xla | cudnn (model.attention.attention_kernel)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def validate(self) -> None:
        errs = []
        if self.kind not in ("gpt2", "llama"):
            errs.append(f"model.kind={self.kind!r}; choose gpt2 or llama")
        for k in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            if getattr(self, k) < 1:
                errs.append(f"model.{k}={getattr(self, k)} must be >= 1")
        if self.n_kv_heads < 0:  # -2 would pass n_heads % kv_heads and fail deep inside the model's split
            errs.append(f"model.n_kv_heads={self.n_kv_heads} must be >= 0 (0 = n_heads, multi-head attention)")
        for k in ("norm_eps", "rope_theta", "init_std"):  # they feed sqrt, log and init directly
            if not 0 < getattr(self, k) < math.inf:  # NaN fails too; inf: zero norms, no rotation, inf weights
                errs.append(f"model.{k}={getattr(self, k)} must be > 0 and finite")
        if self.attention not in ("auto", "xla", "cudnn"):
            errs.append(f"model.attention={self.attention!r}; choose auto, xla or cudnn")
        if not errs and self.d_model % self.n_heads:
            errs.append(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}")
        if not errs and self.n_heads % self.kv_heads:
            errs.append(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}")
        if not errs and self.kind == "llama" and self.head_dim % 2:
            errs.append(f"RoPE needs an even head_dim; d_model/n_heads = {self.head_dim}")
        if errs:
            raise ConfigError("; ".join(errs))

    def param_count(self) -> int:
        """Exact parameter count of the model built from this config."""
        d, f, v, L = self.d_model, self.d_ff, self.vocab_size, self.n_layers
        qkv = d + 2 * self.kv_heads * self.head_dim  # 3d without grouped-query attention
        if self.kind == "gpt2":
            block = (d * qkv + qkv) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
            emb = v * d + self.max_seq_len * d
            head = 2 * d + (0 if self.tie_embeddings else v * d)
        else:
            block = d * qkv + d * d + 3 * d * f + 2 * d
            emb = v * d
            head = d + (0 if self.tie_embeddings else v * d)
        return emb + L * block + head


def block_matmuls(cfg: ModelConfig) -> list[tuple[int, int, bool]]:
    """(k, n, transposed) of a block's matmuls in order (qkv: q with its grouped k/v heads, attention out,
    MLP in, MLP out; LLaMA: SwiGLU's gate and up side by side); every second one transposed in AxoNN's
    3D tensor parallelism (optimization A). The flop count (metrics) and the planner read them."""
    d, f = cfg.d_model, cfg.d_ff
    qkv = d + 2 * cfg.kv_heads * cfg.head_dim
    return [(d, qkv, False), (d, d, True), (d, 2 * f if cfg.kind == "llama" else f, False), (f, d, True)]


def _gpt(name, layers, d, heads, vocab=51200, seq=512, tie=True):
    return ModelConfig(name=name, kind="gpt2", vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads,
                       d_ff=4 * d, max_seq_len=seq, tie_embeddings=tie)


PRESETS: dict[str, ModelConfig] = {
    "gpt-tiny": ModelConfig(),
    "llama-tiny": ModelConfig(name="llama-tiny", kind="llama", vocab_size=256, d_model=64, n_layers=4,
                              n_heads=4, n_kv_heads=2, d_ff=192, max_seq_len=128),
    "gpt-small-cpu": ModelConfig(name="gpt-small-cpu", vocab_size=512, d_model=128, n_layers=8, n_heads=4,
                                 d_ff=512, max_seq_len=256),
    # The LLaMA counterpart of gpt-small-cpu (same width, depth, heads and vocabulary; SwiGLU width
    # 2/3 * 4d rounded up to a multiple of 128): CPU benchmarks of both model kinds at one size.
    "llama-small-cpu": ModelConfig(name="llama-small-cpu", kind="llama", vocab_size=512, d_model=128, n_layers=8,
                                   n_heads=4, n_kv_heads=2, d_ff=384, max_seq_len=256),
    "gpt2-small": _gpt("gpt2-small", 12, 768, 12, vocab=50257, seq=1024),
    "gpt2-1.3b": _gpt("gpt2-1.3b", 24, 2048, 16, vocab=50257, seq=1024),
    # Myelin Table I (vocab 51200, sequence 512).
    "myelin-12b": _gpt("myelin-12b", 48, 4512, 24),
    "myelin-24b": _gpt("myelin-24b", 48, 6336, 36),
    "myelin-50b": _gpt("myelin-50b", 96, 6528, 48),
    "myelin-100b": _gpt("myelin-100b", 96, 9360, 60),
    # AxoNN Table III (GPT-style; sequence 2048 as GPT-3).
    "axonn-gpt-5b": _gpt("axonn-gpt-5b", 24, 4096, 32, seq=2048),
    "axonn-gpt-10b": _gpt("axonn-gpt-10b", 32, 5120, 40, seq=2048),
    "axonn-gpt-20b": _gpt("axonn-gpt-20b", 32, 7168, 56, seq=2048),
    "axonn-gpt-40b": _gpt("axonn-gpt-40b", 38, 9216, 72, seq=2048),
    "axonn-gpt-80b": _gpt("axonn-gpt-80b", 42, 12288, 96, seq=2048),
    # 2BP Transformer-7b: LLaMA/PaLM-style, context 1024, d_model 4096 (LLaMA-7B shape).
    "2bp-transformer-7b": ModelConfig(name="2bp-transformer-7b", kind="llama", vocab_size=32000, d_model=4096,
                                      n_layers=32, n_heads=32, d_ff=11008, max_seq_len=1024),
}


def resolve_model(name: str) -> ModelConfig:
    """A preset by name; raises ConfigError listing the valid names."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


# Model settings that leave every parameter's shape alone: an export starts a model differing only in these
# (e.g. a longer RoPE base for context extension). Any other difference changes some shape.
SHAPE_FREE = ("name", "rope_theta", "norm_eps", "init_std", "attention")


def shape_settings(model: dict) -> dict:
    """The model settings (as ``export.json`` writes them) that shape or give meaning to its parameters:
    all but :data:`SHAPE_FREE`, with ``n_kv_heads`` as the key/value head count it means (0 is ``n_heads``),
    and without ``max_seq_len`` for LLaMA, whose RoPE has no position table (context extension)."""
    out = {k: v for k, v in model.items() if k not in SHAPE_FREE}
    if "n_kv_heads" in out:
        out["n_kv_heads"] = out["n_kv_heads"] or out.get("n_heads")
    if out.get("kind") == "llama":
        out.pop("max_seq_len", None)
    return out
