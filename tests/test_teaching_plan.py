"""The course's minutes are measured and stated where a reader plans with them.

scripts/course_minutes.py measures each stored notebook (prose, code, output,
run time, exercises tried from their stubs); `make notebooks` writes the figures
into each notebook's "*Teaching · Exercises*" line, and `make minutes` into
README's plan and INSTRUCTORS.md. These tests keep all three true, and the core
path (the question answered: 00 to 05) within 3 hours, exercises included."""

import math
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
BOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
sys.path.insert(0, str(ROOT / "scripts"))
import course_minutes as cm  # noqa: E402


@pytest.fixture(scope="module")
def books():
    return cm.books_of(BOOKS)


@pytest.mark.parametrize("book", BOOKS, ids=lambda p: p.stem)
def test_each_notebook_states_its_measured_minutes(book):
    nb = nbformat.read(book, as_version=4)
    m = cm.measure(nb, cm.solutions_of(book))
    assert cm.stated(nb) == (m.teaching, m.doing, m.further), (
        f"{book.stem} states {cm.stated(nb)}, measured "
        f"{(m.teaching, m.doing, m.further)}: rebuild it (make notebooks ONLY=...)"
    )


def test_the_core_path_fits_in_three_hours(books):
    core = [m for p, m, _ in books if p.stem[:2] in cm.CORE]
    assert len(core) == len(cm.CORE)
    total = sum(m.teaching + m.doing for m in core)
    assert total <= cm.CORE_LIMIT, f"the core path takes {cm.hours(total)}"


def test_readme_plan_is_the_measured_one(books):
    text = (ROOT / "README.md").read_text()
    block = cm.PLAN.search(text)
    assert block, "README.md has lost its plan block"
    assert block[0] == cm.readme_plan(books), "README's plan is stale: make minutes"


def test_readme_plan_names_every_notebook_once_and_adds_up(books):
    plan = cm.readme_plan(books)
    for book in BOOKS:
        assert f"`{book.stem}` — " in plan
    total = sum(m.teaching + m.doing + m.further for _, m, _ in books)
    assert f"Everything, every exercise included: {cm.hours(total)}." in plan


def test_instructor_notes_state_the_measured_minutes(books):
    text = (ROOT / "INSTRUCTORS.md").read_text()
    assert cm.instructors_notes(text, books) == text, (
        "INSTRUCTORS.md's minutes are stale: make minutes"
    )


def test_an_exercise_and_a_going_further_part_are_counted_apart():
    nb = nbformat.v4.new_notebook()
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    words = " ".join(["word"] * 150)  # a minute of prose
    nb.cells = [
        md("# 99 · A title\n*Teaching: 1 min · Exercises: 1 min*"),
        md(f"## A section\n{words}"),
        code("x = 1\n" * 15, metadata={"run_seconds": 60.0}),  # 1 + 1 minutes
        md("## Exercises\n" + words),
        code("answer = 1\n", metadata={"tags": ["solution"]}),
        code("check()", metadata={"run_seconds": 30.0}),
        md("## Going further: more\n" + words),
        md(words),
        code("answer = 2\nanswer += 1\n", metadata={"tags": ["solution"]}),
        code("check()"),
        md("## Keypoints\n" + words),
    ]
    m = cm.measure(nb)
    prose = [cm._words(cm.LINE.sub("", c.source)) / cm.PROSE_WPM for c in nb.cells[:]]
    # title, the section, its 15 lines of code and a minute of running, keypoints;
    # the figures of the title's minutes line are not prose
    code_minutes = 15 / cm.CODE_LINES_PER_MIN
    assert m.teaching == math.ceil(prose[0] + prose[1] + code_minutes + 1 + prose[10])
    # the question (the Exercises heading and prose), 3 minutes, one line,
    # the check's 30 s run twice
    assert m.doing == math.ceil(prose[3] + 3 + cm.SOLUTION_LINE_MIN + 1)
    # the going-further heading's prose is its section's; the question after
    # it, 3 minutes and two lines are the exercise's
    assert m.further == math.ceil(prose[6] + prose[7] + 3 + 2 * cm.SOLUTION_LINE_MIN)


def test_the_rates_are_a_newcomers_and_shown_source_reads_as_code():
    """The rates a fresh reader measured the course with (issue 57)."""
    assert (cm.PROSE_WPM, cm.CODE_LINES_PER_MIN, cm.SOLUTION_LINE_MIN) == (120, 10, 1.5)
    source = "def f(x):\n" + "    x += 1\n" * 19
    shown = {"output_type": "display_data", "metadata": {}, "data": {
        "text/markdown": f"```python\n{source}```\n*the whole source: a link*"}}
    cell = nbformat.v4.new_code_cell("show_source(f)", outputs=[shown])
    expected = 20 / cm.CODE_LINES_PER_MIN + 5 / cm.PROSE_WPM  # 5 words
    assert cm._output_minutes(cell) == pytest.approx(expected)


def test_newcomer_prints_the_core_and_the_whole_course():
    import subprocess

    said = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "course_minutes.py"), "--newcomer"],
        capture_output=True, text=True, check=True,
    ).stdout
    books = cm.books_of(BOOKS)
    core = sum(m.teaching + m.doing for p, m, _ in books if p.stem[:2] in cm.CORE)
    assert f"exercises included): {core} min" in said and core <= cm.CORE_LIMIT
    assert "everything, every exercise included:" in said


RUN_ALL_LIMIT = 90  # seconds, on 2 cores, with the default parameters


@pytest.mark.parametrize("book", BOOKS, ids=lambda p: p.stem)
def test_each_stored_run_all_took_at_most_90_seconds(book):
    """The stored outputs come from one Run All (`make notebooks`), whose
    cells' run times are kept: that run took at most 90 s (issue 57). It
    reads the build's record; it times nothing."""
    cells = nbformat.read(book, as_version=4).cells
    solved = cm.solutions_of(book).cells
    seconds = sum(
        cell.metadata.get("run_seconds", 0.0)
        for shown, cell in zip(cells, solved, strict=True)
        for cell in [cell if "solution" in cell.metadata.get("tags", []) else shown]
    )
    assert seconds <= RUN_ALL_LIMIT, (
        f"{book.stem}: its stored Run All took {seconds:.0f} s; make a larger "
        "race a parameter, not the default"
    )
