"""Spectra and estimates from products alone
(notebook 11-curvature-and-uncertainty).

Every operator of ``jacutil.curvature`` is a SciPy ``LinearOperator``, so
SciPy's Lanczos methods take them as they are: ``eigsh`` for the top
eigenvalues of G or of the Hessian, ``svds`` for the top singular values of
J (``jacutil.jacobian_operator``). Hutchinson's estimator gives the trace
and the diagonal from products with random signs: ``E[z.T A z] = tr(A)`` and
``E[z * (A z)] = diag(A)`` for z of independent +1/-1 entries.
"""

from dataclasses import dataclass

import numpy as np

from ..matrix_free.products import jacobian_operator


def as_operator(operator):
    """A square operator for SciPy: a ``LinearOperator`` or array as it is,
    a :class:`jacutil.curvature.kfac.KFAC` (or anything with
    ``as_operator()``) as its operator.

    Raises:
        TypeError: ``operator`` is none of these.
    """
    if hasattr(operator, "as_operator"):
        operator = operator.as_operator()
    shape = getattr(operator, "shape", None)
    if shape is None or len(shape) != 2 or shape[0] != shape[1]:
        raise TypeError(
            f"expected a square LinearOperator or array (m, m), or a KFAC; got "
            f"{type(operator).__name__}."
        )
    return operator


def top_eigenvalues(operator, k=6):
    """The k (fewer than m) largest eigenvalues of a symmetric operator (m, m)
    (a ``LinearOperator``, an array or a ``KFAC``), a NumPy array (k,),
    largest first.

    Introduced in ``11-curvature-and-uncertainty``. ``scipy.sparse.linalg.eigsh``
    (Lanczos) with products only; for the Hessian, which may be indefinite,
    they are the largest *algebraic* ones.

    Raises:
        ValueError: k is not between 1 and m - 1.
    """
    from scipy.sparse.linalg import eigsh

    operator = as_operator(operator)
    m = operator.shape[0]
    if not 1 <= k < m:
        raise ValueError(
            f"k={k}: eigsh finds between 1 and m - 1 = {m - 1} eigenvalues; for "
            "all of them form the matrix and use numpy.linalg.eigvalsh."
        )
    values = eigsh(operator, k=k, which="LA", return_eigenvectors=False)
    return np.sort(values)[::-1]


def top_singular_values(model, x, k=6, **options):
    """The k (fewer than min(n*l, m)) largest singular values of J (n*l x m),
    a NumPy array (k,), largest first.

    Introduced in ``11-curvature-and-uncertainty``. ``scipy.sparse.linalg.svds``
    on ``jacutil.jacobian_operator`` (JVPs and VJPs, no J; ``model``, ``x``
    and ``**options`` as it takes them). Their squares are the top
    eigenvalues of ``J.T J`` (G of the squared error) and of the empirical
    NTK ``J J.T``.
    """
    from scipy.sparse.linalg import svds

    J = jacobian_operator(model, x, **options)
    if not 1 <= k < min(J.shape):
        raise ValueError(
            f"k={k}: svds finds between 1 and min(n*l, m) - 1 = {min(J.shape) - 1} "
            "singular values."
        )
    values = svds(J, k=k, return_singular_vectors=False, random_state=0)
    return np.sort(values)[::-1]


@dataclass
class Estimate:
    """A Monte Carlo estimate and its standard error.

    Args:
        value: the estimate (a float, or an array for a diagonal).
        standard_error: the standard error of the mean over the probes.
        n_probes: how many probes it averaged.
    """

    value: object
    standard_error: object
    n_probes: int


def _probed(operator, n_probes, seed):
    """``z * (A z)`` for ``n_probes`` random sign vectors z, (m, n_probes)."""
    operator = as_operator(operator)
    if n_probes < 2:
        raise ValueError(f"n_probes={n_probes}: a standard error needs at least 2.")
    rng = np.random.default_rng(seed)
    Z = rng.choice([-1.0, 1.0], size=(operator.shape[0], n_probes))
    return Z * (operator @ Z)


def hutchinson_trace(operator, n_probes=100, seed=0):
    """Hutchinson's estimate of ``trace(A)`` from ``n_probes`` products.

    Introduced in ``11-curvature-and-uncertainty``.

    Args:
        operator: a square ``LinearOperator`` (or array) of shape (m, m), or
            a ``KFAC``.
        n_probes: random sign vectors to average over (at least 2).
        seed: the random seed.

    Returns:
        An :class:`Estimate` of the trace.
    """
    samples = _probed(operator, n_probes, seed).sum(axis=0)
    error = samples.std(ddof=1) / np.sqrt(n_probes)
    return Estimate(float(samples.mean()), float(error), n_probes)


def hutchinson_diagonal(operator, n_probes=100, seed=0):
    """Hutchinson's estimate of ``diag(A)`` from ``n_probes`` products.

    Introduced in ``11-curvature-and-uncertainty``. Compare it with
    ``ggn_diagonal``, which is exact: the estimate needs many probes for a
    few digits. Arguments as :func:`hutchinson_trace`; returns an
    :class:`Estimate` whose value is an array (m,).
    """
    samples = _probed(operator, n_probes, seed)
    error = samples.std(axis=1, ddof=1) / np.sqrt(n_probes)
    return Estimate(samples.mean(axis=1), error, n_probes)
