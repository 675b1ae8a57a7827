"""The exercise checks: every exercise has one, the hidden solution passes it
(in the stored notebooks here; in the papermill and nbval runs again), and the
learner copies keep it. Wrong answers are tried in tests/test_check_notebook_NN.py."""

import re
from pathlib import Path

import nbformat
import pytest

from jacutil.teaching import check

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
BOOKS = sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))
SOLUTIONS = NOTEBOOKS / "solutions"
CALL = re.compile(r'check\.exercise\("(\d\d-\d+)"')


def exercises(nb):
    """[(solution cell, check cell)] in order; the check cell follows its solution."""
    cells = [c for c in nb.cells if c.cell_type == "code"]
    pairs = []
    for i, cell in enumerate(cells):
        if "solution" in cell.metadata.get("tags", []):
            following = cells[i + 1] if i + 1 < len(cells) else None
            pairs.append((cell, following))
    return pairs


def check_output(cell):
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


@pytest.mark.parametrize("book", BOOKS, ids=[b.stem for b in BOOKS])
def test_every_exercise_ends_with_its_check(book):
    nb = nbformat.read(SOLUTIONS / book.name, as_version=4)
    pairs = exercises(nb)
    assert pairs, "no exercises"
    for number, (solution, following) in enumerate(pairs, start=1):
        key = f"{book.stem[:2]}-{number}"
        assert following is not None and CALL.findall(following.source) == [key], (
            f"exercise {key}: the cell after its solution must call "
            f'check.exercise("{key}", answer, ...)'
        )
        assert "answer =" in solution.source, f"{key}: the solution sets `answer`"
        assert key in check.keys(), f"{key} has no check in jacutil.teaching.check"


def test_every_check_belongs_to_an_exercise():
    used = set()
    for book in BOOKS:
        for cell in nbformat.read(book, as_version=4).cells:
            used.update(CALL.findall(cell.source))
    assert set(check.keys()) == used


@pytest.mark.parametrize("book", BOOKS, ids=[b.stem for b in BOOKS])
def test_a_learner_reading_a_stored_notebook_sees_no_answer(book):
    """The stored notebook (GitHub, the website) is the learner's: each
    solution a stub, each check "no answer yet", no "✓" anywhere; the
    solutions, source-hidden, are in notebooks/solutions/ (issue 57)."""
    stored = nbformat.read(book, as_version=4)
    solved = nbformat.read(SOLUTIONS / book.name, as_version=4)
    pairs = exercises(solved)
    assert pairs, "no exercises"
    stubs = [c for c in stored.cells if "exercise" in c.metadata.get("tags", [])]
    assert len(stubs) == len(pairs)
    for number, stub in enumerate(stubs, start=1):
        assert stub.source.startswith(f"# Exercise {number}: your solution here")
        assert stub.source.rstrip().endswith("answer = None")
    for cell in stored.cells:
        assert "solution" not in cell.metadata.get("tags", [])
        if cell.cell_type == "code" and CALL.search(cell.source):
            assert check_output(cell).startswith("… Exercise"), check_output(cell)
        for out in cell.get("outputs", []):
            assert "✓ Exercise" not in str(out.get("text", "")), out
    for solution, _ in pairs:
        hidden = solution.metadata.get("jupyter", {})
        assert hidden.get("source_hidden") and hidden.get("outputs_hidden")


def test_no_answer_yet_is_not_an_error():
    said = check.verdict("00-1", None)
    assert not said.correct and not said.answered
    assert str(said).startswith("… Exercise 00-1: no answer yet. Put ")


def test_an_unknown_exercise_names_the_known_ones():
    with pytest.raises(KeyError, match="00-1"):
        check.verdict("99-9", 1)


def test_exercise_prints_one_line(capsys):
    check.exercise("00-1", 1795)
    assert capsys.readouterr().out == "✓ Exercise 00-1: correct.\n"
