"""The same per-sample results in JAX and PyTorch, for ``make bench-peers``.

Each peer rebuilds the Keras model from its own weights (``network.py``
reads Dense, Conv2D, Flatten, LSTM and Add layers, in a chain or a
functional graph with one input and any number of outputs; ``layers.py``
runs them on one sample) and returns, by the peer's idiom:

- ``jac(x)``: the (n_samples, n_outputs, n_params) Jacobian in
  ``flat_params`` order, rows in ``tf.nest.flatten`` order of the outputs
  (``vmap(jacrev)``);
- ``grads(x, y)``: the (n_samples, n_params) gradients of each sample's
  squared-error loss, the mean of (f(x_i) - y_i)**2 over the outputs, as
  ``keras.losses.mean_squared_error`` (``vmap(grad)``);
- ``norms(x, y)``: the (n_samples,) norms of those gradients, computed from
  the gradients.

(``jax_peer.py``, ``torch_peer.py``; JAX's are jitted.) Neither library is
a dependency of ``jacutil``: each builder returns ``None`` when its library
is not installed (``make bench-peers`` installs both). Introduced in
``07-benchmark``.
"""

import importlib
import importlib.util


def available(name):
    """Whether the peer library ``name`` (``"jax"``, ``"torch"``) is installed."""
    return importlib.util.find_spec(name) is not None


def _peer(library, what, model):
    """``library``'s builder ``what`` applied to ``model``, or None without it."""
    if not available(library):
        return None
    module = importlib.import_module(f".{library}_peer", __name__)
    return getattr(module, f"{library}_{what}")(model)


def jax_jacobian(model):
    """``jax.jit(vmap(jacrev(f)))`` on the model's weights, or None without JAX."""
    return _peer("jax", "jacobian", model)


def torch_jacobian(model):
    """``torch.func.vmap(jacrev(f))`` on the model's weights, or None without torch."""
    return _peer("torch", "jacobian", model)


def jax_gradients(model):
    """``jax.jit(vmap(grad(loss)))`` of the squared error, or None without JAX."""
    return _peer("jax", "gradients", model)


def torch_gradients(model):
    """``torch.func.vmap(grad(loss))`` of the squared error, or None without torch."""
    return _peer("torch", "gradients", model)


def jax_gradient_norms(model):
    """The norms of ``jax_gradients`` in the same ``jax.jit``, or None without JAX."""
    return _peer("jax", "gradient_norms", model)


def torch_gradient_norms(model):
    """The norms of ``torch_gradients``, or None without torch."""
    return _peer("torch", "gradient_norms", model)
