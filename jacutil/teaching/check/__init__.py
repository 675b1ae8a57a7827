"""Exercises that check themselves: ``check.exercise("03-1", answer)``.

Each notebook's exercises end with a cell such as::

    check.exercise("03-1", answer, model=model)

It prints one line: "correct", "no answer yet" (``answer`` is still ``None``,
as in the learner copies of ``make learner``), or a hint that teaches what was
expected - the shape, the order of magnitude, the concept - without giving the
answer away. The keyword arguments are the notebook's own objects that the
check needs to compute the expected answer itself (independently of the
learner's code). ``verdict(...)`` returns the same judgement without printing
(the tests use it). Introduced in ``00-welcome`` (its exercises).

One module per notebook (``notebook_00`` ...) registers its checks with
``@checks("00-1")``.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

import numpy as np

__all__ = ["Verdict", "checks", "exercise", "keys", "verdict"]

_CHECKS = {}


@dataclass(frozen=True)
class Verdict:
    """The judgement of one answer to exercise ``key`` (``"NN-k"``): ``correct``,
    and ``message``, the hint or what to put in ``answer`` (empty when correct);
    ``answered`` is False while the answer is still None."""

    key: str
    correct: bool
    message: str
    answered: bool = True

    def __str__(self):
        if self.correct:
            return f"✓ Exercise {self.key}: correct."
        if not self.answered:
            return f"… Exercise {self.key}: no answer yet. {self.message}"
        return f"✗ Exercise {self.key}: not yet. Hint: {self.message}"


class Hint(Exception):
    """Raised inside a check: the answer is wrong, and the message says why."""


class NoAnswer(Exception):
    """Raised inside a check: the answer is still None."""


def checks(*names):
    """Register a check function ``check(answer, **context)`` for exercises.

    Every check has the same contract, written here once: ``answer`` is the
    learner's answer (None: not yet answered) and ``context`` the notebook's
    objects the check needs (its model, its inputs ``x``, ...); it returns
    when the answer is right, raises ``NoAnswer`` when ``answer`` is None and
    ``Hint`` when it is wrong, with a message that says why (never the answer).
    ``names`` are the exercises it checks, each ``"NN-k"``; the decorator
    returns the function unchanged (``ValueError`` if an exercise has a check).
    """

    def register(function):
        for name in names:
            if name in _CHECKS:
                raise ValueError(f"exercise {name!r} has two checks")
            _CHECKS[name] = function
        return function

    return register


def _load():
    for module in pkgutil.iter_modules(__path__):
        if module.name.startswith("notebook_"):
            importlib.import_module(f"{__name__}.{module.name}")


def keys():
    """Every exercise that has a check, a sorted list ("00-1", "00-2", ...)."""
    _load()
    return sorted(_CHECKS)


def verdict(key, answer, **context):
    """Judge ``answer`` to exercise ``key`` as :func:`exercise` does, nothing
    printed: a :class:`Verdict` (``KeyError``: no exercise ``key``).

    >>> verdict("00-1", None).answered
    False
    """
    _load()
    if key not in _CHECKS:
        raise KeyError(f"no exercise {key!r}; there are {', '.join(keys())}")
    try:
        _CHECKS[key](answer, **context)
    except NoAnswer as empty:
        return Verdict(key, False, str(empty), answered=False)
    except Hint as hint:
        return Verdict(key, False, str(hint))
    return Verdict(key, True, "")


def exercise(key, answer, **context):
    """Print whether ``answer`` to exercise ``key`` is right, or a hint.

    ``key`` is "NN-k", exercise k of notebook NN. ``context``: the notebook's
    objects the check needs (its model, its data); the exercise's cell names
    them. ``answer`` is None while not answered yet. Never raises for a wrong
    answer: it teaches and the notebook runs on.
    """
    print(verdict(key, answer, **context))


# Helpers for the checks ----------------------------------------------------


def answered(answer, what):
    """``answer`` unchanged, or NoAnswer if it is None; ``what`` says, in
    words, what to put there (as in every helper below)."""
    if answer is None:
        raise NoAnswer(f"Put {what} in `answer` and run this cell again.")
    return answer


def as_number(answer, what, finite=True):
    """``answer`` as a float, or a Hint that says one number (finite, when
    ``finite``: NaN and inf refused) was expected; NoAnswer for None."""
    answered(answer, what)
    try:
        value = float(np.asarray(answer).item())
    except (TypeError, ValueError):
        kind = type(answer).__name__
        raise Hint(f"expected {what}: one number, got {kind}.") from None
    if finite and not np.isfinite(value):
        raise Hint(f"expected {what}: a finite number, got {value}.")
    return value


NEAR_MISS = 1.5  # within this factor, a hint gives the gap, not the factor


def close_number(value, expected, rel, what):
    """A Hint with the order of magnitude if ``value`` is not within ``rel``;
    for a near miss (within a factor ``NEAR_MISS``), how far off it is; or
    that it has the wrong sign or is zero."""
    if abs(value - expected) <= rel * abs(expected):
        return
    if expected and value and np.sign(value) == np.sign(expected):
        factor = value / expected
        size = "too large" if factor > 1 else "too small"
        if max(factor, 1 / factor) < NEAR_MISS:  # "a factor of about 1" says nothing
            gap = abs(value - expected)
            by = f"{gap:.0f}" if float(gap).is_integer() else f"{gap:.3g}"
            raise Hint(
                f"{what} is close but {size}: by {by}, "
                f"{gap / abs(expected):.1%} of the right value."
            )
        factor = max(factor, 1 / factor)
        raise Hint(f"{what} is {size}, by a factor of about {factor:.2g}.")
    raise Hint(f"{what} has the wrong sign or is zero.")


def as_array(answer, what, shape, shape_words):
    """``answer`` as a float64 array of ``shape``, or a Hint about its shape.

    ``shape_words`` names the axes, e.g. "(n samples, l outputs, m parameters)".
    A tf.Tensor or a memmap is accepted; None, a list of tensors or a ragged
    answer are not (NoAnswer; a Hint for another shape, or NaN or inf).
    """
    answered(answer, what)
    if isinstance(answer, (list, tuple)) and any(a is None for a in answer):
        raise Hint(
            f"expected {what}; it holds None: a gradient that never reached the "
            "variables (was the forward pass inside the tape?)."
        )
    try:
        array = np.asarray(answer, dtype="float64")
    except (TypeError, ValueError):
        raise Hint(f"expected {what}, an array {shape_words}.") from None
    if array.shape != tuple(shape):
        raise Hint(
            f"expected {what} of shape {shape_words} = {tuple(shape)}; "
            f"got {array.shape}."
        )
    if not np.all(np.isfinite(array)):
        raise Hint(f"{what} holds NaN or inf.")
    return array


FLOAT32 = {"rtol": 1e-5, "atol": 1e-6}  # a float32 J against the loop's, say


def same(array, candidate, tolerance=FLOAT32):
    """Whether ``array`` equals ``candidate`` (a right answer, or a known wrong
    one) within ``tolerance`` (``np.allclose``'s; by default float32's error)."""
    return np.allclose(array, candidate, **tolerance)


def flat(arrays):
    """The arrays or tensors (gradients, say) flattened and joined: a 1-D
    float64 array."""
    return np.concatenate([np.asarray(a, "float64").ravel() for a in arrays])


def shape_of(answer):
    """The answer's shape, or None for a ragged list (``as_array`` says why)."""
    try:
        return np.shape(answer)
    except ValueError:
        return None


def close_array(array, expected, what, rtol, atol, wrong):
    """A Hint (``wrong``) if ``array`` is not ``expected`` within tolerance.

    ``rtol`` and ``atol`` as for ``np.allclose``. An all-zero answer gets the
    classic hint (a disconnected tape) first.
    """
    if np.allclose(array, expected, rtol=rtol, atol=atol):
        return
    if not np.any(array) and np.any(expected):
        raise Hint(
            f"{what} is all zeros: the derivatives never reached the variables "
            "(a copy of them, or a pass outside the tape; see 06-pitfalls)."
        )
    raise Hint(wrong)
