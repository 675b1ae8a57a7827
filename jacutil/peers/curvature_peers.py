"""Curvature in PyTorch and JAX libraries on a Keras model's weights.

The peers of ``jacutil.curvature`` for ``python -m jacutil.bench.curvature_rows``
(``make bench-peers``). BackPACK, curvlinops and laplace-torch work on a
``torch.nn.Module``, so :func:`torch_module` rebuilds the Keras chain as one.
Each builder returns a function of NumPy arrays whose result is in jacutil's
conventions (parameters in ``flat_params`` order, the loss summed over
samples), so that it can be compared with jacutil's directly.

Losses, as ``jacutil.curvature.losses``: ``"squared_error"`` is
0.5 |f - y|^2 (H = I), while PyTorch's ``MSELoss(reduction="sum")`` is
|f - y|^2 (H = 2 I): the BackPACK and curvlinops results are halved,
explicitly. ``"softmax_cross_entropy"`` is ``CrossEntropyLoss(reduction=
"sum")`` on logits: the same H. G does not depend on the targets, so the
peers draw arbitrary ones. None of these libraries is a dependency of
``jacutil``: import this module only where they are installed.
Introduced in ``11-curvature-and-uncertainty``.
"""

import contextlib
import os
import sys
import warnings

import numpy as np

from .layers import forward
from .network import describe

LOSSES = ("squared_error", "softmax_cross_entropy")
SCALE = {"squared_error": 0.5, "softmax_cross_entropy": 1.0}  # torch's H -> ours
SPIN = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # the user's choice, if set


def load_torch():
    """The ``torch`` module, imported on first use, with a short OpenMP spin.

    The JAX peers need no PyTorch; the others import it through here, so
    that the spin is shortened (as ``torch_peer.py`` explains) unless the
    user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``; ImportError without
    PyTorch (``make bench-peers`` installs it). Introduced in
    ``11-curvature-and-uncertainty``.
    """
    if "torch" not in sys.modules and not any(name in os.environ for name in SPIN):
        os.environ["GOMP_SPINCOUNT"] = "10000"  # read once, when libgomp loads
    import torch

    return torch


def _check_loss(loss):
    if loss not in LOSSES:
        raise ValueError(
            f"the curvature peers know the losses {', '.join(map(repr, LOSSES))}; "
            f"got {loss!r}. Pass one of them (the model outputs logits for a "
            "cross-entropy)."
        )
    return loss


class TorchModule:
    """A Keras chain rebuilt as a ``torch.nn.Sequential`` on the same weights.

    Build it with :func:`torch_module`. Introduced in
    ``11-curvature-and-uncertainty``.

    Attributes:
        module: the ``nn.Sequential`` (its parameters require gradients).
        index: an int array (m,): entry k of the torch parameter vector (the
            module's parameters flattened and joined in order) is entry
            ``index[k]`` of the ``flat_params`` vector.
        dtype: the torch dtype of the weights.
        image: whether inputs are images (n, h, w, c) moved to (n, c, h, w).
    """

    def __init__(self, module, index, dtype, image):
        self.module = module
        self.index = index
        self.dtype = dtype
        self.image = image

    def inputs(self, x):
        """NumPy inputs ``x`` (Keras's layout) as a tensor in the module's."""
        torch = load_torch()
        t = torch.as_tensor(np.asarray(x), dtype=self.dtype)
        return t.permute(0, 3, 1, 2).contiguous() if self.image else t

    def to_torch(self, v):
        """A vector (m,) in ``flat_params`` order as the module's, a tensor (m,)."""
        torch = load_torch()
        return torch.as_tensor(np.asarray(v)[self.index], dtype=self.dtype)

    def to_ours(self, t):
        """A tensor (m,) or list of per-parameter tensors, in the module's order,
        as a float64 NumPy array (m,) in ``flat_params`` order."""
        torch = load_torch()
        if isinstance(t, (list, tuple)):
            t = torch.cat([b.reshape(-1) for b in t])
        out = np.empty(self.index.size)
        out[self.index] = t.detach().cpu().double().numpy()
        return out


