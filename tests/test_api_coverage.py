"""Every ``jacutil`` name a notebook calls is public and in the API reference.

Reads the code of every notebook source (notebooks/src/NN-name.py: markdown
cells are comments there, so Python's ast sees the code cells only) for

- ``ju.a.b...`` and ``jacutil.a.b...`` attribute chains (``import jacutil as ju``),
- ``from jacutil.x import y`` and the chains on ``y`` (``check.exercise``),

resolves each chain to its object and checks that no part is private (a
leading underscore) and that the object has an entry on the site's API page
(scripts/build_site.py, ``api_page``): its own anchor, or the anchor of the
same object under another public name (``jacutil.per_sample_jacobian`` for
``ju.stages.vectorized.per_sample_jacobian``), or for a method the anchor of
its class. A chain is followed while it stays in jacutil: ``ju.tf.function``
is TensorFlow's, and only ``jacutil.tf`` has to be named on the page.
"""

import ast
import importlib
import inspect
import re
from functools import cache
from pathlib import Path

import pytest

from tests.test_site import site  # noqa: F401 (the site, built once per session)

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "notebooks" / "src").glob("[0-9]*.py"))


def chains(source):
    """``{"jacutil.a.b": [line, ...]}``: the jacutil names a notebook source uses."""
    tree = ast.parse(source.read_text(), filename=str(source))
    aliases = {}  # a name in the notebook -> the dotted jacutil path it stands for
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "jacutil":
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        aliases["jacutil"] = "jacutil"
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if (node.module or "").split(".")[0] == "jacutil":
                for alias in node.names:
                    path = f"{node.module}.{alias.name}"
                    aliases[alias.asname or alias.name] = path
                    found.setdefault(path, []).append(node.lineno)
    inner = {
        id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        parts, value = [], node
        while isinstance(value, ast.Attribute):
            parts.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in aliases:
            path = ".".join([aliases[value.id], *reversed(parts)])
            found.setdefault(path, []).append(node.lineno)
    return found


def used():
    """``[(path, "NN-name.py:line")]`` over every notebook source."""
    return sorted(
        (path, f"{source.name}:{lines[0]}")
        for source in SOURCES
        for path, lines in chains(source).items()
    )


def owned(obj):
    """Whether an object is jacutil's own (not TensorFlow re-exported)."""
    if inspect.ismodule(obj):
        name = obj.__name__
    else:
        name = getattr(obj, "__module__", None) or ""
    return name.split(".")[0] == "jacutil"


def resolve(path):
    """``[(part, object)]`` along a dotted path from ``jacutil``, as far as it
    stays in jacutil: modules and classes, then a function, a method or a
    constant (the documented end). A module or class that is not jacutil's
    (``jacutil.tf``) ends it too."""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    steps = [(parts[0], obj)]
    for i, part in enumerate(parts[1:], start=1):
        parent = obj
        try:
            obj = getattr(parent, part)
        except AttributeError:
            if not inspect.ismodule(parent):
                raise
            obj = importlib.import_module(".".join(parts[: i + 1]))
        steps.append((part, obj))
        if not (inspect.ismodule(obj) or inspect.isclass(obj)) or not owned(obj):
            break
    return steps


def external(steps):
    """Whether a resolved chain ends in TensorFlow's own (``jacutil.tf``)."""
    end = steps[-1][1]
    return (inspect.ismodule(end) or inspect.isclass(end)) and not owned(end)


def anchors(obj):
    """The API page anchors a function or class can have: its own module's
    and every public jacutil name that is the same object."""
    import jacutil

    found = set()
    if getattr(obj, "__qualname__", None) and getattr(obj, "__module__", None):
        found.add(f"{obj.__module__}.{obj.__qualname__}")
    found |= {f"jacutil.{n}" for n in jacutil.__all__ if getattr(jacutil, n) is obj}
    return found


def candidates(steps):
    """Anchors any of which documents the end of a resolved chain."""
    names = [part for part, _ in steps]
    end = steps[-1][1]
    dotted = ".".join(names)
    if inspect.ismodule(end):
        return {f"module-{end.__name__}"}
    found = {dotted}
    if inspect.isfunction(end) or inspect.isclass(end):
        found |= anchors(end)
    if len(steps) >= 2:
        parent = steps[-2][1]
        if inspect.isclass(parent):  # a method or attribute of a class
            found |= {f"{a}.{names[-1]}" for a in anchors(parent)}
        elif inspect.ismodule(parent):  # a module's constant or function
            found.add(f"{parent.__name__}.{names[-1]}")
    return found


@cache
def api_ids(folder):
    html = (Path(folder) / "api.html").read_text()
    return set(re.findall(r'\bid="([^"]+)"', html)), html


def test_notebooks_use_jacutil_names():
    assert SOURCES, "no notebook sources in notebooks/src"
    found = used()
    assert any(path.startswith("jacutil.") for path, _ in found), found


def test_every_name_a_notebook_uses_is_public():
    private = [
        f"{path} ({where})"
        for path, where in used()
        if any(p.startswith("_") and not p.endswith("__") for p in path.split("."))
    ]
    assert not private, (
        "notebooks use private jacutil names (make them public, or use a public "
        f"name): {private}"
    )


def test_every_name_a_notebook_uses_resolves():
    missing = []
    for path, where in used():
        try:
            resolve(path)
        except (AttributeError, ImportError) as error:
            missing.append(f"{path} ({where}): {error}")
    assert not missing, missing


@pytest.mark.parametrize("source", SOURCES, ids=lambda s: s.stem)
def test_every_name_a_notebook_uses_is_on_the_api_page(site, source):  # noqa: F811
    ids, html = api_ids(str(site[0]))
    undocumented = []
    for path, lines in sorted(chains(source).items()):
        if any(p.startswith("_") and not p.endswith("__") for p in path.split(".")):
            continue  # test_every_name_a_notebook_uses_is_public names it
        try:
            steps = resolve(path)
        except (AttributeError, ImportError):
            continue  # test_every_name_a_notebook_uses_resolves names it
        if external(steps):  # jacutil.tf, jacutil.keras: named on the page
            name = ".".join(p for p, _ in steps)
            if f'<span class="pre">{name}</span>' not in html:
                undocumented.append(f"{path} (line {lines[0]}): {name} not named")
            continue
        if not candidates(steps) & ids:
            undocumented.append(
                f"{path} (line {lines[0]}): none of {sorted(candidates(steps))}"
            )
    assert not undocumented, (
        f"{source.name} uses jacutil names the API page does not document: "
        f"{undocumented}"
    )
