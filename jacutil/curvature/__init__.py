"""Curvature, the empirical NTK and Laplace uncertainty from per-sample
pieces (11-curvature-and-uncertainty).

- ``compiled``   G v and H v compiled once per model and loss
- ``losses``     the user's (Keras) loss as one loss per head: ``output_loss``
- ``output_losses``  each head's loss and its Hessian at the outputs, ``H = S S.T``
- ``ggn``        ``ggn_operator``: G = sum_i J_i.T H_i J_i as a LinearOperator, no J
- ``hessian``    ``hessian_operator``: the loss's Hessian-vector products
- ``diagonal``   ``ggn_diagonal``: G's exact diagonal from the layer rules
- ``fisher``     the empirical and Monte Carlo Fisher, ``hessian_diagonal``
- ``kfac``       ``kfac``: Kronecker factors of Dense and Conv layers
- ``ntk``        ``empirical_ntk``: J(x) J(x').T in chunk pairs
- ``spectra``    top eigenvalues and singular values, Hutchinson estimates
- ``laplace``    ``Laplace``: posteriors, predictive variance, marginal likelihood
"""

from ..core.lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(
    __name__,
    modules="compiled diagonal fisher ggn hessian kfac laplace losses ntk "
    "output_losses spectra",
)
