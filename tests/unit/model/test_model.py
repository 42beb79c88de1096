"""Single-device model: shapes, causal masking, parameter counts, abstract construction of large presets."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid.model import PRESETS, Model, block_name


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_forward_shapes_and_causal_mask(name):
    m = Model(PRESETS[name])
    p = m.init(jax.random.key(0))
    tok = jax.random.randint(jax.random.key(1), (2, 16), 0, m.cfg.vocab_size)

    @jax.jit  # one program: op by op, every op would compile (and enter the persistent cache) alone
    def hidden(t):
        h = m.apply_embed(p["embed"], t)
        for i in range(m.cfg.n_layers):
            h = m.apply_block(p[block_name(i)], h)
        return h

    h = hidden(tok)
    assert h.shape == (2, 16, m.cfg.d_model)
    changed = tok.at[:, 10].set((tok[:, 10] + 1) % m.cfg.vocab_size)
    h2 = hidden(changed)
    np.testing.assert_array_equal(np.asarray(h[:, :10]), np.asarray(h2[:, :10]))  # the past never sees the future
    assert not np.allclose(np.asarray(h[:, 10:]), np.asarray(h2[:, 10:]))
    loss = jax.jit(m.loss)(p, tok, tok)
    assert loss.shape == () and abs(float(loss) - np.log(m.cfg.vocab_size)) < 0.5  # near-uniform at init


def test_gpt2_small_parameter_count():
    m = Model(PRESETS["gpt2-small"])
    n = sum(x.size for x in jax.tree.leaves(m.abstract_params()))
    assert abs(n - 124e6) / 124e6 < 0.005, n
    assert n == PRESETS["gpt2-small"].param_count()


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_counts_follow_grouped_query_attention_of_either_kind(name):
    """model.n_kv_heads shapes the qkv kernel of both kinds (the block is one code path); param_count and
    block_matmuls (MFU's flops, the planner) counted GPT-2 as multi-head: gpt-tiny with 2 k/v heads built
    224384 parameters and was counted as 241024."""
    from jaxhybrid.core.config.model import block_matmuls

    cfg = dataclasses.replace(PRESETS[name], n_kv_heads=2)
    shapes = Model(cfg).abstract_params()
    assert sum(x.size for x in jax.tree.leaves(shapes)) == cfg.param_count()
    qkv = shapes["block_000"]["qkv"]["kernel"].shape
    assert block_matmuls(cfg)[0][:2] == qkv == (64, 64 + 2 * 2 * 16)


@pytest.mark.slow
@pytest.mark.parametrize("name,billions", [("myelin-12b", 12), ("myelin-100b", 100), ("axonn-gpt-80b", 80),
                                           ("2bp-transformer-7b", 7)])
def test_large_presets_are_abstract(name, billions):
    n = PRESETS[name].param_count()
    assert 0.8 * billions < n / 1e9 < 1.15 * billions
    shapes = Model(PRESETS[name]).abstract_params()
    assert sum(x.size for x in jax.tree.leaves(shapes)) == n


# Myelin Table I (sequence 512, vocabulary 51200, Sec. VI-C) and AxoNN Table III (sequence 2048, Sec. IV):
# (layers, hidden, heads, sequence) and the billions of parameters each paper names the model by.
PAPER_MODELS = {"myelin-12b": (48, 4512, 24, 512, 12), "myelin-24b": (48, 6336, 36, 512, 24),
                "myelin-50b": (96, 6528, 48, 512, 50), "myelin-100b": (96, 9360, 60, 512, 100),
                "axonn-gpt-5b": (24, 4096, 32, 2048, 5), "axonn-gpt-10b": (32, 5120, 40, 2048, 10),
                "axonn-gpt-20b": (32, 7168, 56, 2048, 20), "axonn-gpt-40b": (38, 9216, 72, 2048, 40),
                "axonn-gpt-80b": (42, 12288, 96, 2048, 80)}


@pytest.mark.parametrize("name", sorted(PAPER_MODELS))
def test_paper_presets_are_the_tables_shapes(name):
    """The presets are the papers' tables, and their parameter counts the billions the papers name them by
    within 5% (12 l h^2 + the 51200 x h table: AxoNN's "80B" has 76.8B, Myelin's "24B" 23.5B)."""
    layers, hidden, heads, seq, billions = PAPER_MODELS[name]
    c = PRESETS[name]
    assert (c.kind, c.n_layers, c.d_model, c.n_heads, c.d_ff, c.vocab_size, c.max_seq_len) == \
        ("gpt2", layers, hidden, heads, 4 * hidden, 51200, seq)
    assert c.param_count() / 1e9 == pytest.approx(billions, rel=0.05)


def test_tied_embeddings_share_gradient():
    cfg = PRESETS["gpt-tiny"].__class__(**{**PRESETS["gpt-tiny"].__dict__, "tie_embeddings": True})
    m = Model(cfg)
    p = m.init(jax.random.key(0))
    assert "kernel" not in p["head"]
    tok = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
    g = jax.jit(jax.grad(m.loss))(p, tok, tok)
    assert float(jnp.abs(g["embed"]["wte"]).sum()) > 0


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_cast_matrices_computes_the_same(name):
    """The 2BP forward differentiates Model.cast_matrices(params): the layers must cast every matrix to
    the compute dtype where they use it, so that the loss and its gradient are bit-identical. (Untied:
    a tied table, used twice, sums its two gradients in bf16 on the copy, one ulp off here and there;
    the stage takes only dx and the tap cotangents from that vjp, never a parameter gradient.)"""
    m = Model(dataclasses.replace(PRESETS[name], tie_embeddings=False), compute_dtype="bfloat16")
    p = m.init(jax.random.key(0))
    pc = m.cast_matrices(p)
    assert {x.dtype for x in jax.tree.leaves(pc) if x.ndim >= 2} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(pc) if x.ndim < 2} == {jnp.dtype(jnp.float32)}
    tok = jax.random.randint(jax.random.key(1), (2, 8), 0, 256)
    loss = jax.jit(jax.value_and_grad(m.loss))
    (l32, g32), (lc, gc) = loss(p, tok, tok), loss(pc, tok, tok)
    assert float(l32) == float(lc)
    for a, b in zip(jax.tree.leaves(g32), jax.tree.leaves(gc)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_bf16_compute_keeps_fp32_params():
    m = Model(PRESETS["llama-tiny"], compute_dtype="bfloat16")
    p = m.init(jax.random.key(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p))
    tok = jax.random.randint(jax.random.key(1), (2, 8), 0, 256)
    g = jax.jit(jax.grad(m.loss))(p, tok, tok)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g))


@pytest.mark.slow
@pytest.mark.parametrize("policy,interval", [("full", 2), ("dots", 1), ("full", 3)])
def test_remat_segments_do_not_change_gradients(policy, interval):
    from jaxhybrid.model import remat_policy
    from jaxhybrid.model.testing import assert_tree_close

    m = Model(PRESETS["gpt-tiny"])
    p = m.init(jax.random.key(0))
    tok = jax.random.randint(jax.random.key(1), (2, 8), 0, 256)
    ref = jax.grad(m.loss)(p, tok, tok)
    got = jax.grad(lambda q: m.loss(q, tok, tok, remat=remat_policy(policy), interval=interval))(p)
    assert_tree_close(got, ref, "fp32_kernel", f"remat={policy} interval={interval}")


def _nvidia_gpu() -> bool:
    d = jax.devices()[0]
    return d.platform == "gpu" and "nvidia" in d.device_kind.lower()


def test_attention_kernel_choice_and_errors():
    from jaxhybrid.core.errors import ConfigError
    from jaxhybrid.model.attention import attention_kernel

    q16 = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    q32 = jnp.zeros((1, 8, 2, 64), jnp.float32)
    assert attention_kernel("auto", q32) == "xla" and attention_kernel("xla", q16) == "xla"
    assert attention_kernel("auto", q16) == ("cudnn" if _nvidia_gpu() else "xla")
    with pytest.raises(ValueError, match="dtype float32"):
        attention_kernel("cudnn", q32)
    with pytest.raises(ValueError, match="head_dim 12"):
        attention_kernel("cudnn", jnp.zeros((1, 8, 2, 12), jnp.bfloat16))
    with pytest.raises(ValueError, match="'flash'"):
        attention_kernel("flash", q16)
    with pytest.raises(ConfigError, match="model.attention='flash'"):
        PRESETS["gpt-tiny"].__class__(attention="flash").validate()


@pytest.mark.skipif(not _nvidia_gpu(), reason="cuDNN flash attention needs an NVIDIA GPU")
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_cudnn_attention_matches_xla(heads, kv_heads):
    """The fused cuDNN kernel against the materialised-scores path: outputs and q/k/v gradients (bf16)."""
    from jaxhybrid.model import Ops
    from jaxhybrid.model.testing import assert_tree_close

    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (2, 256, heads, 64), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (2, 256, kv_heads, 64), jnp.bfloat16) for kk in ks[1:3])
    dy = jax.random.normal(ks[3], q.shape, jnp.bfloat16)

    def run(kernel):
        y, vjp = jax.vjp(lambda *a: Ops().attention(*a, kernel=kernel), q, k, v)
        return y, vjp(dy)

    got, want = jax.jit(lambda: run("cudnn"))(), jax.jit(lambda: run("xla"))()
    assert_tree_close(got, want, "bf16_parity", "cudnn vs xla attention")


@pytest.mark.parametrize("heads,kv_heads,dtype", [(4, 4, jnp.float32), (8, 2, jnp.float32), (4, 2, jnp.bfloat16)])
def test_attention_backward_matches_autodiff_and_keeps_only_probabilities(heads, kv_heads, dtype):
    """The XLA path's written-out backward (attention.causal_attention) against autodiff of the plain
    formula, GQA included; its vjp keeps q, k, v (unrepeated) and the float32 probabilities, nothing else."""
    from jaxhybrid.model.attention import causal_attention
    from jaxhybrid.model.testing import assert_tree_close

    def plain(q, k, v):
        rep = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(q.shape[-1])
        t = q.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(jnp.float32).min)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)

    ks = jax.random.split(jax.random.key(0), 4)
    b, t, d = 2, 32, 16
    q = jax.random.normal(ks[0], (b, t, heads, d), dtype)
    k, v = (jax.random.normal(kk, (b, t, kv_heads, d), dtype) for kk in ks[1:3])
    dy = jax.random.normal(ks[3], q.shape, dtype)
    y, vjp = jax.vjp(causal_attention, q, k, v)
    want_y, want_vjp = jax.vjp(plain, q, k, v)
    tol = "fp32_kernel" if dtype == jnp.float32 else "bf16_parity"
    assert_tree_close((y, vjp(dy)), (want_y, want_vjp(dy)), tol, f"attention {heads}/{kv_heads} {dtype.__name__}")
    kept = sorted((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(vjp))
    assert kept == sorted([(q.shape, str(q.dtype)), (k.shape, str(k.dtype)), (v.shape, str(v.dtype)),
                           ((b, heads, t, t), "float32")]), kept


def test_norms_and_activations_keep_only_inputs_and_statistics():
    """The norms keep x and their per-token statistics, the MLP activations their pre-activations
    (layers: jax.checkpoint), with gradients equal to autodiff of the plain formulas."""
    from jaxhybrid.model.layers import Ops, gelu, swiglu
    from jaxhybrid.model.testing import assert_tree_close

    def plain_ln(x, s, b):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(jnp.square(x - mu).mean(-1, keepdims=True) + 1e-5) * s + b

    def plain_rms(x, s):
        return x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + 1e-5) * s

    ks = jax.random.split(jax.random.key(0), 4)
    x, g = (jax.random.normal(k, (2, 8, 16)) for k in ks[:2])
    s, b = 1.0 + jax.random.normal(ks[2], (2, 1, 16)), jax.random.normal(ks[3], (16,))  # s per sample (taps)
    dy = jax.random.normal(ks[3], x.shape)
    cases = {"layer_norm": (lambda *a: Ops().layer_norm(*a, 1e-5), plain_ln, (x, s, b), [1, 1, 16]),
             "rms_norm": (lambda *a: Ops().rms_norm(*a, 1e-5), plain_rms, (x, s), [1, 16]),
             "gelu": (gelu, lambda u: jax.nn.gelu(u, approximate=True), (x,), [16]),
             "swiglu": (swiglu, lambda a, u: jax.nn.silu(a) * u, (g, x), [16, 16])}
    for name, (fn, ref, args, widths) in cases.items():
        y, vjp = jax.vjp(fn, *args)
        want_y, want_vjp = jax.vjp(ref, *args)
        assert_tree_close((y, vjp(dy)), (want_y, want_vjp(dy)), "fp32_kernel", name)
        # Arrays over every token (2 x 8): the inputs (width 16) and the norms' statistics (width 1).
        kept = sorted(v.shape[-1] for v in jax.tree.leaves(vjp) if getattr(v, "shape", ())[:2] == (2, 8))
        assert kept == widths, (name, kept)


def test_float16_attention_scores_do_not_overflow_before_scaling():
    """|q . k| = 82944 overflows float16 (max 65504) although the scaled score, 10368, does not: the scores
    must leave the matmul in float32 (Megatron scales inside the GEMM for the same reason)."""
    from jaxhybrid.model.attention import causal_attention
    from jaxhybrid.model.testing import assert_tree_close

    rng = np.random.default_rng(0)
    q = jnp.full((1, 4, 2, 64), 36.0, jnp.float16)
    v = jnp.asarray(rng.normal(size=(1, 4, 2, 64)), jnp.float16)
    out = causal_attention(q, q, v)
    ref = causal_attention(q.astype(jnp.float32), q.astype(jnp.float32), v.astype(jnp.float32))
    assert bool(jnp.all(jnp.isfinite(out)))
    assert_tree_close(out.astype(jnp.float32), ref, "fp16_parity", "float16 attention")
    grads = jax.grad(lambda q_: jnp.sum(causal_attention(q_, q_, v).astype(jnp.float32)))(q)
    assert bool(jnp.all(jnp.isfinite(grads)))


@pytest.mark.parametrize("name,tied", [("gpt-tiny", False), ("gpt-tiny", True), ("llama-tiny", True)])
def test_compiled_init_is_the_jitted_init_bit_for_bit_with_one_program_per_kind_of_part(name, tied):
    """``compiled_init`` (every engine's init) gives the jitted ``Model.init``'s bits, for the whole model
    and for a stage's parts (a tied head brings its table), compiling one block program for all blocks."""
    from jaxhybrid.model.transformer import _INIT_PROGRAMS, compiled_init

    m = Model(dataclasses.replace(PRESETS[name], tie_embeddings=tied))
    key = jax.random.key(5)
    program = (m, "block", jax.tree.structure(None), ())  # unplaced; other tests may have compiled it already
    before = _INIT_PROGRAMS[program]._cache_size() if program in _INIT_PROGRAMS else 0
    for parts in (None, (block_name(2), block_name(3), "head")):
        want = jax.jit(lambda k, parts=parts: m.init(k, None, parts))(key)
        got = compiled_init(m, key, parts)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
            assert np.array_equal(np.asarray(g), np.asarray(w)), jax.tree_util.keystr(path)
    assert _INIT_PROGRAMS[program]._cache_size() <= before + 1  # one program for the 4 + 2 blocks
