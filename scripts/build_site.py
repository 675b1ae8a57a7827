"""`make site`: the course website in build/site/, from the notebooks as stored.

Sphinx with myst-nb (execution off: the pages show the stored outputs) and
sphinx-book-theme; settings in website/conf.py, look in website/_static/. The page
sources are generated at every build, into a work folder beside the output,
from what the repository holds, so that they never drift from it:

- index.md: README.md, each notebook's name linked to its page and each
  ``jacutil`` name to its entry in the API reference;
- notebooks/NN-*.ipynb: a copy of every notebooks/NN-*.ipynb, in order, with
  each solution (a cell tagged ``solution``) collapsed into a "Show solution"
  dropdown, live progress-bar widgets dropped (a static page cannot draw them)
  and a box that downloads the notebook and its learner copy (made here by
  scripts/make_learner.py);
- instructors.md: INSTRUCTORS.md;
- api.rst: autodoc of every public function, class and module in
  ``jacutil.__all__``.

Sphinx warnings are errors (-W, with --keep-going to list them all).

    python scripts/build_site.py [--out build/site]
"""

import argparse
import importlib
import inspect
import pkgutil
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "website"
BOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
PAGES = {"README.md": "index.md", "INSTRUCTORS.md": "instructors.md"}
FILES = "_files"  # downloads; excluded from the pages in website/conf.py
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
SOLUTION_PROMPTS = {
    "code_prompt_show": "Show solution",
    "code_prompt_hide": "Hide solution",
}


# What a name in backticks must not be linked inside: code blocks, display
# math, links and images.
NOT_PROSE = r"^```.*?^```[ \t]*$|^~~~.*?^~~~[ \t]*$|\$\$.*?\$\$|!?\[[^\]]*\]\([^)]*\)"


def link_names(text, pages, api_names):
    """Markdown ``text`` with `00-welcome` linked to its page (``pages``: name
    -> path) and `chunked_jacobian`, `ju.jacobian` or `memory.predicted_bytes`
    to its entry in the API reference (``api_names``)."""

    def link(match):
        name = match[1]
        if name in pages:
            return f"[`{name}`]({pages[name]})"
        base = re.sub(r"\(.*\)$", "", name)  # `chunked_jacobian(out=path)`
        base = re.sub(r"^(jacutil|ju)\.", "", base)  # `ju.jacobian`
        if base in api_names:
            return f"{{py:obj}}`{name} <jacutil.{api_names[base]}>`"
        return match[0]

    def prose(part):
        return re.sub(r"`([\w.\-]+(?:\([^`]*\))?)`", link, part)

    parts = re.split(f"({NOT_PROSE})", text, flags=re.M | re.S)
    return "".join(p if i % 2 else prose(p) for i, p in enumerate(parts))


def markdown_page(source, page_of, api_names, copied):
    """A repository Markdown file as a page: links and local images kept working."""
    text = source.read_text()
    for name, page in PAGES.items():
        text = re.sub(
            rf"\]\((?:\./)?{re.escape(name)}(#[^)]*)?\)", rf"]({page}\1)", text
        )
    for image in re.findall(r"!\[[^\]]*\]\(([^)\s]+)", text):
        if "://" not in image:
            copied.add(image)
    return link_names(text, page_of, api_names)


def site_notebook(copy, book, learner_name, api_names):
    """The notebook as its page shows it (the repository's file is not changed)."""
    nb = nbformat.read(copy, as_version=4)
    others = {b.stem: b.name for b in BOOKS if b != book}
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = link_names(cell.source, others, api_names)
        if cell.cell_type != "code":
            continue
        cell.outputs = [o for o in cell.outputs if WIDGET_VIEW not in o.get("data", {})]
        tags = cell.metadata.get("tags", [])
        if "solution" in tags:
            cell.metadata["tags"] = [*tags, "hide-cell"]
            cell.metadata.setdefault("mystnb", {}).update(SOLUTION_PROMPTS)
    box = nbformat.v4.new_markdown_cell(
        ":::{admonition} Run it yourself\n"
        ":class: tip download-notebook\n"
        f"- {{download}}`{book.name} <../{FILES}/{book.name}>`: this notebook, "
        "with its outputs and solutions;\n"
        f"- {{download}}`{learner_name} <../{FILES}/{learner_name}>`: the learner "
        "copy, outputs cleared and each solution an empty stub (`make learner`).\n"
        "\n"
        "Open either in JupyterLab (`make lab` in a clone of the repository).\n"
        ":::"
    )
    titled = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "markdown" and re.search(r"^# ", c.source, re.M)
    ]
    nb.cells.insert(titled[0] + 1 if titled else 0, box)
    return nb


def submodules(package):
    """``[(name, module)]`` of a package's public modules, ``name`` relative
    to jacutil (``core.memory``); a module, or a package with ``__all__``, is
    its own one."""
    if not hasattr(package, "__path__") or hasattr(package, "__all__"):
        # a module, or a package that names its public API (rules, testing)
        return [(package.__name__.split(".", 1)[1], package)]
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            found.append((module.__name__.split(".", 1)[1], module))
    return found


