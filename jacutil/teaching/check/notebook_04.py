"""Checks of 04-chunked's exercises."""

import numpy as np

from ...core.layout import flat_params
from ...core.planner import chunk_size_for
from ...core.precision import float64_copy
from ...stages.vectorized import per_sample_jacobian
from . import Hint, answered, as_array, as_number, checks, close_number

BUDGET = 16 * 2**20  # exercise 1's budget: 16 MiB
AXES = "(n samples, l outputs, m parameters)"


def _sizes(model, x):
    """(n, l, m) of the Jacobian of ``model`` on ``x``."""
    return len(x), int(model(x[:1]).shape[-1]), flat_params(model).size


@checks("04-1")
def float64_chunks(answer, model, x):
    """(chunk size for 16 MiB in float64, the float64 Jacobian of x)."""
    answered(answer, "(chunk, J): the chunk size and the float64 Jacobian")
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        raise Hint(
            "expected two things, answer = (chunk, J): the chunk size "
            "that chunk_size_for gives for 16 MiB, then the Jacobian."
        )
    chunk, J = answer
    n, n_out, m = _sizes(model, x)
    chunk = as_number(chunk, "the chunk size (a number of samples)")
    if chunk == chunk_size_for(BUDGET, n_out, m, 4):
        raise Hint(
            "that chunk size is for float32 numbers: how many bytes does "
            "a float64 number take?"
        )
    if chunk in (chunk_size_for(16e6, n_out, m, 8), chunk_size_for(16e6, n_out, m, 4)):
        raise Hint("that budget is 16 million bytes: how many bytes is a MiB?")
    right = chunk_size_for(BUDGET, n_out, m, 8)
    if chunk == right + 1:
        raise Hint(
            "one sample too many: that chunk's Jacobian is larger than 16 MiB. "
            "The chunk must fit the budget, so the division rounds down."
        )
    close_number(chunk, right, 0, "your chunk size")
    answered(J, "the float64 Jacobian as the second item of answer")
    if np.asarray(J).dtype == np.float32:
        raise Hint(
            "J is float32: chunked_jacobian computes in the dtype of the "
            "model it is given. Which model did yours get?"
        )
    J = as_array(J, "J", (n, n_out, m), AXES)
    x64 = np.asarray(x, "float64")
    expected = per_sample_jacobian(float64_copy(model), x64)
    if np.allclose(J, expected, rtol=1e-9, atol=1e-12):
        return
    if np.allclose(J, expected, rtol=1e-4, atol=1e-5):
        raise Hint(
            "J agrees with the float64 Jacobian only to float32 "
            "precision: it was computed in float32 and then cast. "
            "The weights must be float64 too, not only the result."
        )
    raise Hint(
        "J differs from the Jacobian of this network on these samples. "
        "Does the float64 copy have the float32 model's weights, and are "
        "the samples x[:300]?"
    )


@checks("04-2")
def two_halves(answer, model, x):
    """The memory-mapped file after two calls, one per half of x."""
    answered(answer, "the file's contents (np.load(file))")
    n, n_out, m = _sizes(model, x)
    half = n // 2
    if np.shape(answer) in ((half, n_out, m), (n - half, n_out, m)) and half:
        raise Hint(
            "that is one half. The file holds every sample: read it "
            "back whole (np.load(file)) after the second call."
        )
    array = as_array(answer, "the file's contents", (n, n_out, m), AXES)
    expected = per_sample_jacobian(model, x)

    def right(rows, start, stop):
        return np.allclose(rows, expected[start:stop], rtol=1e-5, atol=1e-6)

    first, second = array[:half], array[half:]
    if not np.any(array):
        raise Hint(
            "the file holds only zeros: no call wrote into it. Was each "
            "call's out a view of the memmap, or a copy of it?"
        )
    if not np.any(first) and right(second, half, n):
        raise Hint(
            "the first half is zeros: the first call's rows were lost when "
            "the file was opened again. What does the mode you opened it "
            "with do to a file that exists? (help(np.lib.format.open_memmap))"
        )
    if right(first, 0, half) and not np.any(second):
        raise Hint(
            "the second half is zeros: the second call's rows never "
            "reached the file. Where did its out point, and when was the "
            "file read?"
        )
    if right(array, 0, n):
        return
    if half and np.allclose(first[: n - half], expected[half:], rtol=1e-5, atol=1e-6):
        raise Hint("the halves are swapped: row i of the file is sample i.")
    raise Hint(
        "the file differs from the Jacobian of these samples. Row i of "
        "the file is sample i: the first call takes x[:half], the "
        "second x[half:] (of the same n samples)."
    )
