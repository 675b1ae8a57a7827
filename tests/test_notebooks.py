"""Every notebook runs with small injected parameters (papermill), and the stored
notebooks are the ones their sources build. nbval (strict) runs in `make test`
over notebooks/ itself: the stored learner copies, whose solutions are stubs.
Papermill runs notebooks/solutions/, the same notebooks with their solutions
in, and every check must print "✓" there."""

import json
from pathlib import Path

import jupytext
import nbformat
import papermill
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
BOOKS = sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))
SOLUTIONS = NOTEBOOKS / "solutions"

# Small values for each notebook's `parameters` cell, one JSON file per notebook
# in tests/small_parameters/, so that the whole papermill run is quick.
SMALL = Path(__file__).resolve().parent / "small_parameters"


def small_parameters(book):
    return json.loads((SMALL / f"{book.stem}.json").read_text())


def parameter_names(nb):
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    names = set()
    for line in cell.source.splitlines():
        name = line.split("=")[0].strip()
        if "=" in line and name.isidentifier():
            names.add(name)
    return names


def test_every_notebook_has_small_parameters():
    assert BOOKS, "no notebooks found"
    assert {b.stem for b in BOOKS} == {p.stem for p in SMALL.glob("*.json")}


@pytest.mark.notebook
@pytest.mark.parametrize("book", BOOKS, ids=[b.stem for b in BOOKS])
def test_papermill_runs_with_small_parameters(book, tmp_path):
    parameters = small_parameters(book)
    nb = nbformat.read(SOLUTIONS / book.name, as_version=4)
    assert set(parameters) <= parameter_names(nb), "unknown parameter injected"
    executed = papermill.execute_notebook(
        str(SOLUTIONS / book.name),
        str(tmp_path / book.name),
        parameters=parameters,
        kernel_name="python3",
        cwd=str(NOTEBOOKS),
        progress_bar=False,
    )
    injected = [
        c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])
    ]
    assert len(injected) == 1
    said = check_lines(executed)
    assert said and all(line.startswith("✓") for line in said), said


def check_lines(nb):
    """What each exercise's check printed (the hidden solutions ran before them)."""
    return [
        "".join(o.get("text", "") for o in c.outputs).strip()
        for c in nb.cells
        if c.cell_type == "code" and "check.exercise(" in c.source
    ]


@pytest.mark.parametrize("book", BOOKS, ids=[b.stem for b in BOOKS])
def test_stored_notebook_matches_its_source(book):
    """notebooks/src/NN.py is the source; `make notebooks` rebuilds the .ipynb."""
    import sys

    sys.path.insert(0, str(NOTEBOOKS.parent / "scripts"))
    from build_notebooks import learner_cells

    source = jupytext.read(NOTEBOOKS / "src" / f"{book.stem}.py")
    solved = nbformat.read(SOLUTIONS / book.name, as_version=4)
    assert [c.source for c in solved.cells] == [c.source for c in source.cells]
    learner = learner_cells(source.cells, book.stem)
    stored = nbformat.read(book, as_version=4)
    assert [c.source for c in stored.cells] == [c.source for c in learner]
    assert [c.cell_type for c in stored.cells] == [c.cell_type for c in source.cells]
    assert not any(c.get("outputs") for c in solved.cells), (
        f"solutions/{book.name} stores outputs: its checks' ✓ would show"
    )


