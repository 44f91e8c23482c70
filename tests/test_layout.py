"""The code's layout against docs/architecture.md, and the docs' links and citations against the docs.

No JAX: these read files only."""

from __future__ import annotations

import ast
import re
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 450


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted((REPO / "s3d_jax").rglob("*.py"))}


def layers() -> dict[str, int]:
    """Module -> its layer's row in the architecture table (0 at the top); a package row covers its modules."""
    rank, order = {}, -1
    for line in (REPO / "docs/architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not line.startswith("|") or cells[1] in ("modules", "---"):
            continue
        order += 1 if cells[0] else 0
        for path in re.findall(r"`(s3d_jax/[\w/]*\.py|s3d_jax/\w+/)`", cells[1]):
            prefix = path.rstrip("/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            for name in MODULES:
                if name == prefix or (path.endswith("/") and name.startswith(prefix + ".")):
                    rank[name] = order
    return rank


def imports(name: str) -> set[str]:
    """The package's modules that `name` imports, at the top or inside a function."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names}
    return {m for m in found if m in MODULES and m != name}


def test_tests_keep_their_cache_out_of_the_home_directory():
    from s3d_jax.paths import cache_root

    root = cache_root().resolve()
    assert Path(tempfile.gettempdir()).resolve() in root.parents and Path.home().resolve() not in root.parents


def test_every_module_is_on_the_map():
    assert sorted(set(MODULES) - set(layers())) == []


def test_no_import_runs_back_up_the_layers():
    rank = layers()
    upward = [f"{m} (layer {rank[m]}) imports {d} (layer {rank[d]})" for m in MODULES for d in imports(m)
              if rank[d] > rank[m] and not d.startswith(m + ".")]  # a package's __init__ may name its own modules
    assert upward == []


def test_no_import_circle():
    graph = {m: imports(m) for m in MODULES}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                pytest.fail("import circle: " + " -> ".join([*path[path.index(d):], d]))
            if d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_no_file_is_too_long():
    files = [*(REPO / "s3d_jax").rglob("*.py"), *(REPO / "tools").glob("*"), *(REPO / "tests").glob("*.py")]
    long = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_readme_and_benchmarks_stay_short():
    """The README is set-up, quick-start and one table; benchmarks.md holds today's tables, history the log."""
    lines = {p.name: len(p.read_text().splitlines()) for p in (REPO / "README.md", REPO / "docs" / "benchmarks.md")}
    assert lines["README.md"] < 160 and lines["benchmarks.md"] <= 300, lines


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(path: Path) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^#+ (.+)$", path.read_text(), re.M)]


def sections(path: Path) -> list[str]:
    """Headings, and the bold or italic leads that open design.md's paragraphs and bullets."""
    return headings(path) + re.findall(r"^\s*(?:- )?\*{1,2}([^*\n]+)\*", path.read_text(), re.M)


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_reach_a_file_and_a_heading(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, fragment = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists() or (fragment and fragment not in {anchor(h) for h in headings(path)}):
            broken.append(target)
    assert broken == []


def test_cited_sections_exist():
    """Every `docs/NAME.md, "Section"` (or `("Section")`) in code, configs and docs names a section there."""
    files = [*(REPO / "s3d_jax").rglob("*.py"), *(REPO / "configs").glob("*.py"), *(REPO / "tests").glob("*.py"), *DOCS]
    missing = []
    for path in files:
        text = re.sub(r"\s*\n\s*(#\s*)?", " ", path.read_text())  # citations broken over comment lines
        for doc, title in re.findall(r"((?:docs/)?[a-z_]+\.md),? \(?\"([^\"]+)\"", text):
            target = REPO / (doc if doc.startswith("docs/") or doc == "README.md" else f"docs/{doc}")
            if not target.exists() or not any(title.lower() in h.lower() for h in sections(target)):
                missing.append(f"{path.relative_to(REPO)}: {doc}, {title!r}")
    assert missing == []
