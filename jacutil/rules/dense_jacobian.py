"""The fastest path: the per-sample Jacobian of a Dense network derived by hand
(notebook 07-benchmark).

For a layer ``z = a @ W + b``, ``a_out = act(z)`` and a per-sample signal
``delta[i, k, q] = d y[i, k] / d z[i, q]`` back-propagated from the outputs,

    d y[i, k] / d W[p, q] = a[i, p] * delta[i, k, q]     (an outer product)
    d y[i, k] / d b[q]    = delta[i, k, q]

and ``delta`` of the layer below is ``(delta @ W.T) * act'(z_below)``: the
per-example-gradient trick (Goodfellow 2015, BackPACK). No tape, no pfor: one
forward pass, l back-propagated signals per sample, and one broadcast product
per kernel that writes its block of columns. Any other layer or activation
falls back to the autodiff per-sample stage.
"""

import numpy as np

from ..core._tf import keras, tf
from ..core.batch import as_batch, take
from ..core.formulation import per_sample_tensor
from ..core.target import resolve_target, variable_list
from ..stages.compiled import compiled_jacobian
from ..stages.vectorized import per_sample_jacobian
from . import chain_layers, is_exact_keras

# act'(z), written with z and a = act(z); None: the derivative is 1.
DERIVATIVES = {
    "linear": lambda z, a: None,
    "relu": lambda z, a: tf.cast(z > 0, z.dtype),
    "tanh": lambda z, a: 1 - a * a,
    "sigmoid": lambda z, a: a * (1 - a),
}


def _activation_name(layer):
    for name in DERIVATIVES:
        if layer.activation is keras.activations.get(name):
            return name
    return None


def dense_chain(model, variables=None):
    """``[(layer, activation name), ...]`` if the hand-derived path applies.

    It applies to an exact Keras ``Sequential`` or functional model (not a
    subclass: its ``call`` may do anything) that is one chain of plain
    ``keras.layers.Dense`` layers (relu, tanh, sigmoid or linear), each used
    once, on a flat input, whose trainable variables are the Jacobian's
    columns. Returns ``(chain, None)``, or ``(None, reason)`` when it does not
    apply.
    """
    if not isinstance(model, keras.Model):
        return None, "not a Keras model"
    if variables is not None:
        return None, "variables= given"
    if not is_exact_keras(model):
        return None, (
            f"{type(model).__name__} is a subclass: its call() may differ from "
            "its layers"
        )
    layers = chain_layers(model)
    if not layers:
        return None, "not a single chain of layers"
    if len({id(layer) for layer in layers}) != len(layers):
        return None, "a layer is used more than once"
    chain = []
    for layer in layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        if type(layer) is not keras.layers.Dense:
            return None, f"layer {layer.name!r} is a {type(layer).__name__}"
        if not layer.built or layer.lora_enabled or layer.quantization_mode:
            return None, f"layer {layer.name!r} is unbuilt, LoRA or quantized"
        if layer.compute_dtype != layer.kernel.dtype:
            return None, f"layer {layer.name!r} computes in {layer.compute_dtype}"
        activation = _activation_name(layer)
        if activation is None:
            return None, f"layer {layer.name!r} has activation {layer.activation}"
        chain.append((layer, activation))
    if not chain or len(chain[0][0].kernel.shape) != 2:
        return None, "no Dense layer"
    try:
        flat = len(model.inputs) == 1 and len(model.inputs[0].shape) == 2
    except (AttributeError, ValueError):
        flat = False
    if not flat:
        return None, "the input is not one flat (n_samples, n_features) array"
    weights = [id(w) for layer, _ in chain for w in layer.trainable_weights]
    if len(set(weights)) != len(weights):
        return None, "a variable is shared by two layers"
    if any(id(v) not in set(weights) for v in model.trainable_variables):
        return None, "a trainable variable outside the Dense layers"
    return chain, None


def agrees_with_autodiff(chain, target, x):
    """Check the hand-derived Jacobian of one sample against autodiff.

    Returns None when they agree, or the reason (the largest difference) when
    they do not: the model does something its layers do not say.
    """
    one = take(x, 0, 1)
    hand = dense_tensor_jacobian(chain, target.variables, one).numpy()
    auto = per_sample_tensor(target, one)[0].numpy()
    scale = max(1.0, float(np.abs(auto).max()))
    tolerance = (1e-4 if auto.dtype == np.float32 else 1e-9) * scale
    error = float(np.abs(hand - auto).max()) if hand.shape == auto.shape else np.inf
    if error <= tolerance:
        return None
    return (
        f"the hand-derived Jacobian of one sample differs from autodiff by "
        f"{error:.3g}: the model computes something its layers do not say"
    )


def _outer(a, delta):
    """(n, l, p*q) block: ``a[i, p] * delta[i, k, q]``, column ``p*q_size + q``.

    Written as a batch of (p, 1) @ (1, q) matrix products: on a CPU that
    writes the block faster than the equivalent broadcast multiply.
    """
    n_samples, n_outputs = tf.shape(delta)[0], tf.shape(delta)[1]
    column = tf.broadcast_to(
        a[:, None, :, None], [n_samples, n_outputs, tf.shape(a)[1], 1]
    )
    product = tf.matmul(column, delta[:, :, None, :])  # (n, l, p, q)
    return tf.reshape(product, [n_samples, n_outputs, -1])