@pytest.mark.parametrize("book", BOOKS, ids=[b.stem for b in BOOKS])
def test_no_stored_stderr_but_a_tagged_lesson(book):
    """Standard error is a red box in JupyterLab: a stored one is a defect
    (TensorFlow's C++ log, a stray warning) unless the cell is a deliberate,
    explained lesson, tagged ``stderr-lesson`` (issue 39)."""
    stored = nbformat.read(book, as_version=4)
    found = [
        f"cell {k}: {''.join(o.get('text', ''))[:120]!r}"
        for k, cell in enumerate(stored.cells)
        if "stderr-lesson" not in cell.metadata.get("tags", [])
        for o in cell.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == "stderr"
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("book", BOOKS, ids=[b.stem for b in BOOKS])
def test_tensorflow_comes_from_jacutil(book):
    """``import tensorflow`` before jacutil prints TensorFlow's C++ start-up
    log (oneDNN, CUDA) into the notebook as stderr - a red box in a learner's
    JupyterLab, hidden here by make's TF_CPP_MIN_LOG_LEVEL. Notebooks take
    ``from jacutil import tf``, which imports it quietly."""
    stored = nbformat.read(book, as_version=4)
    direct = [
        line
        for cell in stored.cells
        if cell.cell_type == "code"
        for line in cell.source.splitlines()
        if line.lstrip().startswith(("import tensorflow", "from tensorflow"))
    ]
    assert not direct, direct


def test_make_run_starts_its_kernels_without_a_security_warning(tmp_path, capfd):
    """Issue 39: `make run` printed ipykernel's "Kernel is running over TCP
    without encryption" once per notebook; its kernels (and make notebooks')
    now talk over IPC, their sockets at an absolute path that is removed."""
    import sys

    from jupyter_core.paths import jupyter_runtime_dir
    from nbclient import NotebookClient

    sys.path.insert(0, str(NOTEBOOKS.parent / "scripts"))
    from local_kernel import LocalKernelManager

    def sockets():
        folders = (NOTEBOOKS, Path(jupyter_runtime_dir()), Path.cwd())
        return {p for f in folders if f.exists() for p in f.glob("kernel-*ipc*")}

    before = sockets()
    book = tmp_path / "one.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print(6 * 7)")]
    nbformat.write(nb, book)

    def as_make_run(manager):  # scripts/run_notebooks.py
        chosen = {"kernel_manager_class": manager} if manager else {}
        return papermill.execute_notebook(
            str(book),
            str(tmp_path / "out.ipynb"),
            kernel_name="python3",
            progress_bar=False,
            cwd=str(NOTEBOOKS),
            **chosen,
        )

    def as_make_notebooks(manager):  # scripts/build_notebooks.py
        run = nbformat.read(book, as_version=4)
        NotebookClient(
            run,
            timeout=60,
            kernel_name="python3",
            kernel_manager_class=manager,
            resources={"metadata": {"path": str(NOTEBOOKS)}},
        ).execute()
        return run

    assert "without encryption" in _said(as_make_run(None), capfd)
    for execute in (as_make_run, as_make_notebooks):
        assert "without encryption" not in _said(execute(LocalKernelManager), capfd)
    assert sockets() == before, "IPC sockets were left behind"


def _said(executed, capfd):
    assert executed.cells[0].outputs[0]["text"] == "42\n"
    said = capfd.readouterr()
    return said.err + said.out


# Every notebook that shows library source shows the idea in plain
# TensorFlow first (issue 39).
PLAIN_FIRST = [b.stem for b in BOOKS if "show_source(" in b.read_text()]


def _asserts_about(trees, name):
    """The assert statements and np.testing.assert_* calls in ``trees`` that
    use ``name``, or a variable assigned from it."""
    import ast

    names = {name}
    for _ in range(3):  # J = plain(...), for a, b in zip(..., J): results of plain too
        for tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign):
                    source, targets = node.value, node.targets
                elif isinstance(node, ast.For):
                    source, targets = node.iter, [node.target]
                else:
                    continue
                if any(
                    isinstance(n, ast.Name) and n.id in names for n in ast.walk(source)
                ):
                    names |= {
                        n.id
                        for target in targets
                        for n in ast.walk(target)
                        if isinstance(n, ast.Name)
                    }

    def uses(node):
        return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))

    return [
        node
        for tree in trees
        for node in ast.walk(tree)
        if (
            isinstance(node, ast.Assert)
            or (isinstance(node, ast.Call) and "assert" in ast.unparse(node.func))
        )
        and uses(node)
    ]


@pytest.mark.parametrize("stem", PLAIN_FIRST)
def test_library_source_comes_after_its_plain_version_proved_equal(stem):
    """Before each shown library source, a cell tagged plain-version defines
    the idea in a few lines of plain TensorFlow, and an assertion (run by
    nbval and papermill) proves it equal to the library function."""
    assert len(PLAIN_FIRST) >= 11, PLAIN_FIRST  # the notebooks found
    import ast

    code = [
        c
        for c in nbformat.read(NOTEBOOKS / f"{stem}.ipynb", 4).cells
        if c.cell_type == "code"
    ]
    trees = [
        ast.parse(
            "\n".join(
                line
                for line in c.source.splitlines()
                if not line.startswith(("%", "!"))
            )
        )
        for c in code
    ]
    plain_since_last, functions, cell_lines = False, [], {}
    for cell, tree in zip(code, trees, strict=True):
        if "plain-version" in cell.metadata.get("tags", []):
            plain_since_last = True
            found = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
            functions += found
            cell_lines.update({f.name: cell.source.splitlines() for f in found})
        elif "show_source(" in cell.source:
            assert plain_since_last, (
                f"library source before its plain version: {cell.source}"
            )
            plain_since_last = False
    assert functions, "no plain version"
    for function in functions:
        lines = cell_lines[function.name][function.lineno - 1 : function.end_lineno]
        length = sum(1 for line in lines if line.strip())
        assert length <= 20, f"{function.name} is {length} lines: not a short idea"
        assert _asserts_about(trees, function.name), (
            f"{function.name} is never asserted equal to the library function"
        )
