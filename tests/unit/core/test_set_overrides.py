"""``--set`` pairs that name a section both whole and key by key. ``--set model=llama-tiny --set
model.d_model=128`` (a preset, then one of its fields) stopped with "'model' is both a value and a
section" and no way out named; the other order, ``--set model.d_model=128 --set model=llama-tiny``, trained
llama-tiny at d_model 64 without a word: the later pair replaced the section and dropped the earlier key."""
from __future__ import annotations

import pytest

from jaxhybrid.core.config.parse import parse_overrides
from jaxhybrid.core.errors import ConfigError
from jaxhybrid.runtime.config_load import load_config


@pytest.mark.parametrize("pairs", [["model=llama-tiny", "model.d_model=128"],
                                   ["model.d_model=128", "model=llama-tiny"]])
def test_preset_with_fields_names_model_name(pairs):
    with pytest.raises(ConfigError, match=r"--set model\.name=llama-tiny"):
        load_config("configs/runs/tiny.yaml", pairs, check=False)


def test_preset_name_with_fields_either_order():
    for pairs in (["model.name=llama-tiny", "model.d_model=128"], ["model.d_model=128", "model.name=llama-tiny"]):
        m = load_config("configs/runs/tiny.yaml", pairs, check=False).model
        assert (m.name, m.d_model, m.kind) == ("llama-tiny", 128, "llama")


def test_a_section_given_whole_after_its_keys():
    """A mapping adds to the keys set before it; a plain value would drop them, so it is refused."""
    assert parse_overrides(["train.steps=7", "train={seed: 3}"]) == {"train": {"steps": 7, "seed": 3}}
    with pytest.raises(ConfigError, match="'train' is a section"):
        parse_overrides(["train.steps=7", "train=5"])
    assert parse_overrides(["train.steps=7", "train.steps=9"]) == {"train": {"steps": 9}}  # last wins
    assert parse_overrides(["model=llama-tiny"]) == {"model": "llama-tiny"}  # a preset alone, as before
