"""The last-layer Laplace posterior (11-curvature-and-uncertainty)."""

import warnings

import numpy as np
import scipy.linalg

from ..core._tf import tf
from ..core.batch import n_samples, take
from ..core.formulation import quiet_function
from ..core.memory import available_bytes
from ..core.planner import plan_chunks, run_chunks, sum_chunks
from .dense_last_layer import FeatureRows
from .kfac import KFAC, LayerFactors
from .laplace_base import Laplace, last_layer_variables, named_layer_variables
from .laplace_kfac import KFACLaplace
from .laplace_low_rank import FormedRows, LowRankGGN

HESSIAN_STRUCTURES = ("auto", "full", "low_rank", "kron")
# the budget of one chunk of the Dense head's per-sample pieces (low rank,
# Kronecker) without memory_budget=: larger chunks would only use more memory
WIDE_BUDGET = 256 * 2**20
SQUARE_COPIES = 3  # a k x k (or m x m) matrix, its eigenvectors, a product
# up to this many outputs H_i = S_i S_i.T (l^3 a sample); wider, H_i's columns
# come from products H_i e_j (l^2 a sample for the closed-form losses)
DIRECT_WIDTH = 64


def _ggn(J, H):
    """G of a chunk, (m, m): sum_i J_i.T H_i J_i."""
    return np.einsum("nkp,nkj,njq->pq", J, H, J, optimize=True)


def _output_hessians(loss, f, y, summed=False, compiled=None):
    """H_i (n, l, l) at the outputs f (n, l), float64; with ``summed``, their
    sum (l, l). ``compiled``: a dict that keeps the compiled products."""
    width = f.shape[1]
    if width <= DIRECT_WIDTH:
        H = np.asarray(loss.hessian(f, y), np.float64)
        return np.sum(H, axis=0) if summed else H
    compiled = {} if compiled is None else compiled
    targets = None if y is None else tf.convert_to_tensor(loss.targets(y, f))
    args = (tf.convert_to_tensor(f), targets)
    columns = None
    if compiled.get("xla", True):
        try:
            columns = _columns_of(compiled, loss, summed, True)(*args)
        except tf.errors.OpError:  # an op XLA cannot compile: without it for good
            compiled["xla"] = False
    if columns is None:
        columns = _columns_of(compiled, loss, summed, False)(*args)
    return np.asarray(columns.numpy(), np.float64).swapaxes(-1, -2)


def _columns_of(compiled, loss, summed, xla):
    """``(f, t) -> [H_i e_j]`` (n, l, l), or their sum (l, l), compiled once
    into ``compiled`` (by XLA: the products' elementwise work fused)."""
    key = (summed, xla)
    if key not in compiled:
        compiled[key] = _hessian_columns(loss, summed, xla)
    return compiled[key]


def _hessian_columns(loss, summed, xla):
    """The function of :func:`_columns_of`."""

    def columns(f, t):
        n, width = tf.shape(f)[0], f.shape[1]
        repeated = tf.nest.map_structure(lambda a: tf.repeat(a, width, axis=0), t)
        eye = tf.tile(tf.eye(width, dtype=f.dtype), [n, 1])
        f = tf.repeat(f, width, axis=0)  # row (i, j): H_i e_j
        H = tf.reshape(loss.hessian_product_tf(f, eye, repeated), [n, width, width])
        return tf.reduce_sum(H, axis=0) if summed else H

    return quiet_function(columns, jit_compile=xla, reduce_retracing=True)


def _compressed(S):
    """Roots S_i (n, l, c) cut to (n, l, r), r the largest rank among them,
    with the same ``S_i S_i.T`` (singular values under numpy's rank
    tolerance dropped): a softmax's H_i has rank l - 1."""
    if np.all(S == np.diagonal(S, 0, 1, 2)[:, :, None] * np.eye(S.shape[1])):
        return S  # diagonal (the squared error, a sigmoid): kept as it is
    U, s, _ = np.linalg.svd(S, full_matrices=False)
    tolerance = s[:, :1] * max(S.shape[1:]) * np.finfo(np.float64).eps
    rank = max(1, int(np.max(np.sum(s > tolerance, axis=1), initial=1)))
    return U[:, :, :rank] * s[:, None, :rank]


