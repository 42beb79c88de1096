"""Host-offloaded optimizer (Myelin V-B/V-C) against the on-device optimizer, bit for bit."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxhybrid.model.testing import assert_tree_close
from jaxhybrid.optim.memory_report import model_state_bytes
from jaxhybrid.optim.offload import OffloadedOptimizer
from jaxhybrid.optim.offload_updater import OffloadUpdater
from jaxhybrid.optim.updater import DeviceUpdater, decay_mask
from jaxhybrid.parallel.data.allreduce import iter_reduced_chunks, reduced_beside

TX = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=0.01)
SHAPES = {"w1": (8, 16), "b1": (16,), "block": {"w2": (16, 16), "b2": (16,)}, "out": (16, 4)}  # 480 params


def _loss(p, batch, scale):
    """A small MLP regression in the parameters' own dtype (bf16 params give bf16 gradients)."""
    x, y = batch
    h = jnp.tanh(x.astype(p["w1"].dtype) @ p["w1"] + p["b1"])
    h = jnp.tanh(h @ p["block"]["w2"] + p["block"]["b2"])
    err = (h @ p["out"]).astype(jnp.float32) - y
    return jnp.mean(err * err) * scale


def _setup(compute_dtype="float32"):
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s) * 0.5, jnp.float32), SHAPES,
                          is_leaf=lambda s: isinstance(s, tuple))
    batches = [(jnp.asarray(rng.normal(size=(6, 8)), jnp.float32), jnp.asarray(rng.normal(size=(6, 4)), jnp.float32))
               for _ in range(5)]
    return None, params, batches, _GRAD


_GRAD = jax.jit(jax.grad(_loss))


def _nparams(params):
    return sum(x.size for x in jax.tree.leaves(params))


@pytest.mark.slow
@pytest.mark.parametrize("backend,clip,scale,rule", [("numpy", 1e3, 1.0, "all"), ("pinned_host", 0.05, 8.0, "matrices"),
                                                     ("numpy", 1e3, 1.0, "matrices")])
def test_fp32_five_steps_bit_exact_with_device_adamw(backend, clip, scale, rule):
    """``rule``: which parameters decay (``optim.weight_decay_mask``); with ``matrices`` the buckets of 97
    elements cut through the biases, so a bucket's decay mask starts and ends inside a leaf."""
    from jaxhybrid.core.config.schema import OptimConfig

    _, params, batches, grad = _setup()
    n = _nparams(params)
    bsize = 97  # does not divide n
    assert n % bsize
    decay = decay_mask(OptimConfig(weight_decay_mask=rule))
    ref = DeviceUpdater(TX, clip, decay)
    rp, rs = jax.tree.map(jnp.array, params), ref.init(params)
    opt = OffloadedOptimizer(TX, bsize, grad_clip=clip, backend=backend, name="adamw", decay=decay)
    st = opt.init(params)
    flat = opt.device_params(st)
    for b in batches:
        g = grad(rp, b, scale)
        assert_tree_close(grad(opt.params_tree(flat), b, scale), g, "exact", "grads")
        sq, nf = ref.stats(g)
        st, flat, info = opt.step(st, g, flat, loss_scale=scale, sq=sq)
        rp, rs, gnorm = ref.apply(rp, rs, g, scale, sq, nf)
        assert not info["skipped"] and info["grad_norm"] == float(gnorm)
    assert_tree_close(opt.master_params(st), rp, "exact", "master")
    assert_tree_close(opt.inner_state(st), rs, "exact", "adam state")
    assert_tree_close(opt.params_tree(flat), rp, "exact", "device params")


