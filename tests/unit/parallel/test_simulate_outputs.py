"""``jaxhybrid simulate --trace OUT.json / --png OUT.png`` are probed before the simulation, as the other
commands probe their output paths. A folder given as ``--trace`` ended in an IsADirectoryError traceback,
and an unwritable place in a bare "[Errno 2] No such file or directory" that named no flag, both after
the schedule had been built and simulated. Missing folders on the way are still made."""
from __future__ import annotations

import json

import pytest

from jaxhybrid.cli.main import main

BASE = ["simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches", "2"]


@pytest.mark.parametrize("flag", ["--trace", "--png"])
def test_a_folder_is_refused_naming_the_flag(tmp_path, capsys, flag):
    assert main([*BASE, flag, str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"jaxhybrid simulate: error: {flag} {tmp_path} is a directory; give a "
                                       f"file\n")


@pytest.mark.parametrize("flag", ["--trace", "--png"])
def test_an_unwritable_place_is_refused_naming_the_flag(capsys, flag):
    assert main([*BASE, flag, "/proc/out.file"]) == 2
    assert capsys.readouterr().err.startswith(f"jaxhybrid simulate: error: {flag} /proc/out.file cannot be "
                                              f"written: /proc takes no new file")


def test_missing_folders_are_made(tmp_path, capsys):
    trace = tmp_path / "new" / "deeper" / "t.json"
    assert main([*BASE, "--trace", str(trace), "--json"]) == 0
    assert json.loads(trace.read_text())["traceEvents"]
    assert json.loads(capsys.readouterr().out)["makespan"] == 9
