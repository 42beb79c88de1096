"""A resume from a damaged checkpoint, or from one of another model, is a named error, not orbax's or flax's.

One 2-step run is copied and damaged per case: what a user gets from a partial copy, a full disk or a run
folder whose config.yaml is gone (the one file the layout check reads before anything is built).
"""
import shutil

import pytest

from jaxhybrid.core.errors import ConfigError
from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.trainer import Trainer

FAST = ["model.name=gpt-tiny", "model.n_layers=2", "data.seq_len=32", "train.global_batch=4", "train.steps=2",
        "metrics.progress=false", "metrics.tensorboard=false", "metrics.plot=false"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved") / "run"
    Trainer(load_config(None, FAST + [f"run.dir={root}"])).run()  # checkpoints step 2 at the end
    return root


def _resume(saved, tmp_path, damage, *extra):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    damage(run / "checkpoints" / "rank_0" / "2")
    Trainer(load_config(None, FAST + [f"run.dir={run}", "train.steps=3", "run.resume=true", *extra])).run()


def _truncate_arrays(step):
    for f in (step / "state").rglob("d/*"):
        f.write_bytes(f.read_bytes()[:10])


DAMAGE = {
    "truncated arrays": _truncate_arrays,
    "meta missing": lambda step: (step / "meta" / "metadata").unlink(),
    "meta garbage": lambda step: (step / "meta" / "metadata").write_text("{garbage"),
    "state missing": lambda step: shutil.rmtree(step / "state"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_checkpoint_is_named_with_its_folder_and_the_fix(saved, tmp_path, damage):
    """Each used to end in orbax's own words (a tensorstore byte range, 'File ... not found', a bare JSON
    decode error naming no file) or a KeyError traceback (state folder gone)."""
    with pytest.raises(ValueError, match=rf"{tmp_path / 'run' / 'checkpoints' / 'rank_0' / '2'}\S* (cannot be read|"
                                         rf"holds no readable checkpoint).*(delete|restore)"):
        _resume(saved, tmp_path, damage)


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_the_fix_offers_an_earlier_step_only_where_one_is_held(saved, tmp_path, damage):
    """The one step of this run is damaged: deleting it leaves nothing to resume (it offered that anyway),
    whichever read fails: the arrays' metadata (truncated arrays, state gone) or the restore itself."""
    with pytest.raises(ValueError, match=r"restore the folder from a copy, or start a new run \(this rank holds no "
                                         r"earlier step\)"):
        _resume(saved, tmp_path, damage)


@pytest.mark.slow
def test_truncated_arrays_are_not_called_missing_metadata(saved, tmp_path):
    """orbax reads the array metadata from the store whose files were truncated: the metadata file is there."""
    with pytest.raises(ValueError, match=r"cannot be read \(its orbax metadata is missing or damaged\); if it is damaged"):
        _resume(saved, tmp_path, _truncate_arrays)


@pytest.mark.slow
@pytest.mark.parametrize("extra, leaf", [(("model.d_model=96",), r"params\.block_000\.attn_out\.kernel: saved \(64, 64\), "
                                                                 r"this run \(96, 96\)"),
                                         (("model.n_layers=3",), r"not saved, this run")])
def test_a_checkpoint_of_another_model_is_named_without_its_config_yaml(saved, tmp_path, extra, leaf):
    """Without config.yaml (a partial copy, checkpoints moved between runs) the layout check had nothing to
    compare: another d_model restored the saved arrays as they were and failed in flax's apply with a
    ScopeParamShapeError traceback; another depth in orbax's 'Structure mismatch' dump. The saved tree is
    now compared with this run's, leaf by leaf, before anything is read."""
    with pytest.raises(ConfigError, match=rf"holds another model or layout than this run's .*{leaf}"):
        _resume(saved, tmp_path, lambda step: (step.parent.parent.parent / "config.yaml").unlink(), *extra)
