"""`make site`: the course website in build/site/, from the notebooks as stored.

Sphinx with myst-nb (execution off: the pages show the stored outputs) and
sphinx-book-theme; settings in website/conf.py, look in website/_static/. The page
sources are generated at every build, into a work folder beside the output,
from what the repository holds, so that they never drift from it:

- index.md: README.md, each notebook's name linked to its page and each
  ``jacutil`` name to its entry in the API reference;
- notebooks/NN-*.ipynb: a copy of every notebooks/NN-*.ipynb, in order, shown
  as JupyterLab shows it (``site_notebook``):
  - each solution (a cell tagged ``solution``) collapsed into a "Show
    solution" dropdown;
  - a progress bar (a tqdm.auto widget, which a static page cannot draw) as
    its final text, ``100%|##########| 1000/1000 [00:12<00:00]``, read from
    the widget state stored in the notebook's metadata (the output's own
    text/plain is the bar's first state, 0%, and is used only when the state
    is missing);
  - what a cell printed on stderr (TensorFlow's and Python's warnings) in a
    warning box; a carriage return overwrites its line, as in JupyterLab;
  - each figure's alt text made from the ``Finding:`` lines its cell printed
    (else the last sentence of the markdown above it; the build lists those);
  - no nbval plumbing: ``# NBVAL_...`` lines and ``nbval-*`` tags dropped;
  - a box that downloads the notebook and its learner copy (made here by
    scripts/make_learner.py), with links that open it in Colab or Binder;
- instructors.md: INSTRUCTORS.md;
- cluster.md: docs/cluster.md, the guide to running on a cluster;
- api.rst: autodoc of every public function, class and module in
  ``jacutil.__all__``, and of every further jacutil name that a notebook
  source (notebooks/src) uses: ``check.exercise``, ``ju.bench.run_bench``,
  ``ju.core.guards.RETRACE_LIMIT``.

Every page's footer has the licences (LICENSE, copied into the site) and a
"Report a problem with this page" link to the repository's issue form
(.github/ISSUE_TEMPLATE/problem.yml); the repository is pyproject.toml's
[project.urls] Repository (website/conf.py).

Sphinx warnings are errors (-W, with --keep-going to list them all).

    python scripts/build_site.py [--out build/site] [--notebooks NN-name.ipynb ...]

``--notebooks`` builds the site with those notebooks only (a quick look at one
page; tests/test_site.py builds a page from a made-up notebook that way).
"""

import argparse
import ast
import copy
import html
import importlib
import inspect
import pkgutil
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "website"
BOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
PAGES = {
    "README.md": "index.md",
    "INSTRUCTORS.md": "instructors.md",
    "docs/cluster.md": "cluster.md",
}
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

    def repository_file(match):
        """[CITATION.cff](CITATION.cff): a file of the repository, not a page,
        linked on GitHub."""
        path = match[2]
        kind = "tree" if (ROOT / path).is_dir() else "blob"
        return f"{match[1]}({repository()}/{kind}/main/{path})"

    text = re.sub(
        r"((?<!!)\[[^\]]*\])\((?!#|[a-z]+:|/)([^)\s#]+)\)",
        lambda m: m[0] if not (ROOT / m[2]).exists() else repository_file(m),
        text,
    )
    return link_names(text, page_of, api_names)


def overwrite_returns(text):
    """Text as a terminal (and JupyterLab) shows it: a carriage return goes
    back to the line's start, so what follows the last one stays."""
    lines = []
    for line in text.split("\n"):
        parts = line.rstrip("\r").split("\r")
        lines.append(parts[-1])
    return "\n".join(lines)


PROGRESS_LINE = re.compile(r"\d+%\|")  # tqdm's "100%|####| 8/8 [...]"


def widget_final_text(view, state):
    """A tqdm.auto progress bar's last text, from the notebook's widget state:
    an HBox of an HTML label (``chunks: 100%``), a progress bar and an HTML
    count (``8/8 [00:01<00:00, 7.9it/s]``). None if the state lacks it."""
    model = state.get(view.get("model_id", ""))
    if not model:
        return None
    parts = []
    for child in model.get("state", {}).get("children", []) or [view["model_id"]]:
        child = state.get(str(child).removeprefix("IPY_MODEL_"), {})
        values = child.get("state", {})
        if child.get("model_name", "").endswith("ProgressModel"):
            top = values.get("max") or 0
            done = min(max((values.get("value") or 0) / top, 0), 1) if top else 0
            parts.append("█" * round(done * 10) + " " * (10 - round(done * 10)))
        elif "value" in values:
            parts.append(html.unescape(str(values["value"])))
    if not parts:
        return None
    text = "|".join(parts).replace(" ", " ").replace("​", "")
    return re.sub(r"\|\s+", "| ", text).strip()


