"""The first-call rows of ``make bench-peers`` (issue 64): each library's
function on a row computes what jacutil's does, and the table's ratio and
verdict follow from the times (no timing is asserted)."""

import numpy as np
import pytest

from jacutil.bench import first_call


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_the_tape_loop_computes_what_jacutil_does(name):
    ours, args, check = first_call.prepared(name, "jacutil")
    tape, tape_args, _ = first_call.prepared(name, "tape")
    expected = np.asarray(ours(*args))
    value = np.asarray(tape(*tape_args))
    assert check(value, expected) < 1e-4
    with pytest.raises(AssertionError, match="differs from jacutil's"):
        check(value + 1.0, expected)


def test_the_row_models_are_the_same_in_every_process():
    """Each library builds the row's model in a process of its own: the same
    seed must give the same weights."""
    row = first_call.ROWS["bert"]
    first, second = first_call.row_model(row)[0], first_call.row_model(row)[0]
    for a, b in zip(first.weights, second.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _result(against, times, aim=2.0):
    return {"row": "r", "what": "norms", "model": "m", "n": 8, "aim": aim,
            "against": against,
            "libraries": {lib: {"first": t, "warm": t / 10}
                          for lib, t in times.items()}}  # fmt: skip


def test_the_ratio_is_to_the_fastest_peer_or_the_tape_loop():
    times = {"jacutil": 0.6, "jax": 0.4, "torch": 0.3, "tape": 9.0}
    peers = _result("peer", times, aim=1.0)
    assert first_call.ratio(peers) == pytest.approx(2.0)
    tape = _result("tape", {"jacutil": 3.0, "tape": 2.0})
    assert first_call.ratio(tape) == pytest.approx(1.5)
    assert first_call.ratio(_result("peer", {"jacutil": 1.0, "tape": 2.0})) is None
    table = first_call.table([peers, tape])
    rows = table.splitlines()[2:]
    assert rows[0].endswith("| no |") and rows[1].endswith("| yes |")
