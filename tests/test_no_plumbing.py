"""No test plumbing on the page a learner reads: nbval's markers are cell tags
(nbval reads `nbval-ignore-output` and friends from the cell's metadata), not
comments in the code; the sources in notebooks/src/ hold them the same way."""

import json
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
BOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
SOURCES = sorted((ROOT / "notebooks" / "src").glob("[0-9]*.py"))
NBVAL_TAGS = {"nbval-ignore-output", "nbval-skip", "nbval-check-output"}


@pytest.mark.parametrize("book", BOOKS, ids=lambda p: p.stem)
def test_no_nbval_comment_in_a_notebook(book):
    nb = nbformat.read(book, as_version=4)
    shown = [c.source for c in nb.cells if "NBVAL" in c.source]
    assert not shown, f"{book.stem}: move the marker to a cell tag: {shown[0][:80]!r}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_no_nbval_comment_in_a_source(source):
    text = source.read_text()
    assert "NBVAL" not in text, f"{source.name}: use the tag nbval-ignore-output"
    # every nbval tag a source uses is one nbval knows
    for found in re.findall(r"^# %%.*?tags=(\[[^\]]*\])", text, re.MULTILINE):
        tags = set(json.loads(found))
        unknown = {t for t in tags if t.startswith("nbval")} - NBVAL_TAGS
        assert not unknown, f"{source.name}: nbval does not read {unknown}"