def text_output(kind, text):
    """A display output that the page shows as a styled block of text."""
    if kind == "progress":
        body = f'<div class="output-progress"><pre>{html.escape(text)}</pre></div>'
    else:
        body = (
            '<div class="admonition warning output-warning" role="note">'
            '<p class="admonition-title">Warning (printed on stderr)</p>'
            f"<pre>{html.escape(text)}</pre></div>"
        )
    return nbformat.v4.new_output(
        "display_data", data={"text/html": body, "text/plain": text}
    )


def stderr_outputs(text):
    """What a cell printed on stderr: progress bars as their final text, the
    rest (warnings) in warning boxes, in the order printed."""
    runs = []
    for line in overwrite_returns(text).split("\n"):
        kind = "progress" if PROGRESS_LINE.search(line) else "warning"
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(line)
        else:
            runs.append((kind, [line]))
    return [
        text_output(kind, "\n".join(lines).strip("\n"))
        for kind, lines in runs
        if "".join(lines).strip()
    ]


def shown_outputs(outputs, widget_state):
    """A cell's outputs as JupyterLab shows them (see the module's docstring)."""
    shown = []
    for output in outputs:
        data = output.get("data", {})
        if WIDGET_VIEW in data:
            text = widget_final_text(data[WIDGET_VIEW], widget_state)
            text = text or overwrite_returns(data.get("text/plain", "")).strip()
            if text:
                shown.append(text_output("progress", text))
        elif output.get("output_type") == "stream":
            output = copy.deepcopy(output)
            if (
                shown
                and shown[-1].get("output_type") == "stream"
                and shown[-1].get("name") == output.get("name")
            ):
                shown[-1]["text"] += output["text"]  # one stream, as printed
            else:
                shown.append(output)
        else:
            shown.append(output)
    for output in shown:  # show_source's link to the whole file: on GitHub
        markdown = output.get("data", {}).get("text/markdown")
        if markdown:
            markdown = markdown if isinstance(markdown, str) else "".join(markdown)
            output["data"]["text/markdown"] = re.sub(
                r"\]\(\.\./(jacutil/[^)\s]+)\)",
                lambda m: f"]({repository()}/blob/main/{m[1]})",
                markdown,
            )
    final = []
    for output in shown:
        if output.get("output_type") == "stream":
            text = overwrite_returns(output["text"])
            if output.get("name") == "stderr":
                final += stderr_outputs(output["text"])
                continue
            output["text"] = text
        final.append(output)
    return final


NBVAL_LINE = re.compile(r"^[ \t]*#[ \t]*NBVAL_\w*[ \t]*$\n?", re.M)


def plain_sentences(markdown):
    """A markdown cell's prose as plain sentences (no code, math marks, links)."""
    text = re.sub(
        r"^```.*?^```[ \t]*$|^:::.*?^:::[ \t]*$", " ", markdown, flags=re.M | re.S
    )
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: their text
    text = re.sub(r"^[ \t]*(#+|[-*]|\d+\.)[ \t]+", "", text, flags=re.M)
    text = re.sub(r"<[^>]+>|`|\*\*|(?<!\w)\*|\*(?!\w)|\$", "", text)
    text = re.sub(r"\s+", " ", text).strip()
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z0-9(])", text) if s.strip()]


def figure_alt(cell, above):
    """A figure's alt text: what its cell found (its ``Finding:`` lines), else
    the last sentence of the nearest markdown cell above it (``above``).
    Returns (alt, whether it came from Finding: lines)."""
    findings = [
        line.strip().removeprefix("Finding:").strip()
        for output in cell.outputs
        if output.get("output_type") == "stream"
        for line in overwrite_returns(output.get("text", "")).split("\n")
        if line.strip().startswith("Finding:")
    ]
    if findings:
        return "Figure: " + "; ".join(f.rstrip(" .;") for f in findings) + ".", True
    sentences = plain_sentences(above) if above else []
    if not sentences:
        return "Figure", False
    return "Figure: " + re.sub(r"[:;,]$", ".", sentences[-1]), False


# Figures whose cell printed no Finding: line ("NN-name: cell N"), for the
# build's log (their alt text is the markdown's last sentence above them).
FIGURES_WITHOUT_FINDING = []


def solutions_path(book):
    """notebooks/solutions/NN-name.ipynb: the notebook with its solutions in."""
    return book.parent / "solutions" / book.name


