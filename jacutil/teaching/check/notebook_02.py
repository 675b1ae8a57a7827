"""Checks of 02-vectorized's exercises."""

import numpy as np

from ...core._shared import sizes_of
from ...stages.loop import loop_jacobian
from . import FLOAT32, Hint, answered, as_array, as_number, checks, close_array, same

BUDGET_GIB = 8


def _pair(answer, what):
    answered(answer, what)
    if isinstance(answer, dict) or np.ndim(answer) != 1 or len(answer) != 2:
        raise Hint(f"expected {what}: two numbers, e.g. `answer = (n, gib)`.")
    first, second = answer
    return (
        as_number(first, "the largest n"),
        as_number(second, "the GiB needed at 2n"),
    )


@checks("02-1")
def doubling_the_batch(answer, batch_model):
    """Largest n in 8 GiB from a*n^2 + b*n + c, and the GiB at twice that n."""
    n, gib = _pair(answer, "a pair (largest n in 8 GiB, GiB needed at 2n)")
    n_best = batch_model.largest_n(BUDGET_GIB * 2**30)
    gib_best = float(batch_model.predict(2 * n_best)) / 2**30
    if n <= 0 or gib <= 0:
        raise Hint("both numbers are positive: a number of samples, and GiB.")
    n_right = abs(n / n_best - 1) <= 0.05
    gib_right = abs(gib / gib_best - 1) <= 0.1
    if n_right and gib_right:
        return
    if not n_right:
        if n > n_best:
            raise Hint(
                f"your n is too large, by a factor of about {n / n_best:.2g}: "
                "its predicted peak is over 8 GiB. Memory grows like n^2, not "
                "in proportion to n: twice the samples, about four times the "
                "memory. Solve a*n^2 + b*n + c = 8 GiB (`batch_model.largest_n`)."
            )
        raise Hint(
            f"your n is too small, by a factor of about {n_best / n:.2g}: a "
            "larger batch still fits in 8 GiB. Is 8 GiB written as 8 * 2**30 "
            "bytes? Solve a*n^2 + b*n + c = 8 GiB (`batch_model.largest_n`)."
        )
    for factor, unit in [(2**10, "MiB"), (2**30, "bytes")]:
        if abs(gib / (gib_best * factor) - 1) <= 0.1:
            raise Hint(
                f"that second number looks like {unit}: give it in GiB (bytes / 2**30)."
            )
    if abs(gib / BUDGET_GIB - 2) <= 0.25:
        raise Hint(
            "doubling n doubled your memory: that is a model linear in n. The "
            "batch tape's memory has an n^2 term (`batch_model.quadratic`)."
        )
    if abs(gib / BUDGET_GIB - 1) <= 0.1:
        raise Hint(
            "that is the memory at n itself (8 GiB): predict it at 2n "
            "(`batch_model.predict`)."
        )
    size = "too large" if gib > gib_best else "too small"
    raise Hint(
        f"your GiB at 2n is {size}: predict the peak at 2n with the "
        "fitted model, in GiB (bytes / 2**30)."
    )


@checks("02-2")
def columns_of_the_last_layer(answer, model, x):
    """J with respect to the last layer: the last columns of the full J."""
    full = loop_jacobian(model, x).astype("float64")
    last = model.layers[-1].trainable_variables
    sizes = sizes_of(last)
    n, n_out, m = full.shape
    count = sum(sizes)
    answered(answer, "the Jacobian with respect to the last layer's variables")
    if np.ndim(answer) == 3 and np.shape(answer)[2] == m and m != count:
        raise Hint(
            "that has a column for every parameter of the model: pass "
            "`variables=model.layers[-1].trainable_variables`."
        )
    J = as_array(
        answer,
        "the last layer's Jacobian",
        (n, n_out, count),
        "(n samples, l outputs, the last layer's parameters)",
    )
    expected = full[:, :, m - count :]
    if same(J, expected):
        return
    if same(J, full[:, :, :count]):
        raise Hint(
            "those are the FIRST columns of J: the columns follow "
            "`flat_params` order, `model.trainable_variables` from the first "
            "layer to the last."
        )
    if len(sizes) == 2 and same(
        J, np.concatenate(np.split(expected, [sizes[0]], axis=2)[::-1], axis=2)
    ):
        raise Hint(
            "the bias comes before the kernel in your columns: within a "
            "layer the kernel comes first (trainable_variables order)."
        )
    close_array(
        J,
        expected,
        "your Jacobian",
        wrong="it is not the last columns of the loop's Jacobian on the same "
        "samples. Did you use `model` and `x_check`, and the last layer's "
        "kernel and bias (in that order)?",
        **FLOAT32,
    )
