"""A Keras model read into plain records that JAX and PyTorch can rebuild.

``describe(model)`` returns the model's layers, input to output, as
:class:`Layer` records holding NumPy weights in Keras's own layouts, and
``theta``, the trainable weights in ``flat_params`` order. A weight that is
trainable is held as its index into ``theta``, so a peer differentiates
exactly the Jacobian's columns. Introduced in ``07-benchmark``.

Keras layouts, which the peers follow:

- ``Dense``: kernel (n_in, n_out), bias (n_out,); ``y = a @ kernel + bias``.
- ``Conv2D``: channels last (h, w, c), kernel (kh, kw, c_in, c_out).
- ``Flatten``: flattens (h, w, c) in that order, row-major.
- ``LSTM``: kernel (n_in, 4u), recurrent_kernel (u, 4u), bias (4u), gates in
  the order i, f, c (candidate), o; returns the last h.
"""

from dataclasses import dataclass, field

import numpy as np

from ..core._tf import keras
from ..rules import chain_layers

ACTIVATIONS = ("linear", "relu", "tanh", "sigmoid")


@dataclass
class Layer:
    """One layer: its kind, its weights, its options.

    ``weights[name]`` is an int (an index into ``theta``: trainable) or a
    NumPy array (a constant), or None (no bias).
    """

    kind: str  # "dense", "conv2d", "flatten" or "lstm"
    weights: dict = field(default_factory=dict)
    activation: str = "linear"
    recurrent_activation: str = "sigmoid"  # LSTM only
    strides: tuple = (1, 1)  # Conv2D only
    padding: str = "valid"  # Conv2D only
    dilation: tuple = (1, 1)  # Conv2D only


def describe(model):
    """``(layers, theta)``: the model as :class:`Layer` records and its weights.

    Raises ``ValueError`` for a layer or an option the peers do not rebuild.
    """
    layers = chain_layers(model) if isinstance(model, keras.Model) else None
    if not layers:
        raise ValueError("the peers rebuild a Keras chain of layers only")
    variables = list(model.trainable_variables)  # flat_params order
    index = {id(v): i for i, v in enumerate(variables)}

    def weight(variable):
        if variable is None:
            return None
        return index.get(id(variable), np.asarray(variable))

    records = []
    for layer in layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        read = READERS.get(type(layer))
        if read is None:
            raise ValueError(
                f"the peers rebuild Dense, Conv2D, Flatten and LSTM layers only; "
                f"layer {layer.name!r} is a {type(layer).__name__}"
            )
        records.append(read(layer, weight))
    used = {w for r in records for w in r.weights.values() if isinstance(w, int)}
    if used != set(range(len(variables))):
        raise ValueError("a trainable variable is not a weight of these layers")
    return records, [np.asarray(v) for v in variables]


def activation_name(function, layer):
    """The name of a Keras activation function, if the peers know it."""
    for name in ACTIVATIONS:
        if function is keras.activations.get(name):
            return name
    raise ValueError(f"layer {layer.name!r} has an activation the peers lack")


def _dense(layer, weight):
    return Layer(
        "dense",
        {"kernel": weight(layer.kernel), "bias": weight(layer.bias)},
        activation_name(layer.activation, layer),
    )


def _conv2d(layer, weight):
    if layer.data_format != "channels_last" or layer.groups != 1:
        raise ValueError(f"layer {layer.name!r}: channels last, one group only")
    if layer.padding == "same" and tuple(layer.strides) != (1, 1):
        raise ValueError(f"layer {layer.name!r}: 'same' padding with strides")
    return Layer(
        "conv2d",
        {"kernel": weight(layer.kernel), "bias": weight(layer.bias)},
        activation_name(layer.activation, layer),
        strides=tuple(layer.strides),
        padding=layer.padding,
        dilation=tuple(layer.dilation_rate),
    )


def _flatten(layer, weight):
    if layer.data_format != "channels_last":
        raise ValueError(f"layer {layer.name!r}: channels last only")
    return Layer("flatten")


def _lstm(layer, weight):
    if layer.return_sequences or layer.return_state or layer.go_backwards:
        raise ValueError(f"layer {layer.name!r}: the last h only, forwards")
    cell = layer.cell
    return Layer(
        "lstm",
        {
            "kernel": weight(cell.kernel),
            "recurrent_kernel": weight(cell.recurrent_kernel),
            "bias": weight(cell.bias if cell.use_bias else None),
        },
        activation_name(cell.activation, layer),
        recurrent_activation=activation_name(cell.recurrent_activation, layer),
    )


READERS = {
    keras.layers.Dense: _dense,
    keras.layers.Conv2D: _conv2d,
    keras.layers.Flatten: _flatten,
    keras.layers.LSTM: _lstm,
}
