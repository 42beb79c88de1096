"""Every option of every command and benchmark says what it does in ``--help``. ``plan --json`` and
``partition --json`` / ``--algorithm`` and a dozen benchmark options printed their name alone (or only
their default), so a user learned what ``--json`` prints, or what ``bench pipeline --timeout`` bounds,
only from the source."""
from __future__ import annotations

import argparse
import importlib

import pytest

from jaxhybrid.cli.commands.bench import BENCHES
from jaxhybrid.cli.main import COMMANDS


def _parser(module: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(p)
    return p


@pytest.mark.parametrize("module", [m for m, _ in COMMANDS.values()] + [f"jaxhybrid.bench.{b}" for b in BENCHES])
def test_every_option_has_help(module):
    bare = [a.option_strings[-1] for a in _parser(module)._actions if a.option_strings and not a.help]
    assert bare == [], f"{module}: options without help: {bare}"