def _one_delta(delta):
    """delta as one number where one value repeats for every parameter."""
    if np.ndim(delta) and np.all(delta == delta[0]):
        return float(delta[0])
    return delta


class LastLayerLaplace(Laplace):
    """``structure="last_layer"``: the weights of the last layer that has
    weights (:func:`last_layer_variables`, or ``last_layer=``), the other
    weights fixed at theta*. Introduced in ``11-curvature-and-uncertainty``.

    ``hessian_structure=`` (keyword; laplace-torch's name) says how G is held:

    * ``"full"``: G (m, m) formed; P factored by Cholesky, and G's
      eigenvalues give log det P at any one delta.
    * ``"low_rank"``: exact, ``G = U.T U`` with U the k = n r rows
      ``S_i.T J_i`` (``H_i = S_i S_i.T``, S_i (l', r), r the largest rank of
      the H_i: l' for the squared error, l' - 1 for a softmax cross-entropy,
      taken as l' where l' > 64); log det P, Sigma's products and
      the predictive come from the (k, k) Gram matrix ``U U.T`` and its
      eigendecomposition, by Woodbury
      (:mod:`jacutil.curvature.laplace_low_rank`); nothing is m x m. Over a
      Dense layer U is never formed either (``FeatureRows``).
    * ``"kron"``: approximate, a Dense last layer only: G replaced by
      ``A (x) B``, ``A = sum phi_bar phi_bar.T / n`` (d+1, d+1) and
      ``B = sum_i A_i.T H_i A_i`` (l, l), the Dense head's exact KFAC factors
      (jacutil's convention: :mod:`jacutil.curvature.kfac`, kernel and bias
      as one block ``[kernel; bias]``; laplace-torch's last-layer ``"kron"``
      keeps the bias apart), held as a ``KFAC`` and solved as
      :class:`KFACLaplace` does. Exact where every ``A_i.T H_i A_i`` is the
      same (the squared error on a linear Dense head) or n = 1.
    * ``"auto"`` (the default): ``"low_rank"`` where k = n r < m, else
      ``"full"``; ``"kron"`` where that (k, k) or (m, m) matrix would not
      fit in the memory free and the last layer is one Dense layer (a
      1,000-class head), with a ``UserWarning`` that says so.

    The choice is :attr:`hessian_structure`, shows in ``repr``, and
    :attr:`hessian_reason` says why. Where the matrix asked for would not
    fit in memory (and ``"auto"`` cannot take ``"kron"``), ValueError.

    Attributes:
        hessian_structure: ``"full"``, ``"low_rank"`` or ``"kron"``.
        hessian_reason: why that one (a ``str``).
        low_rank: the ``LowRankGGN`` of ``"low_rank"``, else None.
        ggn: G (m, m) (``"low_rank"``: formed on each access, small last
            layers only), or the ``KFAC`` of ``"kron"``.
    """

    structure = "last_layer"
    hessian_structure = None  # the one chosen, by _fit
    hessian_reason = None  # why, in words
    low_rank = None
    _roots = None  # S_i (n, l', r) of the training samples, while needed
    _covariance_kept = None  # (delta, sigma^2, (Sigma, parts)) of the last predictive
    # "kron" solves as KFACLaplace does, its ggn a KFAC of one block
    _eigen_precision = KFACLaplace._eigen_precision
    _kron_precision, _kron_log_det = KFACLaplace._precision, KFACLaplace._log_det
    _kron_diagonal = KFACLaplace._covariance_diagonal
    _kron_parts = KFACLaplace._dense_parts

    def __init__(
        self, model, x, y=None, loss="squared_error", structure=None, *,
        hessian_structure="auto", **options,
    ):  # fmt: skip
        if hessian_structure not in HESSIAN_STRUCTURES:
            raise ValueError(
                "hessian_structure must be one of "
                f"{', '.join(map(repr, HESSIAN_STRUCTURES))}; "
                f"got {hessian_structure!r}."
            )
        self._asked = hessian_structure
        super().__init__(model, x, y, loss, structure, **options)

    def __repr__(self):
        return f"{super().__repr__()[:-1]}, hessian={self.hessian_structure!r})"

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

    @property
    def ggn(self):
        if self.hessian_structure == "low_rank":
            return self.low_rank.to_dense()
        return self._ggn

    # -- the fit ------------------------------------------------------------------

    def _fit(self, x):
        self.hessian_structure = self._chosen()
        if self.hessian_structure == "kron":
            self._ggn = self._kronecker(x)
        elif self.hessian_structure == "low_rank":
            self.low_rank = LowRankGGN(self._rows(x))
        else:
            G = self._summed(x, _ggn if self.dense is None else self.dense.ggn)
            self._ggn = 0.5 * (G + G.T)
            self._eigenvalues = np.linalg.eigvalsh(self._ggn)
        self._roots = None  # the low rank's are in its rows now

    def _chosen(self):
        """The hessian structure asked for, "auto" resolved; checked to fit."""
        chosen, rank = self._asked, self.n_outputs
        if chosen in ("auto", "low_rank") and rank <= DIRECT_WIDTH:
            rank = self._sample_roots().shape[2]
        m, k = self.n_params, self.n_data * rank
        if chosen == "auto":
            chosen = "low_rank" if k < m else "full"
        if chosen == "kron":
            if self.dense is None:
                raise ValueError(
                    "hessian_structure='kron' takes the Kronecker factors of a "
                    "Dense last layer (its inputs and output Hessians); this last "
                    "layer is not one Dense layer of a functional or Sequential "
                    "model. Use 'low_rank' or 'full', or structure='kfac'."
                )
            self.hessian_reason = "hessian_structure='kron', as asked"
            return chosen
        side = k if chosen == "low_rank" else m
        needed = 8 * SQUARE_COPIES * side**2
        if needed > available_bytes() and self._asked == "auto" and self.dense:
            self.hessian_reason = (
                f"hessian_structure='auto' took 'kron': {chosen!r} would need a "
                f"{side:,} x {side:,} matrix (about {needed / 2**30:,.1f} GiB with "
                f"its workspace; m = {m:,} parameters, n r = {k:,} rows of G's "
                "root), more than the memory free; 'kron' holds the Dense head's "
                "Kronecker factors (approximate, see LastLayerLaplace)"
            )
            warnings.warn(self.hessian_reason, UserWarning, stacklevel=5)
            return "kron"
        self.hessian_reason = f"hessian_structure={self._asked!r}: {chosen!r}"
        if needed > available_bytes():
            raise ValueError(
                f"hessian_structure={chosen!r} needs a {side:,} x {side:,} matrix "
                f"(about {needed / 2**30:,.1f} GiB with its workspace; m = {m:,} "
                f"parameters, n r = {k:,} rows of G's root), more than the "
                "memory free. Pass hessian_structure='kron' (a Dense last layer), "
                "or fewer samples for 'low_rank'."
            )
        return chosen

    def _chunks(self, x):
        """Over a Dense layer, low rank and Kronecker hold per sample only its
        features and l x l pieces: chunks of at most ``WIDE_BUDGET``."""
        if self.dense is None or self.hessian_structure == "full":
            return super()._chunks(x)
        d1, width = self.dense.n_features, self.dense.n_outputs
        # H_i by products: the repeated outputs, the identity, the softmax and
        # its products in TensorFlow, then NumPy's copies: about 12 l^2 numbers
        pieces = d1 + 12 * width * max(width, self.n_outputs)
        if self.low_rank is not None:  # the predictive: (k, l) per test sample
            pieces = max(pieces, self.n_data + 3 * self.low_rank.n_rows * width)
        budget = WIDE_BUDGET if self.memory_budget is None else self.memory_budget
        return plan_chunks(
            int(n_samples(x)), per_sample=8 * pieces, memory_budget=budget
        )  # fmt: skip

    def _rows(self, x):
        """U's rows ``S_i.T J_i``: ``FeatureRows`` over a Dense layer (phi and
        ``R_i = A_i.T S_i``), else ``FormedRows``; one pass over x."""
        roots = self._sample_roots()
        n, lp = roots.shape[0], roots.shape[2]
        plan = self._chunks(x)
        if self.dense is None:

            def rows(start, stop):
                J = self._jacobian(take(x, start, stop))
                U = np.einsum("nkc,nkp->ncp", roots[start:stop], J)
                return U.reshape(stop - start, -1)

            U = run_chunks(plan, rows, shape=(n, lp * self.n_params), dtype=np.float64)
            return FormedRows(U.reshape(n * lp, self.n_params))
        d1, width = self.dense.n_features, self.dense.n_outputs

        def features(start, stop):
            phi, _, A = self.dense.head(take(x, start, stop))
            S = roots[start:stop]
            R = S if A is None else np.matmul(A.transpose(0, 2, 1), S)
            return np.concatenate([phi, R.reshape(len(phi), -1)], axis=1)

        out = run_chunks(plan, features, shape=(n, d1 + width * lp), dtype=np.float64)
        return FeatureRows(out[:, :d1], out[:, d1:].reshape(n, width, lp))

    def _sample_roots(self):
        """Every sample's ``S_i`` (n, l', r), ``H_i = S_i S_i.T``, r the
        largest rank of the H_i; computed once."""
        if self._roots is None:
            S = self.loss.sqrt_hessian(self.f_train, self._y)
            self._roots = _compressed(np.asarray(S, np.float64))
        return self._roots

    def _kronecker(self, x):
        """The KFAC (one block) of the Dense last layer: A and B from one pass."""

        compiled = {}

        def sums(start, stop):  # sum phi phi.T, sum A.T H A
            phi, _, A = self.dense.head(take(x, start, stop))
            f, y = self.f_train[start:stop], take(self._y, start, stop)
            H = _output_hessians(self.loss, f, y, A is None, compiled)
            if A is None:  # f = z: the H_i summed as they come
                return phi.T @ phi, H
            return self.dense.kronecker_sums(phi, A, H)

        AA, BB = sum_chunks(self._chunks(x), sums)
        width, m = self.dense.n_outputs, self.n_params
        kernel = slice(0, m - width * self.dense.with_bias)
        bias = slice(kernel.stop, m) if self.dense.with_bias else None
        name, A = self.dense.layer.name, AA / self.n_data
        factors = [LayerFactors(name, A, BB, kernel, bias)]
        return KFAC(factors, np.zeros(0, int), np.zeros(0), m)

    # -- the posterior at delta and sigma^2 -------------------------------------------

    def _precision(self, delta, s2):
        if self.hessian_structure == "kron":
            return self._kron_precision(delta, s2)
        return self.ggn / s2 + np.diag(np.broadcast_to(delta, self.n_params))

    def _inverse(self, P):  # by Cholesky solves
        factor = scipy.linalg.cho_factor(P, lower=True)
        return scipy.linalg.cho_solve(factor, np.eye(self.n_params))

    def _log_det(self, delta, s2):
        if self.hessian_structure == "kron":
            return self._kron_log_det(delta, s2)
        if self.low_rank is not None:
            return self.low_rank.log_det(_one_delta(delta), s2)
        if np.ndim(delta) == 0:
            return float(np.sum(np.log(self._eigenvalues / s2 + delta)))
        factor = np.linalg.cholesky(self._precision(delta, s2))
        return 2.0 * float(np.sum(np.log(np.diagonal(factor))))

    def _covariance_diagonal(self, delta, s2):
        if self.hessian_structure == "kron":
            return self._kron_diagonal(delta, s2)
        if self.low_rank is not None:
            return self.low_rank.covariance_diagonal(_one_delta(delta), s2)
        return np.diagonal(self._inverse(self._precision(delta, s2)))

    def _covariance_times(self, V, delta, s2):  # low rank, without the Dense form
        return self.low_rank.covariance_times(V, _one_delta(delta), s2)

    def _jacobian_variance(self):
        if self.low_rank is not None:
            return super()._jacobian_variance()  # by _covariance_times
        L = np.linalg.cholesky(self.posterior_precision())

        def variance(J):  # P = L L.T: J Sigma J.T = |L^-1 J.T|^2
            c, width = J.shape[:2]
            Z = scipy.linalg.solve_triangular(
                L, J.reshape(c * width, -1).T, lower=True
            ).reshape(-1, c, width)
            return np.einsum("pck,pcj->ckj", Z, Z)

        return variance

    def _dense_parts(self, delta, s2):
        if self.hessian_structure == "kron":
            return self._kron_parts(delta, s2)
        if self.low_rank is not None:
            delta = _one_delta(delta)  # one Dense layer: one delta
            lower = self.low_rank.inner_factor(delta, s2)
            return "low_rank", (self.low_rank.rows, lower, delta)
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
