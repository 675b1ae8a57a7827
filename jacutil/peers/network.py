"""A Keras model read into plain records that JAX and PyTorch can rebuild.

A chain of layers (``Sequential``, or a functional model without branches)
is a list of :class:`Layer` records, each applied to the one before. Any
other functional model with one input - skips joined by ``Add``, several
outputs, nested models - is read as a graph in topological order by the
rules' reader (``jacutil.rules.graph.graph_nodes``), and a last
``"outputs"`` record joins the model's outputs, each flattened per sample,
in ``tf.nest.flatten`` order: the order of a Jacobian's rows (see
``jacutil/core/outputs.py``). Introduced in ``07-benchmark``.

Keras layouts, which the peers follow:

- ``Dense``: kernel (n_in, n_out), bias (n_out,); ``y = a @ kernel + bias``.
- ``Conv2D``: channels last (h, w, c), kernel (kh, kw, c_in, c_out).
- ``Flatten``: flattens (h, w, c) in that order, row-major.
- ``LSTM``: kernel (n_in, 4u), recurrent_kernel (u, 4u), bias (4u), gates in
  the order i, f, c (candidate), o; returns the last h.
- ``Add``: the sum of its inputs, no weights.
"""

from dataclasses import dataclass, field, replace

import numpy as np

from ..core._tf import keras
from ..rules.graph import NotAGraph, chain_layers, graph_nodes, is_exact_keras

ACTIVATIONS = ("linear", "relu", "tanh", "sigmoid")
MERGES = ("add", "outputs")  # the kinds that read a list of values


@dataclass
class Layer:
    """One layer: its kind, its weights, its options.

    ``weights[name]`` is an int (an index into ``theta``: trainable) or a
    NumPy array (a constant), or None (no bias). ``inputs`` is empty in a
    chain (the record reads the value before it); in a graph it names the
    values the record reads: 0 the model's input, k record k - 1's output.
    """

    kind: str  # "dense", "conv2d", "flatten", "lstm", "add" or "outputs"
    weights: dict = field(default_factory=dict)
    activation: str = "linear"
    recurrent_activation: str = "sigmoid"  # LSTM only
    strides: tuple = (1, 1)  # Conv2D only
    padding: str = "valid"  # Conv2D only
    dilation: tuple = (1, 1)  # Conv2D only
    inputs: tuple = ()  # a graph's: the values read; empty in a chain


def describe(model):
    """``(layers, theta)``: the model as :class:`Layer` records and its weights.

    ``model`` is a chain of layers or a functional model with one input
    (``Add`` skips, several outputs); ValueError for a layer or an option the
    peers do not rebuild. ``layers`` are input to output, with NumPy weights
    in Keras's own layouts; ``theta`` is the trainable weights as NumPy
    arrays in ``flat_params`` order, and a record holds a trainable weight as
    its index into ``theta``, so a peer differentiates exactly the
    Jacobian's columns.
    """
    if not isinstance(model, keras.Model):
        raise ValueError("the peers rebuild a Keras model only")
    variables = list(model.trainable_variables)  # flat_params order
    index = {id(v): i for i, v in enumerate(variables)}

    def weight(variable):
        if variable is None:
            return None
        return index.get(id(variable), np.asarray(variable))

    layers = chain_layers(model)
    if layers and not any(is_exact_keras(layer) for layer in layers):
        records = [read_layer(layer, weight) for layer in layers]
    else:  # branches, several outputs, nested models: the rules' graph
        records = _graph(model, weight)
    used = {w for r in records for w in r.weights.values() if isinstance(w, int)}
    if used != set(range(len(variables))):
        raise ValueError("a trainable variable is not a weight of these layers")
    return records, [np.asarray(v) for v in variables]


def read_layer(layer, weight):
    """The :class:`Layer` record of one Keras layer (ValueError if the peers do
    not rebuild it); ``weight(variable)`` is its index into theta, or a constant.
    """

    read = READERS.get(type(layer))
    if read is None:
        raise ValueError(
            "the peers rebuild Dense, Conv2D, Flatten, LSTM and Add layers only; "
            f"layer {layer.name!r} is a {type(layer).__name__}"
        )
    return read(layer, weight)


def _graph(model, weight):
    """A functional model's records in topological order, then ``"outputs"``,
    read from the rules' graph (``jacutil.rules.graph.graph_nodes``)."""
    one_input = "the peers rebuild a functional model with one input only"
    if not is_exact_keras(model):
        raise ValueError(one_input)
    try:
        nodes, wiring = graph_nodes(model)
    except NotAGraph as reason:
        raise ValueError(f"the peers cannot rebuild this graph: {reason}") from None
    if len(wiring.model_inputs) != 1:
        raise ValueError(one_input)
    values = {wiring.model_inputs[0]: 0}  # a tensor's key -> its value's index
    records = []
    for node, keys, key in zip(nodes, wiring.inputs, wiring.outputs, strict=True):
        record, extra = read_layer(node.operation, weight), node.extra_arguments()
        if extra:
            raise ValueError(f"layer {node.name!r}: called with {extra}")
        if record.kind not in MERGES and len(keys) != 1:
            raise ValueError(f"layer {node.name!r}: one input only")
        records.append(replace(record, inputs=tuple(values[k] for k in keys)))
        values[key] = len(records)
    outputs = tuple(values[key] for key in wiring.model_outputs)
    return [*records, Layer("outputs", inputs=outputs)]


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


def _add(layer, weight):
    return Layer("add")


READERS = {
    keras.layers.Dense: _dense,
    keras.layers.Conv2D: _conv2d,
    keras.layers.Flatten: _flatten,
    keras.layers.LSTM: _lstm,
    keras.layers.Add: _add,
}