def site_notebook(copy_path, book, learner_name, api_names, books=None, links=None):
    """The notebook as its page shows it (the repository's file is not changed).

    ``links``: the notebook's Colab and Binder addresses, if the repository is
    known (see ``cloud_links``)."""
    nb = nbformat.read(copy_path, as_version=4)
    # Each exercise's stub becomes its solution, folded behind "Show
    # solution", without outputs: the check below it says "no answer yet".
    # A notebook without a solutions notebook (one not made by `make
    # notebooks`) shows its own solution cells, folded as well.
    solved_path = solutions_path(book)
    if solved_path.exists():
        solved = nbformat.read(solved_path, as_version=4)
        for k, cell in enumerate(solved.cells):
            if "solution" in cell.metadata.get("tags", []):
                nb.cells[k] = nbformat.from_dict({**cell, "outputs": []})
    books = BOOKS if books is None else books
    others = {b.stem: b.name for b in books if b != book}
    widget_state = (
        nb.metadata.get("widgets", {})
        .get("application/vnd.jupyter.widget-state+json", {})
        .get("state", {})
    )
    above = ""
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            cell.source = link_names(cell.source, others, api_names)
            above = cell.source
        if cell.cell_type != "code":
            continue
        cell.source = NBVAL_LINE.sub("", cell.source)
        tags = [t for t in cell.metadata.get("tags", []) if not t.startswith("nbval")]
        if "tags" in cell.metadata:
            cell.metadata["tags"] = tags
        if any("image/png" in o.get("data", {}) for o in cell.outputs):
            alt, found = figure_alt(cell, above)
            mystnb = cell.metadata.setdefault("mystnb", {})
            mystnb.setdefault("image", {})["alt"] = alt
            if not found:
                first = next((ln for ln in cell.source.splitlines() if ln.strip()), "")
                FIGURES_WITHOUT_FINDING.append(f"{book.stem}: cell {index} ({first})")
        cell.outputs = shown_outputs(cell.outputs, widget_state)
        if "solution" in tags:
            cell.metadata["tags"] = [*tags, "hide-cell"]
            cell.metadata.setdefault("mystnb", {}).update(SOLUTION_PROMPTS)
    nb.metadata.pop("widgets", None)
    cloud = ""
    if links:
        cloud = (
            f"- [Open in Colab]({links['colab']}) or "
            f"[Launch on Binder]({links['binder']}): run it in your browser, "
            "nothing to install (in Colab, first run "
            f'`%pip install "jacutil @ git+{links["repository"]}"` in a new '
            "cell; Binder installs the repository's environment.yml, which takes "
            "a few minutes the first time).\n"
        )
    solutions = f"{book.stem}-solutions.ipynb"
    solutions_line = (
        f"- {{download}}`{solutions} <../{FILES}/{solutions}>`: "
        "the same with the solutions in, no outputs (open it after trying);\n"
        if solutions_path(book).exists()
        else ""
    )
    box = nbformat.v4.new_markdown_cell(
        ":::{admonition} Run it yourself\n"
        ":class: tip download-notebook\n"
        f"- {{download}}`{book.name} <../{FILES}/{book.name}>`: this notebook, "
        "with its outputs, each exercise a stub;\n"
        f"{solutions_line}"
        f"- {{download}}`{learner_name} <../{FILES}/{learner_name}>`: the learner "
        "copy, outputs cleared and each solution an empty stub (`make learner`);\n"
        f"{cloud}"
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


def repository():
    """pyproject.toml's [project.urls] Repository, without a trailing slash."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        url = tomllib.load(f)["project"].get("urls", {}).get("Repository", "")
    return url.rstrip("/").removesuffix(".git")


def cloud_links(book):
    """Where a notebook opens in Colab and on Binder, from the repository's URL
    (GitHub's owner/name); None if it is not on GitHub."""
    url = repository()
    found = re.fullmatch(r"https://github\.com/([^/]+)/([^/]+)", url)
    if not found:
        return None
    owner, name = found.groups()
    path = f"notebooks/{book.name}"
    return {
        "repository": url,
        "colab": f"https://colab.research.google.com/github/{owner}/{name}/blob/main/{path}",
        "binder": f"https://mybinder.org/v2/gh/{owner}/{name}/HEAD?labpath={path}",
    }


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
    covered = covered_anchors(functions, classes, modules)
    lines += notebook_entries(covered)
    return "\n".join(lines), documented


def member_anchors(prefix, obj):
    """The anchors of a class's documented public members (none for a function)."""
    if not inspect.isclass(obj):
        return set()
    return {
        f"{prefix}.{m}"
        for m, member in vars(obj).items()
        if not m.startswith("_") and inspect.getdoc(member)
    }


def covered_anchors(functions, classes, modules):
    """The anchors (HTML ids) the reference has before the notebooks' extra
    names: jacutil.X, jacutil.X.method, module-jacutil.m, jacutil.m.f."""
    import jacutil

    found = {"module-jacutil"}
    for n in functions + classes:
        found.add(f"jacutil.{n}")
        found |= member_anchors(f"jacutil.{n}", getattr(jacutil, n))
    top = {id(getattr(jacutil, n)) for n in functions + classes}
    for n in modules:
        found.add(f"module-jacutil.{n}")
        for name, module in submodules(getattr(jacutil, n)):
            found.add(f"module-jacutil.{name}")
            for m in public_callables(module):
                if id(getattr(module, m)) not in top:
                    found.add(f"jacutil.{name}.{m}")
                    found |= member_anchors(f"jacutil.{name}.{m}", getattr(module, m))
    return found


def notebook_names():
    """The dotted jacutil names the notebook sources (notebooks/src) use:
    ``ju.a.b``, ``jacutil.a.b``, ``from jacutil.a import b`` and ``b.c``."""
    found = set()
    for source in sorted((ROOT / "notebooks" / "src").glob("[0-9]*.py")):
        tree = ast.parse(source.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "jacutil":
                        aliases[a.asname or "jacutil"] = (
                            a.name if a.asname else "jacutil"
                        )
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                if (node.module or "").split(".")[0] == "jacutil":
                    for a in node.names:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                        found.add(f"{node.module}.{a.name}")
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and id(node) not in inner:
                parts, value = [], node
                while isinstance(value, ast.Attribute):
                    parts.insert(0, value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in aliases:
                    found.add(".".join([aliases[value.id], *parts]))
    return found


def entry_for(path):
    """``(directive, target, anchors)``: how the API page documents a dotted
    jacutil name, and the anchors any of which already does; None for a
    private name, one that does not resolve, or TensorFlow's (``ju.tf.x``)."""
    parts = path.split(".")
    if any(p.startswith("_") for p in parts):
        return None  # tests/test_api_coverage.py names it
    obj, parent = importlib.import_module("jacutil"), None
    for i, part in enumerate(parts[1:], start=1):
        parent = obj
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if not inspect.ismodule(parent):
                return None
            try:
                obj = importlib.import_module(".".join(parts[: i + 1]))
            except ImportError:
                return None
        if inspect.ismodule(obj) or inspect.isclass(obj):
            if not _is_jacutil(obj):  # jacutil.tf, jacutil.keras: TensorFlow's
                return "external", ".".join(parts[: i + 1]), set()
            continue
        parts = parts[: i + 1]
        break
    dotted = ".".join(parts)
    if inspect.ismodule(obj):
        return "automodule", obj.__name__, {f"module-{obj.__name__}"}
    anchors = {dotted}
    for o in [obj] + ([parent] if inspect.isclass(parent) else []):
        if getattr(o, "__qualname__", None) and getattr(o, "__module__", None):
            own = f"{o.__module__}.{o.__qualname__}"
            anchors.add(own if o is obj else f"{own}.{parts[-1]}")
    if inspect.isclass(parent):
        return "automethod", dotted, anchors
    if inspect.isclass(obj):
        return "autoclass", dotted, anchors
    if callable(obj):
        return "autofunction", dotted, anchors
    return (
        "autodata",
        f"{parent.__name__}.{parts[-1]}",
        anchors | {f"{parent.__name__}.{parts[-1]}"},
    )


def _external_name(dotted):
    obj = importlib.import_module("jacutil")
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return getattr(obj, "__name__", dotted)


def notebook_entries(covered):
    """The reference's last section: every further jacutil name a notebook
    uses (its module, function, class, method or constant), so that the
    reference covers what the course calls."""
    entries, external = {}, set()
    for path in sorted(notebook_names()):
        entry = entry_for(path)
        if entry and entry[0] == "external":
            external.add(entry[1])
        elif entry and not entry[2] & covered:
            entries.setdefault((entry[0], entry[1]), entry)
            covered |= entry[2]
    if not entries and not external:
        return []
    lines = [
        "Further names the notebooks use",
        "-------------------------------",
        "",
        "Functions, classes, methods and constants of ``jacutil``'s modules that a",
        "notebook calls or reads, beyond the names above.",
        "",
    ]
    if external:
        lines += [
            "TensorFlow's own, as ``jacutil`` imports them (TensorFlow's and Keras's",
            "documentation describe them): "
            + ", ".join(
                f"``{name}`` (``{_external_name(name)}``)" for name in sorted(external)
            )
            + ".",
            "",
        ]
    groups = {}
    for kind, target in entries:
        module = target if kind == "automodule" else target.rsplit(".", 1)[0]
        if kind == "automethod":  # jacutil.x.Class.method: in jacutil.x
            module = module.rsplit(".", 1)[0]
        groups.setdefault(module, []).append((kind, target))
    for module, members in sorted(groups.items()):
        title = f"In ``{module}``"
        lines += [title, "~" * len(title), ""]
        for kind, target in sorted(members, key=lambda e: (e[0] != "automodule", e[1])):
            if kind == "autodata":
                lines += constant_entry(target)
                continue
            lines.append(f".. {kind}:: {target}")
            if kind == "automodule":
                lines.append("   :no-members:")
            elif kind == "autoclass":
                lines.append("   :members:")
            lines.append("")
    return lines


def constant_entry(target):
    """A module's constant as ``py:data``, its value (or type) and the comment
    the source gives it (autodoc's autodata would show ``int``'s docstring)."""
    module_name, name = target.rsplit(".", 1)
    module = importlib.import_module(module_name)
    value = getattr(module, name)
    lines = [f".. py:data:: {name}", f"   :module: {module_name}"]
    if isinstance(value, (int, float, str, bool)):
        lines.append(f"   :value: {value!r}")
    else:
        lines.append(f"   :type: {type(value).__name__}")
    note = source_comment(module, name)
    return lines + ["", *(f"   {line}" for line in note), ""]


def source_comment(module, name):
    """The comment on a constant's line, or the comment lines just above it,
    as text (``["Traces of one compiled Jacobian before note_trace warns."]``)."""
    try:
        text = inspect.getsource(module)
    except (OSError, TypeError):
        return []
    source = text.splitlines()
    lines = [
        node.lineno - 1
        for node in ast.parse(text).body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name) and target.id == name
    ]
    if not lines:
        return []
    i = lines[0]
    after = re.search(r"#\s*(.+)$", source[i])
    if after and "noqa" not in after[1]:
        note = after[1]
    else:
        above = []
        for previous in reversed(source[:i]):
            if not previous.lstrip().startswith("#"):
                break
            above.insert(0, previous.lstrip().lstrip("#").strip())
        note = " ".join(above)
    if not note:
        return []
    if re.match(r"[a-z]+\b(?![_.(])", note):
        note = note[0].upper() + note[1:]
    note = re.sub(r"([*`|_\\])", r"\\\1", note)  # no markup: as written
    return [note if note.endswith(".") else f"{note}."]


def _is_jacutil(obj):
    name = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", "")
    return (name or "").split(".")[0] == "jacutil"


def generate(src, books=None):
    """Write the page sources into ``src`` (``books``: the notebooks, all of
    notebooks/NN-*.ipynb unless given)."""
    books = BOOKS if books is None else [Path(b).resolve() for b in books]
    FIGURES_WITHOUT_FINDING.clear()
    if src.exists():
        shutil.rmtree(src)
    files = src / FILES
    files.mkdir(parents=True)
    (src / "notebooks").mkdir()

    api, api_names = api_page()
    (src / "api.rst").write_text(api)

    # Each notebook as it is now, its learner copy made from those same bytes
    # by make_learner.py (which writes build/learner/ under its working folder).
    copies = [Path(shutil.copy(book, files / book.name)) for book in books]
    work = src / "learner-work"
    work.mkdir()
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_learner.py"), *map(str, copies)],
        cwd=work,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    page_of = {}
    for book, stored in zip(books, copies, strict=True):
        if solutions_path(book).exists():
            shutil.copy(solutions_path(book), files / f"{book.stem}-solutions.ipynb")
        learner_name = f"{book.stem}-learner.ipynb"
        shutil.move(work / "build" / "learner" / book.name, files / learner_name)
        page = site_notebook(
            stored, book, learner_name, api_names, books, cloud_links(book)
        )
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
        "instructors\ncluster\napi\n```\n"
    )


def build(out, src=None, books=None):
    """Generate the sources and run Sphinx; returns Sphinx's exit status."""
    from sphinx.cmd.build import build_main

    out = Path(out).resolve()
    src = Path(src).resolve() if src else out.parent / f"{out.name}-src"
    generate(src, books)
    if FIGURES_WITHOUT_FINDING:
        print(
            "site: figures whose cell prints no Finding: line (alt text from "
            "the markdown above): " + "; ".join(FIGURES_WITHOUT_FINDING)
        )
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
    parser.add_argument(
        "--notebooks", nargs="+", help="only these notebooks (default: all)"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    status = build(args.out, args.src, args.notebooks)
    if status:
        raise SystemExit(status)
    print(f"site: {args.out}/index.html ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
