"""``jaxhybrid simulate`` refuses a flag that cannot change the result instead of ignoring it (as it does
--pipeline-limit, --period and --memory-saving given to the wrong schedule): ``--residual-bytes`` without
a split backward printed peak_bytes from the activation bytes alone, and ``--message-bytes`` without
``--bandwidth`` (infinite by default) cost nothing, both without a word."""
from __future__ import annotations

import pytest

from jaxhybrid.cli.main import build_parser

BASE = ("simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches", "2")


def _run(*argv: str) -> int:
    _, args = build_parser(list(argv))
    return args._run(args)


def test_residual_bytes_needs_a_split_backward():
    with pytest.raises(ValueError, match=r"^--residual-bytes .* needs --split-backward"):
        _run(*BASE, "--residual-bytes", "5")
    assert _run(*BASE, "--residual-bytes", "5", "--split-backward") == 0
    assert _run("simulate", "--schedule", "zb-h1", "--stages", "2", "--microbatches", "2",
                "--residual-bytes", "5") == 0  # always split


def test_message_bytes_needs_a_bandwidth():
    with pytest.raises(ValueError, match=r"^--message-bytes 100 needs --bandwidth"):
        _run(*BASE, "--message-bytes", "100")
    assert _run(*BASE, "--message-bytes", "100", "--bandwidth", "1e9") == 0
