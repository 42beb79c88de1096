"""``jaxhybrid`` command line: one sub-command per module, imported only when used.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int``, and may expose
``prepare(args)``, run before JAX starts (and before :func:`~jaxhybrid.runtime.host_alloc.configure_host_malloc`,
which reads the CPU device count from the environment it settles). Errors a user can fix
(:class:`ValueError`, including :class:`~jaxhybrid.core.config.schema.ConfigError`, and missing files) print one line
and exit with code 2 and no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from jaxhybrid.core import __version__
from jaxhybrid.core.argtypes import DefaultsHelp
from jaxhybrid.core.errors import is_disk_full
from jaxhybrid.core.launch_env import bind_rank_cpus
from jaxhybrid.runtime.host_alloc import configure_host_malloc

COMMANDS = {
    "train": ("jaxhybrid.cli.commands.train", "train a model (one process, or one rank under mpirun)"),
    "launch": ("jaxhybrid.cli.commands.launch", "start an MPI job of `jaxhybrid train` ranks"),
    "simulate": ("jaxhybrid.cli.commands.simulate", "simulate a pipeline schedule: makespan, bubble, memory"),
    "plan": ("jaxhybrid.cli.commands.plan", "rank parallel layouts for a model on a cluster"),
    "partition": ("jaxhybrid.cli.commands.partition", "MadPipe / PipeDream layer partitioning of a profile"),
    "prepare-data": ("jaxhybrid.cli.commands.prepare_data", "tokenize text into a token memmap"),
    "export": ("jaxhybrid.cli.commands.export", "a run's weights (any layout) as one single-device checkpoint"),
    "bench": ("jaxhybrid.cli.commands.bench", "benchmarks that print side-by-side ratios as JSON"),
}


DESCRIPTION = ("jaxhybrid: hybrid-parallel training in JAX (Myelin's message-driven pipelines, 2BP split "
               "backward, AxoNN 4D tensor parallelism, MadPipe partitioning). `jaxhybrid COMMAND --help` "
               "for a command's options.")


def version() -> str:
    """This package's version and the JAX it runs on, read from the installed metadata (no JAX import)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return f"jaxhybrid {__version__} (jax {installed('jax')}, jaxlib {installed('jaxlib')})"
    except PackageNotFoundError:
        return f"jaxhybrid {__version__} (jax not installed)"


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace | None]:
    parser = argparse.ArgumentParser(prog="jaxhybrid", description=DESCRIPTION)
    parser.add_argument("-V", "--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        return parser, None
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])

    p = argparse.ArgumentParser(prog=f"jaxhybrid {name}", description=COMMANDS[name][1], formatter_class=DefaultsHelp)
    module.add_arguments(p)
    args = p.parse_args(argv[1:])
    args._run = module.run
    args._prepare = getattr(module, "prepare", lambda _: None)
    return parser, args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        bind_rank_cpus()  # a `jaxhybrid launch` rank pins itself before JAX sizes its thread pool from the affinity
    except ValueError as e:
        print(f"jaxhybrid: error: {e}", file=sys.stderr)
        return 2
    parser, args = build_parser(argv)  # command modules import no JAX at module level
    if args is None:
        if argv:
            parser.parse_args(argv)  # --help, --version (exit 0); an unknown command or option (exit 2)
        parser.print_help(sys.stderr)  # no command is a usage error, as argparse treats a missing one
        return 2
    try:
        args._prepare(args)  # e.g. the fake CPU devices a benchmark needs, which the malloc tuning reads
        configure_host_malloc()  # before JAX's CPU client starts its threads (jaxhybrid/runtime/host_alloc.py)
        return int(args._run(args) or 0)
    except BrokenPipeError:
        # `jaxhybrid plan ... | head`: the reader left. Python's documented recipe: point stdout at devnull
        # so the interpreter's final flush raises nothing either, and exit 1 without a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, OSError) as e:
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError) and not is_disk_full(e):
            raise
        watchdog = sys.modules.get("jaxhybrid.parallel.pipeline.watchdog")  # loaded once a rank joins an MPI job
        if watchdog is not None:
            watchdog.report_if_in_job(e)  # a rank's failure mid-job: named, with its traceback, then abort
        # One write: ranks of a job share the stream, and print's separate newline let another rank's line
        # land in between ("...nope.jsonjaxhybrid train: error: ...").
        sys.stderr.write(f"jaxhybrid {argv[0]}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"jaxhybrid {argv[0]}: interrupted\n")  # what was kept is said where it was kept
        return 130  # 128 + SIGINT, the shell's convention


if __name__ == "__main__":
    sys.exit(main())