def torch_module(model):
    """The Keras model rebuilt as a :class:`TorchModule` on its weights.

    ``model`` is a chain of Dense, Conv2D and Flatten layers (a ``Sequential``
    or a functional model without branches), activations linear, ReLU, tanh
    or sigmoid; ValueError for another layer, a branching model, a weight
    that is not trainable or an unsupported Conv2D option. A Dense kernel
    (n_in, n_out) becomes ``Linear.weight`` (n_out, n_in); a Conv2D kernel
    (kh, kw, c_in, c_out) ``Conv2d.weight`` (c_out, c_in, kh, kw), images
    going in as (n, c, h, w); PyTorch's ``Flatten`` reads (c, h, w) where
    Keras's reads (h, w, c), so the Dense kernel after it has its rows
    permuted to match. Introduced in ``11-curvature-and-uncertainty``.
    """
    torch = load_torch()
    records, theta = describe(model)
    if any(r.inputs for r in records):
        raise ValueError(
            "the curvature peers rebuild a chain of layers only (BackPACK reads "
            "an nn.Sequential); this model branches. Time it on a chain."
        )
    dtype = {"float32": torch.float32, "float64": torch.float64}[
        np.dtype(theta[0].dtype).name
    ]
    offsets = np.cumsum([0] + [p.size for p in theta])
    numbers = [
        np.arange(offsets[k], offsets[k + 1]).reshape(p.shape)
        for k, p in enumerate(theta)
    ]
    shape = tuple(model.inputs[0].shape[1:])
    image = len(shape) == 3
    sample = torch.zeros(
        (1, shape[2], shape[0], shape[1]) if image else (1, *shape), dtype=dtype
    )
    modules, index = [], []
    flattened_from = None  # (c, h, w) when Flatten read an image
    for record in records:
        w = record.weights
        if any(v is not None and not isinstance(v, int) for v in w.values()):
            raise ValueError(
                "the curvature peers differentiate every weight, and this model "
                "has a frozen one: unfreeze it (layer.trainable = True) or time "
                "a model whose weights are all trainable"
            )
        if record.kind == "dense":
            kernel = theta[w["kernel"]]
            numbers_kernel = numbers[w["kernel"]]
            if flattened_from is not None:  # rows in PyTorch's (c, h, w) order
                c, h, wd = flattened_from
                out = kernel.shape[1]
                kernel, numbers_kernel = (
                    a.reshape(h, wd, c, out).transpose(2, 0, 1, 3).reshape(-1, out)
                    for a in (kernel, numbers_kernel)
                )

                flattened_from = None
            layer = torch.nn.Linear(
                *kernel.shape, bias=w["bias"] is not None, dtype=dtype
            )
            weights = [(layer.weight, kernel.T, numbers_kernel.T)]
        elif record.kind == "conv2d":
            kernel = theta[w["kernel"]]
            kh, kw, c_in, c_out = kernel.shape
            if record.padding == "same" and (kh % 2 == 0 or kw % 2 == 0):
                raise ValueError(
                    "a Conv2D with 'same' padding and an even kernel pads "
                    "unevenly, which torch.nn.Conv2d cannot: use an odd kernel "
                    "or 'valid' padding"
                )
            padding = 0
            if record.padding == "same":
                padding = tuple(
                    d * (k - 1) // 2
                    for d, k in zip(record.dilation, (kh, kw), strict=True)
                )
            layer = torch.nn.Conv2d(
                c_in,
                c_out,
                (kh, kw),
                stride=record.strides,
                padding=padding,
                dilation=record.dilation,
                bias=w["bias"] is not None,
                dtype=dtype,
            )
            order = (3, 2, 0, 1)
            weights = [
                (
                    layer.weight,
                    kernel.transpose(order),
                    numbers[w["kernel"]].transpose(order),
                )
            ]
        elif record.kind == "flatten":
            if sample.ndim == 4:
                flattened_from = tuple(sample.shape[1:])
            layer, weights = torch.nn.Flatten(), []
        else:
            raise ValueError(
                f"the curvature peers rebuild Dense, Conv2D and Flatten layers; "
                f"this model has a {record.kind!r} layer"
            )
        if w.get("bias") is not None:
            weights.append((layer.bias, theta[w["bias"]], numbers[w["bias"]]))
        with torch.no_grad():
            for parameter, value, number in weights:
                parameter.copy_(torch.as_tensor(np.ascontiguousarray(value)))
                index.append(np.ascontiguousarray(number).reshape(-1))
        modules.append(layer)
        with torch.no_grad():
            sample = layer(sample)  # the next layer's input shape
        if record.activation != "linear":
            modules.append(
                {
                    "relu": torch.nn.ReLU,
                    "tanh": torch.nn.Tanh,
                    "sigmoid": torch.nn.Sigmoid,
                }[record.activation]()
            )
    module = torch.nn.Sequential(*modules)
    return TorchModule(module, np.concatenate(index), dtype, image)