@pytest.mark.slow
def test_bf16_masters_match_mixed_precision_reference():
    """fp32 masters + bf16 compute copy built with plain optax: masters bit-identical after 5 steps."""
    _, params, batches, grad16 = _setup("bfloat16")
    ref = DeviceUpdater(TX, 1.0)
    master, rs = jax.tree.map(jnp.array, params), ref.init(params)
    opt = OffloadedOptimizer(TX, 150, grad_clip=1.0, compute_dtype="bfloat16", backend="pinned_host", name="adamw")
    st = opt.init(params)
    flat = opt.device_params(st)
    for b in batches:
        copy16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
        g16 = grad16(copy16, b, 2.0)
        assert_tree_close(grad16(opt.params_tree(flat), b, 2.0), g16, "exact", "bf16 grads")
        g32 = jax.tree.map(lambda x: x.astype(jnp.float32), g16)
        sq, nf = ref.stats(g32)
        st, flat, _ = opt.step(st, g16, flat, loss_scale=2.0, sq=sq)
        master, rs, _ = ref.apply(master, rs, g32, 2.0, sq, nf)
    assert opt.params_tree(flat)["block"]["w2"].dtype == jnp.bfloat16
    assert_tree_close(opt.master_params(st), master, "exact", "fp32 masters")
    assert_tree_close(opt.params_tree(flat), jax.tree.map(lambda x: x.astype(jnp.bfloat16), master), "exact", "bf16 copy")


@pytest.mark.slow
def test_overflow_skips_and_leaves_host_state_unchanged():
    _, params, batches, grad = _setup()
    opt = OffloadedOptimizer(TX, 100, grad_clip=1.0, backend="numpy", name="adamw")
    st = opt.init(params)
    st, flat, _ = opt.step(st, grad(opt.params_tree(opt.device_params(st)), batches[0], 1.0))
    before = opt.state_dict(st)
    flat_before = np.asarray(flat.astype(jnp.float32))
    g = opt.flatten(grad(opt.params_tree(flat), batches[1], 1.0))
    bad = g.at[-3].set(jnp.inf)
    # Agreed overflow (trainer: engine.global_max): nothing runs.
    st2, flat2, info = opt.step(st, bad, flat, finite=False)
    assert info["skipped"] and st2 is st
    # Overflow only visible in the last (reduced) bucket: the step rolls back.
    st3, flat3, info = opt.step(st, bad, flat, sq=jnp.float32(1.0))
    assert info["skipped"] and info["nonfinite"] == 1.0
    assert_tree_close(opt.state_dict(st3), before, "exact", "state after overflow")
    assert_tree_close(opt.state_dict(st), before, "exact", "input state")
    assert_tree_close(np.asarray(flat3), flat_before, "exact", "device params after overflow")


@pytest.mark.slow
def test_chunk_fed_step_equals_whole_gradient_step():
    k = 3
    _, params, batches, grad = _setup()
    for clip in (0.0, 0.5):
        a = OffloadedOptimizer(TX, 60, grad_clip=clip, backend="pinned_host", name="adamw")
        b = OffloadedOptimizer(TX, 60, grad_clip=clip, backend="pinned_host", name="adamw")
        sa, sb = a.init(params), b.init(params)
        g = a.flatten(grad(params, batches[0], 1.0))
        sa, fa, ia = a.step(sa, g)
        sb, fb, ib = b.step(sb, chunks=iter_reduced_chunks(g, None, k * 60))
        # With clipping the norm is summed per chunk, so it may differ from the whole-vector sum in the
        # last bit; without clipping the chunked step is bit-identical.
        tol = "exact" if clip == 0 else "fp32_parity"
        assert_tree_close(b.state_dict(sb), a.state_dict(sa), tol, f"chunked k={k} clip={clip}")
        assert_tree_close(np.asarray(fb), np.asarray(fa), tol, "device params")
    with pytest.raises(ValueError, match="not aligned to bucket_size=60"):
        b.step(sb, chunks=iter_reduced_chunks(g, None, 100))


