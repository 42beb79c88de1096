"""``jaxhybrid simulate``'s inputs are checked before the simulation: costs, link times and periods must be
finite, flags that cannot change the result are refused, and the output paths are probed."""
from __future__ import annotations

import json
import math

import pytest

from jaxhybrid.cli.main import build_parser, main
from jaxhybrid.parallel.pipeline.costs import Costs

# ``jaxhybrid simulate`` refuses costs, link times and periods that are not finite numbers. An infinite
# ``--costs`` entry, ``--latency`` or ``--message-bytes``, or a NaN ``--latency``, printed ``makespan=inf``
# (or a finite makespan) with ``bubble_ratio=nan`` and ``busy=nan`` and exited 0; a NaN or infinite 1F1B*
# ``--period`` was taken as the default period. The checks live in :class:`Costs` and MadPipe's grouping,
# which every caller (the simulator, the planner, the benchmarks) goes through.

BASE = ("simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches", "2")


def _run(*argv: str) -> int:
    _, args = build_parser(list(argv))
    return args._run(args)


@pytest.mark.parametrize("costs", ["inf,1,1", "1,inf,1", "1,1,inf", "1,1,-inf"])
def test_infinite_costs_are_refused(costs):
    with pytest.raises(ValueError, match=r"finite"):
        _run(*BASE, f"--costs={costs}")


@pytest.mark.parametrize("flags", [("--latency", "inf"), ("--latency", "nan"),
                                   ("--message-bytes", "inf", "--bandwidth", "10")])
def test_non_finite_link_times_are_refused(flags):
    with pytest.raises(ValueError, match=r"finite"):
        _run(*BASE, *flags)


@pytest.mark.parametrize("period", ["nan", "inf"])
def test_non_finite_period_is_refused(period):
    with pytest.raises(ValueError, match=rf"period {period} must be a finite number"):
        _run("simulate", "--schedule", "1f1b-star", "--stages", "2", "--microbatches", "4", "--period", period)


def test_costs_refuse_infinity_directly():
    with pytest.raises(ValueError, match=r"costs.backward_weight = \(1.0, inf\)"):
        Costs((1.0, 1.0), (1.0, 1.0), (1.0, math.inf))
    assert Costs((1.0,), (1.0,), (0.0,), bandwidth=math.inf).bandwidth == math.inf  # no link cost: allowed


def test_finite_values_still_simulate(capsys):
    assert _run(*BASE, "--costs", "1,2,1", "--latency", "0.5") == 0
    assert "makespan=" in capsys.readouterr().out
    assert _run("simulate", "--schedule", "1f1b-star", "--stages", "2", "--microbatches", "4", "--period", "5") == 0


@pytest.mark.parametrize("flag", ["--activation-bytes", "--residual-bytes"])
def test_a_bad_byte_value_is_named_not_its_count(flag):
    """``--activation-bytes nan`` said 'give one finite value >= 0, or 2 (one per stage), not 1': the
    count was right, the value was not."""
    with pytest.raises(ValueError, match=rf"^{flag} '1,nan': nan is not a finite number >= 0$"):
        _run(*BASE, "--split-backward", flag, "1,nan")
    with pytest.raises(ValueError, match=rf"^{flag} '1,2,3': give one value, or 2 \(one per stage\), not 3$"):
        _run(*BASE, "--split-backward", flag, "1,2,3")


# ``jaxhybrid simulate`` refuses a flag that cannot change the result instead of ignoring it (as it does
# --pipeline-limit, --period and --memory-saving given to the wrong schedule): ``--residual-bytes`` without
# a split backward printed peak_bytes from the activation bytes alone, and ``--message-bytes`` without
# ``--bandwidth`` (infinite by default) cost nothing, both without a word.

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


# ``jaxhybrid simulate --trace OUT.json / --png OUT.png`` are probed before the simulation, as the other
# commands probe their output paths. A folder given as ``--trace`` ended in an IsADirectoryError traceback,
# and an unwritable place in a bare "[Errno 2] No such file or directory" that named no flag, both after
# the schedule had been built and simulated. Missing folders on the way are still made.

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
