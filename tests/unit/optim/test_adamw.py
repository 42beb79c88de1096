"""The trainer's AdamW settings. Which parameters it decays (``optim.weight_decay_mask``): the rule, its
bit-exact equality with optax's own ``adamw(mask=...)``, and the per-bucket runs the offloaded optimizer
builds its mask from (the layouts' parity with the single device runs with the default rule elsewhere).
Its learning-rate schedule: the warm-up's first step."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxhybrid.core.config.schema import OptimConfig
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.model.testing import assert_tree_close
from jaxhybrid.optim.buckets import BucketLayout, decay_bounds
from jaxhybrid.optim.updater import DeviceUpdater, decay_mask, lr_schedule
from jaxhybrid.runtime.config_load import load_config

SHAPES = {"embed": (11, 6), "ln": {"scale": (6,), "bias": (6,)}, "dense": {"kernel": (6, 5), "bias": (5,)}}


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), SHAPES,
                        is_leaf=lambda s: isinstance(s, tuple))


def test_matrices_decay_and_vectors_do_not():
    """A zero gradient leaves Adam's step at 0, so only the decay moves a parameter: every matrix
    shrinks by exactly ``lr * wd``, the norm scale and the biases stay where they were."""
    o = OptimConfig(lr=0.1, weight_decay=0.5)
    upd = DeviceUpdater(optax.adamw(o.lr, weight_decay=o.weight_decay), 0.0, decay_mask(o))
    params = _params()
    zeros = jax.tree.map(jnp.zeros_like, params)
    new, _, _ = upd.apply(jax.tree.map(jnp.array, params), upd.init(params), zeros, 1.0, *upd.stats(zeros))
    for path, before in jax.tree_util.tree_flatten_with_path(params)[0]:
        after = new
        for k in path:
            after = after[k.key]
        want = before * (1 - 0.1 * 0.5) if before.ndim >= 2 else before
        assert_tree_close(after, want, "fp32_kernel", jax.tree_util.keystr(path))
    assert decay_mask(OptimConfig(weight_decay_mask="all")) is None
    assert decay_mask(OptimConfig(weight_decay=0.0)) is None  # nothing to mask


def test_decay_view_equals_optax_adamw_mask_bit_for_bit():
    """The updaters mask by showing AdamW zeros where no decay applies; optax masks the decay transform.
    Five steps of each on the same gradients give the same bits (``u + wd * 0 == u``)."""
    o = OptimConfig()
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    mask = decay_mask(o)
    ours = DeviceUpdater(optax.adamw(sched, weight_decay=0.1), 1.0, mask)
    theirs = DeviceUpdater(optax.adamw(sched, weight_decay=0.1, mask=mask), 1.0)
    pa, pb = _params(), _params()
    sa, sb = ours.init(pa), theirs.init(pb)
    for step in range(5):
        g = _params(step + 1)
        pa, sa, _ = ours.apply(pa, sa, g, 1.0, *ours.stats(g))
        pb, sb, _ = theirs.apply(pb, sb, g, 1.0, *theirs.stats(g))
    assert_tree_close(pa, pb, "exact", "params")
    unmasked = DeviceUpdater(optax.adamw(sched, weight_decay=0.1), 1.0)
    pc, sc = _params(), unmasked.init(_params())
    for step in range(5):
        g = _params(step + 1)
        pc, sc, _ = unmasked.apply(pc, sc, g, 1.0, *unmasked.stats(g))
    assert not np.array_equal(pc["ln"]["scale"], pa["ln"]["scale"])  # the mask changed something


def test_decay_bounds_give_each_element_its_leafs_flag():
    """The runs of decayed elements, cut at bucket edges, merged across adjacent decayed leaves, padded:
    ``searchsorted`` of every element (as the bucket program does it) gives back its leaf's flag."""
    assert decay_bounds([3, 4, 2, 5], [True, False, True, True], BucketLayout(14, 5)).tolist() == [
        [0, 3], [2, 5], [0, 4]]
    rng = np.random.default_rng(0)
    for trial in range(20):
        sizes = [int(x) for x in rng.integers(1, 9, size=rng.integers(1, 8))]
        flags = [bool(x) for x in rng.integers(0, 2, size=len(sizes))]
        layout = BucketLayout(sum(sizes), int(rng.integers(1, sum(sizes) + 1)))
        rows = decay_bounds(sizes, flags, layout)
        want = np.repeat(flags, sizes)
        for i, (s, e) in enumerate(layout.all_bounds()):
            got = np.searchsorted(rows[i], np.arange(e - s), side="right") % 2 == 1
            np.testing.assert_array_equal(got, want[s:e], err_msg=f"trial {trial} bucket {i}: {sizes} {flags}")


def test_an_unknown_rule_is_named():
    with pytest.raises(ConfigError, match=r"optim.weight_decay_mask='bias'; choose matrices"):
        load_config(None, ["optim.weight_decay_mask=bias"])


def test_warmup_starts_above_zero_and_reaches_the_peak():
    """nanoGPT's ramp, ``lr * (c + 1) / (warm + 1)``: step 1 trains; then the peak and the
    cosine down to ``lr * min_lr_ratio``. Without warm-up the first step takes the peak."""
    sched = lr_schedule(OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1), 10)
    np.testing.assert_allclose([float(sched(c)) for c in range(5)], [0.2, 0.4, 0.6, 0.8, 1.0], rtol=1e-6)
    np.testing.assert_allclose(float(sched(10)), 0.1, rtol=1e-6)
    assert float(lr_schedule(OptimConfig(lr=1.0, warmup_steps=0), 10)(0)) == 1.0