def test_chunks_reduced_beside_the_update_feed_the_same_step_and_overlap_in_the_trace():
    """Myelin V-C: chunks reduced by a thread of their own (at most two waiting) give the bit-identical
    step, the recorded reduce and update lanes overlap in time, and the thread's error reaches the caller."""
    _, params, batches, grad = _setup()
    a = OffloadedOptimizer(TX, 60, grad_clip=0.0, backend="pinned_host", name="adamw")
    b = OffloadedOptimizer(TX, 60, grad_clip=0.0, backend="pinned_host", name="adamw")
    sa, sb = a.init(params), b.init(params)
    g = a.flatten(grad(params, batches[0], 1.0))
    events = []
    slow = (time.sleep(0.01) or c for c in iter_reduced_chunks(g, None, 60, ahead=False))  # a reduction's time
    _, fa, _ = a.step(sa, chunks=iter_reduced_chunks(g, None, 60))
    _, fb, _ = b.step(sb, chunks=reduced_beside(slow, lambda *ev: events.append(ev)))
    assert_tree_close(np.asarray(fb), np.asarray(fa), "exact", "device params")
    reduce = [(s, e) for _, kind, s, e in events if kind == "reduce"]
    update = [(s, e) for _, kind, s, e in events if kind == "update"]
    assert len(reduce) == len(update) == -(-int(g.shape[0]) // 60) > 2
    assert any(rs < ue and us < re for rs, re in reduce for us, ue in update), (reduce, update)

    def failing():
        yield 0, 60, g[:60]
        raise RuntimeError("peer died")

    with pytest.raises(RuntimeError, match="peer died"):
        list(reduced_beside(failing()))


@pytest.mark.slow
def test_save_restore_exact_and_bucket_size_independent(tmp_path):
    from jaxhybrid.runtime.checkpoint.store import Checkpointer

    _, params, batches, grad = _setup()
    opt = OffloadedOptimizer(TX, 100, grad_clip=1.0, backend="numpy", name="adamw")
    st = opt.init(params)
    for b in batches[:2]:
        st, flat, _ = opt.step(st, grad(opt.master_params(st), b, 1.0))
    ck = Checkpointer(tmp_path, 0)
    ck.save(2, {"opt_state": opt.state_dict(st)}, {"step": 2})
    other = OffloadedOptimizer(TX, 77, grad_clip=1.0, backend="pinned_host", name="adamw")
    other.init(params)
    saved, _ = ck.restore(2, {"opt_state": opt.state_dict(st)})
    ck.close()
    st2 = other.load_state_dict(saved["opt_state"])
    assert_tree_close(other.state_dict(st2), opt.state_dict(st), "exact", "restored")
    for b in batches[2:]:
        st, _, _ = opt.step(st, grad(opt.master_params(st), b, 1.0))
        st2, _, _ = other.step(st2, grad(other.master_params(st2), b, 1.0))
    assert_tree_close(other.master_params(st2), opt.master_params(st), "exact", "resumed masters")


def test_bad_input_names_the_value():
    _, params, _, _ = _setup()
    n = _nparams(params)
    with pytest.raises(ValueError, match="bucket_size=0"):
        OffloadedOptimizer(TX, 0)
    big = OffloadedOptimizer(TX, n + 1)  # more than this process holds: one bucket of everything
    big.init(params)
    assert (big.layout.count, big.layout.size) == (1, n)
    with pytest.raises(ValueError, match="'lamb' cannot be offloaded"):
        OffloadedOptimizer(optax.lamb(1e-3), 100, name="lamb")
    with pytest.raises(ValueError, match="not elementwise"):
        OffloadedOptimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), 100)
    with pytest.raises(ValueError, match="must be float32"):
        OffloadedOptimizer(TX, 100).init(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))