def public_callables(module):
    """Functions and classes a module offers: its __all__, or what it defines."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            n
            for n, obj in vars(module).items()
            if not n.startswith("_")
            and getattr(obj, "__module__", None) == module.__name__
        ]
    return [
        n
        for n in names
        if inspect.isfunction(getattr(module, n)) or inspect.isclass(getattr(module, n))
    ]


def first_line(obj):
    doc = inspect.getdoc(obj) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def api_page():
    """The API reference (api.rst: autodoc speaks reStructuredText) and the
    names that prose may link to it: functions and classes, and a module's
    members as `memory.predicted_bytes` (not a bare module name: `batch` is
    more often a word than jacutil.core.batch)."""
    import jacutil

    own = [n for n in jacutil.__all__ if _is_jacutil(getattr(jacutil, n))]
    others = [n for n in jacutil.__all__ if n not in own]
    functions = [n for n in own if inspect.isfunction(getattr(jacutil, n))]
    classes = [n for n in own if inspect.isclass(getattr(jacutil, n))]
    modules = [n for n in own if inspect.ismodule(getattr(jacutil, n))]
    missed = set(own) - set(functions) - set(classes) - set(modules)
    if missed:
        raise SystemExit(f"jacutil.__all__: not a function, class or module: {missed}")
    top = {id(getattr(jacutil, n)) for n in functions + classes}

    def heading(text, underline):
        return [text, underline * len(text), ""]

    lines = heading("API reference", "=") + [
        "Every public name of ``jacutil`` (``jacutil.__all__``), generated from its",
        "signature and docstring.",
        "",
        ".. automodule:: jacutil",
        "   :no-members:",
        "",
        ".. list-table::",
        "   :header-rows: 1",
        "   :widths: 1 3",
        "",
        "   * - name",
        "     - what it does",
    ]
    for n in functions + classes + modules:
        lines += [
            f"   * - :py:obj:`~jacutil.{n}`",
            f"     - {first_line(getattr(jacutil, n))}",
        ]
    if others:
        lines += [
            "",
            "Also exported, not documented here: "
            + ", ".join(
                f"``jacutil.{n}`` (``{getattr(getattr(jacutil, n), '__name__', n)}``)"
                for n in others
            )
            + ".",
        ]
    lines += ["", *heading("Functions", "-")]
    for n in functions:
        lines += [f".. autofunction:: jacutil.{n}", ""]
    lines += heading("Classes", "-")
    for n in classes:
        lines += [f".. autoclass:: jacutil.{n}", "   :members:", ""]
    lines += heading("Modules", "-")
    documented = {n: n for n in functions + classes}
    for n in modules:
        lines += heading(f"``jacutil.{n}``", "~")
        parts = submodules(getattr(jacutil, n))
        if parts[0][0] != n:  # a package of modules: its docstring, then each
            lines += [f".. automodule:: jacutil.{n}", "   :no-members:", ""]
        for name, module in parts:
            members = [
                m for m in public_callables(module) if id(getattr(module, m)) not in top
            ]
            short = name.rsplit(".", 1)[-1]  # memory.predicted_bytes in prose
            for m in members:
                documented[f"{name}.{m}"] = f"{name}.{m}"
                documented.setdefault(f"{short}.{m}", f"{name}.{m}")
            if name != n:
                lines += heading(f"``jacutil.{name}``", "^")
            lines += [f".. automodule:: jacutil.{name}"]
            lines += (
                [f"   :members: {', '.join(members)}"]
                if members
                else ["   :no-members:"]
            )
            lines += [""]
    return "\n".join(lines), documented


def _is_jacutil(obj):
    name = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", "")
    return (name or "").split(".")[0] == "jacutil"


def generate(src):
    """Write the page sources into ``src``."""
    if src.exists():
        shutil.rmtree(src)
    files = src / FILES
    files.mkdir(parents=True)
    (src / "notebooks").mkdir()

    api, api_names = api_page()
    (src / "api.rst").write_text(api)

    # Each notebook as it is now, its learner copy made from those same bytes
    # by make_learner.py (which writes build/learner/ under its working folder).
    copies = [Path(shutil.copy(book, files / book.name)) for book in BOOKS]
    work = src / "learner-work"
    work.mkdir()
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_learner.py"), *map(str, copies)],
        cwd=work,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    page_of = {}
    for book, copy in zip(BOOKS, copies, strict=True):
        learner_name = f"{book.stem}-learner.ipynb"
        shutil.move(work / "build" / "learner" / book.name, files / learner_name)
        page = site_notebook(copy, book, learner_name, api_names)
        nbformat.write(page, src / "notebooks" / book.name)
        page_of[book.stem] = f"notebooks/{book.name}"
    shutil.rmtree(work)

    copied = set()
    for name, page in PAGES.items():
        text = markdown_page(ROOT / name, page_of, api_names, copied)
        if page == "index.md":
            text += toctrees(page_of)
        (src / page).write_text(text)
    for image in copied:
        if not (ROOT / image).is_file():
            raise SystemExit(f"README.md or INSTRUCTORS.md shows {image}: no such file")
        (src / image).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / image, src / image)


def toctrees(page_of):
    """The site's order: the notebooks, then the instructor notes and the API."""
    notebooks = "\n".join(p.removesuffix(".ipynb") for p in page_of.values())
    return (
        "\n\n```{toctree}\n:hidden:\n:caption: Notebooks\n\n"
        f"{notebooks}\n```\n\n"
        "```{toctree}\n:hidden:\n:caption: Teaching and reference\n\n"
        "instructors\napi\n```\n"
    )


def build(out, src=None):
    """Generate the sources and run Sphinx; returns Sphinx's exit status."""
    from sphinx.cmd.build import build_main

    out = Path(out).resolve()
    src = Path(src).resolve() if src else out.parent / f"{out.name}-src"
    generate(src)
    if out.exists():
        shutil.rmtree(out)
    return build_main(
        [
            "-b",
            "html",
            "-W",
            "--keep-going",
            "-q",
            "-c",
            str(CONF),
            "-d",
            str(src / ".doctrees"),
            str(src),
            str(out),
        ]
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "build" / "site"))
    parser.add_argument("--src", help="where the page sources go (default: OUT-src)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    status = build(args.out, args.src)
    if status:
        raise SystemExit(status)
    print(f"site: {args.out}/index.html ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
