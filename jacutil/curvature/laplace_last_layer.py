"""The last-layer Laplace posterior (11-curvature-and-uncertainty)."""

import numpy as np
import scipy.linalg

from .laplace_base import Laplace, last_layer_variables, named_layer_variables


def _ggn(J, H):
    """G of a chunk, (m, m): sum_i J_i.T H_i J_i."""
    return np.einsum("nkp,nkj,njq->pq", J, H, J, optimize=True)


class LastLayerLaplace(Laplace):
    """``structure="last_layer"``: the full G (m, m) of the last layer that
    has weights (:func:`last_layer_variables`, or ``last_layer=``), the other
    weights fixed at theta*; P is factored by Cholesky, and G's eigenvalues
    give log det P at any one delta. Introduced in
    ``11-curvature-and-uncertainty``."""

    structure = "last_layer"
    _covariance_kept = None  # (delta, sigma^2, (Sigma, parts)) of the last predictive

    def _check_last_layer(self, variables):
        if variables is not None:
            raise ValueError(
                "pass last_layer= or variables=, not both: each says which "
                "weights the posterior covers."
            )

    def _default_variables(self, model, x, last_layer):
        if last_layer is not None:
            return named_layer_variables(model, last_layer)
        return last_layer_variables(model, x)

    def _fit(self, x):
        G = self._summed(x, _ggn if self.dense is None else self.dense.ggn)
        self.ggn = 0.5 * (G + G.T)
        self._eigenvalues = np.linalg.eigvalsh(self.ggn)

    def _precision(self, delta, s2):
        return self.ggn / s2 + np.diag(np.broadcast_to(delta, self.n_params))

    def _inverse(self, P):  # by Cholesky solves
        factor = scipy.linalg.cho_factor(P, lower=True)
        return scipy.linalg.cho_solve(factor, np.eye(self.n_params))

    def _log_det(self, delta, s2):
        if np.ndim(delta) == 0:
            return float(np.sum(np.log(self._eigenvalues / s2 + delta)))
        factor = np.linalg.cholesky(self._precision(delta, s2))
        return 2.0 * float(np.sum(np.log(np.diagonal(factor))))

    def _covariance_diagonal(self, delta, s2):
        return np.diagonal(self._inverse(self._precision(delta, s2)))

    def _jacobian_variance(self):
        L = np.linalg.cholesky(self.posterior_precision())

        def variance(J):  # P = L L.T: J Sigma J.T = |L^-1 J.T|^2
            c, width = J.shape[:2]
            Z = scipy.linalg.solve_triangular(
                L, J.reshape(c * width, -1).T, lower=True
            ).reshape(-1, c, width)
            return np.einsum("pck,pcj->ckj", Z, Z)

        return variance

    def _dense_parts(self, delta, s2):
        return "full", self._kept_covariance(delta, s2)[1]

    def _kept_covariance(self, delta, s2):
        """``(Sigma, parts)`` at delta and sigma^2: Sigma (m, m) and, with the
        Dense form, its ``DenseLastLayer.full_parts``; kept for the next call
        with the same values."""
        kept = self._covariance_kept
        if kept and kept[1] == s2 and np.array_equal(np.asarray(kept[0]), delta):
            return kept[2]
        covariance = self._inverse(self._precision(delta, s2))
        covariance = 0.5 * (covariance + covariance.T)
        parts = None if self.dense is None else (self.dense.full_parts(covariance),)
        self._covariance_kept = (np.copy(delta), s2, (covariance, parts))
        return covariance, parts
