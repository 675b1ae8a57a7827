"""The proof a plan needs before use: its rules agree with autodiff."""

import numpy as np

from ..core._shared import joined_gradients, sizes_of
from ..core._tf import tf
from ..core.batch import n_samples, take
from ..core.target import watched
from .walk import OutputRows, rules_squared_norms, rules_tensor

SAMPLES_CHECKED = 8  # samples on which the rules are proved, spread over the batch


def relative_error(hand, reference):
    """The largest difference of ``hand`` from ``reference``, relative to the
    largest ``|reference|`` (absolute below 1); inf when their shapes differ."""
    hand, reference = np.asarray(hand), np.asarray(reference)
    if hand.shape != reference.shape:
        return np.inf
    if hand.size == 0:
        return 0.0
    scale = max(1.0, float(np.abs(reference).max()))
    return float(np.abs(hand - reference).max()) / scale


def disagreement(plan, target, x, seed=0):
    """None if the rules agree with autodiff on several samples, else the reason.

    Up to ``SAMPLES_CHECKED`` samples, spread evenly over the batch, each
    compared alone: one vector-Jacobian product ``J_i.T @ w_i`` for random
    weights ``w_i`` of its outputs, by the rules and by a tape of its own.
    Any difference between the two Jacobians shows (almost surely) in it.
    The rules' norms of that product (:func:`rules_squared_norms`, which
    may not form it) are checked against its norm too.

    Arguments as :meth:`Plan.check`; ``seed`` seeds the random weights.
    """
    found = first_difference(plan, target, x, seed)
    if found is None:
        return None
    what, error, i = found
    if what == "norms":
        return (
            f"the layer rules' gradient norms differ from autodiff's by "
            f"{error:.3g} (squared, relative) on sample {i}: a rule's norms "
            "are wrong"
        )
    return (
        f"the layer rules differ from autodiff by {error:.3g} (relative) on "
        f"sample {i}: the model computes something its layers do not say"
    )


def _picked(x):
    rows = int(n_samples(x))
    picked = np.unique(np.linspace(0, rows - 1, min(rows, SAMPLES_CHECKED)).round())
    return [int(i) for i in picked]


def spread_samples(x):
    """Up to ``SAMPLES_CHECKED`` samples of the batch ``x``, spread evenly
    over it (the first and the last among them): what a check reads."""
    picked = _picked(x)
    return tf.nest.map_structure(lambda t: tf.gather(t, picked), x)


def first_difference(plan, target, x, seed=0, largest=False):
    """``(what, error, sample)`` of the first check that fails
    (:func:`disagreement`'s), ``what`` ``"jacobian"`` or ``"norms"``, the
    error relative; None when all pass (the tolerance: float32's or
    float64's, times sqrt(l)). ``largest``: the largest error of all
    checks instead, passed or not."""
    picked = _picked(x)
    chosen = spread_samples(x)
    J = rules_tensor(plan, chosen)  # (k, l, m)
    w = tf.random.stateless_normal(J.shape[:2], [seed, 1], dtype=J.dtype)
    hand = tf.einsum("ikm,ik->im", J, w).numpy()
    tolerance = (1e-4 if J.dtype == tf.float32 else 1e-9) * np.sqrt(J.shape[1])
    squared = rules_squared_norms(plan, chosen, OutputRows(w[:, None]))[:, 0].numpy()
    sources = [watched(v) for v in target.variables]
    worst = None
    for row, i in enumerate(picked):
        with tf.GradientTape() as tape:
            target.watch(tape)
            y = target.forward(take(x, i, i + 1))[0]
            score = tf.reduce_sum(tf.cast(w[row], y.dtype) * y)
        grads = tape.gradient(score, sources)
        auto = joined_gradients(grads, sizes_of(target.variables), J.dtype).numpy()
        errors = {
            "jacobian": relative_error(hand[row], auto),
            "norms": relative_error(squared[row], auto @ auto),  # no gradients
        }
        for what, error in errors.items():
            if largest and (worst is None or not error <= worst[1]):
                worst = (what, error, i)
            elif not largest and not error <= tolerance:
                return what, error, i
    return worst
