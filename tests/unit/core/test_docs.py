"""The user documentation stays honest: the generated config page is current, every link and every
repository path or ``jaxhybrid.x.y`` name that README.md and docs/*.md give exists, the README stays short,
and no page points outside the repository."""
from __future__ import annotations

import ast
import dataclasses
import glob
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PREFIXES = ("jaxhybrid/", "tests/", "scripts/", "configs/", "docs/")

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"\bjaxhybrid(?:\.[A-Za-z_]\w*)+")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _path_exists(base: Path, path: str) -> bool:
    """A path relative to ``base``; ``<name>`` placeholders and ``*`` match any name."""
    pattern = re.sub(r"<[^>]*>", "*", path)
    if "*" in pattern:
        return bool(glob.glob(str(base / pattern)))
    return (base / pattern).exists()


def _top_names(source: str) -> dict[str, ast.AST]:
    names = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names[n.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                names[(a.asname or a.name).split(".")[0]] = node
    return names


def dotted_resolves(name: str, root: Path = ROOT) -> bool:
    """``jaxhybrid.a.b[.attr[.member]]``: the longest prefix that is a module or package, then the rest
    defined in it (a top-level name, then a member of that class)."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:k])
        source_file = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if not source_file.exists():
            continue
        rest = parts[k:]
        if not rest:
            return True
        if base.is_dir() and (base / f"{rest[0]}.py").exists():
            return False  # a submodule the longer prefix would have found
        names = _top_names(source_file.read_text(encoding="utf-8"))
        node = names.get(rest[0])
        if node is None:
            return False
        if len(rest) == 1:
            return True
        if not isinstance(node, ast.ClassDef) or len(rest) > 2:
            return False
        return rest[1] in _top_names(ast.unparse(ast.Module(body=node.body, type_ignores=[])))
    return False


def anchors(page: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as dashes."""
    heads = re.findall(r"^#{1,6} +(.+?) *$", FENCE.sub("", page), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def broken_references(text: str, page_dir: Path, root: Path = ROOT) -> list[str]:
    """What a page names that does not exist: relative links (their path, and a heading anchor of a page),
    repository paths in backticks (inline spans: the first word; fenced blocks: every word) and
    ``jaxhybrid.x.y`` names."""
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        if path and not _path_exists(page_dir, path):
            bad.append(f"link ({target})")
        elif anchor and (path == "" or path.endswith(".md")):
            page = text if not path else (page_dir / path).read_text(encoding="utf-8")
            if anchor not in anchors(page):
                bad.append(f"anchor ({target})")
    fenced = "\n".join(FENCE.findall(text))
    words = [span.split()[0] for span in SPAN.findall(FENCE.sub("", text)) if span.split()]
    words += [w.strip("'\"") for w in fenced.split()]
    for word in words:
        word = word.split("=", 1)[-1].split("::", 1)[0].rstrip(".,;:)")
        if word.startswith(PREFIXES) and not _path_exists(root, word):
            bad.append(f"path `{word}`")
    for name in set(DOTTED.findall(text)):
        if not dotted_resolves(name, root):
            bad.append(f"module `{name}`")
    return bad


def test_configuration_page_is_current():
    page = ROOT / "docs" / "configuration.md"
    assert page.exists() and page.read_text(encoding="utf-8") == _generator().render(), (
        "docs/configuration.md is stale: run `python scripts/gen_config_docs.py`")


def test_check_flag_exits_1_on_a_stale_page(tmp_path, monkeypatch, capsys):
    gen = _generator()
    page = tmp_path / "configuration.md"
    monkeypatch.setattr(gen, "PAGE", page)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1  # no page yet
    assert gen.main([]) == 0 and page.read_text(encoding="utf-8") == gen.render()
    assert gen.main(["--check"]) == 0
    page.write_text(gen.render().replace("optimizer steps", "steps"), encoding="utf-8")
    assert gen.main(["--check"]) == 1
    assert "run `python scripts/gen_config_docs.py`" in capsys.readouterr().err


def test_configuration_page_names_every_key():
    gen = _generator()
    text = gen.render()
    for section in gen.dataclasses.fields(gen.Config):
        for f in gen.dataclasses.fields(section.default_factory):
            assert f"| `{section.name}.{f.name}` |" in text


def test_field_docs_read_trailing_and_preceding_comments():
    from jaxhybrid.core.config.schema import OptimConfig, TrainConfig
    docs = _generator().field_docs(TrainConfig)
    assert docs["steps"] == "optimizer steps"  # trailing
    assert docs["checkpoint_interval"].startswith("Myelin's ac: blocks per recomputed segment")  # lines above
    assert docs["checkpoint_interval"].endswith("0 = the optimal one (Sec. V-A)")
    assert _generator().field_docs(OptimConfig)["beta1"] == "AdamW's first-moment decay"
    assert _generator().field_docs(_Uncommented)["b"] == ""  # no comment: the line above is a field


@dataclasses.dataclass(frozen=True)
class _Uncommented:
    a: int = 1  # the line above b
    b: int = 2


def test_every_link_and_path_in_the_docs_exists():
    assert len(PAGES) > 5, "README.md and the docs/ pages"
    problems = {p.relative_to(ROOT).as_posix(): broken_references(p.read_text(encoding="utf-8"), p.parent)
                for p in PAGES}
    assert not {k: v for k, v in problems.items() if v}


def test_reference_check_finds_what_is_missing(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "jaxhybrid" / "core").mkdir(parents=True)
    (tmp_path / "jaxhybrid" / "__init__.py").write_text("")
    (tmp_path / "jaxhybrid" / "core" / "__init__.py").write_text("")
    (tmp_path / "jaxhybrid" / "core" / "errors.py").write_text("class ConfigError(ValueError):\n    code = 1\n")
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## What `it` does (CPU)\n")
    good = ("# Top\n[a](../jaxhybrid/core/errors.py#L1) `jaxhybrid/core/errors.py: ConfigError` "
            "[o](other.md#what-it-does-cpu) [t](#top) "
            "`jaxhybrid.core.errors.ConfigError.code` `jaxhybrid.core` [web](https://example.org) [x](#top)\n"
            "```\npython jaxhybrid/core/errors.py --x=jaxhybrid/core\n```\n")
    assert broken_references(good, tmp_path / "docs", tmp_path) == []
    bad = ("[a](missing.md#x) [o](other.md#nowhere) [t](#nothere) `scripts/nope.sh --flag` `jaxhybrid.core.errors.Nope` `jaxhybrid.core.nothere`\n"
           "```\nrun --config=configs/gone.yaml\n```\n")
    assert sorted(broken_references(bad, tmp_path / "docs", tmp_path)) == [
        "anchor (#nothere)", "anchor (other.md#nowhere)", "link (missing.md#x)", "module `jaxhybrid.core.errors.Nope`", "module `jaxhybrid.core.nothere`",
        "path `configs/gone.yaml`", "path `scripts/nope.sh`"]


def test_readme_is_at_most_200_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move details to docs/"


def test_no_page_points_outside_the_repository():
    # ARCHITECTURE.md (upper case) was a file outside the repository; docs/architecture.md is this one's page.
    outside = re.compile(r"(?i:\bsessions? \d+)|facts\.md|ARCHITECTURE\.md|\.\./shared|/work/")
    found = {p.name: outside.findall(p.read_text(encoding="utf-8")) for p in PAGES}
    assert not {k: v for k, v in found.items() if v}
