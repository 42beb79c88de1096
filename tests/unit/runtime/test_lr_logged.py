"""The learning rate each step applied is logged (metrics.jsonl and the console), as Megatron-LM and
MaxText log theirs: a warm-up or schedule setting could not be checked from a run's output before."""
import json
import math

import pytest

from jaxhybrid.runtime.config_load import load_config
from jaxhybrid.runtime.metrics.writer import _summary
from jaxhybrid.runtime.trainer import Trainer

FAST = ["model.name=gpt-tiny", "model.n_layers=2", "data.seq_len=32", "train.global_batch=4",
        "metrics.progress=false", "metrics.tensorboard=false", "metrics.plot=false",
        "optim.lr=0.03", "optim.warmup_steps=2", "optim.min_lr_ratio=0.1"]


def _cfg(tmp_path, *extra, name="run"):
    return load_config(None, FAST + [f"run.dir={tmp_path / name}"] + list(extra))


@pytest.mark.slow
def test_lr_is_logged_per_step(tmp_path):
    Trainer(_cfg(tmp_path, "train.steps=4")).run()
    recs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # Warm-up step c takes lr (c + 1) / (warm + 1), then cosine to lr * min_lr_ratio at the last step.
    assert [r["lr"] for r in recs[:3]] == pytest.approx([0.01, 0.02, 0.03])
    assert recs[3]["lr"] == pytest.approx(0.03 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2))))
    assert "lr 0.01 " in _summary(recs[0])  # the console line


@pytest.mark.slow
def test_a_skipped_step_does_not_advance_the_logged_lr_and_resume_keeps_it(tmp_path):
    """An overflow step applies no update, so the optimizer's schedule does not advance: the next step
    applies the lr the skipped one would have. The count of applied updates survives a checkpoint."""
    extra = ["train.steps=5", "train.inject_overflow_step=2", "precision.dynamic_loss_scale=true",
             "precision.loss_scale_init=1024"]
    t = Trainer(_cfg(tmp_path, *extra))
    st = t.init_state()
    lrs = []
    for _ in range(3):
        st, info = t.step(st)
        lrs.append(info["lr"])
    assert lrs == pytest.approx([0.01, 0.02, 0.02]) and st.updates == 2
    ckpt = t._checkpointer()
    t.save(ckpt, st)
    ckpt.close()
    resumed = Trainer(_cfg(tmp_path, *extra, "run.resume=true"))
    st2 = resumed.restore(resumed._checkpointer(), resumed.init_state())
    assert (st2.step, st2.updates) == (3, 2)
    _, info = resumed.step(st2)
    assert info["lr"] == pytest.approx(0.03)