def _torch_loss(loss):
    torch = load_torch()
    if _check_loss(loss) == "squared_error":
        return torch.nn.MSELoss(reduction="sum")  # |f - y|^2: H = 2 I
    return torch.nn.CrossEntropyLoss(reduction="sum")


def _targets(loss, f):
    """Arbitrary targets of the right kind: G does not depend on them."""
    torch = load_torch()
    if loss == "squared_error":
        return torch.zeros_like(f)
    return torch.zeros(f.shape[0], dtype=torch.long)


@contextlib.contextmanager
def _quiet_hooks():
    """Silence PyTorch's note that BackPACK's backward hooks fire on the
    outputs: the inputs need no gradient here, and the results are right."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
        yield


def _backpack_pass(model, loss, extension):
    """``(rebuilt, backward)``: the chain extended for BackPACK, and ``backward(x)``,
    which leaves ``extension``'s results on its parameters (loss summed over x)."""
    from backpack import backpack, extend

    _check_loss(loss)
    rebuilt = torch_module(model)
    extend(rebuilt.module)
    criterion = extend(_torch_loss(loss))

    def backward(x):
        rebuilt.module.zero_grad()
        f = rebuilt.module(rebuilt.inputs(x))
        with backpack(extension()), _quiet_hooks():
            criterion(f, _targets(loss, f)).backward()

    return rebuilt, backward


def backpack_ggn_diagonal(model, loss="squared_error"):
    """BackPACK's ``DiagGGNExact``: ``diag(x)``, the diagonal of G, shape (m,).

    ``model`` a Keras chain (see :func:`torch_module`), ``loss``
    ``"squared_error"`` or ``"softmax_cross_entropy"`` (ValueError otherwise).
    ``diag(x)`` maps NumPy inputs to a NumPy array (m,) in ``flat_params``
    order, G of the loss summed over samples (MSELoss halved). Introduced in
    ``11-curvature-and-uncertainty``.
    """
    from backpack.extensions import DiagGGNExact

    rebuilt, backward = _backpack_pass(model, loss, DiagGGNExact)

    def diag(x):
        backward(x)
        blocks = [p.diag_ggn_exact for p in rebuilt.module.parameters()]
        return SCALE[loss] * rebuilt.to_ours(blocks)

    return diag


def backpack_kflr(model, loss="squared_error"):
    """BackPACK's ``KFLR`` factors: ``factors(x)``, one (A, B) per layer.

    KFLR is the Kronecker-factored G with the loss's exact H (BackPACK's
    ``KFAC`` draws H's square root by Monte Carlo), so KFLR is the one to
    compare with ``jacutil.curvature.kfac``. For a Linear layer its
    ``B kron A`` is jacutil's weight block ``A kron B`` exactly (the rows
    permuted to PyTorch's (out, in) order). For a Conv2d it is not: BackPACK
    sums each signal over the output positions before the outer product
    (``B = sum (sum_r delta_r)(sum_r delta_r).T``) and does not divide A by
    the number of positions R, while jacutil's KFAC-expand sums the outer
    products per position and divides A by n R. Arguments as
    :func:`backpack_ggn_diagonal`. ``factors(x)`` gives a list, per Linear or
    Conv2d layer, of ``(A, B)`` NumPy arrays as BackPACK gives them (``kflr =
    [B, A]``): A the input factor (with a bias column when the layer has a
    bias), B the output factor, for the loss summed over samples (MSELoss
    halved). Introduced in ``11-curvature-and-uncertainty``.
    """
    from backpack.extensions import KFLR

    torch = load_torch()
    rebuilt, backward = _backpack_pass(model, loss, KFLR)

    def factors(x):
        backward(x)
        out = []
        for layer in rebuilt.module:
            if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
                B, A = layer.weight.kflr
                out.append((A.detach().numpy(), SCALE[loss] * B.detach().numpy()))
        return out

    return factors


def curvlinops_ggn(model, x, loss="squared_error"):
    """curvlinops's ``GGNLinearOperator`` on x: ``matvec(v)`` = G v, (m,).

    ``x`` is the n samples (one batch); ``model`` and ``loss`` as
    :func:`backpack_ggn_diagonal`. ``v`` and G v are in ``flat_params``
    order, G of the loss summed over samples (MSELoss halved). Introduced in
    ``11-curvature-and-uncertainty``.
    """
    from curvlinops import GGNLinearOperator

    _check_loss(loss)
    rebuilt = torch_module(model)
    inputs = rebuilt.inputs(x)
    torch = load_torch()
    with torch.no_grad():
        targets = _targets(loss, rebuilt.module(inputs))
    operator = GGNLinearOperator(
        rebuilt.module,
        _torch_loss(loss),
        list(rebuilt.module.parameters()),
        [(inputs, targets)],
        check_deterministic=False,
    )
    scale = SCALE[loss]

    def matvec(v):
        return scale * rebuilt.to_ours(operator @ rebuilt.to_torch(v))

    return matvec


