"""Checks of 07-benchmark's exercises."""

import numpy as np

from ...core._shared import count_params
from ...stages.loop import loop_jacobian
from . import Hint, answered, as_array, as_number, checks, close_array, close_number


def _kernel_by_columns(columns, width, outputs):
    """The last block with its kernel's columns ordered q * width + p."""
    n = columns.shape[0]
    kernel = columns[:, :, : width * outputs].reshape(n, outputs, width, outputs)
    kernel = kernel.transpose(0, 1, 3, 2).reshape(n, outputs, width * outputs)
    return np.concatenate([kernel, columns[:, :, width * outputs :]], 2)


def _before_activation(model, x, outputs):
    """The last block built from the last hidden layer's pre-activations."""
    hidden = x
    for layer in model.layers[:-2]:
        hidden = layer(hidden)
    before = model.layers[-2]
    z = np.asarray(hidden) @ np.asarray(before.kernel) + np.asarray(before.bias)
    z = np.concatenate([z, np.ones((len(x), 1))], 1)
    blocks = np.einsum("ip,kq->ikpq", z, np.eye(outputs))
    return blocks.reshape(len(x), outputs, -1)


@checks("07-1")
def last_layer_columns(answer, model, x):
    """The last Dense layer's (h + 1) * l columns of J: its input, a one
    appended, on the diagonal; checked against ``loop_jacobian``.
    """
    width, outputs = (int(s) for s in model.layers[-1].kernel.shape)
    x = np.asarray(x)
    n, size = len(x), (width + 1) * outputs
    what = "the last layer's columns of J"
    answered(answer, f"{what}, an array (n samples, {outputs} outputs, {size})")
    if np.shape(answer) == (n, outputs, width * outputs):
        raise Hint(
            f"{width * outputs} columns: the kernel's alone. The last layer "
            f"also has {outputs} biases, whose columns follow the kernel's "
            "(the one appended to the layer's input)."
        )
    words = "(n samples, l outputs, the last layer's parameters)"
    array = as_array(answer, what, (n, outputs, size), words)
    expected = np.asarray(loop_jacobian(model, x))[:, :, -size:]
    tolerance = {"rtol": 1e-4, "atol": 1e-5}
    if np.allclose(array, expected, **tolerance):
        return
    if np.allclose(array, _kernel_by_columns(expected, width, outputs), **tolerance):
        raise Hint(
            "the right numbers in the wrong columns: flat_params flattens the "
            "kernel W[p, q] row by row, so the l entries of input p sit side by "
            "side (column p * l + q), and the next input's follow."
        )
    if np.allclose(array[:, :, :outputs], expected[:, :, -outputs:], **tolerance):
        raise Hint(
            "the bias columns come last, after the kernel's (flat_params "
            "order: kernel, then bias)."
        )
    if np.allclose(array, _before_activation(model, x, outputs), **tolerance):
        raise Hint(
            "those are the last hidden layer's values before its activation: "
            "the last layer sees them after the ReLU (the layer's output)."
        )
    close_array(
        array,
        expected,
        "your array",
        wrong="it differs from J's last columns. Which terms of "
        "y_k = sum_p a_p W[p, k] + b_k contain W[p, q], and which contain "
        "b_q? Are the a_p the second hidden layer's outputs, sample by sample?",
        **tolerance,
    )


@checks("07-2")
def bytes_a_copy_moves(answer, model, n):
    """``jac(x, copy=True)`` reads J once and writes it once: 2 * n * l * m
    numbers of the model's dtype.
    """
    outputs = int(model.outputs[0].shape[-1])
    params = count_params(model.trainable_variables)
    dtype = np.dtype(str(model.trainable_variables[0].dtype))
    numbers = n * outputs * params
    expected = 2 * numbers * dtype.itemsize
    moved = as_number(answer, "the bytes the copy reads and writes")
    if abs(moved - expected) <= 1e-3 * expected:
        return
    if moved == numbers * dtype.itemsize:
        raise Hint(
            "that is J's size once: the copy reads every number from "
            "TensorFlow's buffer and also writes it into the new array."
        )
    if moved in (numbers, 2 * numbers):
        raise Hint(
            f"that counts numbers, not bytes: each {dtype} number takes "
            f"{dtype.itemsize} bytes."
        )
    if dtype.itemsize != 8 and moved == 16 * numbers:
        raise Hint(f"J is {dtype} here, {dtype.itemsize} bytes a number, not 8.")
    for unit, scale in (("MB", 1e6), ("MiB", 2**20), ("GB", 1e9), ("GiB", 2**30)):
        if abs(moved * scale - expected) <= 0.01 * expected:
            raise Hint(f"that looks like {unit}: give the number of bytes.")
    close_number(moved, expected, 1e-3, "your number of bytes")
