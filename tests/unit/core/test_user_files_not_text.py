"""A file a user names that is not UTF-8 text (a binary or a Latin-1 file given by mistake), or that is a
folder, is named in the error. Before, a config (``--config``, and so ``launch``), a hardware file
(``plan --hardware``, ``metrics.hardware``), a plan file (``plan.file``) or a profile (``partition
--profile``) that was not UTF-8 failed with Python's bare "'utf-8' codec can't decode byte 0xff in
position 0: invalid start byte", naming neither the file nor what it was read as; a folder given as
``--config`` was "config file not found"."""
from __future__ import annotations

import pytest

from jaxhybrid.cli.main import main


@pytest.fixture
def binary(tmp_path):
    p = tmp_path / "notes.yaml"
    p.write_bytes(b"\xff\xfe\x00train: {}\n")
    return p


def _err(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv, what", [
    (("train", "--config", "{f}"), "config file"),
    (("launch", "-n", "2", "--", "--config", "{f}"), "config file"),
    (("plan", "--model", "gpt-tiny", "--gpus", "1", "--gpus-per-node", "1", "--hardware", "{f}"), "hardware file"),
    (("train", "--set", "plan.file={f}", "--set", "run.dir={d}/run"), "plan file"),
    (("partition", "--profile", "{f}", "--processors", "2", "--memory", "1e9", "--bandwidth", "1e9"), "profile"),
])
def test_a_file_that_is_not_text_is_named(tmp_path, binary, capsys, argv, what):
    rc, err = _err(capsys, *(a.format(f=binary, d=tmp_path) for a in argv))
    assert rc == 2, err
    assert f"{what} {binary} is not UTF-8 text (invalid start byte at byte 0)" in err, err


def test_a_folder_given_as_config_is_named_as_one(tmp_path, capsys):
    rc, err = _err(capsys, "train", "--config", str(tmp_path))
    assert (rc, err) == (2, f"jaxhybrid train: error: config file {tmp_path} is a folder; give a YAML file\n")
