"""2BP stage kernels against plain ``jax.vjp`` of the same slice.

Tiny models (d_model 32, 3 blocks, microbatch 2 x 8 tokens) keep compile time low; every comparison goes
through ``assert_tree_close`` so a failure names the pytree path.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid.model import PRESETS, Model, compiled_init
from jaxhybrid.model.testing import TOLERANCES, assert_tree_close, max_rel_err
from jaxhybrid.model.transformer import TIED_KEY
from jaxhybrid.parallel.twobp import stage_kernels
from jaxhybrid.parallel.twobp.residuals import ParamSlot, WeightResiduals
from jaxhybrid.parallel.twobp.stage import (
    Stage,
    auto_weight_join,
    concat_weight_residuals,
    reference_apply,
    weight_join,
)
from jaxhybrid.parallel.twobp.stage_costs import kernel_costs, split_ratios
from jaxhybrid.runtime.engines.base import LocalEngine

MB, T = 2, 8
SMALL = dict(d_model=32, n_heads=4, d_ff=64, n_layers=3, vocab_size=64, max_seq_len=16)
CONFIGS = {
    "gpt2": dataclasses.replace(PRESETS["gpt-tiny"], **SMALL),
    "llama": dataclasses.replace(PRESETS["llama-tiny"], n_kv_heads=2, **SMALL),
    "gpt2-tied": dataclasses.replace(PRESETS["gpt-tiny"], tie_embeddings=True, **SMALL),
}


def _model(kind, dtype="float32"):
    return Model(CONFIGS[kind], compute_dtype=dtype)


@functools.lru_cache(maxsize=None)
def _stage(kind, lo, hi, remat="none", dtype="float32", ac=0):
    """Stages are cached across tests so their jitted kernels compile once per session."""
    return Stage(_model(kind, dtype), lo, hi, remat=remat, checkpoint_interval=ac)


@functools.lru_cache(maxsize=None)
def _full_params(kind, seed):
    """Whole-model params, initialised under jit (eager flax init compiles op by op: seconds)."""
    return compiled_init(_model(kind), jax.random.key(seed))


def _inputs(stage, seed, mb=MB):
    rng = np.random.default_rng(seed)
    c = stage.cfg
    if stage.is_first:
        x = jnp.asarray(rng.integers(0, c.vocab_size, (mb, T)), jnp.int32)
    else:
        x = jnp.asarray(rng.standard_normal((mb, T, c.d_model)), stage.model.dtype)
    tgt = jnp.asarray(rng.integers(0, c.vocab_size, (mb, T)), jnp.int32) if stage.is_last else None
    return x, tgt


def _cotangent(stage, y, seed):
    if stage.is_last:
        return jnp.asarray(1.7, jnp.float32)
    return jnp.asarray(np.random.default_rng(seed).standard_normal(y.shape), y.dtype)


def _reference(stage, params, x, tgt, dy):
    """Plain jax.vjp of the same slice (jitted: eager dispatch compiles op by op): (y, dx or None, dparams)."""

    @jax.jit
    def ref(params, x, tgt, dy):
        if stage.is_first:
            y, vjp = jax.vjp(lambda p: reference_apply(stage, p, x, tgt), params)
            return y, None, vjp(dy)[0]
        y, vjp = jax.vjp(lambda p, h: reference_apply(stage, p, h, tgt), params, x)
        dp, dx = vjp(dy)
        return y, dx, dp

    return ref(params, x, tgt, dy)


def _random_ranges(kind, n=3):
    """Two random block ranges per model kind; over the kinds, first, middle, last and whole-model
    stages are all covered (a fixed seed per kind keeps runs reproducible)."""
    rng = np.random.default_rng(len(kind))
    if kind == "llama":  # a middle stage and the whole model (first and last at once)
        return [(1, int(rng.integers(2, n))), (0, n)]
    if kind == "gpt2-tied":  # the last stage, which holds the tied table's copy
        return [(int(rng.integers(1, n)), n)]
    return [(0, int(rng.integers(1, n))), (int(rng.integers(1, n)), n)]


@pytest.mark.parametrize("kind", ["gpt2", "llama", "gpt2-tied"])
def test_split_and_fused_reproduce_vjp_of_slice(kind):
    full = _full_params(kind, 0)
    for k, (lo, hi) in enumerate(_random_ranges(kind)):
        stage = _stage(kind, lo, hi)
        what = f"{kind}[{lo},{hi}) "
        params = stage.slice_params(full)
        x, tgt = _inputs(stage, k)
        y, res = stage.forward(params, x, tgt)
        dy = _cotangent(stage, y, k + 10)
        y_ref, dx_ref, dp_ref = _reference(stage, params, x, tgt, dy)
        assert_tree_close(y, y_ref, "fp32_kernel", what + "forward")
        dx, wr = stage.backward_input(res, dy)
        dp = stage.backward_weight(params, wr)
        assert (dx is None) == stage.is_first
        if dx is not None:
            assert_tree_close(dx, dx_ref, "fp32_kernel", what + "dx")
        assert_tree_close(dp, dp_ref, "fp32_kernel", what + "dparams")
        if k == 0:  # the fused kernel once per kind (each compile costs about a second here)
            dx_f, dp_f = stage.backward(res, dy)
            assert_tree_close(dp_f, dp, "fp32_kernel", what + "fused vs split dparams")
            if dx is not None:
                assert_tree_close(dx_f, dx, "fp32_kernel", what + "fused vs split dx")


@pytest.mark.parametrize("kind", ["llama", "gpt2-tied"])
def test_weight_pass_on_concatenated_microbatches_is_the_sum(kind, monkeypatch):
    stage = _stage(kind, *_random_ranges(kind)[0])
    params = stage.slice_params(_full_params(kind, 0))
    wrs = []
    for k in range(3):
        x, tgt = _inputs(stage, 20 + k)
        y, res = stage.forward(params, x, tgt)
        wrs.append(stage.backward_input(res, _cotangent(stage, y, 30 + k))[1])
    singles = [stage.backward_weight(params, w) for w in wrs]
    total = jax.tree.map(lambda *a: a[0] + a[1] + a[2], *singles)
    cat = concat_weight_residuals(wrs)
    assert cat.batch == 3 * MB
    assert_tree_close(stage.backward_weight(params, cat), total, "fp32_kernel", f"{kind} concat ")
    # The list form: the three weight passes summed in one program, no copy of the residuals.
    before = stage.trace_counts["backward_weight_sum"]
    assert_tree_close(stage.backward_weight(params, wrs), total, "fp32_kernel", f"{kind} list ")
    assert_tree_close(stage.backward_weight(params, tuple(wrs)), total, "fp32_kernel", f"{kind} tuple ")
    assert stage.trace_counts["backward_weight_sum"] == before + 1  # list and tuple: one program
    # More than SUM_CHUNK microbatches: several programs, each adding the running sum.
    with monkeypatch.context() as mp:
        mp.setattr(stage_kernels, "SUM_CHUNK", 2)
        assert_tree_close(stage.backward_weight(params, wrs), total, "fp32_kernel", f"{kind} chunked ")
    assert stage.trace_counts["backward_weight_sum"] == before + 3  # chunks (2) and (1, running sum)
    # A running sum: added inside the kernel, its buffers donated (the pipeline's accumulation).
    for call in (lambda acc: stage.backward_weight(params, wrs, acc),
                 lambda acc: stage.backward_weight(params, wrs[0], acc),
                 lambda acc: stage.backward(res, _cotangent(stage, y, 30 + 2), acc)[1]):
        acc = jax.tree.map(jnp.ones_like, total)
        got, plain = call(acc), call(None)
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(acc))
        assert_tree_close(got, jax.tree.map(lambda g: g + 1, plain), "fp32_kernel", f"{kind} acc + grads ")
    with pytest.raises(ValueError, match="acc must be a gradient sum shaped like"):
        stage.backward_weight(params, wrs[0], {"nope": jnp.zeros(3)})
    for bad, match in [([], "non-empty list"), ([wrs[0], {"records": 1}], "of dict"),
                       ([wrs[0], dataclasses.replace(wrs[1], site_index=wrs[1].site_index[::-1])], "2 different")]:
        with pytest.raises(ValueError, match=match):
            stage.backward_weight(params, bad)


def test_weight_join_auto_concatenates_only_where_that_moves_fewer_bytes():
    """``pipeline.weight_join=auto``: one batch (concat) where copying K microbatches' weight residuals
    (R bytes each) moves fewer bytes than writing K gradient trees (G bytes each) and the copy is at most
    one tree, the list (sum) otherwise; ``param_bytes`` comes from shapes and matches the real params."""
    stage = Stage(Model(dataclasses.replace(CONFIGS["gpt2"], d_model=64, d_ff=256)), 1, 2)
    params = stage.init_params(jax.random.key(0))
    g = stage.param_bytes
    assert g == sum(v.nbytes for v in jax.tree.leaves(params))
    picked = {}
    for mb in (1, 8):
        wrs = []
        for k in range(2):
            x, tgt = _inputs(stage, 40 + k, mb)
            y, res = stage.forward(params, x, tgt)
            wrs.append(stage.backward_input(res, _cotangent(stage, y, 50 + k))[1])
        r = Stage.weight_residual_bytes(wrs[0])
        auto = weight_join("auto")
        got = auto(stage, wrs)
        picked[mb] = "concat" if isinstance(got, WeightResiduals) else "sum"
        assert auto.chosen == {2: picked[mb]}  # what it took, by join size (bench pipeline reports it)
        assert picked[mb] == ("concat" if 4 * r + g < 2 * g and 2 * r <= g else "sum"), (mb, r, g)
        assert isinstance(weight_join("sum")(stage, wrs), list)
        assert weight_join("concat")(stage, wrs).batch == 2 * mb
    assert picked == {1: "concat", 8: "sum"}  # both branches taken at these sizes
    assert auto_weight_join(stage, wrs[0], 1) == "sum"  # one microbatch: nothing to join
    with pytest.raises(ValueError, match="weight_join='stack'; choose auto, sum or concat"):
        weight_join("stack")


def test_remat_modes_and_checkpoint_interval_agree():
    model = _model("llama")
    base = _stage("llama", 0, 3)
    params = base.slice_params(_full_params("llama", 0))
    x, tgt = _inputs(base, 3)
    y, res = base.forward(params, x, tgt)
    dy = _cotangent(base, y, 4)
    _, dp = base.backward(res, dy)
    nbytes = {"none": Stage.residual_bytes(res)}
    for remat, ac in (("dots", 0), ("full", 2)):
        s = _stage("llama", 0, 3, remat, "float32", ac)
        y2, r2 = s.forward(params, x, tgt)
        assert_tree_close(y2, y, "fp32_kernel", f"{remat}/ac={ac} forward")
        dx2, wr2 = s.backward_input(r2, dy)
        assert_tree_close(s.backward_weight(params, wr2), dp, "fp32_kernel", f"{remat}/ac={ac} dparams")
        nbytes[f"{remat}{ac}"] = Stage.residual_bytes(r2)
    # (Stage.activation_bytes is residual_bytes of jax.eval_shape of this same forward: equal by construction.)
    nbytes["full0"] = Stage.residual_bytes(_stage("llama", 0, 3, "full").forward(params, x, tgt)[1])
    assert Stage(model, 0, 3, remat="full", checkpoint_interval=2).segments == [(0, 2), (2, 3)]
    # full with ac=2 keeps tokens, targets and one [mb, T, d] float32 segment input; ac=0 (no hint)
    # checkpoints every block.
    assert nbytes["full2"] == 2 * MB * T * 4 + MB * T * 32 * 4
    assert nbytes["full0"] == 2 * MB * T * 4 + 2 * MB * T * 32 * 4
    assert nbytes["full2"] < nbytes["full0"] < min(nbytes["dots0"], nbytes["none"])
    # dots saves the sites' outputs (matmul + bias) and the norms' statistics and recomputes the rest:
    # what none keeps but for the attention core's [mb, H, T, T] float32 probabilities (3 blocks here).
    # (Saving the bare matmul outputs instead kept each site's zero tap as well, more than none.)
    probs = 3 * MB * CONFIGS["llama"].n_heads * T * T * 4
    assert nbytes["none"] - probs < nbytes["dots0"] < nbytes["none"]
    # Myelin's optimal interval from the pipeline depth (factor of N/G_inter closest to sqrt(N)).
    deep = Model(dataclasses.replace(CONFIGS["gpt2"], n_layers=16))
    s8 = Stage(deep, 0, 8, remat="full", num_stages_hint=2)  # N/G = 8, sqrt(16) = 4
    assert s8.checkpoint_interval == 4 and s8.segments == [(0, 4), (4, 8)]


@pytest.mark.parametrize("kind,remat", [("llama", "none"), ("gpt2", "none"), ("gpt2-tied", "dots")])
def test_residual_bytes_match_kept_arrays(kind, remat):
    full = _full_params(kind, 0)
    for lo, hi in _random_ranges(kind):
        stage = _stage(kind, lo, hi, remat)
        params = stage.slice_params(full)
        x, tgt = _inputs(stage, 5)
        y, res = stage.forward(params, x, tgt)
        kept = [v for v in jax.tree.leaves((res.vjp, res.records)) if isinstance(v, jax.Array)]
        assert Stage.residual_bytes(res) == sum(v.nbytes for v in kept) > 0
        # The weights are slotted, not stored per microbatch: no kept buffer is a parameter buffer.
        pbufs = {v.unsafe_buffer_pointer() for v in jax.tree.leaves(params)}
        assert not pbufs & {v.unsafe_buffer_pointer() for v in kept}
        assert any(isinstance(v, ParamSlot) for v in jax.tree.leaves(res.vjp, is_leaf=lambda v: isinstance(v, ParamSlot)))
        _, wr = stage.backward_input(res, _cotangent(stage, y, 6))
        assert Stage.weight_residual_bytes(wr) == sum(v.nbytes for v in jax.tree.leaves(wr))


@pytest.mark.parametrize("kind,cots,records", [
    ("gpt2", 4, 4),   # qkv, attn_out, mlp_up, mlp_down
    ("llama", 5, 4),  # + mlp_gate, which reads the same input as mlp_up
])
def test_weight_residuals_keep_matmul_inputs_and_cotangents_and_norm_partials(kind, cots, records):
    """Per block, the weight pass keeps each matmul's input and output cotangent, and for the norms only
    per-sample gradients (Tape.per_sample, also for the matmul biases), packed into one [mb, sum d] array:
    no norm input or output cotangent of shape [mb, T, d]."""
    stage = _stage(kind, 1, 2)  # one middle block
    params = stage.slice_params(_full_params(kind, 0))
    x, _ = _inputs(stage, 3)
    y, res = stage.forward(params, x)
    _, wr = stage.backward_input(res, _cotangent(stage, y, 4))
    assert (len(wr.cots), len(wr.records), list(wr.partials)) == (cots, records, ["float32"])
    # Every vector weight (norm scales and biases, matmul biases) and nothing else has a per-sample slot.
    vectors = sum(v.size for v in jax.tree.leaves(params) if v.ndim == 1)
    assert wr.partials["float32"].shape == (MB, vectors)
    assert not any(r is x or np.array_equal(r, x) for r in wr.records)  # the block input fed only ln_attn
    # The partials alone carry the norm and bias gradients: zero them and only those leaves change.
    g = stage.backward_weight(params, wr)
    g0 = stage.backward_weight(params, dataclasses.replace(wr, partials={k: p * 0 for k, p in wr.partials.items()}))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(g0)):
        name = jax.tree_util.keystr(path)
        assert ("ln_" in name or "bias" in name) == (not np.array_equal(a, b)), name


@pytest.mark.parametrize("kind,lo,hi,remat", [("gpt2", 1, 2, "none"), ("llama", 1, 3, "dots"),
                                              ("gpt2-tied", 2, 3, "full")])
def test_weight_pass_does_only_the_weight_matmuls_by_xlas_count(kind, lo, hi, remat):
    """XLA's flop count of the compiled kernels (middle and last stages): the weight pass is exactly
    2BP's ``dW = x^T dy`` per matmul (2 * tokens * kernel elements) plus the batch sums of the per-sample
    vector gradients, so it recomputes nothing of the forward; input + weight pass match the fused
    backward to within the cheap elementwise work XLA:CPU duplicates into several consumer fusions."""
    stage = _stage(kind, lo, hi, remat)
    params = stage.slice_params(_full_params(kind, 0))
    x, tgt = _inputs(stage, 7)
    y, res = stage.forward(params, x, tgt)
    dy = _cotangent(stage, y, 8)
    costs = kernel_costs(stage, params, x, tgt, res, dy, stage.backward_input(res, dy)[1])
    leaves = jax.tree.leaves(params)
    matmul = sum(v.size for v in leaves if v.ndim == 2)  # block kernels, the head's (or the tied copy)
    vectors = sum(v.size for v in leaves if v.ndim == 1)
    assert costs["backward_weight"]["flops"] == 2 * MB * T * matmul + (MB - 1) * vectors
    ratios = split_ratios(costs)
    assert abs(ratios["split_flops_over_fused"] - 1) < 0.03, (ratios, costs)
    assert costs["backward_input"]["flops"] > costs["backward_weight"]["flops"] > 0
    assert min(c["bytes_accessed"] for c in costs.values()) > 0
    assert set(split_ratios(costs, "gpu").values()) == {None}  # XLA's GPU count misses library calls


def test_kernels_compile_once_per_shape():
    stage = _stage("llama", *_random_ranges("llama")[0])  # a middle stage
    params = stage.slice_params(_full_params("llama", 0))
    for k in range(3):
        x, _ = _inputs(stage, 40 + k)
        y, res = stage.forward(params, x)
        dx, wr = stage.backward_input(res, y)
        stage.backward_weight(params, wr)
        stage.backward(res, y)
        if k == 0:
            first = dict(stage.trace_counts)
    assert stage.trace_counts == first


@pytest.mark.parametrize("kind", ["llama", "gpt2-tied"])  # gpt2: biases and the tied logits in bf16
def test_bfloat16_stages_match_bf16_vjp_and_track_float32(kind):
    full = _full_params(kind, 0)
    s32, s16 = _stage(kind, 0, 3), _stage(kind, 0, 3, "none", "bfloat16")
    params = s32.slice_params(full)
    x, tgt = _inputs(s32, 7)
    one = jnp.ones((), jnp.float32)
    grads = {}
    for name, s in (("f32", s32), ("bf16", s16)):
        y, res = s.forward(params, x, tgt)
        _, wr = s.backward_input(res, one)
        grads[name] = s.backward_weight(params, wr)
        assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(grads[name]))
    # Same bf16 computation as plain jax.vjp of the slice, up to XLA's rounding/fusion choices.
    assert_tree_close(grads["bf16"], _reference(s16, params, x, tgt, one)[2], "bf16_parity", "bf16 vs bf16 vjp ")
    err = max_rel_err(grads["bf16"], grads["f32"])
    assert TOLERANCES["fp32_kernel"] < err <= TOLERANCES["bf16_parity"], err  # ran in bf16, tracks float32
    # The offloaded optimizer hands the stage its bf16 compute copy: the same loss, bf16 gradients.
    half = jax.tree.map(lambda v: v.astype(jnp.bfloat16), params)
    y16, res = s16.forward(half, x, tgt)
    assert_tree_close(y16, s16.forward(params, x, tgt)[0], "exact", "loss from the compute copy ")
    g16 = s16.backward_weight(half, s16.backward_input(res, one)[1])
    assert all(v.dtype == jnp.bfloat16 for v in jax.tree.leaves(g16))
    assert_tree_close(jax.tree.map(lambda v: v.astype(jnp.float32), g16), grads["bf16"], "bf16_parity",
                      "compute-copy gradients vs float32-master gradients ")
    mid = _stage(kind, 1, 2, "none", "bfloat16")
    mid_params = mid.slice_params(full)
    y, res = mid.forward(mid_params, jnp.ones((2, T, 32), jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and Stage.residual_bytes(res) > 0
    # The casts of the float32 masters are redone by the input pass, not kept per microbatch (plain
    # jax.vjp of the model on the masters would keep them): no kept bf16 array has a matrix's shape.
    mats = {tuple(v.shape) for v in jax.tree.leaves(mid_params) if v.ndim == 2}
    kept = {tuple(v.shape) for v in jax.tree.leaves(res.vjp) if getattr(v, "dtype", None) == jnp.bfloat16}
    assert mats and not mats & kept, mats & kept


def test_tied_embedding_params_and_names():
    model = _model("gpt2-tied")
    full = _full_params("gpt2-tied", 0)
    last = Stage(model, 1, 3)
    assert last.param_names == ["block_001", "block_002", "head", TIED_KEY]
    assert last.slice_params(full)[TIED_KEY] is full["embed"]["wte"]
    assert Stage(model, 0, 3).param_names == ["embed", "block_000", "block_001", "block_002", "head"]
    assert Stage(model, 1, 2).param_names == ["block_001"]


@pytest.mark.parametrize("kind,lo,hi", [("gpt2", 1, 2), ("llama", 0, 2), ("gpt2-tied", 1, 3), ("gpt2-tied", 0, 1)])
def test_stage_init_materialises_only_its_parts_with_the_whole_models_values(kind, lo, hi):
    """A pipeline rank initialises its stage alone (never the whole model), bit-identical to slicing the
    whole model's init: every part has its own folded key."""
    model, stage, rng = _model(kind), Stage(_model(kind), lo, hi), jax.random.key(3)
    init = jax.jit(model.init, static_argnums=(1, 2))
    whole, own = init(rng, None, None), init(rng, None, stage.init_parts)
    tied_head = stage.is_last and model.cfg.tie_embeddings
    assert sorted(own) == sorted(set(stage.init_parts) | ({"embed"} if tied_head else set()))
    assert_tree_close(stage.slice_params(own), stage.slice_params(whole), "exact", "jitted init")
    assert_tree_close(stage.init_params(rng), stage.slice_params(LocalEngine(model).init_params(rng)), "exact",
                      "the single-device engine's init")
    with pytest.raises(ValueError, match=r"\['block_007'\] are not among"):
        model.init(rng, parts=("block_007",))