def test_updater_matches_device_updater():
    from jaxhybrid.core.config.schema import Config, OptimConfig

    _, params, batches, grad = _setup()
    cfg = Config(optim=OptimConfig(bucket_size=64, grad_clip=0.5))
    off, dev = OffloadUpdater(TX, cfg), DeviceUpdater(TX, 0.5, decay_mask(cfg.optim))
    pa, sa = params, off.init(params)
    pb, sb = jax.tree.map(jnp.array, params), dev.init(params)
    for b in batches[:3]:
        ga, gb = grad(pa, b, 1.0), grad(pb, b, 1.0)
        pa, sa, na = off.apply(pa, sa, ga, 1.0, *off.stats(ga))
        pb, sb, nb = dev.apply(pb, sb, gb, 1.0, *dev.stats(gb))
        assert float(na) == float(nb)
    assert_tree_close(pa, pb, "exact", "params")
    like = off.state_dict(sa)
    assert_tree_close(off.state_dict(off.load_state_dict(sa, like)), like, "exact", "state_dict round trip")


def test_streamed_update_matches_whole_gradient_update_and_rolls_back_on_a_peer_overflow():
    """``OffloadUpdater.apply_streamed`` (Myelin V-C, fed reduced chunks as ``PipelineEngine`` yields them)
    against ``apply`` on the whole gradient; then a peer's overflow (``global_max`` says 1 while this
    rank's chunks were finite) leaves the host state as it was and rebuilds the old parameters."""
    from jaxhybrid.core.config.schema import Config, OptimConfig

    _, params, batches, grad = _setup()
    cfg = Config(optim=OptimConfig(bucket_size=64, grad_clip=0.5))
    a, b = OffloadUpdater(TX, cfg), OffloadUpdater(TX, cfg)
    pa, sa = a.compute_params(params), a.init(params)
    pb, sb = b.compute_params(params), b.init(params)

    def chunks(flat, k=2):  # k buckets per chunk, as iter_reduced_chunks cuts a reduced vector
        n = flat.shape[0]
        return ((s, min(s + k * 64, n), flat[s:min(s + k * 64, n)]) for s in range(0, n, k * 64))

    same = lambda x: x  # noqa: E731  (one rank: the sums and maxima over ranks are the values)
    for batch in batches[:3]:
        ga, gb = grad(pa, batch, 1.0), grad(pb, batch, 1.0)
        pa, sa, na, nf = a.apply_streamed(pa, sa, chunks(a.opt.flatten(ga)), 1.0, same, same)
        pb, sb, nb = b.apply(pb, sb, gb, 1.0, *b.stats(gb))
        assert float(nf) == 0.0
        assert_tree_close(float(na), float(nb), "fp32_parity", "grad norm ")
    assert_tree_close(pa, pb, "fp32_parity", "params")  # the norm is summed per chunk, not per leaf
    assert_tree_close(a.state_dict(sa), b.state_dict(sb), "fp32_parity", "host state ")
    before = a.state_dict(sa)
    g = grad(pa, batches[3], 1.0)
    pc, sc, _, nf = a.apply_streamed(pa, sa, chunks(a.opt.flatten(g)), 1.0, same, lambda x: jnp.float32(1.0))
    assert float(nf) == 1.0
    assert_tree_close(a.state_dict(sc), before, "exact", "host state after a peer's overflow ")
    assert_tree_close(pc, a.opt.params_tree(a.opt.device_params(sa)), "exact", "params after a peer's overflow ")


