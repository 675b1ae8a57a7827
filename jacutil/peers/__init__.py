"""The same per-sample Jacobian in JAX and PyTorch, for ``make bench-peers``.

Each peer rebuilds the Keras model from its own weights (``network.py``
reads Dense, Conv2D, Flatten and LSTM layers; ``layers.py`` runs them on one
sample) and returns ``jac(x)``: the (n_samples, n_outputs, n_params) array
in ``flat_params`` order, computed by the peer's idiom, ``vmap(jacrev)``
(``jax_peer.py``, ``torch_peer.py``). Neither library is a dependency of
``jacutil``: each builder returns ``None`` when its library is not installed
(``make bench-peers`` installs both). Introduced in ``07-benchmark``.
"""

import importlib.util


def available(name):
    """Whether the peer library ``name`` (``"jax"``, ``"torch"``) is installed."""
    return importlib.util.find_spec(name) is not None


def jax_jacobian(model):
    """``jax.jit(vmap(jacrev(f)))`` on the model's weights, or None without JAX."""
    if not available("jax"):
        return None
    from .jax_peer import jax_jacobian

    return jax_jacobian(model)


def torch_jacobian(model):
    """``torch.func.vmap(jacrev(f))`` on the model's weights, or None without torch."""
    if not available("torch"):
        return None
    from .torch_peer import torch_jacobian

    return torch_jacobian(model)


PEERS = {
    "JAX jit(vmap(jacrev))": jax_jacobian,
    "torch.func vmap(jacrev)": torch_jacobian,
}
