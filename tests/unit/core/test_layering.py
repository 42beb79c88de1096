"""The package's imports go one way, down the layers of docs/architecture.md, and form no cycle.

Every ``import`` statement counts, the function-local ones too: a local import hides an edge from a reader
but not from the interpreter. The layers, lowest first; a module may import its own layer and those below.
Imports sit at the top of a module; a jaxhybrid module is imported inside a function only where the top
would pull JAX (or another heavy dependency) into a module that runs without it, so that device-free
commands (``plan``, ``simulate``, ``partition``, ``--help``) start without JAX.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "jaxhybrid"
LAYERS = ["core", "model", "parallel", "optim", "planner", "runtime", "cli", "bench"]
TOP = len(LAYERS)  # the package root (public API, ``python -m jaxhybrid``) sits above every layer


# Third-party packages whose import costs start-up time (or needs devices): JAX and what builds on it.
HEAVY = {"jax", "jaxlib", "flax", "optax", "orbax", "mpi4jax", "mpi4py", "matplotlib", "scipy", "tensorboardX",
         "tokenizers"}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _targets(node: ast.Import | ast.ImportFrom, name: str, path: Path) -> list[str]:
    """Dotted names an import statement may load: the module, and ``module.name`` for each name taken."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def _imports(name: str, path: Path) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of a module, with whether it runs inside a function."""
    out = []

    def walk(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append((child, local))
            else:
                walk(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(ast.parse(path.read_text(), str(path)), False)
    return out


def import_edges(local: bool | None = None) -> dict[str, dict[str, int]]:
    """``{module: {imported jaxhybrid module: line}}`` over the package's import statements: all of them, or
    only the top-level (``local=False``) or function-local (``local=True``) ones."""
    mods = _modules()
    edges: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        out = edges.setdefault(name, {})
        for node, inside in _imports(name, path):
            if local is not None and inside != local:
                continue
            for t in _targets(node, name, path):
                if t in mods and t != name:
                    out.setdefault(t, node.lineno)
    return edges


def heavy_modules() -> set[str]:
    """Modules whose top-level imports load a :data:`HEAVY` package, directly or through other modules
    (importing ``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b`` too)."""
    mods = _modules()
    top = import_edges(local=False)
    direct = {name for name, path in mods.items()
              for node, inside in _imports(name, path) if not inside
              for t in _targets(node, name, path) if t.split(".")[0] in HEAVY}
    heavy = set(direct)
    changed = True
    while changed:
        changed = False
        for name in mods:
            if name in heavy:
                continue
            loads = {".".join(t.split(".")[:i]) for t in top[name] for i in range(2, t.count(".") + 2)}
            if loads & heavy:
                heavy.add(name)
                changed = True
    return heavy


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else TOP


def _name(level: int) -> str:
    return LAYERS[level] if level < TOP else "package root"


def test_every_module_belongs_to_a_layer():
    assert len(_modules()) > 100, f"found {len(_modules())} modules under {PACKAGE}"
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


def test_local_imports_only_where_start_up_needs_them():
    heavy = heavy_modules()
    mods = _modules()
    needless = []
    for name, path in mods.items():
        for node, inside in _imports(name, path):
            targets = [t for t in _targets(node, name, path) if t in mods]
            loads = {".".join(t.split(".")[:i]) for t in targets for i in range(2, t.count(".") + 2)}
            if inside and targets and (name in heavy or not loads & heavy):
                needless.append(f"{name} imports {targets[-1]} inside a function (line {node.lineno}): "
                                "move it to the top")
    assert not needless, "\n".join(needless)


def test_public_api_names_resolve():
    import jaxhybrid

    missing = [name for name in jaxhybrid.__all__ if not hasattr(jaxhybrid, name)]
    assert not missing, f"jaxhybrid.__all__ names these, which do not resolve: {missing}"
