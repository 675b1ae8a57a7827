"""Laplace uncertainty for a trained Keras model (11-curvature-and-uncertainty).

A trained model's weights ``theta*`` are the MAP estimate. The Laplace
approximation puts a Gaussian around them, ``N(theta*, Sigma)``, whose
precision is the curvature of the loss plus the prior's::

    P = G / sigma^2 + diag(delta),        Sigma = P^-1,

with ``G = sum_i J_i.T H_i J_i`` the Gauss-Newton matrix of the summed loss
(``H_i`` from :class:`jacutil.curvature.losses.OutputLoss`), ``sigma^2`` the
noise variance of a regression (1 for a classification) and ``delta`` the
prior precision: one number, or one per layer (laplace-torch's per-module
prior). Three structures of P, as in laplace-torch, one class and module
each: ``"last_layer"`` (:class:`LastLayerLaplace`), ``"diagonal"``
(:class:`DiagonalLaplace`) and ``"kfac"`` (:class:`KFACLaplace`); the last
layer's G exactly by its low rank where n r < m, or by a Kronecker product
(``hessian_structure=``, :mod:`jacutil.curvature.laplace_low_rank`), around
what they share (:class:`Laplace`): the linearized predictive, and the
marginal likelihood that chooses the prior. Over one Dense layer J is never
formed (:attr:`Laplace.jacobian_form`): it is ``A (phi (x) I)`` from the
layer's inputs phi (:mod:`jacutil.curvature.dense_last_layer`, as
laplace-torch treats a Linear last layer).
"""

from .laplace_base import PRIOR_STRUCTURES, STRUCTURES, Laplace, last_layer_variables  # noqa: F401
from .laplace_diagonal import DiagonalLaplace  # noqa: F401
from .laplace_kfac import KFACLaplace  # noqa: F401
from .laplace_last_layer import LastLayerLaplace  # noqa: F401


def laplace(
    model, x, y=None, loss="squared_error", structure="last_layer", **options
):  # fmt: skip
    """Fit a Laplace approximation around a trained model's weights: the
    same as ``Laplace(model, x, y, loss, structure, **options)``, an instance
    of the structure's class. Introduced in ``11-curvature-and-uncertainty``.

    Args:
        model: a trained Keras model (its weights are theta*), or a callable
            ``f(x)`` with ``variables=``.
        x: the training inputs (n samples): an array, or a list or dict of
            arrays, or a ``tf.data.Dataset`` / ``keras.utils.PyDataset`` of
            ``(x, y)`` batches as ``model.fit`` takes them (then no ``y``).
        y: the training targets: (n, l) values, or integer labels for
            ``"softmax_cross_entropy"``.
        loss: ``"squared_error"`` (a regression), ``"softmax_cross_entropy"``
            or ``"sigmoid_cross_entropy"`` (a classification; the model
            outputs logits), or an ``OutputLoss``.
        structure: ``"last_layer"``, ``"diagonal"`` or ``"kfac"``.
        prior_precision: (keyword only, as are the rest) delta: a positive
            number, or one per layer of the posterior (laplace-torch's
            per-module prior): a dict ``{layer name: delta}`` naming every
            layer, or a sequence in the order of :attr:`Laplace.layer_names`.
        sigma_noise: sigma, the noise standard deviation of a regression
            (it must stay 1 for a classification).
        variables: the variables the posterior covers (default: the last
            layer's for ``"last_layer"``, every trainable one otherwise).
            Any iterable of variables; it is read once.
        last_layer: for ``"last_layer"``: the layer (or list of layers, as
            objects or names) whose weights the posterior covers instead of
            the one found from the forward pass; several heads need it.
        hessian_structure: for ``"last_layer"`` (laplace-torch's name):
            ``"auto"`` (the default) is ``"low_rank"`` where n r < m (n
            samples, r the rank of each sample's H, m the weights: G is
            never formed, its log det and solves come from the n r x n r
            Gram matrix), else ``"full"`` (G formed); ``"kron"`` approximates
            a Dense head's G by a Kronecker product (a 1,000-class head on
            2,048 features). The one taken is ``la.hessian_structure``.
        memory_budget: bytes for one chunk of J (default: the package's
            policy, :func:`jacutil.core.planner.memory_budget_for`: one
            chunk while J fits in 64 MiB, else half the memory free now).

    Raises:
        ValueError: an unknown structure or loss, y of the wrong shape, NaN
            or infinity in x or y, a cross-entropy on a model that ends in a
            softmax or sigmoid, a prior precision or noise that is not
            positive, a memory budget below one byte, or a model whose
            outputs end in different weighted layers (several heads) without
            ``last_layer=``.
        TypeError: a plain callable without ``variables=``.
    """
    return Laplace(model, x, y, loss, structure, **options)
