"""A resume that changes the compute dtype (allowed: the resume names it) rescales as the new dtype does.
A bfloat16 run resumed as float16 kept the saved static scale 1.0 (``jaxhybrid train ... --set
precision.compute_dtype=float16 --resume`` logged ``scale 1`` on every step: float16 gradients unscaled,
one doubling per 1000 steps), and a float16 run resumed as bfloat16 kept 32768 as a fixed scale."""
import dataclasses

from jaxhybrid.core.config.schema import PrecisionConfig
from jaxhybrid.optim.loss_scale import from_config


def _scale(dtype: str):
    return from_config(dataclasses.replace(PrecisionConfig(), compute_dtype=dtype))


def test_static_checkpoint_resumed_as_float16_starts_at_loss_scale_init():
    saved = _scale("bfloat16").update(True).state_dict()
    resumed = _scale("float16").load_state_dict(saved)
    assert resumed.dynamic and resumed.scale == PrecisionConfig().loss_scale_init == 2.0**15


def test_float16_checkpoint_resumed_as_bfloat16_keeps_the_static_scale():
    st = _scale("float16").update(False).update(True)  # halved once, one good step
    resumed = _scale("bfloat16").load_state_dict(st.state_dict())
    assert not resumed.dynamic and resumed.scale == 1.0


def test_same_mode_continues():
    st = _scale("float16").update(False).update(True)
    resumed = _scale("float16").load_state_dict(st.state_dict())
    assert (resumed.scale, resumed.good_steps) == (2.0**14, 1)


def test_checkpoints_without_the_mode():
    """Written before the mode was saved: scale 1.0 with no good steps is a static run's state."""
    assert _scale("float16").load_state_dict({"scale": 1.0, "good_steps": 0}).scale == 2.0**15
    assert _scale("float16").load_state_dict({"scale": 4096.0, "good_steps": 7}).scale == 4096.0