@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_streamed_norm_leaves_out_what_the_engines_norm_view_drops(clip):
    """With tied embeddings the last stage holds a copy of the table that the first stage counts in the
    global norm; streamed (V-C), the updater's per-chunk norm leaves the ranges ``norm_view`` drops out, as
    ``stats(norm_view(grads))`` does on the whole gradient. Here ``block`` (elements 16-288 of 480, cut by
    the 128-element chunks) plays the copy. With clipping the norm is summed before the first bucket
    (and reaches the parameters); without, chunk by chunk as they update (the logged norm)."""
    from jaxhybrid.core.config.schema import Config, OptimConfig

    _, params, batches, grad = _setup()
    cfg = Config(optim=OptimConfig(bucket_size=64, grad_clip=clip))
    view = lambda g: {k: v for k, v in g.items() if k != "block"}  # noqa: E731
    a, b = OffloadUpdater(TX, cfg), OffloadUpdater(TX, cfg)
    pa, sa, pb, sb = a.compute_params(params), a.init(params), b.compute_params(params), b.init(params)
    assert a.opt.spec.dropped_ranges(view) == ((16, 288),)  # block.b2 and block.w2, merged
    same = lambda x: x  # noqa: E731
    for batch in batches[:3]:
        ga, gb = grad(pa, batch, 1.0), grad(pb, batch, 1.0)
        flat = a.opt.flatten(ga)
        every = float(a.opt._sq(flat)) ** 0.5
        chunks = ((s, min(s + 128, 480), flat[s:min(s + 128, 480)]) for s in range(0, 480, 128))
        pa, sa, na, _ = a.apply_streamed(pa, sa, chunks, 1.0, same, same, view)
        pb, sb, nb = b.apply(pb, sb, gb, 1.0, *b.stats(view(gb)))
        assert_tree_close(float(na), float(nb), "fp32_parity", "grad norm ")
        assert abs(float(na) - every) > 1e-3 * every, (float(na), every)  # the dropped leaves mattered
    assert_tree_close(pa, pb, "fp32_parity", "params")


def test_trainer_path_holds_myelins_device_footprint():
    """``OffloadUpdater.apply`` called as ``Trainer.step`` calls it (the params and gradient pytrees the
    engine used) consumes both, and its device peak, probed after the gradients are flattened and after
    every bucket, stays within Myelin's ``4 phi + 28 bsize`` (bf16; with both pytrees kept alive next to
    the flat vectors it would be about 4 phi above it)."""
    from jaxhybrid.core.config.schema import Config, OptimConfig, PrecisionConfig
    from jaxhybrid.optim.memory_report import live_device_bytes

    _, params, batches, grad = _setup()
    cfg = Config(optim=OptimConfig(bucket_size=32), precision=PrecisionConfig(compute_dtype="bfloat16"))
    upd = OffloadUpdater(TX, cfg)
    state = upd.init(params)
    p = upd.compute_params(params)
    for b in batches[:2]:
        before = {id(a) for a in jax.live_arrays()} - {id(x) for x in jax.tree.leaves((p, state))}
        g = grad(p, b, 1.0)
        peak = [0]
        upd.opt.on_bucket = lambda i: peak.__setitem__(0, max(peak[0], live_device_bytes(exclude=before)))
        old = jax.tree.leaves((p, g))
        p, state, _ = upd.apply(p, state, g, 1.0, *upd.stats(g))
        assert all(x.is_deleted() for x in old), "apply must consume the old params and the gradients"
        assert 0 < peak[0] <= model_state_bytes(480, compute_dtype="bfloat16", offload=True,
                                                bucket_size=32)["device_total"], peak[0]
    assert jax.tree.map(lambda x: x.dtype, p) == jax.tree.map(lambda _: jnp.dtype(jnp.bfloat16), SHAPES,
                                                                is_leaf=lambda s: isinstance(s, tuple))


def test_memory_report_matches_myelin_formulas():
    phi, b = 10_000, 100
    base = model_state_bytes(phi, compute_dtype="bfloat16")
    assert base["device_total"] == 20 * phi  # Myelin V-B: 20 phi
    off = model_state_bytes(phi, compute_dtype="bfloat16", offload=True, bucket_size=b, prefetch=0)
    assert off["device_total"] == 4 * phi + 16 * b and off["host_total"] == 12 * phi
    assert model_state_bytes(phi, compute_dtype="bfloat16", offload=True, bucket_size=b)["device_total"] == 4 * phi + 28 * b
    with pytest.raises(ValueError, match="compute_dtype='int8'"):
        model_state_bytes(phi, compute_dtype="int8")


