"""When a path is skipped at n: predicted time, or for n² paths, memory.

A path is skipped where its predicted time for all its calls at n exceeds
``max_seconds``, or, for the quadratic ``tape.jacobian`` paths, where its
predicted memory does not fit. In every function below, ``done`` is the
:class:`~.runner.Result` objects so far, ``path`` a path's name, ``n`` the
number of samples, ``model`` a name in ``MODELS`` and ``per_n2`` the path's
bytes per n**2 (see :func:`quadratic_bytes`), or None. Introduced in
``07-benchmark``.
"""

import numpy as np

from ..core import memory
from .paths import PATHS, count_outputs


def format_seconds(s):
    """Seconds ``s`` as 1.23 s, 45.6 ms or 789 us; '-' for None."""
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{1e3 * s:.1f} ms"
    return f"{1e6 * s:.0f} us"


def predict(done, path, n):
    """Seconds of one call at n, extrapolated from the sizes this path ran at.

    From one size: linear in n (small n is mostly overhead, so a quadratic
    path would be overestimated); from two: the fitted slope, between 1 and
    the path's exponent. Memory, not time, guards the quadratic paths. None
    where the path has not run yet.
    """
    ran = [r for r in done if r.path == path and r.median is not None]
    if not ran:
        return None
    slope = 1.0
    if len(ran) >= 2:
        a, b = ran[-2], ran[-1]
        slope = np.log(b.median / a.median) / np.log(b.n / a.n)
        slope = float(np.clip(slope, 1.0, PATHS[path].exponent))
    return ran[-1].median * (n / ran[-1].n) ** slope


def predicted_peak(done, path, n, model="mlp", per_n2=None):
    """Bytes at n of a quadratic path: the largest of three guesses.

    a*n**2 fitted to the peaks measured so far; ``per_n2 * n**2`` (bytes per
    n**2 from the model's size, see ``quadratic_bytes``); and for the
    question's MLP the measured model of notebook 02. None without any guess.
    """
    peaks = [(r.n, r.peak) for r in done if r.path == path and r.peak]
    guesses = [max(p / m**2 for m, p in peaks) * n**2] if peaks else []
    if per_n2:
        guesses.append(per_n2 * n**2)
    if model == "mlp":
        guesses.append(memory.predicted_bytes(n, "batch"))
    return max(guesses, default=None)


def quadratic_bytes(network, x):
    """Bytes per n**2 of ``tape.jacobian`` over a batch: n*l rows, each
    back-propagated through the whole batch's activations (about
    l * activations * itemsize; 1,600 for the MLP, where 1,955 was measured):
    an ``int``, from one sample of the Keras model ``network``'s inputs ``x``.
    """
    n_outputs = count_outputs(network, x)
    elements = memory.activation_elements(network, x[:1], unroll=False)
    return n_outputs * elements * x.dtype.itemsize


def memory_guard(done, path, n, model="mlp", per_n2=None):
    """``(predicted peak bytes, free bytes)`` of a quadratic path at n.

    The rule: a quadratic path runs at n only where its predicted peak
    (:func:`predicted_peak`) is below half of the memory free now. Two ints,
    or ``(None, None)`` for a linear path.
    """
    if PATHS[path].exponent != 2:
        return None, None
    peak = predicted_peak(done, path, n, model, per_n2)
    free = memory.available_bytes(safety=1.0)  # all that is free now
    return (None if peak is None else int(peak)), free


def skip_reason(
    done, path, n, repeats, max_seconds, model="mlp", per_n2=None, guard=None
):
    """``(predicted seconds of one call, why it is skipped or None)``.

    Memory first, for a quadratic path (:func:`memory_guard`): skipped where
    its predicted peak is above half the free memory. Then time: skipped
    where the first call and ``repeats`` more, each taking the predicted
    seconds, would exceed ``max_seconds``. ``guard`` is ``memory_guard``'s
    answer if the caller already has it.
    """

    predicted = predict(done, path, n)
    peak, free = guard or memory_guard(done, path, n, model, per_n2)
    if peak is not None and peak > free // 2:  # memory first: the real limit
        return predicted, (
            f"out of memory: predicted peak {peak / 2**30:.1f} GiB > half of "
            f"the {free / 2**30:.1f} GiB free"
        )
    calls = repeats + 1
    if predicted is not None and predicted * calls > max_seconds:
        return predicted, (
            f"predicted {calls} calls x {format_seconds(predicted)} = "
            f"{format_seconds(calls * predicted)} > {format_seconds(max_seconds)}"
        )
    return predicted, None
