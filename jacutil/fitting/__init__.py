"""Fitting with the Jacobian (05-scipy-least-squares) and per-sample gradients.

- ``scipy_bridge``    ``least_squares_problem``: a model as SciPy's fun and jac
- ``gauss_newton``    ``levenberg_marquardt``: our own damped Gauss-Newton
- ``loss_gradients``  ``per_sample_gradients`` and their norms

DP-SGD, built on the per-sample gradients, lives in ``jacutil.privacy`` (09).
"""

from ..core.lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(
    __name__, modules="gauss_newton loss_gradients scipy_bridge"
)
