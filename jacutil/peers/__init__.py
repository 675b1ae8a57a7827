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


def _builder(library, what, summary):
    """The public ``{library}_{what}(model)``: ``library``'s builder ``what``
    (in ``{library}_peer.py``) applied to the model, or None without it."""

    def build(model):
        if not available(library):
            return None
        module = importlib.import_module(f".{library}_peer", __name__)
        return getattr(module, f"{library}_{what}")(model)

    build.__name__ = build.__qualname__ = f"{library}_{what}"
    build.__doc__ = f"{summary}, or None without {library}."
    return build


jax_jacobian = _builder(
    "jax", "jacobian", "``jax.jit(vmap(jacrev(f)))`` on the model's weights"
)
torch_jacobian = _builder(
    "torch", "jacobian", "``torch.func.vmap(jacrev(f))`` on the model's weights"
)
jax_gradients = _builder(
    "jax", "gradients", "``jax.jit(vmap(grad(loss)))`` of the squared error"
)
torch_gradients = _builder(
    "torch", "gradients", "``torch.func.vmap(grad(loss))`` of the squared error"
)
jax_gradient_norms = _builder(
    "jax", "gradient_norms", "The norms of ``jax_gradients`` in the same ``jax.jit``"
)
torch_gradient_norms = _builder(
    "torch", "gradient_norms", "The norms of ``torch_gradients``"
)
