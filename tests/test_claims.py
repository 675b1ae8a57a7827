"""A claim is code (issue 57): every comparative keypoint cites a claim that
its notebook's run asserts, and a run that contradicts one stops."""

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from jacutil.teaching.claims import ClaimContradicted, claim, unbacked_claims
from tests.test_notebooks import BOOKS


@pytest.mark.parametrize("book", BOOKS, ids=[b.stem for b in BOOKS])
def test_every_comparative_keypoint_is_asserted_by_the_run(book):
    problems = unbacked_claims(nbformat.read(book, as_version=4).cells)
    assert not problems, "\n".join(problems)


def _notebook(keypoint, code):
    return nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell(code),
            nbformat.v4.new_markdown_cell("## Keypoints\n\n" + keypoint),
        ]
    )


def test_a_comparative_keypoint_without_its_claim_fails_the_anatomy():
    nb = _notebook("- XLA's first call is slower than a warm one.", "x = 1")
    (problem,) = unbacked_claims(nb.cells)
    assert "slower" in problem and "claim(" in problem


def test_a_cited_claim_that_no_cell_asserts_fails_the_anatomy():
    nb = _notebook("- It is slower. <!-- claim: xla-first -->", "x = 1")
    (problem,) = unbacked_claims(nb.cells)
    assert "'xla-first'" in problem and "no cell asserts" in problem
    nb = _notebook(
        "- It is slower. <!-- claim: xla-first -->",
        'claim("xla-first", first > warm, "first > warm")',
    )
    assert unbacked_claims(nb.cells) == []
    nb = _notebook("- The loop is correct: it equals the reference.", "x = 1")
    assert unbacked_claims(nb.cells) == []  # no comparison: nothing to assert


def test_a_claim_prints_its_evidence_or_stops_the_run(capsys):
    claim("first-call", 0.8 > 0.1, "the first call (0.8 s) costs more than 0.1 s")
    assert capsys.readouterr().out == (
        "Claim first-call: the first call (0.8 s) costs more than 0.1 s\n"
    )
    with pytest.raises(ClaimContradicted, match="does not hold on this run"):
        claim("first-call", 0.105 > 0.129, "the first call (0.105 s) > 0.129 s")
    with pytest.raises(ValueError, match="lower-case words"):
        claim("First call", True, "")


def test_a_deliberately_contradicted_claim_fails_the_notebook_run(tmp_path):
    """As papermill and nbval run a notebook: the contradicted cell errors."""
    nb = _notebook(
        "- The first call is slower. <!-- claim: first-slower -->",
        "from jacutil.teaching.claims import claim\n"
        "first, warm = 0.105, 0.129  # a compile reused: the first call was fast\n"
        'claim("first-slower", first > warm, f"first {first} s > warm {warm} s")',
    )
    assert unbacked_claims(nb.cells) == []  # the anatomy is right...
    with pytest.raises(CellExecutionError, match="ClaimContradicted"):
        NotebookClient(nb, timeout=120, kernel_name="python3").execute()


def test_shown_source_leaves_out_docstrings_and_what_the_plain_version_has():
    from jacutil.teaching.notebook import ELIDED, source_link, trimmed_source
    from tests.test_claims import _shown

    text = trimmed_source(_shown)
    assert "Docstring" not in text and "return total" in text
    plain = "def plain(x):\n    total = 0\n    for v in x:\n        total += v\n"
    text = trimmed_source(_shown, plain)
    assert ELIDED in text and "total += v" not in text
    assert "return total" in text and text.startswith("def _shown(x):")
    line = _shown.__code__.co_firstlineno
    assert source_link(_shown) == ("tests/test_claims.py", line)


def _shown(x):
    """Docstring: left out."""
    total = 0
    for v in x:
        total += v
    return total