def laplace_torch_variance(
    model, x, y, *, structure="last_layer", prior_precision=1.0, sigma_noise=1.0
):
    """laplace-torch's linearized predictive covariance, a regression's.

    The posterior ``N(theta*, (G / sigma^2 + delta I)^-1)`` of the summed
    squared error, as ``jacutil.curvature.laplace.Laplace`` (same prior
    precision delta and noise sigma, both fixed). Introduced in
    ``11-curvature-and-uncertainty``.

    Args:
        model: a Keras chain (see :func:`torch_module`), its last layer Dense.
        x: the training inputs.
        y: their targets (n, l).
        structure: ``"last_layer"`` (laplace-torch's ``FullLLLaplace``) or
            ``"diagonal"`` (``DiagLaplace``, every weight); ValueError otherwise.
        prior_precision: delta.
        sigma_noise: sigma.

    Returns:
        ``variance(x_test)``: NumPy inputs -> (n_test, l, l), J* Sigma J*.T.
    """
    from laplace import Laplace

    weights = {"last_layer": "last_layer", "diagonal": "all"}
    hessians = {"last_layer": "full", "diagonal": "diag"}
    if structure not in weights:
        raise ValueError(
            f"structure must be 'last_layer' or 'diagonal'; got {structure!r}."
        )
    rebuilt = torch_module(model)
    torch = load_torch()
    data = torch.utils.data.TensorDataset(
        rebuilt.inputs(x), torch.as_tensor(np.asarray(y), dtype=rebuilt.dtype)
    )
    posterior = Laplace(
        rebuilt.module,
        "regression",
        subset_of_weights=weights[structure],
        hessian_structure=hessians[structure],
        # as tensors of the weights' dtype: plain floats become float32 ones
        sigma_noise=torch.tensor(sigma_noise, dtype=rebuilt.dtype),
        prior_precision=torch.tensor(prior_precision, dtype=rebuilt.dtype),
    )
    posterior.fit(torch.utils.data.DataLoader(data, batch_size=len(data)))

    def variance(x_test):
        _, f_var = posterior(rebuilt.inputs(x_test), pred_type="glm")
        return f_var.detach().double().numpy()

    return variance


def jax_ntk(model):
    """The empirical NTK by ``jit(vmap(jacrev))`` then ``J J.T`` (einsum).

    ``model`` is one ``network.describe`` reads (ValueError otherwise);
    ``ntk(x)`` maps NumPy inputs to (n l, n l), rows and columns sample-major
    (row ``i * l + k``: sample i, output k), as
    ``jacutil.curvature.ntk.empirical_ntk``. Introduced in
    ``11-curvature-and-uncertainty``.
    """
    import jax.numpy as jnp

    from .jax_peer import joined_jacobian, on_numpy

    def kernel(layers, theta, x):
        J = joined_jacobian(layers, theta, x)
        J = J.reshape(-1, J.shape[-1])  # n l rows, sample-major
        return jnp.einsum("ap,bp->ab", J, J)

    return on_numpy(model, kernel)


def neural_tangents_ntk(model):
    """neural-tangents' ``empirical_ntk_fn`` on the model, or None without it.

    neural-tangents 0.6.5 (the newest) imports ``jax.core.Jaxpr``, which
    newer JAX releases no longer have: then this returns None. Introduced
    in ``11-curvature-and-uncertainty``. Arguments and ``ntk(x)`` as
    :func:`jax_ntk`.
    """

    try:
        import neural_tangents as nt
    except ImportError:
        return None
    import jax
    import jax.numpy as jnp

    from .jax_peer import OPS, rebuilt

    layers, theta = rebuilt(model)

    def f(theta, x):
        return jax.vmap(lambda s: forward(layers, theta, s, OPS))(x)

    kernel = jax.jit(nt.empirical_ntk_fn(f, trace_axes=(), vmap_axes=0))

    def ntk(x):
        K = np.asarray(kernel(jnp.asarray(x), None, theta))  # (n, n, l, l)
        rows = K.shape[0] * K.shape[2]  # n l, sample-major
        return K.transpose(0, 2, 1, 3).reshape(rows, rows)

    return ntk
