"""README's 3-hour plan adds up, names real notebooks, and its total of every
notebook's minutes is the sum of their "Teaching · Exercises" lines."""

import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
BOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
sys.path.insert(0, str(ROOT / "scripts"))
from run_notebooks import teaching_minutes  # noqa: E402

ROW = re.compile(r"^\| (\d):(\d\d) \| (.+?) \| (\d+) \|$", re.MULTILINE)


def plan():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("**A 3-hour plan**") :]
    rows = ROW.findall(section)
    return [(60 * int(h) + int(m), what, int(n)) for h, m, what, n in rows]


def test_the_plan_runs_three_hours_without_gaps():
    rows = plan()
    assert rows and rows[0][0] == 0
    for (start, _, minutes), (following, _, _) in zip(rows, rows[1:], strict=False):
        assert start + minutes == following
    assert rows[-1][0] + rows[-1][2] == 180


def test_the_plan_names_every_notebook():
    named = " ".join(what for _, what, _ in plan())
    for book in BOOKS:
        assert f"`{book.stem}`" in named, f"{book.stem} is not in the 3-hour plan"


def test_the_stated_total_is_the_sum_of_the_notebooks():
    total = sum(sum(teaching_minutes(nbformat.read(b, as_version=4))) for b in BOOKS)
    text = (ROOT / "README.md").read_text()
    assert f"{total // 60} h {total % 60} min" in text
