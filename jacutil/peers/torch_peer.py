"""Per-sample Jacobians and loss gradients in PyTorch, with ``torch.func``.

``f(theta, x)`` is the Keras model rebuilt from its weights for one sample
(see ``layers.forward``), in Keras's layouts: activations stay channels last
(h, w, c) between layers, so ``conv2d`` permutes to PyTorch's (c, h, w) and
back, and ``Flatten`` sees Keras's order. The Jacobian is
``vmap(jacrev(f))``; the per-sample gradients of a squared-error loss are
``vmap(grad(loss))``, and their norms those gradients, then norms. Eager:
PyTorch compiles nothing here. Introduced in ``07-benchmark``.

PyTorch's CPU build runs its operations on OpenMP threads, which by default
spin for a long time at each barrier. On a small machine shared with other
work (2 cores here, TensorFlow's own thread pools beside them) a spinning
thread takes the core that the next operation needs, and ``jac(x)`` ran an
order of magnitude slower than with a short spin. So, unless the user chose
(``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) or torch is already loaded, the
spin is shortened before torch is imported.
"""

import numpy as np

from .curvature_peers import load_torch
from .layers import Ops, bind, forward, joined, squared_error
from .network import describe

torch = load_torch()  # the spin shortened first


def conv2d(a, kernel, layer):
    """One sample (h, w, c_in), channels last, as Keras's Conv2D."""
    y = torch.nn.functional.conv2d(
        a.permute(2, 0, 1),  # (c_in, h, w)
        kernel.permute(3, 2, 0, 1),  # (c_out, c_in, kh, kw)
        stride=layer.strides,
        padding=layer.padding,
        dilation=layer.dilation,
    )
    return y.permute(1, 2, 0)  # back to (h', w', c_out)


OPS = Ops(
    act={
        "linear": lambda z: z,
        "relu": torch.relu,
        "tanh": torch.tanh,
        "sigmoid": torch.sigmoid,
    },
    conv2d=conv2d,
    concat=torch.cat,
)


def _tensor(array):
    return torch.from_numpy(np.array(array))  # a writable copy


def _rebuilt(model):
    """``(layers, theta)`` of the model, as torch tensors."""
    layers, theta = describe(model)
    return bind(layers, _tensor), tuple(_tensor(p) for p in theta)


def torch_jacobian(model):
    """``jac(x)``: the (n_samples, n_outputs, n_params) Jacobian, from torch."""
    layers, theta = _rebuilt(model)

    def f(theta, x):
        return forward(layers, theta, x, OPS)

    per_sample = torch.func.vmap(torch.func.jacrev(f), in_dims=(None, 0))

    def jac(x):
        with torch.no_grad():
            blocks = per_sample(theta, _tensor(x))
            # columns in flat_params order
            return joined(blocks, blocks[0].shape[:2], OPS).numpy()

    return jac


def _per_sample_grad(model):
    """``blocks(x, y)``: ``vmap(grad(loss))`` of the squared error on NumPy
    arrays, a tuple of (n, *shape) torch blocks, one per parameter."""
    layers, theta = _rebuilt(model)

    def loss(theta, x, y):
        return squared_error(layers, theta, x, y, OPS)

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))

    @torch.no_grad()
    def blocks(x, y):
        return per_sample(theta, _tensor(x), _tensor(y))

    return blocks


def torch_gradients(model):
    """``grads(x, y)``: (n_samples, n_params) per-sample squared-error gradients."""
    per_sample = _per_sample_grad(model)

    def grads(x, y):
        blocks = per_sample(x, y)
        return joined(blocks, blocks[0].shape[:1], OPS).numpy()

    return grads


def torch_gradient_norms(model):
    """``norms(x, y)``: (n_samples,) norms of those gradients, gradients first."""
    per_sample = _per_sample_grad(model)

    def norms(x, y):
        blocks = per_sample(x, y)
        squares = sum(b.reshape(b.shape[0], -1).square().sum(1) for b in blocks)
        return squares.sqrt().numpy()

    return norms
