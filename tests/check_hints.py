"""The one helper of tests/test_check_notebook_NN.py."""

from jacutil.teaching import check


def hint(key, answer, **context):
    """The hint that ``answer`` gets: it must be judged answered and wrong."""
    said = check.verdict(key, answer, **context)
    assert said.answered and not said.correct, str(said)
    return said.message
