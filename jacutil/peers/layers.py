"""One sample's forward pass, written once for JAX and PyTorch alike.

``forward(layers, theta, x, ops)`` runs the :class:`~.network.Layer`
records on one sample ``x`` and returns its outputs as a flat vector (a
graph's outputs joined in the Jacobian's row order). Both libraries share
``@``, ``+``, ``*``, indexing, ``reshape`` and ``mean``; what differs comes
in ``ops``: the activations by name, ``conv2d`` and ``concat``. The peers
wrap ``forward`` in their own ``vmap(jacrev(...))``, and
``squared_error`` in their ``vmap(grad(...))``. Introduced in
``07-benchmark``.
"""

from dataclasses import dataclass, replace

from .network import MERGES


@dataclass
class Ops:
    """What a library adds: ``act[name](z)``, ``conv2d(a, kernel, layer)``
    and ``concat(vectors)``.

    ``conv2d`` takes one sample (h, w, c_in) and a Keras kernel (kh, kw,
    c_in, c_out), and returns (h', w', c_out), channels last like Keras.
    ``concat`` joins a list of 1-D arrays into one.
    """

    act: dict
    conv2d: object
    concat: object = None


def bind(layers, convert):
    """The records with their constant (not trainable) weights converted."""

    def constant(w):
        return w if w is None or isinstance(w, int) else convert(w)

    return [
        replace(layer, weights={k: constant(w) for k, w in layer.weights.items()})
        for layer in layers
    ]


def forward(layers, theta, x, ops):
    """The outputs of one sample ``x``, flattened: a 1-D array (n_outputs,).

    ``layers`` are the :class:`~.network.Layer` records, weights bound;
    ``theta`` the trainable weights in ``flat_params`` order; ``ops`` the
    library's :class:`Ops`.
    """
    values = [x]  # a graph's record reads by index; a chain's, the last value
    for layer in layers:
        weights = {
            name: theta[w] if isinstance(w, int) else w
            for name, w in layer.weights.items()
        }
        if layer.kind in MERGES:
            a = [values[i] for i in layer.inputs]
        else:
            a = values[layer.inputs[0]] if layer.inputs else values[-1]
        values.append(KINDS[layer.kind](a, weights, layer, ops))
    return values[-1].reshape(-1)


def squared_error(layers, theta, x, y, ops):
    """One sample's squared-error loss: the mean of (f(x) - y)**2 over outputs.

    As ``keras.losses.mean_squared_error`` on a model with one output: a
    scalar, ``y`` the target of the sample ``x``; the rest as :func:`forward`.
    """

    return ((forward(layers, theta, x, ops) - y.reshape(-1)) ** 2).mean()


def dense(a, w, layer, ops):
    z = a @ w["kernel"]
    if w["bias"] is not None:
        z = z + w["bias"]
    return ops.act[layer.activation](z)


def conv2d(a, w, layer, ops):
    z = ops.conv2d(a, w["kernel"], layer)
    if w["bias"] is not None:
        z = z + w["bias"]
    return ops.act[layer.activation](z)


def flatten(a, w, layer, ops):
    return a.reshape(-1)  # (h, w, c) row-major, as Keras's Flatten


def lstm(a, w, layer, ops):
    """Keras's LSTM on one sequence (n_steps, n_in): the last h, (units,)."""
    act, gate = ops.act[layer.activation], ops.act[layer.recurrent_activation]
    units = w["recurrent_kernel"].shape[0]
    inputs = a @ w["kernel"]  # every step's input term at once: (n_steps, 4u)
    if w["bias"] is not None:
        inputs = inputs + w["bias"]
    h = c = None  # the zero state: its terms are left out
    for step in range(inputs.shape[0]):
        z = inputs[step]
        if h is not None:
            z = z + h @ w["recurrent_kernel"]
        i, f, g, o = (z[k * units : (k + 1) * units] for k in range(4))
        i, f, o = gate(i), gate(f), gate(o)
        c = i * act(g) if c is None else f * c + i * act(g)
        h = o * act(c)
    return h


def add(values, w, layer, ops):
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total


def outputs(values, w, layer, ops):
    """The model's outputs, each flattened, joined in the Jacobian's row order."""
    return ops.concat([value.reshape(-1) for value in values])


def joined(blocks, leading, ops):
    """Per-parameter blocks (leading..., *shape) -> (leading..., m), in order."""
    return ops.concat([b.reshape(*leading, -1) for b in blocks], -1)


KINDS = {
    "dense": dense,
    "conv2d": conv2d,
    "flatten": flatten,
    "lstm": lstm,
    "add": add,
    "outputs": outputs,
}
