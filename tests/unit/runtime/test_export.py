"""``jaxhybrid export`` and ``train.init_from``: a run's weights, whatever layout saved them, as the
single-device model's dict, and runs of other layouts started from it (tensor mesh, pipeline stages)."""
import jax
import numpy as np
import pytest

from jaxhybrid.cli.main import main
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.model import Model
from jaxhybrid.model.testing import assert_tree_close
from jaxhybrid.model.transformer import PARAM_LAYOUT, TIED_KEY
from jaxhybrid.parallel.data.flat import FlatSpec
from jaxhybrid.parallel.twobp.stage import make_stages
from jaxhybrid.runtime.checkpoint.export import consolidate, export_run, load_export, params_for, read_meta
from jaxhybrid.runtime.checkpoint.store import Checkpointer, read_state
from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.run_dir import write_run_config
from jaxhybrid.runtime.trainer import Trainer

# Tied embeddings, so a last pipeline stage holds the table's copy.
FAST = ["model.name=gpt-tiny", "model.n_layers=2", "model.tie_embeddings=true", "data.seq_len=32",
        "train.global_batch=4", "metrics.progress=false", "metrics.tensorboard=false", "metrics.plot=false",
        "optim.warmup_steps=1"]


def _cfg(run_dir, *extra):
    return load_config(None, FAST + [f"run.dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step single-device run, checkpointed at 2 and 3, and its step-3 export."""
    root = tmp_path_factory.mktemp("export")
    t = Trainer(_cfg(root / "run", "train.steps=3", "checkpoint.every=2"))
    t.run()
    assert main(["export", "--run-dir", str(root / "run"), "--out", str(root / "w")]) == 0
    return root, t


@pytest.mark.slow
def test_export_is_the_runs_weights_and_names_its_source(trained, capsys):
    root, t = trained
    got = load_export(root / "w")
    assert_tree_close(got, jax.tree.map(np.asarray, t.final_state.params), "exact", "export vs final params ")
    meta = read_meta(root / "w")
    assert (meta["step"], meta["parts"], meta["layout"]["pipeline"]) == (3, t.model.names, 1)
    assert meta["params"] == t.model.cfg.param_count()
    assert main(["export", "--run-dir", str(root / "run"), "--out", str(root / "w2"), "--step", "2"]) == 0
    assert read_meta(root / "w2")["step"] == 2
    assert not any(p.name.startswith(".") for p in root.iterdir())  # the temporary folder was renamed
    with pytest.raises(ValueError, match=r"step 1 of .* is not a checkpointed step; steps all ranks hold: 2, 3"):
        export_run(root / "run", root / "w3", step=1)
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        export_run(root / "run", root / "w", step=3)
    with pytest.raises(ValueError, match="has no config.yaml"):
        export_run(root / "w", root / "w4")


@pytest.mark.slow
def test_pipeline_and_offload_checkpoints_consolidate(trained, tmp_path, monkeypatch):
    """Per-rank checkpoints as a 2-stage x 2-replica pipeline writes them: each rank its stage's parts (the
    last with the tied copy), and with the offloaded optimizer the fp32 masters as a flat vector with
    the bf16 compute copy as params. The export is the model's dict of the masters, read from ranks 0
    and 1 only (the replicas' parts are known from their metadata)."""
    import jaxhybrid.runtime.checkpoint.export as ce

    read = []

    def spy(path):
        read.append(path.parent.parent.name)  # <run>/checkpoints/rank_<r>/<step>/state
        return read_state(path)

    monkeypatch.setattr(ce, "read_state", spy)
    root, t = trained
    full = jax.tree.map(np.asarray, t.final_state.params)
    stages = make_stages(t.model, [1, 1])
    for offload in (False, True):
        run = tmp_path / f"pipe{offload}"
        cfg = _cfg(run, "parallel.pipeline=2", "parallel.data=2", f"optim.offload={str(offload).lower()}")
        run.mkdir()
        write_run_config(run, cfg, 0)
        for rank in range(4):
            mine = stages[rank % 2].slice_params(full)
            if offload:
                master = FlatSpec(mine).ravel_host(mine)
                state = {"params": jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), mine),
                         "opt_state": {"master": master, "state": {"000": np.zeros_like(master)}}}
            else:
                state = {"params": mine, "opt_state": {"count": np.zeros((), np.int32)}}
            ck = Checkpointer(run, rank)
            ck.save(5, state, {"step": 5, "param_layout": PARAM_LAYOUT})  # as Trainer.save writes it
            ck.close()
        read.clear()
        params, step, _ = consolidate(run)
        assert step == 5 and read == ["rank_0", "rank_1"]
        assert_tree_close(params, full, "exact", f"offload={offload} consolidated ")


@pytest.mark.slow
def test_init_from_starts_a_tensor_run_and_pipeline_stages_from_the_export(trained, tmp_path, capsys):
    """A (data 2, row 2, col 2) mesh starts from the exported weights, sharded, and takes the same first step
    as a single-device run from them; a pipeline's last stage gets its blocks, head and the tied copy."""
    root, _ = trained
    want = load_export(root / "w")
    one = Trainer(_cfg(tmp_path / "one", "train.steps=1", f"train.init_from={root / 'w'}"))
    assert_tree_close(jax.tree.map(np.asarray, one.init_state().params), want, "exact", "single device ")
    said = f"jaxhybrid: weights from {root / 'w'} (step 3 of {root / 'run'}); a fresh optimizer"
    assert said in capsys.readouterr().err
    tp = Trainer(_cfg(tmp_path / "tp", "train.steps=1", f"train.init_from={root / 'w'}", "parallel.data=2",
                      "parallel.tensor_row=2", "parallel.tensor_col=2"))
    st = tp.init_state()
    assert any(len(x.sharding.device_set) > 1 for x in jax.tree.leaves(st.params))
    assert_tree_close(jax.tree.map(np.asarray, st.params), want, "exact", "tensor mesh ")
    losses = [t.run()["first_loss"] for t in (one, tp)]
    assert_tree_close(np.float32(losses[1]), np.float32(losses[0]), "fp32_parity", "first loss ")
    last = make_stages(Model(one.cfg.model), [1, 1])[1]
    got = params_for(last.init_params(jax.random.key(1)), root / "w")
    assert sorted(got) == sorted(["block_001", "head", TIED_KEY])
    assert_tree_close(got, {**last.slice_params(want)}, "exact", "last stage ")