def test_bad_inputs_raise_naming_values():
    model = _model("gpt2")
    with pytest.raises(ValueError, match=r"\[2, 2\).*3 blocks"):
        Stage(model, 2, 2)
    with pytest.raises(ValueError, match=r"\[2, 4\)"):
        Stage(model, 2, 4)
    with pytest.raises(ValueError, match=r"\[-1, 2\)"):
        Stage(model, -1, 2)
    with pytest.raises(ValueError, match="remat='some'"):
        Stage(model, 0, 1, remat="some")
    with pytest.raises(ValueError, match="checkpoint_interval=2 with remat='none'"):
        Stage(model, 0, 2, checkpoint_interval=2)
    full = _full_params("gpt2", 0)
    mid = Stage(model, 1, 2)
    params = mid.slice_params(full)
    cached = _stage("llama", *_random_ranges("llama")[0])
    with pytest.raises(ValueError, match="bfloat16.*float32"):
        mid.forward(params, jnp.zeros((MB, T, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\[mb, T, 32\]"):
        mid.forward(params, jnp.zeros((MB, T, 16), jnp.float32))
    with pytest.raises(ValueError, match=r"must all be float32 .* got bfloat16: \[\"\['block_001'\]"):
        mid.forward(jax.tree.map(lambda v: v.astype(jnp.bfloat16), params), jnp.zeros((MB, T, 32)))
    with pytest.raises(ValueError, match="expects params"):
        mid.forward({"block_000": params["block_001"]}, jnp.zeros((MB, T, 32)))
    with pytest.raises(ValueError, match="max_seq_len=16"):
        mid.forward(params, jnp.zeros((MB, 32, 32)))
    last = Stage(model, 2, 3)
    with pytest.raises(ValueError, match="needs targets"):
        last.forward(last.slice_params(full), jnp.zeros((MB, T, 32)))
    with pytest.raises(ValueError, match="int tokens"):
        Stage(model, 0, 1).forward(Stage(model, 0, 1).slice_params(full), jnp.zeros((MB, T, 32)))
    y, res = cached.forward(cached.slice_params(_full_params("llama", 0)), jnp.zeros((MB, T, 32)))
    with pytest.raises(ValueError, match=r"cotangent float32 \(2, 4, 32\).*\(2, 8, 32\)"):
        cached.backward_input(res, jnp.zeros((2, 4, 32)))
    with pytest.raises(ValueError, match="WeightResiduals"):
        cached.backward_weight(cached.slice_params(_full_params("llama", 0)), res)
    with pytest.raises(ValueError, match="full params lack"):
        last.slice_params({"block_002": {}})


def test_stages_of_equal_layouts_share_their_programs():
    """A stage rebuilt with an equal layout (a new engine, a resume in the same process) reuses the kernels,
    so it neither traces nor compiles again; another block range, dtype or remat gets its own."""
    one = Stage(_model("gpt2"), 1, 3)
    again = Stage(_model("gpt2"), 1, 3)
    assert again.kernels is one.kernels and again.passes is one.passes
    for other in (Stage(_model("gpt2"), 1, 2), Stage(_model("gpt2", "bfloat16"), 1, 3),
                  Stage(_model("gpt2"), 1, 3, remat="dots"), Stage(_model("gpt2-tied"), 1, 3)):
        assert other.kernels is not one.kernels, other
    params = one.init_params(jax.random.key(3))
    x, _ = _inputs(one, 5)
    y, _ = one.forward(params, x, _inputs(one, 6)[1])
    traced = dict(one.trace_counts)
    y2, _ = again.forward(again.init_params(jax.random.key(3)), x, _inputs(one, 6)[1])
    assert again.trace_counts == traced and np.array_equal(y, y2)
