"""The package's layering, read from its code: no import cycle between
jacutil's modules (imports inside functions included), the core imports
nothing above it (issue 35), and each part imports only the parts below it
(issue 55: core <- rules <- engine <- the consumers; a stage is a lesson
that no other part imports)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "jacutil"


def _name(path):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name, path):
    """Every jacutil module ``name`` imports, anywhere in its file."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            stem = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join([*stem, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    resolved = set()
    for target in found:
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


# package faces (__init__) re-export their children: not a job of their own
GRAPH = {
    name: {t for t in _imports(name, path) if MODULES[t].name != "__init__.py"}
    for name, path in MODULES.items()
    if path.name != "__init__.py"
}


def _reaches(start, goal):
    seen, todo = set(), list(GRAPH[start])
    while todo:
        name = todo.pop()
        if name == goal:
            return True
        if name not in seen:
            seen.add(name)
            todo.extend(GRAPH[name])
    return False


def test_no_import_cycles():
    cycles = sorted(
        f"{a} -> {b} -> ... -> {a}" for a in GRAPH for b in GRAPH[a] if _reaches(b, a)
    )
    assert not cycles, "\n".join(cycles)


def test_the_core_imports_nothing_above_it():
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if name.startswith("jacutil.core.")
        for target in targets
        if not target.startswith("jacutil.core.")
    )
    assert not upward, "\n".join(upward)


# each part (a folder of jacutil, or auto.py) and the parts it may import
# (../shared/DESIGN.md); teaching, testing, bench, peers and the face may
# use anything
LOW = ["core", "rules", "engine"]
LAYERS = {
    "core": [], "rules": ["core"], "engine": ["core", "rules"],
    "stages": LOW, "matrix_free": LOW, "auto": [*LOW, "matrix_free"],
    "curvature": [*LOW, "matrix_free"],
    "fitting": [*LOW, "matrix_free", "curvature"],
    "privacy": [*LOW, "matrix_free", "curvature", "fitting"],
    "scale": [*LOW, "matrix_free", "auto", "fitting", "curvature"],
}  # fmt: skip


def _part(module):
    return module.split(".")[1]


def test_each_part_imports_only_the_parts_below_it():
    breaks = sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if _part(name) in LAYERS
        for target in targets
        if _part(target) != _part(name) and _part(target) not in LAYERS[_part(name)]
    )
    assert not breaks, "\n".join(breaks)


def test_the_graph_is_read():
    """The checks above see the package's real imports (they cannot pass on
    an empty graph)."""
    assert "jacutil.engine.compiled" in GRAPH["jacutil.engine.rows"]
    assert "jacutil.core.cache" in GRAPH["jacutil.engine.compiled"]
    assert "jacutil.engine.compiled" in GRAPH["jacutil.curvature.fisher"]
