"""Per-sample Jacobians and loss gradients in JAX, each under one ``jax.jit``.

``f(theta, x)`` is the Keras model rebuilt from its weights for one sample
(see ``layers.forward``). The Jacobian is ``jit(vmap(jacrev(f)))``; the
per-sample gradients of a squared-error loss are ``jit(vmap(grad(loss)))``,
and their norms the same gradients, then norms, in the same jitted
function. Each differentiates every array in ``theta`` and joins the blocks
in ``flat_params`` order; ``jit`` compiles the whole once per n.
Introduced in ``07-benchmark``.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .layers import Ops, bind, forward, joined, squared_error
from .network import describe


def conv2d(a, kernel, layer):
    """One sample (h, w, c_in), channels last, as Keras's Conv2D."""
    y = jax.lax.conv_general_dilated(
        a[None],
        kernel,
        window_strides=layer.strides,
        padding=layer.padding.upper(),
        rhs_dilation=layer.dilation,
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    return y[0]


OPS = Ops(
    act={
        "linear": lambda z: z,
        "relu": jax.nn.relu,
        "tanh": jnp.tanh,
        "sigmoid": jax.nn.sigmoid,
    },
    conv2d=conv2d,
    concat=jnp.concatenate,
)


def rebuilt(model):
    """``(layers, theta)`` of the model, as JAX arrays."""
    layers, theta = describe(model)
    return bind(layers, jnp.asarray), [jnp.asarray(p) for p in theta]


def joined_jacobian(layers, theta, x):
    """(n, l, m): ``vmap(jacrev(f))``, columns in ``flat_params`` order."""

    def f(theta, x):
        return forward(layers, theta, x, OPS)

    blocks = jax.vmap(jax.jacrev(f), in_axes=(None, 0))(theta, x)
    return joined(blocks, blocks[0].shape[:2], OPS)


def _gradients(layers, theta, x, y):
    """(n, m): ``vmap(grad(loss))`` of the squared error, blocks joined."""

    def loss(theta, x, y):
        return squared_error(layers, theta, x, y, OPS)

    blocks = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(theta, x, y)
    return joined(blocks, blocks[0].shape[:1], OPS)


def on_numpy(model, compute):
    """``compute(layers, theta, *arrays)`` jitted, on the model's weights, as a
    function of NumPy arrays returning one."""
    layers, theta = rebuilt(model)
    compiled = jax.jit(lambda theta, *arrays: compute(layers, theta, *arrays))
    return lambda *arrays: np.asarray(compiled(theta, *map(jnp.asarray, arrays)))


def jax_jacobian(model):
    """``jac(x)``: the (n_samples, n_outputs, n_params) Jacobian, from JAX."""
    return on_numpy(model, joined_jacobian)


def jax_gradients(model):
    """``grads(x, y)``: (n_samples, n_params) per-sample squared-error gradients."""
    return on_numpy(model, _gradients)


def jax_gradient_norms(model):
    """``norms(x, y)``: (n_samples,) norms of those gradients, gradients first."""

    def norms(layers, theta, x, y):
        return jnp.linalg.norm(_gradients(layers, theta, x, y), axis=1)

    return on_numpy(model, norms)
