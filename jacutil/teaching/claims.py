"""A sentence that states a result of the run is asserted by the run.

Prose is written once; the outputs come from a run on some machine. When
the two disagree nothing fails unless the run checks what the text says.
``claim`` is that check, in the cell that measures it::

    claim("xla-first-call", first > warm,
          f"XLA's first call ({first:.2f} s) costs more than a warm call "
          f"({warm:.3f} s)")

It prints the sentence, with the run's own figures, when it holds, and
raises ``ClaimContradicted`` when it does not, so that papermill, nbval and
``make notebooks`` stop on a run that contradicts its notebook.

A keypoint (or any markdown) that states a comparative result names its
claim in an HTML comment, invisible where the notebook is read::

    - XLA's first call costs more than a warm one. <!-- claim: xla-first-call -->

``unbacked_claims`` lists the keypoints that compare (faster, fits, stops,
within, pays off, the default...) without naming a claim, and the names
that no ``claim(...)`` call of the notebook asserts; tests/test_claims.py
runs it on every notebook. Introduced by every notebook (issue 57).
"""

import re

__all__ = ["ClaimContradicted", "claim", "unbacked_claims", "COMPARATIVE"]


class ClaimContradicted(AssertionError):
    """The run measured the opposite of what the notebook's text says."""


def claim(name, holds, sentence):
    """Print ``sentence`` if ``holds``, else raise ClaimContradicted.

    ``name``: the claim's name, which the markdown that states it cites as
    ``<!-- claim: name -->``. ``holds``: the run's own test of it (a bool
    computed from the values the cell measured). ``sentence``: the claim in
    words, with those values, so that the reader sees the evidence.
    """
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
        raise ValueError(
            f"a claim's name is lower-case words joined by '-', got {name!r}"
        )
    if bool(holds):
        print(f"Claim {name}: {sentence}")
        return
    raise ClaimContradicted(
        f"Claim {name} does not hold on this run: {sentence}. The notebook's "
        "text states it; either the demonstration no longer shows it (make it "
        "robust: a size or a deadline taken from what was measured) or the "
        "text must say what was measured instead."
    )


# Words that state a comparison or an outcome of the run.
COMPARATIVE = re.compile(
    r"\b(faster|fastest|slower|slowest|cheaper|cheapest|costs? (?:more|less)|"
    r"fits?|stops?|within|pays? off|by default|the default|beats?|"
    r"speeds? up|more than|less than|fewer than|outruns?|grows? like|"
    r"linear in|removes?|stays|costs? little|buys? little|(?:more|less) memory|"
    r"\d+(?:\.\d+)?\s?(?:×|x)\b)",
    re.IGNORECASE,
)
CITED = re.compile(r"<!--\s*claim:\s*([a-z0-9][a-z0-9-]*(?:\s*,\s*[a-z0-9-]+)*)\s*-->")
ASSERTED = re.compile(r"\bclaim\(\s*[\"']([a-z0-9][a-z0-9-]*)[\"']")


def _source(cell):
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def _keypoints(cells):
    """Each bullet of the notebook's `## Keypoints` cell(s), as one string."""
    bullets, inside = [], False
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        text = _source(cell)
        heading = re.match(r"##\s+(.+)", text)
        if heading:
            inside = heading[1].strip().lower().startswith("keypoints")
        if not inside:
            continue
        for bullet in re.split(r"\n(?=- )", text):
            if bullet.startswith("- "):
                bullets.append(" ".join(bullet.split()))
    return bullets


def unbacked_claims(cells):
    """What a notebook states without asserting: a list of messages.

    ``cells``: the notebook's cells (nbformat or plain dicts). Reports a
    keypoint that compares (COMPARATIVE) and cites no claim, and a cited
    claim that no code cell asserts with ``claim("name", ...)``.
    """
    asserted = set()
    for cell in cells:
        if cell["cell_type"] == "code":
            asserted |= set(ASSERTED.findall(_source(cell)))
    problems = []
    for bullet in _keypoints(cells):
        word = COMPARATIVE.search(CITED.sub("", bullet))
        if word and not CITED.search(bullet):
            problems.append(
                f"keypoint states a result ({word[0]!r}) without a claim: "
                f"{bullet[:100]!r}; assert it with claim(...) in the cell "
                "that measures it and cite it as <!-- claim: name -->"
            )
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        for names in CITED.findall(_source(cell)):
            for name in re.split(r"\s*,\s*", names):
                if name not in asserted:
                    problems.append(
                        f"claim {name!r} is cited but no cell asserts "
                        f"claim({name!r}, ...)"
                    )
    return problems
