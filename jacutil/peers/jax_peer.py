"""The per-sample Jacobian in JAX: ``jit(vmap(jacrev(f)))``.

``f(theta, x)`` is the Keras model rebuilt from its weights for one sample
(see ``layers.forward``); ``jacrev`` differentiates it with respect to every
array in ``theta``, ``vmap`` maps that over the samples and ``jit`` compiles
the whole, once per n. Introduced in ``07-benchmark``.
"""

import jax
import jax.numpy as jnp
import numpy as np

from .layers import Ops, bind, forward
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
)


def jax_jacobian(model):
    """``jac(x)``: the (n_samples, n_outputs, n_params) Jacobian, from JAX."""
    layers, theta = describe(model)
    layers = bind(layers, jnp.asarray)
    theta = [jnp.asarray(p) for p in theta]

    def f(theta, x):
        return forward(layers, theta, x, OPS)

    @jax.jit
    def jacobian(theta, x):
        blocks = jax.vmap(jax.jacrev(f), in_axes=(None, 0))(theta, x)
        n_samples, n_outputs = blocks[0].shape[:2]
        flat = [b.reshape(n_samples, n_outputs, -1) for b in blocks]
        return jnp.concatenate(flat, axis=2)  # columns in flat_params order

    def jac(x):
        return np.asarray(jacobian(theta, jnp.asarray(x)))

    return jac