def test_init_from_is_checked_before_anything_is_built(trained, tmp_path):
    root, _ = trained
    with pytest.raises(ConfigError, match=r"holds weights of another shape than this run's model: model.n_layers "
                                          r"2 there, 3 here; model.d_ff 256 there, 128 here$"):
        Trainer(_cfg(tmp_path / "a", f"train.init_from={root / 'w'}", "model.n_layers=3", "model.d_ff=128"))
    Trainer(_cfg(tmp_path / "c", f"train.init_from={root / 'w'}", "model.init_std=0.05"))  # no shape changes
    with pytest.raises(ConfigError, match=f"train.init_from={tmp_path}: {tmp_path} is not a jaxhybrid export"):
        Trainer(_cfg(tmp_path / "b", f"train.init_from={tmp_path}"))
    # A resumed run continues from its own checkpoints: the export it started from is not read again.
    t = Trainer(_cfg(root / "run", "train.init_from=/nonexistent", "run.resume=true", "train.steps=3"))
    assert t.run()["steps"] == 3


def test_init_from_compares_the_shapes_the_settings_mean(trained, tmp_path):
    """``n_kv_heads: 0`` means ``n_heads``, and LLaMA's RoPE has no position table, so an export starts a
    model that spells its KV heads out or extends its context (``max_seq_len``); a real change is named."""
    import dataclasses
    import json

    from jaxhybrid.core.config.model import PRESETS
    from jaxhybrid.runtime.checkpoint.export import check_init_from

    root, _ = trained
    check_init_from(_cfg(tmp_path / "a", f"train.init_from={root / 'w'}", "model.n_kv_heads=4"))
    llama = tmp_path / "llama"
    llama.mkdir()
    meta = read_meta(root / "w")
    meta["model"] = json.loads(json.dumps(dataclasses.asdict(PRESETS["llama-tiny"])))
    (llama / "export.json").write_text(json.dumps(meta))
    longer = ["model.name=llama-tiny", f"train.init_from={llama}", "model.max_seq_len=256", "data.seq_len=256"]
    check_init_from(load_config(None, [f"run.dir={tmp_path / 'b'}", *longer]))
    with pytest.raises(ConfigError, match=r"model.n_kv_heads 2 there, 4 here$"):
        check_init_from(load_config(None, [f"run.dir={tmp_path / 'c'}", *longer, "model.n_kv_heads=4"]))
    with pytest.raises(ConfigError, match=rf"{root / 'run'} is the run.dir of a training run, not an export; make "
                                          rf"one from it with `jaxhybrid export --run-dir {root / 'run'} --out"):
        check_init_from(_cfg(tmp_path / "d", f"train.init_from={root / 'run'}"))


def test_a_damaged_checkpoint_is_named_not_a_traceback(trained, tmp_path):
    """A committed step whose orbax metadata is gone (a partial copy, a disk fault) is named with its path."""
    import shutil

    root, _ = trained
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    shutil.rmtree(run / "checkpoints" / "rank_0" / "3" / "state" / "d")
    (run / "checkpoints" / "rank_0" / "3" / "state" / "_METADATA").unlink()
    with pytest.raises(ValueError, match=r"rank_0/3/state holds no readable checkpoint \(its orbax metadata is "
                                         r"missing or damaged\)"):
        export_run(run, tmp_path / "w", step=3)


def test_weights_of_the_old_qkv_layout_are_refused(trained, tmp_path):
    """Checkpoints and exports record the parameter layout (model.transformer.PARAM_LAYOUT: the fused qkv
    columns grouped per key/value head). One written before it (no param_layout in a checkpoint's meta;
    export format 1) holds [q | k | v] columns, which would load and compute another attention: a resume,
    an export and init_from name it instead."""
    import json
    import shutil

    from jaxhybrid.runtime.run_dir import check_param_layout

    root, _ = trained
    old = tmp_path / "w_old"
    shutil.copytree(root / "w", old)
    meta = json.loads((old / "export.json").read_text())
    (old / "export.json").write_text(json.dumps({**meta, "format": 1}))
    with pytest.raises(ConfigError, match=r"export of format 1 \(parameter layout: fused qkv columns as \[q \| k \| v\]\)"):
        Trainer(_cfg(tmp_path / "a", f"train.init_from={old}"))
    run = tmp_path / "run_old"
    shutil.copytree(root / "run", run)
    check_param_layout(run)  # this version's checkpoints pass
    for f in (run / "checkpoints").glob("rank_*/*/meta/metadata"):
        f.write_text(json.dumps({k: v for k, v in json.loads(f.read_text()).items() if k != "param_layout"}))
    msg = r"its checkpoints hold parameter layout 1 \(fused qkv columns as \[q \| k \| v\]\)"
    with pytest.raises(ConfigError, match=msg):
        Trainer(_cfg(run, "run.resume=true", "train.steps=4"))
    with pytest.raises(ConfigError, match=msg):
        export_run(run, tmp_path / "w2")
