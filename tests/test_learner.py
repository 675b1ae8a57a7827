"""Learner copies keep everything but outputs and solutions.

That each runs to the end, with its checks saying "no answer yet", is tested in
JupyterLab itself, where a workshop participant runs it (tests/test_browser.py).
"""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
BOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
SMALL = ROOT / "tests" / "small_parameters"


@pytest.fixture(scope="module")
def learner_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("learner")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_learner.py"), *map(str, BOOKS)],
        cwd=out,
        check=True,
        capture_output=True,
    )
    return out / "build" / "learner"


@pytest.mark.parametrize("book", BOOKS, ids=[b.stem for b in BOOKS])
def test_learner_copy_empties_solutions_only(learner_dir, book):
    original = nbformat.read(book, as_version=4)
    copy = nbformat.read(learner_dir / book.name, as_version=4)
    assert len(copy.cells) == len(original.cells)
    solutions = 0
    for before, after in zip(original.cells, copy.cells, strict=True):
        assert "solution" not in before.metadata.get("tags", [])
        if "exercise" in before.metadata.get("tags", []):
            solutions += 1
            assert after.source.startswith(f"# Exercise {solutions}:")
        assert after.source == before.source
        if after.cell_type == "code":
            assert after.outputs == [] and after.execution_count is None
    assert solutions >= 2
