"""YAML's null and booleans on typed keys. A text key read null as the text "None": ``--set run.dir=null``
trained into a folder named None, ``data: {path: ~}`` failed with "data path not found: None" and
``train: {init_from: null}`` with "None is not a jaxhybrid export". A float key read true as 1.0:
``--set optim.lr=true`` was reported as "optim.lr=1.0 must be in (0, 1)", a value the user never wrote."""
import pytest

from jaxhybrid.core.errors import ConfigError
from jaxhybrid.runtime.config_load import load_config


@pytest.mark.parametrize("key", ["data.path", "train.init_from", "plan.file", "run.name"])
@pytest.mark.parametrize("null", ["null", "~", ""])
def test_null_text_is_none(key, null):
    cfg = load_config("configs/runs/tiny.yaml", [f"{key}={null}"])
    sec, name = key.split(".")
    assert getattr(getattr(cfg, sec), name) == ""


def test_null_run_dir_is_refused_not_named_none():
    with pytest.raises(ConfigError, match="run.dir='' must not be empty"):
        load_config("configs/runs/tiny.yaml", ["run.dir=null"])


def test_yaml_file_null(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("include: " + str(__import__("pathlib").Path("configs/runs/tiny.yaml").resolve()) +
                 "\ndata: {path: ~}\ntrain: {init_from: null}\n")
    cfg = load_config(f)
    assert (cfg.data.path, cfg.train.init_from) == ("", "")


def test_boolean_is_not_a_float():
    with pytest.raises(ConfigError, match=r"^optim\.lr: cannot read True as float$"):
        load_config("configs/runs/tiny.yaml", ["optim.lr=true"])


def test_an_integer_other_than_0_or_1_is_not_a_boolean():
    """YAML reads ``offload: 2`` as the integer 2: a typo, not "on" (it read as true)."""
    with pytest.raises(ConfigError, match=r"^optim\.offload: cannot read 2 as bool$"):
        load_config("configs/runs/tiny.yaml", ["optim.offload=2"])
    f = __import__("pathlib").Path("configs/runs/tiny.yaml").resolve()
    assert load_config(f, ["optim.offload=1"]).optim.offload is True
