"""The KFAC Laplace posterior (11-curvature-and-uncertainty)."""

import math

import numpy as np

from .kfac import kfac
from .laplace_base import Laplace


class KFACLaplace(Laplace):
    """``structure="kfac"``: every parameter, G replaced by its Kronecker
    factors (:func:`jacutil.curvature.kfac.kfac`), P never formed:
    ``(K / s + d I)^-1 = s (K + s d I)^-1`` with ``s = sigma^2``, block by
    block (one layer each, so a per-layer delta keeps the inverse exact).
    Introduced in ``11-curvature-and-uncertainty``."""

    structure = "kfac"

    def _fit(self, x):
        self.ggn = kfac(self.model, x, self.loss, y=self._y, variables=self.variables)
        if self.dense is not None and not self._one_kronecker_block():
            self.dense, self.jacobian_form = None, "general"

    def _one_kronecker_block(self):
        """Whether KFAC is one block over the Dense layer, as its Dense form needs."""
        factors = self.ggn.factors
        return (
            len(factors) == 1
            and self.ggn.rest.size == 0
            and (factors[0].bias is not None) == self.dense.with_bias
            and factors[0].A.shape[0] == self.dense.n_features
        )

    def _eigen_precision(self, delta, s2):
        """P at delta (one per parameter) and sigma^2, diagonalized:
        ``(p_rest, [(factor, QA, QB, p_block)])``, P's diagonal on the other
        parameters and, per Kronecker block, the eigenvectors of A and B and
        P's eigenvalues ``eA eB.T / s2 + d``: one delta d per block, or
        ValueError."""
        blocks = []
        for f in self.ggn.factors:
            columns = np.r_[f.kernel, f.bias] if f.bias is not None else np.r_[f.kernel]
            values = np.unique(delta[columns])
            if len(values) != 1:
                raise ValueError(
                    f"layer {f.name!r} is one Kronecker block A (x) B in KFAC, whose "
                    "damped inverse is exact for one delta per block only; its "
                    f"parameters have {len(values)} prior precisions. Give each "
                    "layer one value (a dict {layer name: delta})."
                )
            eA, QA, eB, QB = f.eig()
            blocks.append((f, QA, QB, np.outer(eA, eB) / s2 + float(values[0])))
        return self.ggn.rest_diagonal / s2 + delta[self.ggn.rest], blocks

    def _precision(self, delta, s2):
        raise ValueError(
            "a KFAC posterior precision is never formed as a matrix (it is "
            "m x m); use predictive_variance, or the KFAC object in .ggn."
        )

    def _log_det(self, delta, s2):
        # log det(K / s + d I) = log det(K + s d I) - m log s, block by block
        if np.ndim(delta) == 0:
            return float(self.ggn.logdet(s2 * delta)) - self.n_params * math.log(s2)
        rest, blocks = self._eigen_precision(delta, s2)
        return float(np.sum(np.log(rest))) + sum(
            float(np.sum(np.log(p))) for *_, p in blocks
        )

    def _covariance_times(self, V, delta, s2):
        if np.ndim(delta) == 0:
            return s2 * np.asarray(self.ggn.inverse_matvec(V, s2 * delta), np.float64)
        V = np.asarray(V, dtype=np.float64)
        out = np.zeros_like(V)
        rest, blocks = self._eigen_precision(delta, s2)
        out[self.ggn.rest] = V[self.ggn.rest] / rest[:, None]
        for f, QA, QB, p in blocks:  # s (A (x) B + s d I)^-1, exact
            W = np.einsum("ba,bdk,de->aek", QA, f.as_matrix(V), QB) / p[:, :, None]
            f.put(out, np.einsum("ab,bdk,ed->aek", QA, W, QB))
        return out

    def _covariance_diagonal(self, delta, s2):
        out = np.zeros((self.n_params, 1))
        rest, blocks = self._eigen_precision(delta, s2)
        out[self.ggn.rest, 0] = 1.0 / rest
        for f, QA, QB, p in blocks:  # sum_ab QA[i,a]^2 QB[j,b]^2 / p[a,b]
            f.put(out, ((QA**2) @ (1.0 / p) @ (QB**2).T)[:, :, None])
        return out[:, 0]

    def _dense_parts(self, delta, s2):
        if np.ndim(delta) == 0:
            delta = np.full(self.n_params, delta)
        _, [(_, QA, QB, p)] = self._eigen_precision(delta, s2)  # one block
        return "kronecker", (QA, QB, 1.0 / p)
