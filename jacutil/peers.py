"""The same per-sample Jacobian in JAX and PyTorch, for ``make bench-peers``.

Each peer rebuilds a Keras chain of Dense layers (see ``dense_chain``) from
the model's own weights and returns ``jac(x)``: the (n_samples, n_outputs,
n_params) array in ``flat_params`` order, computed by the peer's idiom,
``vmap(jacrev)``. Neither library is a dependency of ``jacutil``: each
builder returns ``None`` when its library is not installed
(``pip install -e ".[peers]"``). Introduced in ``07-benchmark``.
"""

import importlib.util

import numpy as np

from .dense_jacobian import dense_chain


def available(name):
    """Whether the peer library ``name`` (``"jax"``, ``"torch"``) is installed."""
    return importlib.util.find_spec(name) is not None


def _layers(model):
    """[(kernel, bias or None, activation, trainable)] as NumPy arrays."""
    chain, reason = dense_chain(model)
    if chain is None:
        raise ValueError(
            f"the peers rebuild chains of Dense layers only, and {reason}."
        )
    trainable = {id(v) for v in model.trainable_variables}
    layers = []
    for layer, activation in chain:
        bias = np.asarray(layer.bias) if layer.use_bias else None
        on = id(layer.kernel) in trainable
        layers.append((np.asarray(layer.kernel), bias, activation, on))
    return layers


def _parameters(layers):
    """The trainable weights in ``flat_params`` order (kernel, then bias)."""
    theta = []
    for kernel, bias, _, on in layers:
        if on:
            theta += [kernel] + ([bias] if bias is not None else [])
    return theta


def _forward(layers, act, matmul):
    """f(theta, x) for one sample, with ``act[name]`` and ``matmul``."""

    def forward(theta, x):
        values = iter(theta)
        a = x
        for kernel, bias, activation, on in layers:
            if on:
                kernel = next(values)
                bias = next(values) if bias is not None else None
            a = matmul(a, kernel)
            if bias is not None:
                a = a + bias
            a = act[activation](a)
        return a

    return forward


def jax_jacobian(model):
    """``jax.jit(vmap(jacrev(f)))`` on the model's weights, or None without JAX."""
    if not available("jax"):
        return None
    import jax
    import jax.numpy as jnp

    layers = _layers(model)
    act = {
        "linear": lambda a: a,
        "relu": jax.nn.relu,
        "tanh": jnp.tanh,
        "sigmoid": jax.nn.sigmoid,
    }
    forward = _forward(layers, act, jnp.matmul)
    theta = [jnp.asarray(p) for p in _parameters(layers)]

    @jax.jit
    def jacobian(theta, x):
        blocks = jax.vmap(jax.jacrev(forward), in_axes=(None, 0))(theta, x)
        n_samples, n_outputs = x.shape[0], blocks[0].shape[1]
        flat = [b.reshape(n_samples, n_outputs, -1) for b in blocks]
        return jnp.concatenate(flat, axis=2)

    def jac(x):
        return np.asarray(jacobian(theta, jnp.asarray(x)))

    return jac


def torch_jacobian(model):
    """``torch.func.vmap(jacrev(f))`` on the model's weights, or None without torch."""
    if not available("torch"):
        return None
    import torch

    layers = _layers(model)
    act = {
        "linear": lambda a: a,
        "relu": torch.relu,
        "tanh": torch.tanh,
        "sigmoid": torch.sigmoid,
    }
    layers = [
        (
            torch.from_numpy(k),
            None if b is None else torch.from_numpy(b),
            activation,
            on,
        )
        for k, b, activation, on in layers
    ]
    forward = _forward(layers, act, torch.matmul)
    theta = tuple(_parameters(layers))
    per_sample = torch.func.vmap(torch.func.jacrev(forward), in_dims=(None, 0))

    def jac(x):
        with torch.no_grad():
            x = torch.from_numpy(np.ascontiguousarray(x))
            blocks = per_sample(theta, x)
            n_samples, n_outputs = x.shape[0], blocks[0].shape[1]
            flat = [b.reshape(n_samples, n_outputs, -1) for b in blocks]
            return torch.cat(flat, dim=2).numpy()

    return jac


PEERS = {
    "JAX jit(vmap(jacrev))": jax_jacobian,
    "torch.func vmap(jacrev)": torch_jacobian,
}
