"""A Gauss-Newton matrix of low rank, never formed
(notebook 11-curvature-and-uncertainty).

``G = sum_i J_i.T H_i J_i = U.T U`` with U the (k, m) stacked rows
``S_i.T J_i`` (``H_i = S_i S_i.T``, S_i (l', r)): k = n r rows. Where
k < m, everything the Laplace posterior ``P = G / s + diag(delta)`` needs
(s = sigma^2) comes from the small Gram matrix ``K = U U.T`` (k, k): its
eigenvalues lam are G's nonzero ones (G's other m - k are 0), and

* ``log det P = sum log(lam / s + delta) + (m - k) log delta``;
* with ``D = diag(delta)`` (one delta, or one per parameter), Woodbury's
  ``log det P = log det D + log det(I + U D^-1 U.T / s)`` and
  ``Sigma = D^-1 - D^-1 U.T (s I + U D^-1 U.T)^-1 U D^-1``, by a Cholesky
  factor of the (k, k) inner matrix at the delta asked for.

U enters only through products (:class:`FormedRows` holds it; a Dense head
gives them from its features: ``jacutil.curvature.dense_last_layer``).
"""

import numpy as np
import scipy.linalg

BLOCK_ELEMENTS = 2**22  # (m, b) columns of U.T Q at a time: 32 MiB of float64


class FormedRows:
    """U (k, m) itself, for a last layer without the Dense form."""

    def __init__(self, U):
        self.U = np.ascontiguousarray(U, dtype=np.float64)
        self.n_rows, self.n_params = self.U.shape

    def gram(self, inverse_delta=None):
        """``U diag(inverse_delta) U.T`` (k, k); ``U U.T`` without it."""
        if inverse_delta is None:
            return self.U @ self.U.T
        return (self.U * inverse_delta) @ self.U.T

    def times(self, V):
        """``U V``: V (m, c) -> (k, c)."""
        return self.U @ V

    def transposed_times(self, Y):
        """``U.T Y``: Y (k, c) -> (m, c)."""
        return self.U.T @ Y

    def to_dense(self):
        """G = U.T U, (m, m)."""
        return self.U.T @ self.U


class LowRankGGN:
    """G = U.T U from ``U U.T``: its eigenvalues (log det P at any delta) and,
    at one delta and sigma^2 at a time, the Cholesky factor of the inner
    matrix of Woodbury's identity (see the module); G itself is never
    formed (but by :meth:`to_dense`).

    Args:
        rows: U by its products (:class:`FormedRows`, or the Dense head's
            ``FeatureRows``): ``n_rows`` k, ``n_params`` m, ``gram()``,
            ``times``, ``transposed_times``, ``to_dense``.

    Attributes:
        eigenvalues: K's eigenvalues (k,), clipped at 0: G's nonzero ones.
    """

    def __init__(self, rows):
        self.rows = rows
        self.n_rows, self.n_params = rows.n_rows, rows.n_params
        self.gram = rows.gram()
        self.gram = 0.5 * (self.gram + self.gram.T)
        self.eigenvalues = np.clip(np.linalg.eigvalsh(self.gram), 0.0, None)
        self._kept = None  # (delta, s2, lower Cholesky factor of the inner matrix)

    def to_dense(self):
        """G (m, m): small last layers only (tests, ``posterior_precision``)."""
        return self.rows.to_dense()

    def log_det(self, delta, s2):
        """log det(G / s + diag(delta)), delta a number or one per parameter."""
        if np.ndim(delta) == 0:
            spanned = np.sum(np.log(self.eigenvalues / s2 + delta))
            return float(spanned + (self.n_params - self.n_rows) * np.log(delta))
        lower = self.inner_factor(delta, s2)  # of s I + U D^-1 U.T
        inner = 2 * np.sum(np.log(np.diag(lower))) - self.n_rows * np.log(s2)
        return float(np.sum(np.log(delta)) + inner)

    def inner_factor(self, delta, s2):
        """L, lower, with ``L L.T = s I + U D^-1 U.T`` (``U U.T / delta`` for
        one delta); kept for the same values."""
        kept = self._kept
        if kept and kept[1] == s2 and np.array_equal(kept[0], delta):
            return kept[2]
        if np.ndim(delta) == 0:
            inner = self.gram / delta + s2 * np.eye(self.n_rows)
        else:
            inner = self.rows.gram(1.0 / delta) + s2 * np.eye(self.n_rows)
        lower = np.linalg.cholesky(inner)
        self._kept = (np.copy(delta), s2, lower)
        return lower

    def covariance_times(self, V, delta, s2):
        """``Sigma V`` (m, c) for V (m, c), by Woodbury."""
        per_row = delta if np.ndim(delta) == 0 else delta[:, None]
        scaled = np.asarray(V, dtype=np.float64) / per_row
        lower = self.inner_factor(delta, s2)
        inner = scipy.linalg.cho_solve((lower, True), self.rows.times(scaled))
        return scaled - self.rows.transposed_times(inner) / per_row

    def covariance_diagonal(self, delta, s2):
        """Sigma's diagonal (m,): ``diag(U.T L^-T L^-1 U)`` from the columns of
        ``U.T L^-T``, a block at a time."""
        lower = self.inner_factor(delta, s2)
        Q = scipy.linalg.solve_triangular(lower, np.eye(self.n_rows), lower=True).T
        taken = np.zeros(self.n_params)
        block = max(1, BLOCK_ELEMENTS // max(1, self.n_params))
        for start in range(0, self.n_rows, block):
            taken += np.sum(
                self.rows.transposed_times(Q[:, start : start + block]) ** 2, 1
            )
        return 1.0 / delta - taken / delta**2