def test_memory_report_divides_the_optimizer_state_over_its_shards():
    """optim.shard_optimizer (ZeRO-1): each of G_data replicas holds ceil(phi / G_data) parameters' Adam state,
    and with offload their host masters too; the device keeps the whole parameters and gradients."""
    phi, b = 10_001, 1000
    whole, sharded = (model_state_bytes(phi, optimizer_shards=d) for d in (1, 4))
    assert sharded["device"]["optimizer_state"] == 8 * 2501 and whole["device"]["optimizer_state"] == 8 * phi
    assert {k: v for k, v in sharded["device"].items() if k != "optimizer_state"} == \
        {k: v for k, v in whole["device"].items() if k != "optimizer_state"}
    off = model_state_bytes(phi, compute_dtype="bfloat16", offload=True, bucket_size=b, optimizer_shards=4)
    assert off["host"] == {"params_master": 4 * 2501, "optimizer_state": 8 * 2501} and off["optimizer_shards"] == 4


def test_memory_report_from_config_is_written(tmp_path):
    import json

    from jaxhybrid.core.config.schema import Config, OptimConfig, PrecisionConfig
    from jaxhybrid.optim.memory_report import report_from_config, summary_line, write_report

    cfg = Config(optim=OptimConfig(offload=True, bucket_size=100), precision=PrecisionConfig(compute_dtype="bfloat16"))
    rep = report_from_config(cfg, 10_000)
    assert rep["device_total"] == 4 * 10_000 + 28 * 100 and rep["alternative"]["device_total"] == 20 * 10_000
    path = write_report(tmp_path, rep)
    assert json.loads(path.read_text())["host_total"] == 12 * 10_000
    assert "offload=True" in summary_line(rep) and "note" not in rep  # buckets of 100 << phi: it pays
    small = report_from_config(Config(optim=OptimConfig(offload=True)), 10_000)  # one bucket of all phi
    assert small["device_total"] > small["alternative"]["device_total"]
    assert "set optim.bucket_size" in small["note"] and "note: offload holds" in summary_line(small)
    plain = report_from_config(Config(), 10_000)  # offload off: the note is only in memory.json
    assert "note" in plain and "note" not in summary_line(plain)


def test_early_column_sum_starts_stages_in_the_given_order_and_returns_them_whole():
    """``optim.overlap_grad_reduce``'s sum (one rank: the identity, through MPI's non-blocking
    all-reduce): a stage handed over early waits for those before it in ``order``; the result has every
    stage's leaves back in their shapes, dtypes and devices, cut into buckets of 3 elements on the way."""
    from mpi4py import MPI

    from jaxhybrid.parallel.data.allreduce import EarlyColumnSum

    grads = {s: {"w": jnp.arange(7.0, dtype=jnp.float32).reshape(7, 1) * (s + 1),
                 "b": jnp.full((2,), 0.5 * s, jnp.bfloat16)} for s in (0, 2)}
    spans = []
    early = EarlyColumnSum(MPI.COMM_SELF, (2, 0), 3)
    early.add(0, grads[0])
    assert not early._started  # stage 2 comes first on every replica
    early.add(2, grads[2])
    assert list(early._started) == [2, 0] and len(early._started[2].requests) == 3  # 9 elements, 3 buckets
    with pytest.raises(ValueError, match="stage 0 given twice"):
        early.add(0, grads[0])
    out = early.result(lambda *ev: spans.append(ev))
    for s in (0, 2):
        for k in ("w", "b"):
            got, want = out[s][k], grads[s][k]
            assert got.dtype == want.dtype and got.shape == want.shape and got.sharding == want.sharding
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert [name for name, kind, *_ in spans] == ["all-reduce s2", "all-reduce s0"]
    with pytest.raises(RuntimeError, match=r"without the final gradients of stages \[1\]"):
        partial = EarlyColumnSum(MPI.COMM_SELF, (0, 1), 3)
        partial.add(0, grads[0])
        partial.result()
