"""Single-device model: shapes, causal masking, parameter counts, abstract construction of large presets."""
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
    loss = m.loss(p, tok, tok)
    assert loss.shape == () and abs(float(loss) - np.log(m.cfg.vocab_size)) < 0.5  # near-uniform at init


def test_gpt2_small_parameter_count():
    m = Model(PRESETS["gpt2-small"])
    n = sum(x.size for x in jax.tree.leaves(m.abstract_params()))
    assert abs(n - 124e6) / 124e6 < 0.005, n
    assert n == PRESETS["gpt2-small"].param_count()


@pytest.mark.parametrize("name,billions", [("myelin-12b", 12), ("myelin-100b", 100), ("axonn-gpt-80b", 80),
                                           ("2bp-transformer-7b", 7)])
def test_large_presets_are_abstract(name, billions):
    n = PRESETS[name].param_count()
    assert 0.8 * billions < n / 1e9 < 1.15 * billions
    shapes = Model(PRESETS[name]).abstract_params()
    assert sum(x.size for x in jax.tree.leaves(shapes)) == n


def test_tied_embeddings_share_gradient():
    cfg = PRESETS["gpt-tiny"].__class__(**{**PRESETS["gpt-tiny"].__dict__, "tie_embeddings": True})
    m = Model(cfg)
    p = m.init(jax.random.key(0))
    assert "kernel" not in p["head"]
    tok = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
    g = jax.grad(m.loss)(p, tok, tok)
    assert float(jnp.abs(g["embed"]["wte"]).sum()) > 0


def test_bf16_compute_keeps_fp32_params():
    m = Model(PRESETS["llama-tiny"], compute_dtype="bfloat16")
    p = m.init(jax.random.key(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p))
    tok = jax.random.randint(jax.random.key(1), (2, 8), 0, 256)
    g = jax.grad(m.loss)(p, tok, tok)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g))


@pytest.mark.parametrize("policy,interval", [("full", 2), ("dots", 1), ("full", 3)])
def test_remat_segments_do_not_change_gradients(policy, interval):
    from jaxhybrid.model import remat_policy
    from jaxhybrid.testing import assert_tree_close

    m = Model(PRESETS["gpt-tiny"])
    p = m.init(jax.random.key(0))
    tok = jax.random.randint(jax.random.key(1), (2, 8), 0, 256)
    ref = jax.grad(m.loss)(p, tok, tok)
    got = jax.grad(lambda q: m.loss(q, tok, tok, remat=remat_policy(policy), interval=interval))(p)
    assert_tree_close(got, ref, "fp32_kernel", f"remat={policy} interval={interval}")
