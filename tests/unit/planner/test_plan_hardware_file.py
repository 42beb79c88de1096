"""``jaxhybrid plan --hardware FILE``: the planner's keys of a hardware file are checked when it is read,
each wrong value named with its file. Before, a negative ``memory_bytes`` ranked against "-9e-10 GB
usable", text where a number belongs ended in Python's bare "could not convert string to float",
``gpus_per_node: 0`` was blamed on ``--gpus-per-node`` ("must be in [1, 0]"), ``2.5`` and negative
bandwidths were used as they were, and a zero or missing ``host_to_device`` crashed the offload model
with a ZeroDivisionError traceback."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jaxhybrid.cli.main import main

H100 = Path(__file__).resolve().parents[3] / "configs" / "hardware" / "h100-node.yaml"


def _plan(tmp_path, capsys, edit) -> tuple[int, str]:
    hw = yaml.safe_load(H100.read_text())
    edit(hw)
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(hw))
    rc = main(["plan", "--model", "gpt-tiny", "--gpus", "2", "--gpus-per-node", "2", "--hardware", str(path),
               "--global-batch", "16", "--top", "1"])
    return rc, capsys.readouterr().err


def _set(*keys, value):
    def edit(hw):
        d = hw
        for k in keys[:-1]:
            d = d[k]
        if value is None:
            del d[keys[-1]]
        else:
            d[keys[-1]] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_set("memory_bytes", value=-1), "memory_bytes=-1 must be a finite number > 0"),
    (_set("memory_bytes", value="lots"), "memory_bytes='lots' must be a finite number > 0"),
    (_set("gpus_per_node", value=0), "gpus_per_node=0 must be an integer >= 1"),
    (_set("gpus_per_node", value=2.5), "gpus_per_node=2.5 must be an integer >= 1"),
    (_set("bandwidth", "inter_node", value=-5), "bandwidth.inter_node=-5 must be a finite number > 0"),
    (_set("bandwidth", "host_to_device", value=0), "bandwidth.host_to_device=0 must be a finite number > 0"),
    (_set("bandwidth", "host_to_device", value=None), "bandwidth.host_to_device is missing"),
    (_set("bandwidth", "intra_node", value=[{"span": 0, "bytes_per_s": 1e9}]),
     "bandwidth.intra_node[0].span=0 must be an integer >= 1"),
    (_set("bandwidth", "intra_node", value=[{"span": 8, "bytes_per_s": "abc"}]),
     "bandwidth.intra_node[0].bytes_per_s='abc' must be a finite number > 0"),
    (_set("bandwidth", "intra_node", value=450e9), "bandwidth.intra_node=450000000000.0 must be a list of "),
])
def test_a_wrong_planner_value_is_named_with_its_file(tmp_path, capsys, edit, message):
    rc, err = _plan(tmp_path, capsys, edit)
    assert rc == 2, err
    assert err.startswith(f"jaxhybrid plan: error: hardware file {tmp_path / 'hw.yaml'}: "), err
    assert message in err, err


def test_the_shipped_file_as_it_is_plans(tmp_path, capsys):
    assert _plan(tmp_path, capsys, lambda hw: None)[0] == 0
