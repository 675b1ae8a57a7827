"""The diagonal Laplace posterior (11-curvature-and-uncertainty)."""

import numpy as np

from .diagonal import ggn_diagonal
from .laplace_base import Laplace


class DiagonalLaplace(Laplace):
    """``structure="diagonal"``: every parameter, G replaced by its exact
    diagonal (:func:`jacutil.curvature.diagonal.ggn_diagonal`); P and Sigma
    are (m,) vectors. Introduced in ``11-curvature-and-uncertainty``."""

    structure = "diagonal"

    def _fit(self, x):
        if self.dense is not None:
            self.ggn = self._summed(x, self.dense.ggn_diagonal)
        else:
            options = {"variables": self.variables, "memory_budget": self.memory_budget}
            G = ggn_diagonal(self.model, x, self.loss, y=self._y, **options)
            self.ggn = np.asarray(G, dtype=np.float64)

    def _precision(self, delta, s2):
        return self.ggn / s2 + delta

    def _inverse(self, P):
        return 1.0 / P

    def _log_det(self, delta, s2):
        return float(np.sum(np.log(self._precision(delta, s2))))

    def _covariance_diagonal(self, delta, s2):
        return 1.0 / self._precision(delta, s2)

    def _covariance_times(self, V, delta, s2):
        return V / self._precision(delta, s2)[:, None]

    def _dense_parts(self, delta, s2):
        shape = (self.dense.n_features, self.dense.n_outputs)
        return "diagonal", (self._covariance_diagonal(delta, s2).reshape(shape),)
