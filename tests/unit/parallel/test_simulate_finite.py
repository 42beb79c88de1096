"""``jaxhybrid simulate`` refuses costs, link times and periods that are not finite numbers. An infinite
``--costs`` entry, ``--latency`` or ``--message-bytes``, or a NaN ``--latency``, printed ``makespan=inf``
(or a finite makespan) with ``bubble_ratio=nan`` and ``busy=nan`` and exited 0; a NaN or infinite 1F1B*
``--period`` was taken as the default period. The checks live in :class:`Costs` and MadPipe's grouping,
which every caller (the simulator, the planner, the benchmarks) goes through."""
from __future__ import annotations

import math

import pytest

from jaxhybrid.cli.main import build_parser
from jaxhybrid.parallel.pipeline.costs import Costs

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
