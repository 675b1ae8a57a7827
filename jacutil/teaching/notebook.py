"""Small helpers for the notebooks: show a function's source, name the device."""

import ast
import inspect
import textwrap
from pathlib import Path

from ..core._tf import tf

ELIDED = "...  # as in the plain version above"


def _docstring_lines(source):
    """Line numbers (from 0) of every docstring in ``source``."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno - 1, first.end_lineno))
    return lines


def _plain_lines(plain):
    if plain is None:
        return set()
    text = plain if isinstance(plain, str) else inspect.getsource(plain)
    return {line.strip() for line in text.splitlines() if len(line.strip()) > 3}


def trimmed_source(obj, plain=None):
    """The source of ``obj`` as a notebook shows it: docstrings out, and each
    run of two or more lines that the plain version (a function or its
    source) already has folded into one ``...`` line. Comments are kept."""
    source = textwrap.dedent(inspect.getsource(obj))
    lines = source.splitlines()
    drop = _docstring_lines(source)
    drop |= {k + 1 for k in drop if k + 1 < len(lines) and not lines[k + 1].strip()}
    known = _plain_lines(plain)
    kept = [(k, line) for k, line in enumerate(lines) if k not in drop]
    out, run = [], []

    def flush():
        if len(run) >= 2:
            indent = run[0][: len(run[0]) - len(run[0].lstrip())]
            out.append(indent + ELIDED)
        else:
            out.extend(run)
        run.clear()

    for k, line in kept:
        if k > 0 and line.strip() in known:  # the def line always shows
            run.append(line)
        else:
            flush()
            out.append(line)
    flush()
    return "\n".join(out) + "\n"


def source_link(obj):
    """(path from the repository's root, first line) of ``obj``'s source."""
    path = Path(inspect.getsourcefile(inspect.unwrap(obj))).resolve()
    root = Path(__file__).resolve().parents[2]
    line = inspect.getsourcelines(obj)[1]
    return path.relative_to(root).as_posix(), line


def show_source(obj, plain=None):
    """Display the source of a ``jacutil`` function, trimmed, with a link to
    the whole file.

    The notebooks show the code that the package runs - not a second copy -
    and only what the plain version before it lacks (``trimmed_source``).
    ``obj``: a function, class or method whose source ``inspect`` can find;
    ``plain``: the notebook's plain version of it, or None. Introduced in
    ``01-nested-loop``.
    """
    from IPython.display import Markdown, display

    path, line = source_link(obj)
    note = "docstring left out" + (
        "; `...` marks lines the plain version above has" if plain is not None else ""
    )
    display(
        Markdown(
            f"```python\n{trimmed_source(obj, plain)}```\n"
            f"*{note}. The whole source: [{path}, line {line}](../{path}#L{line}).*"
        )
    )


def device_summary():
    """One line: TensorFlow's version and the devices that will run the code."""
    gpus = tf.config.list_logical_devices("GPU")
    where = f"{len(gpus)} GPU(s): " + ", ".join(g.name for g in gpus) if gpus else "CPU"
    return f"TensorFlow {tf.__version__}, running on {where}"
