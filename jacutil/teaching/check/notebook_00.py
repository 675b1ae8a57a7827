"""Checks of 00-welcome's exercises."""

import numpy as np

from ...core._shared import sizes_of
from ...teaching.models import small_cnn
from . import Hint, as_array, as_number, checks, close_array, close_number


@checks("00-1")
def parameters_of_a_network(answer):
    """10 -> 128 (ReLU) -> 3: each Dense layer has a*b weights and b biases."""
    count = as_number(answer, "the number of parameters")
    weights = 10 * 128 + 128 * 3
    biases = 128 + 3
    if count == weights:
        raise Hint(
            "that counts the weights only: each Dense layer also has one "
            "bias per output unit."
        )
    if count == biases:
        raise Hint(
            "that counts the biases only: a Dense layer from a to b "
            "units also has a*b weights."
        )
    close_number(count, weights + biases, 0, "your count")


@checks("00-2")
def derivative_by_a_bias(answer, J):
    """d f_k / d b_k' of the last layer: the identity, for every sample."""
    J = np.asarray(J)
    n_outputs = J.shape[1]
    words = "(l outputs k, l biases k')"
    array = as_array(
        answer, "d f_k / d b_k' as an l x l matrix", (n_outputs, n_outputs), words
    )
    for sample in J[:, :, -n_outputs:]:
        close_array(
            array,
            sample,
            "your matrix",
            rtol=1e-6,
            atol=1e-6,
            wrong="it differs from the last l columns of J. Which terms of "
            "f_k = sum_j h_j W_jk + b_k contain b_k'? And how does the "
            "derivative depend on the sample?",
        )


@checks("00-3")
def columns_of_a_frozen_layer(answer):
    """Freezing small_cnn's first Conv2D drops its kernel and its biases."""
    fewer = as_number(answer, "how many columns J loses")
    first = small_cnn().layers[0]
    kernel, bias = sizes_of(first.trainable_variables)
    if fewer == kernel:
        raise Hint("that is the kernel alone: the layer's biases are frozen too.")
    if fewer == bias:
        raise Hint(
            "that is the biases alone: the kernel is height x width x "
            "input channels x filters numbers."
        )
    close_number(fewer, kernel + bias, 0, "your number of columns")
