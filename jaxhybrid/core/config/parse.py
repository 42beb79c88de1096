"""Reading a typed config: YAML files (with ``include:``), ``--set key=value`` pairs, and the coercion
of their values onto frozen dataclasses, each error naming the key (:mod:`jaxhybrid.core.config.schema` holds the
schema, the defaults and the cross-field rules).
"""
from __future__ import annotations

import dataclasses
import typing
from functools import reduce
from pathlib import Path
from typing import Any

import yaml

from jaxhybrid.core.config.model import resolve_model
from jaxhybrid.core.errors import ConfigError


def to_plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: to_plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_plain(v) for v in x]
    return x


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the field's declared type, or raise naming the key."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin is typing.Union or (origin is not None and type(None) in args):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return tuple(_coerce(v, args[0], key) for v in value)
    try:
        if typ is bool:
            if isinstance(value, str):
                low = value.lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            if isinstance(value, bool) or value in (0, 1):  # optim.offload=2 is a typo, not "on"
                return bool(value)
            raise ValueError
        if typ is int:
            if isinstance(value, bool):
                raise ValueError
            # 1e6 comes as a string (YAML's floats need a dot and an exponent sign); 2.5 is no count to round.
            number = float(value) if isinstance(value, str) and "e" in value.lower() else value
            if isinstance(number, float) and not number.is_integer():
                raise ValueError
            return int(number)
        if typ is float:
            if isinstance(value, bool):  # float(True) is 1.0: optim.lr=true read as a learning rate of 1
                raise ValueError
            return float(value)
        if typ is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            # YAML's null (null, ~, an empty value) is "none": the empty string every path and name key
            # takes for that, not a file or run directory named "None".
            return "" if value is None else str(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int of "1e400", which floats read as inf
        raise ConfigError(f"{key}: cannot read {value!r} as {getattr(typ, '__name__', typ)}") from None
    return value


def apply_updates(obj: Any, updates: dict[str, Any], prefix: str = "") -> Any:
    """Return a copy of dataclass ``obj`` with nested ``updates``; unknown keys raise ConfigError."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    changes = {}
    for key, value in updates.items():
        path = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key '{path}'; valid keys here: {', '.join(sorted(names))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if isinstance(value, str) and key == "model":
                changes[key] = resolve_model(value)
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: expected a mapping of keys, got {value!r}")
            if key == "model" and "name" in value:
                # A model preset first, then the explicit fields on top of it.
                base = resolve_model(str(value["name"]))
                rest = {k: v for k, v in value.items() if k != "name"}
                changes[key] = apply_updates(base, rest, path + ".")
                continue
            changes[key] = apply_updates(current, value, path + ".")
        else:
            changes[key] = _coerce(value, hints[key], path)
    return dataclasses.replace(obj, **changes)


def parse_overrides(pairs: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=x"]`` into a nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        key, raw = pair.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: '{part}' is both a value and a section{_preset_hint(part, node)}")
        last, old = parts[-1], node.get(parts[-1])
        if isinstance(old, dict):
            # Keys set one by one before: a mapping adds to them; a plain value would drop them unsaid.
            if not isinstance(value, dict):
                raise ConfigError(f"--set {key}={raw}: '{key.strip()}' is a section, set key by key by another "
                                  f"--set{_preset_hint(last, value) if len(parts) == 1 else ''}")
            value = merge(old, value, f"{key.strip()}.")
        node[last] = value
    return tree


def _preset_hint(section: str, value: Any) -> str:
    """``--set model=NAME`` names a preset and replaces the whole model section; with other ``model.*``
    keys, the preset goes in ``model.name``, which takes them on top (as a YAML file's ``model:`` does)."""
    if section != "model" or not isinstance(value, str):
        return ""
    return f"; to change fields of preset {value!r}, name it with --set model.name={value}"


def merge(a: dict, b: dict, prefix: str = "") -> dict:
    """``b`` over ``a``, section by section. A section of ``a`` that is not a mapping is an error here even
    when ``b`` adds keys to it: replacing it would hide the error :func:`apply_updates` gives it alone.
    A model preset name (``model: llama-tiny``) is a section too: it is the mapping ``{name: llama-tiny}``."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and k in out:
            old = out[k]
            if k == "model" and not prefix and isinstance(old, str):
                old = {"name": old}
            if not isinstance(old, dict):
                raise ConfigError(f"{prefix}{k}: expected a mapping of keys, got {old!r}")
            v = merge(old, v, f"{prefix}{k}.")
        out[k] = v
    return out


def lookup(cfg: Any, key: str) -> Any:
    """The value of dotted ``key`` (``"optim.lr"``) in a config, as plain data (a tuple as a list)."""
    return to_plain(reduce(getattr, key.split("."), cfg))


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: the dotted keys a nested override tree sets."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last value of a key named twice in one mapping: a second ``train:`` section would
    drop the first's keys without a word. A merge key's (``<<``) entries may still be overridden."""

    def construct_mapping(self, node, deep=False):
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_scalar(key_node)
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping (first on line {first[key] + 1}); keep "
                    f"one and merge their settings into it", key_node.start_mark)
            first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def read_text(p: Path, what: str) -> str:
    """``p``'s text, for every file a user names (configs, hardware files, plans, profiles). One that is
    not UTF-8, a binary given by mistake, is named with ``what`` it was read as: Python's own
    UnicodeDecodeError names neither."""
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def load_yaml(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML override file; ``include: other.yaml`` pulls another file in first (``_chain``: the
    files that included this one, so a cycle is named rather than recursed into)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {p} is a folder; give a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    text = read_text(p, "config file")
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"malformed YAML in {p}{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections, got {type(data).__name__}")
    inc = data.pop("include", None)
    if inc:
        if not isinstance(inc, str):
            raise ConfigError(f"{p}: include: {inc!r} must be one file name (read relative to {p.parent})")
        target = p.parent / inc  # relative to the including file, wherever the job runs from
        if not target.is_file():
            raise ConfigError(f"{p}: include: {inc} not found (looked for {target}; an include is read "
                              f"relative to the file that names it)")
        chain = (*_chain, p)
        if target.resolve() in {c.resolve() for c in chain}:
            raise ConfigError(f"{p}: include: {inc} includes {target} again ({' -> '.join(map(str, chain))} -> "
                              f"{target}); remove one of the includes")
        data = merge(load_yaml(target, chain), data)
    return data
