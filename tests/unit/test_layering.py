"""The package's imports go one way, down the layers of docs/architecture.md, and form no cycle.

Every ``import`` statement counts, the function-local ones too: a local import hides an edge from a reader
but not from the interpreter. The layers, lowest first; a module may import its own layer and those below.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "jaxhybrid"
LAYERS = ["core", "model", "parallel", "optim", "planner", "runtime", "cli", "bench"]
TOP = len(LAYERS)  # the package root (public API, ``python -m jaxhybrid``) sits above every layer


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def import_edges() -> dict[str, dict[str, int]]:
    """``{module: {imported jaxhybrid module: line}}`` over every import statement of the package."""
    mods = _modules()
    edges: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = edges.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                if t in mods and t != name:
                    out.setdefault(t, node.lineno)
    return edges


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else TOP


def _name(level: int) -> str:
    return LAYERS[level] if level < TOP else "package root"


def test_every_module_belongs_to_a_layer():
    loose = [m for m in _modules() if m != "jaxhybrid" and m != "jaxhybrid.__main__" and layer(m) == TOP]
    assert not loose, f"modules outside the layers {LAYERS}: {loose}"


def test_imports_go_down_the_layers():
    upward = [f"{src} (layer {_name(layer(src))}) imports {dst} (layer {_name(layer(dst))}) at line {line}"
              for src, outs in import_edges().items() for dst, line in outs.items()
              if layer(src) < TOP and layer(dst) > layer(src)]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_cycle():
    edges = import_edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in edges.get(m, {}):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))
