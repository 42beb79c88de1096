"""Argument checks shared by the commands, made before any slow work (profiling, compiling, tokenizing,
starting MPI), so a mistyped flag fails at once with a line naming the flag, the value and what it may be.

``positive_int`` is an argparse ``type=``: argparse then reports ``jaxhybrid CMD: error: argument --flag:
...`` with its usage line and exit code 2, as it does for a value that is no integer at all. A flag whose
default means "derive it" (the config's batch, the model's sequence length, all cores) defaults to None
rather than 0, so a typed 0 is rejected instead of silently meaning the default. The other checks depend on
more than one value and raise ValueError, which ``jaxhybrid.cli.main`` prints as ``jaxhybrid CMD: error:``.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def _int_at_least(floor: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = floor - 1
    if value < floor:
        raise argparse.ArgumentTypeError(f"must be an integer >= {floor} (got {text!r})")
    return value


def positive_int(text: str) -> int:
    """argparse ``type=`` of a count that must be >= 1."""
    return _int_at_least(1, text)


def nonnegative_int(text: str) -> int:
    """argparse ``type=`` of a count that may be 0 (warm-up rounds)."""
    return _int_at_least(0, text)


def check_seq_len(seq_len: int | None, model, flag: str = "--seq-len") -> None:
    """A given sequence length fits the model's position table (``train`` rejects a longer
    ``data.seq_len``; the planner and the profiler would otherwise cost a model that cannot run)."""
    if seq_len is not None and seq_len > model.max_seq_len:
        raise ValueError(f"{flag} {seq_len} must be at most {model.name}'s max_seq_len={model.max_seq_len}")


def nearest_existing(path: Path) -> Path:
    """``path`` if it exists, else its nearest existing parent: the folder that would take it."""
    return next(d for d in (path, *path.parents) if d.exists())


def check_writable(path: str | Path, flag: str, directory: bool = False, hint: str = "",
                   parents: bool = False) -> None:
    """``path`` can be written where the command will write it after its slow part: a file (its folder
    must exist, unless ``parents``: the writer makes missing folders) or, with ``directory``, a folder
    (made with its parents if missing). The folder that would take the new entry is probed with a
    temporary file, since as root ``os.access`` calls even /proc writable. Errors name ``flag`` and the
    path (``flag`` ending in ``=``: a config key, as ``run.dir=``), then ``hint``."""
    p = Path(path)
    what = f"{flag}{path}" if flag.endswith("=") else f"{flag} {path}"
    if p.is_dir() != directory and p.exists():
        want = "a directory" if directory else "a file"
        raise ValueError(f"{what} is {'a directory' if p.is_dir() else 'a file'}; give {want}{hint}")
    where = p.absolute()
    made = (where, *where.parents) if directory else where.parents if parents else ()  # folders made on the way
    near = nearest_existing(made[0]) if made else where.parent
    if not near.is_dir():
        why = "is not a directory" if near.exists() else "does not exist"
        raise ValueError(f"{what} cannot be written: {near} {why}{hint}")
    try:
        tempfile.TemporaryFile(dir=near).close()
    except OSError as e:
        raise ValueError(f"{what} cannot be written: {near} takes no new file ({e.strerror or e}){hint}") from None


class DefaultsHelp(argparse.HelpFormatter):
    """``--help`` says each option's default unless its help already speaks of one: argparse's own
    ArgumentDefaultsHelpFormatter also prints ``(default: None)``/``(default: False)`` for options whose
    default means "not given", and nothing for options without help text."""

    def _format_action(self, action):
        shown = action.default not in (None, False, argparse.SUPPRESS, "", [])
        if not shown or not action.option_strings or "default" in (action.help or ""):
            return super()._format_action(action)
        saved = action.help
        action.help = f"{saved} (default: %(default)s)" if saved else "default: %(default)s"
        try:
            return super()._format_action(action)
        finally:
            action.help = saved
