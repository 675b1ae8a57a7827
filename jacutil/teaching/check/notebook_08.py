"""Checks of 08-your-own-model's exercises."""

import numpy as np

from ...core.layout import flat_params
from ...stages.loop import loop_jacobian
from ...testing.finite_differences import finite_difference_jacobian
from . import Hint, answered, as_array, checks, close_array, shape_of


@checks("08-1")
def rows_split_per_step(answer, model, x):
    """A GRU's (steps, outputs) per sample: J's rows split back, step-major."""
    words = "(n samples, steps, outputs, m parameters)"
    what = "the rows of J split per step"
    answered(answer, f"{what}, an array of shape {words}")
    J = loop_jacobian(model, x)
    n, rows, m = J.shape
    steps, outputs = (int(d) for d in model(x[:1]).shape[1:])
    shape = (n, steps, outputs, m)
    got = shape_of(answer)
    if got == (n, rows, m):
        raise Hint(
            f"that is J itself, {rows} rows per sample unsplit: split each "
            f"sample's rows into {words} (split_outputs gives the model's "
            "output shape back)."
        )
    if got == (n, outputs, steps, m):
        raise Hint(
            "steps and outputs are swapped: a sample's output has shape "
            "(steps, outputs), one vector of outputs per time step."
        )
    array = as_array(answer, what, shape, words)
    swapped = J.reshape(n, outputs, steps, m).transpose(0, 2, 1, 3)
    if np.allclose(array, swapped, rtol=1e-4, atol=1e-5):
        raise Hint(
            "the shape is right but the rows are in the wrong places: a "
            "sample's rows run through its (steps, outputs) output in "
            "tf.nest.flatten order, the last axis fastest."
        )
    close_array(
        array,
        J.reshape(shape),
        what,
        rtol=1e-4,
        atol=1e-5,
        wrong="it differs from the GRU's Jacobian computed by the loop of "
        "01. Was it computed on `gru` and `x_gru`, with the model's "
        "trainable variables in their own order?",
    )


def _row_indices(answer, what):
    answered(answer, what)
    if isinstance(answer, slice):
        answer = range(*answer.indices(10**6))
    array = np.asarray(answer)
    if array.ndim == 3:
        raise Hint(
            f"expected {what} (which of the l rows of a sample they are), "
            "not the rows themselves."
        )
    if array.ndim > 1 or not np.issubdtype(array.dtype, np.integer):
        raise Hint(f"expected {what}: a list of integers.")
    return [int(i) for i in np.atleast_1d(array)]


@checks("08-2")
def rows_of_a_dict_output(answer):
    """Dict outputs are flattened in sorted key order: probs, then score."""
    widths = {"score": 2, "probs": 3}  # the two heads of the exercise
    rows, start = {}, 0
    for key in sorted(widths):  # tf.nest.flatten's order for a dict
        rows[key] = list(range(start, start + widths[key]))
        start += widths[key]
    what = "the row indices that hold `score`"
    got = _row_indices(answer, what)
    if len(got) != widths["score"]:
        raise Hint(
            f"score has {widths['score']} outputs, so {widths['score']} rows "
            f"per sample; you gave {len(got)} index(es)."
        )
    if got == list(range(widths["score"])):
        raise Hint(
            "that is where score sits in the list model [score, probs]. "
            "A dict has no order of its own: in which order does "
            "tf.nest.flatten take its keys?"
        )
    if got == [i + 1 for i in rows["score"]]:
        raise Hint("rows are counted from 0, as NumPy indexes them.")
    if sorted(got) == rows["score"] and got != rows["score"]:
        raise Hint("the right rows, but list them in increasing order.")
    if got != rows["score"]:
        raise Hint(
            "those are not score's rows. A sample's row is every output leaf "
            "flattened and joined in tf.nest.flatten order; check with "
            "split_outputs."
        )


@checks("08-3")
def derivative_by_a_moving_mean(answer, model, x, variable):
    """d outputs / d moving_mean against central differences in float64."""
    words = "(n samples, l outputs, moving-mean entries)"
    what = "d outputs / d moving_mean"
    answered(answer, f"{what}, an array of shape {words}")
    expected = finite_difference_jacobian(model, x, variables=[variable])
    n, rows, m = expected.shape
    if shape_of(answer) == (n, rows, flat_params(model).size):
        raise Hint(
            "those are the columns of the trainable variables: the moving "
            "mean is not among them. Pass variables=[...] with the moving "
            "mean alone."
        )
    array = as_array(answer, what, (n, rows, m), words)
    if np.allclose(array, -expected, rtol=1e-6, atol=1e-9):
        raise Hint(
            "it has the opposite sign: is that the derivative by the input x? "
            "BatchNormalization computes (x - moving_mean) / sqrt(...)."
        )
    close_array(
        array,
        expected,
        what,
        rtol=1e-6,
        atol=1e-9,
        wrong="it differs from central differences on the float64 model. "
        "Which variable did you differentiate by, and in which dtype?",
    )