def dense_blocks(chain, variables, x):
    """The Jacobian's column blocks, (n, l, size) each, in ``variables`` order.

    A kernel followed by its bias is one block: the layer's input with a
    column of ones appended gives the kernel's rows and then the bias's.
    """
    position = {id(v): i for i, v in enumerate(variables)}
    inputs, slopes = [], []
    a = x
    for layer, activation in chain:  # forward, keeping what the blocks need
        inputs.append(a)
        z = tf.matmul(a, layer.kernel)
        if layer.use_bias:
            z = z + layer.bias
        a = z if activation == "linear" else layer.activation(z)
        slopes.append(DERIVATIVES[activation](z, a))

    n_samples, n_outputs = tf.shape(x)[0], a.shape[-1]
    delta = tf.eye(n_outputs, dtype=x.dtype)[None]  # (1, l, l): dy/dy
    if slopes[-1] is not None:
        delta = delta * slopes[-1][:, None, :]
    blocks = {}
    for j in reversed(range(len(chain))):  # backward: one delta per layer
        layer = chain[j][0]
        delta = tf.broadcast_to(delta, [n_samples, n_outputs, layer.units])
        kernel = position.get(id(layer.kernel))
        bias = position.get(id(layer.bias)) if layer.use_bias else None
        if kernel is not None and bias == kernel + 1:
            ones = tf.ones([n_samples, 1], x.dtype)
            blocks[kernel] = _outer(tf.concat([inputs[j], ones], 1), delta)
        else:
            if kernel is not None:
                blocks[kernel] = _outer(inputs[j], delta)
            if bias is not None:
                blocks[bias] = delta
        if j > 0:
            delta = tf.matmul(delta, layer.kernel, transpose_b=True)
            if slopes[j - 1] is not None:
                delta = delta * slopes[j - 1][:, None, :]
    return [blocks[i] for i in sorted(blocks)]


def dense_tensor_jacobian(chain, variables, x):
    """(n, l, m) tensor of the hand-derived Jacobian; columns follow ``variables``."""
    return tf.concat(dense_blocks(chain, variables, x), axis=2)


class DenseJacobian:
    """A reusable, compiled, hand-derived ``jac(x)``: see ``compiled_dense_jacobian``.

    ``fallback`` is None on the hand-derived path, or the reason why it does
    not apply (then the compiled autodiff per-sample stage runs instead).
    """

    def __init__(self, model, jit_compile, variables, training):
        variables = None if variables is None else variable_list(variables)
        self.model = model
        self.target = resolve_target(model, variables, training)
        self.chain, self.fallback = dense_chain(model, variables)
        self.jit_compile = jit_compile
        self.trace_count = 0
        self._options = {
            "jit_compile": jit_compile,
            "variables": variables,
            "training": training,
        }
        self._checked = False
        if self.chain is None:
            self._autodiff = compiled_jacobian(model, **self._options)
            return
        chain, columns = self.chain, self.target.variables

        def traced(x):
            self.trace_count += 1  # Python side effect: runs once per trace
            return dense_tensor_jacobian(chain, columns, x)

        n_features = int(chain[0][0].kernel.shape[0])
        self.target.feature_shape = (n_features,)
        spec = tf.TensorSpec([None, n_features], self.target.dtype)
        self._function = tf.function(
            traced, input_signature=[spec], jit_compile=jit_compile
        )

    def tensor(self, x):
        """The Jacobian of ``x`` as a tensor (hand-derived path only)."""
        return self._function(as_batch(x, self.target))

    def _check(self, x):
        """On the first call: one sample against autodiff, or fall back."""
        self._checked = True
        reason = agrees_with_autodiff(self.chain, self.target, as_batch(x, self.target))
        if reason is not None:
            self.chain, self.fallback = None, reason
            self._autodiff = compiled_jacobian(self.model, **self._options)

    def __call__(self, x, *, copy=False):
        """Return the (n_samples, n_outputs, n_params) Jacobian of ``x``.

        On the hand-derived path the array is a read-only view of
        TensorFlow's result, not a copy: copying 228 MB (n = 10,000 on the
        question's network) costs as long as computing it. Pass
        ``copy=True``, or take ``np.array(J)``, for an array you may write to.
        """
        if self.chain is not None and not self._checked:
            self._check(x)
        if self.chain is None:
            return self._autodiff(x)
        J = np.asarray(self.tensor(x))
        return J.copy() if copy else J


def compiled_dense_jacobian(
    model, *, jit_compile=False, variables=None, training=False
):
    """Return a reusable, compiled ``jac(x)`` derived by hand for Dense networks.

    A ``tf.function`` with a ``None`` batch dimension, so a new n does not
    retrace (``jac.trace_count``); with ``jit_compile=True`` XLA compiles
    once per new n. ``jac(x)`` returns a read-only (n_samples, n_outputs,
    n_params) array in ``flat_params`` order; ``jac(x, copy=True)`` a
    writable one. A model that is not a chain of Dense layers gets the
    compiled per-sample autodiff stage instead (``jac.fallback`` says why);
    so does one whose first sample's hand-derived Jacobian differs from
    autodiff (checked on the first call).
    Introduced in ``07-benchmark``.
    """
    return DenseJacobian(model, jit_compile, variables, training)


def dense_jacobian(model, x, *, variables=None, training=False):
    """Per-sample Jacobian of a Dense network, derived by hand (no tape).

    Runs eagerly, once; reuse :func:`compiled_dense_jacobian` for speed.
    Any other model, or one whose first sample disagrees with autodiff,
    falls back to :func:`per_sample_jacobian`.

    Returns (n_samples, n_outputs, n_params). Introduced in ``07-benchmark``.
    """
    variables = None if variables is None else variable_list(variables)
    target = resolve_target(model, variables, training, x)
    chain, _ = dense_chain(model, variables)
    if chain is not None:
        x = as_batch(x, target)
        if agrees_with_autodiff(chain, target, x) is None:
            return dense_tensor_jacobian(chain, target.variables, x).numpy()
    return per_sample_jacobian(model, x, variables=variables, training=training)
