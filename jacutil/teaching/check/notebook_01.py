"""Checks of 01-nested-loop's exercises."""

import numpy as np

from ...stages.loop import loop_jacobian
from . import FLOAT32, Hint, answered, as_array, as_number, checks, close_array, same

COLLEAGUE_SAMPLES, COLLEAGUE_OUTPUTS = 10_000, 10


@checks("01-1")
def minutes_for_a_colleague(answer, per_row):
    """n * l rows, one sample each, at the measured cost of one row."""
    minutes = as_number(answer, "the predicted time in minutes")
    expected = COLLEAGUE_SAMPLES * COLLEAGUE_OUTPUTS * float(per_row) / 60
    if minutes <= 0:
        raise Hint("a time in minutes is a positive number.")
    ratio = minutes / expected
    if 1 / 1.5 <= ratio <= 1.5:
        return
    near = {
        1 / COLLEAGUE_OUTPUTS: "that is one row per sample: the loop runs one "
        "row per sample AND per output, n * l of them.",
        2 / COLLEAGUE_OUTPUTS: "that counts l = 2 outputs, the outputs of this "
        "notebook's network: the colleague's network has l = 10.",
        2.0: "that counts each row twice: `per_row` already holds one "
        "forward AND one backward pass, and the loop's bookkeeping.",
        60.0: "that looks like seconds: divide by 60 for minutes.",
        1 / 60: "that looks like hours: the question asks for minutes.",
        1000.0: "that looks like milliseconds or a `per_row` in ms: "
        "`per_row` is in seconds; the question asks for minutes.",
        60_000.0: "that looks like milliseconds: the question asks for minutes.",
    }
    for factor, hint in near.items():
        if abs(np.log(ratio / factor)) < np.log(1.5):
            raise Hint(hint)
    size = "too large" if ratio > 1 else "too small"
    raise Hint(
        f"your time is {size}, by a factor of about {max(ratio, 1 / ratio):.2g}. "
        "Count the rows (samples x outputs) and multiply by the time of one "
        "row (`per_row`, in seconds)."
    )


@checks("01-2")
def one_forward_pass_per_sample(answer, model, x):
    """The loop with one persistent tape per sample: the same Jacobian."""
    expected = loop_jacobian(model, x).astype("float64")
    n, n_out, m = expected.shape
    answered(answer, "the per-sample Jacobian")
    if n_out > 1 and getattr(answer, "shape", None) == (n, m):
        raise Hint(
            "one row per sample: `tape.gradient` of a vector differentiates "
            "its sum over the outputs. J has one row per sample AND output: "
            "shape (n samples, l outputs, m parameters)."
        )
    J = as_array(
        answer,
        "the per-sample Jacobian",
        (n, n_out, m),
        "(n samples, l outputs, m parameters)",
    )
    if same(J, expected):
        return
    summed = expected.sum(axis=1, keepdims=True)
    if n_out > 1 and same(J, np.repeat(summed, n_out, axis=1)):
        raise Hint(
            "every row of a sample holds the SUM of its outputs' gradients: "
            "`tape.gradient` of a vector differentiates its sum. Take the "
            "gradient of each output y[k] (sliced inside the tape) on its own."
        )
    if n_out > 1 and same(J, expected[:, ::-1]):
        raise Hint(
            "the rows of each sample are in the wrong order: "
            "J[i, k] is the gradient of output k."
        )
    if n > 1 and same(J, expected[::-1]):
        raise Hint("the samples are in the wrong order: J[i] is sample i.")
    if n_out > 1 and any(
        same(J, np.repeat(expected[:, k : k + 1], n_out, axis=1)) for k in range(n_out)
    ):
        raise Hint(
            "every row of a sample is the gradient of the same output: "
            "take output k's gradient for row k."
        )
    close_array(
        J,
        expected,
        "your Jacobian",
        wrong="it differs from `loop_jacobian(model, x)`. Row J[i, k, :] is "
        "the gradient of output k of sample i with respect to every variable, "
        "flattened and joined in `model.trainable_variables` order.",
        **FLOAT32,
    )
