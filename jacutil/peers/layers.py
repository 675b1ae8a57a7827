"""One sample's forward pass, written once for JAX and PyTorch alike.

``forward(layers, theta, x, ops)`` runs the :class:`~.network.Layer`
records on one sample ``x`` and returns its outputs as a flat vector. Both
libraries share ``@``, ``+``, ``*``, indexing and ``reshape``; what differs
comes in ``ops``: the activations by name and ``conv2d``. The peers wrap
``forward`` in their own ``vmap(jacrev(...))``. Introduced in
``07-benchmark``.
"""

from dataclasses import dataclass, replace


@dataclass
class Ops:
    """What a library adds: ``act[name](z)`` and ``conv2d(a, kernel, layer)``.

    ``conv2d`` takes one sample (h, w, c_in) and a Keras kernel (kh, kw,
    c_in, c_out), and returns (h', w', c_out), channels last like Keras.
    """

    act: dict
    conv2d: object


def bind(layers, convert):
    """The records with their constant (not trainable) weights converted."""

    def constant(w):
        return w if w is None or isinstance(w, int) else convert(w)

    return [
        replace(layer, weights={k: constant(w) for k, w in layer.weights.items()})
        for layer in layers
    ]


def forward(layers, theta, x, ops):
    """The outputs of one sample ``x``, flattened: shape (n_outputs,)."""
    a = x
    for layer in layers:
        weights = {
            name: theta[w] if isinstance(w, int) else w
            for name, w in layer.weights.items()
        }
        a = KINDS[layer.kind](a, weights, layer, ops)
    return a.reshape(-1)


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


KINDS = {"dense": dense, "conv2d": conv2d, "flatten": flatten, "lstm": lstm}
