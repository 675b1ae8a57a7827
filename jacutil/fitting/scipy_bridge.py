"""A Keras model as SciPy's least-squares problem (notebook 05-scipy-least-squares).

``scipy.optimize.least_squares(fun, theta0, jac=jac)`` takes residuals
``r(theta)`` of length n*l and their (n*l) x m Jacobian. Row ``i*l + k`` is
sample ``i``, output ``k``: exactly ``J.reshape(n*l, m)`` of the (n, l, m)
Jacobian that every stage returns, so no transpose is needed.
"""

import numpy as np

from ..core._shared import size_of
from ..core._tf import tf
from ..core.batch import as_batch, n_samples, take
from ..core.data import inputs_of, read_data
from ..core.layout import flat_params, set_flat_params
from ..core.outputs import output_layout
from ..core.planner import bytes_per_sample, chunk_size_for, plan_chunks, sum_chunks
from ..core.resume import fingerprint
from ..core.target import resolve_target
from ..curvature.diagonal import ggn_diagonal
from ..curvature.kfac import kfac
from ..engine.compiled import compiled_for
from ..engine.rows import chunked_jacobian
from ..matrix_free.products import jacobian_operator, products


class LeastSquaresProblem:
    """``fun``, ``jac`` and ``theta0`` of a model fitted to ``(x, y)``.

    See :func:`least_squares_problem`. ``compiled`` is the compiled Jacobian
    that every ``jac`` call reuses (its ``trace_count`` stays 1).
    """

    def __init__(
        self, model, x, y, variables, training, chunk_size, memory_budget, jacobian
    ):
        if jacobian not in ("formed", "operator"):
            raise ValueError(
                f'jacobian must be "formed" or "operator"; got {jacobian!r}.'
            )
        self.jacobian = jacobian
        self.model = model
        x, y, weights = read_data(x, y, inputs=inputs_of(model))
        if weights is not None or y is None:
            raise ValueError(
                "least squares needs x and y, and no sample weights: "
                + (
                    "pass y, or a dataset of (x, y) batches."
                    if y is None
                    else "the residuals f(x) - y are unweighted; give batches of "
                    "(x, y)."
                )  # fmt: skip
            )
        self._target = resolve_target(model, variables, training, x)
        # The columns are the variables of this moment, kept: freezing a layer
        # later does not change the length of theta under SciPy's feet.
        self._variables = self._target.variables
        self.x = as_batch(x, self._target)
        n_rows = int(n_samples(self.x))
        n_outputs = output_layout(self._target, self.x).n_outputs
        self.y = _target_rows(y, n_rows, n_outputs).reshape(n_rows * n_outputs)
        self.n_samples, self.n_outputs = n_rows, n_outputs
        self.n_params = self._target.n_params
        self.theta0 = flat_params(model, variables=self._variables).astype(np.float64)
        self._options = {
            "variables": self._variables,
            "training": training,
            "progress": False,
            "method": "rules",  # the layer rules, where the plan is proved
        }
        self.compiled = compiled_for(model, self._variables, training, False, "rules")
        activations = self.compiled.activation_elements(self.x)
        itemsize = self._target.dtype.itemsize
        # the operator's chunk holds its forward pass and backward signals, not J
        sizes = (n_outputs, self.n_params, itemsize)
        per_sample, chunk_for = itemsize * (4 * activations + 2 * n_outputs), None
        if jacobian != "operator":  # a chunk of J, too small a budget refused
            per_sample = bytes_per_sample(*sizes, activations)

            def chunk_for(budget):
                return chunk_size_for(budget, *sizes, activations=activations)

        self.plan = plan_chunks(
            n_rows, chunk_size=chunk_size, memory_budget=memory_budget,
            per_sample=per_sample, chunk_for=chunk_for,
        )  # fmt: skip
        self.chunk_size = self.plan.chunk_size
        self.products = None
        if jacobian == "operator":
            self.products = products(
                model,
                variables=self._variables,
                training=training,
                chunk_size=self.chunk_size,
            )

    def set_params(self, theta):
        """Write ``theta`` (length ``n_params``) into the model's variables."""
        theta = np.asarray(theta)
        if theta.shape != (self.n_params,):
            raise ValueError(
                f"theta has shape {theta.shape}, but the model has "
                f"{self.n_params:,} trainable parameters: pass a flat vector of "
                "that length, in flat_params(model) order - start from "
                "problem.theta0."
            )
        set_flat_params(self.model, theta, variables=self._variables)

    def _residuals(self, start, stop):
        outputs = self._target.forward(take(self.x, start, stop)).numpy()
        rows = slice(start * self.n_outputs, stop * self.n_outputs)
        return outputs.astype(np.float64).ravel() - self.y[rows]

    def _jacobian(self, start, stop):
        J = chunked_jacobian(
            self.model,
            take(self.x, start, stop),
            chunk_size=self.chunk_size,
            **self._options,
        )
        return J.reshape(-1, self.n_params).astype(np.float64)

    def fun(self, theta):
        """Residuals ``f(x) - y`` at ``theta``: float64, row ``i*l + k``."""
        self.set_params(theta)
        return self._residuals(0, self.n_samples)

    def jac(self, theta):
        """The (n*l) x m Jacobian of the residuals at ``theta``, float64.

        With ``jacobian="operator"`` a ``LinearOperator`` of the same shape
        (products with J, never J): pass ``tr_solver="lsmr"`` to SciPy. It is
        J at ``theta`` for good, like the formed array: ``fun(trial)`` writes
        the trial's parameters into the model, and an optimizer that rejects
        the trial applies the J of the accepted point again (SciPy does, and
        ``levenberg_marquardt`` too), so each product first checks that the
        model holds ``theta`` and writes back the variables that differ (the
        check reads the variables: about 0.3 ms for a small MLP, a product
        1 ms or more). Applying it leaves ``theta`` in the model; after a fit,
        ``set_params(result.x)`` as always.
        """
        self.set_params(theta)
        if self.products is not None:
            return self._operator_at(theta)
        return self._jacobian(0, self.n_samples)

    def _operator_at(self, theta):
        """``jacobian_operator`` pinned to ``theta`` (see :meth:`jac`)."""
        from scipy.sparse.linalg import LinearOperator

        J = jacobian_operator(self.model, self.x, products=self.products)
        pin = _Pin(self._variables, theta, self._target.dtype)

        def pinned(product):
            def apply(a):
                pin()
                return product(a)

            return apply

        return LinearOperator(
            J.shape,
            matvec=pinned(J.matvec),
            rmatvec=pinned(J.rmatvec),
            matmat=pinned(J.matmat),
            rmatmat=pinned(J.rmatmat),
            dtype=J.dtype,
        )

    def gauss_newton_diagonal(self, theta):
        """diag(J.T @ J) at ``theta``, shape (m,), float64: the exact
        Gauss-Newton diagonal of the residuals (``ggn_diagonal``, notebook
        11), without forming J or JtJ; a preconditioner of
        ``levenberg_marquardt(..., solver="cg")``."""
        self._at_for_curvature(theta, "gauss_newton_diagonal")
        return ggn_diagonal(self.model, self.x, variables=self._variables)

    def gauss_newton_kfac(self, theta):
        """The Kronecker factors of J.T @ J at ``theta`` (``kfac``, notebook
        11; a ``keras.Sequential`` model): a :class:`~jacutil.curvature.kfac.KFAC`
        whose ``inverse_matvec`` preconditions ``levenberg_marquardt(...,
        solver="cg")``."""
        self._at_for_curvature(theta, "gauss_newton_kfac")
        return kfac(self.model, self.x, variables=self._variables)

    def _at_for_curvature(self, theta, what):
        """Write ``theta`` into the model, refusing a problem in training mode:
        the curvature is computed in inference mode."""
        if self._target.training:
            raise ValueError(
                f"{what} runs the model in inference mode, but this problem was "
                "built with training=True: build it without training, or use "
                "levenberg_marquardt without a preconditioner."
            )
        self.set_params(theta)

    def normal_equations(self, theta, checkpoint=None):
        """``(J.T @ J, J.T @ r)`` at ``theta``, summed chunk by chunk.

        Only one chunk of J (``chunk_size`` samples) exists at a time, so this
        works when the whole (n*l) x m Jacobian does not fit in memory. The
        Gauss-Newton step solves ``(JtJ + damping * I) step = -Jtr``.

        ``checkpoint``: a ``.npz`` path where the partial sums are saved after
        each chunk; called again after an interruption with the same theta,
        data and chunk size, it goes on from the next chunk and ends with the
        same sums, bit for bit (notebook ``10-beyond-one-machine``).
        """
        if self.products is not None:
            raise ValueError(
                "normal_equations forms an m x m matrix, which the matrix-free "
                'problem (jacobian="operator") exists to avoid; use '
                'levenberg_marquardt(problem, solver="cg") instead.'
            )
        self.set_params(theta)
        record = checkpoint and fingerprint(
            self.model, self._variables, (self.x, self.y),
            chunk_size=self.chunk_size, training=self._target.training,
        )  # fmt: skip
        return sum_chunks(
            self.plan, self._normal_equations, checkpoint=checkpoint, record=record
        )

    @property
    def n_chunks(self):
        return self.plan.n_chunks

    def chunk_normal_equations(self, k):
        """``J_k.T @ J_k`` and ``J_k.T @ r_k`` of chunk ``k`` at the model's weights."""
        return self._normal_equations(*self.plan.chunk(k))

    def _normal_equations(self, start, stop):
        J = self._jacobian(start, stop)
        return J.T @ J, J.T @ self._residuals(start, stop)


class _Pin:
    """Puts ``theta`` back into ``variables`` where they hold something else.

    A copy of theta, split per variable in the model's dtype; a call reads
    each variable (cheaper than writing it: 0.3 ms against 1.1 ms for all of
    a small MLP) and assigns only those that differ.
    """

    def __init__(self, variables, theta, dtype):
        self.variables = list(variables)
        self.parts, start = [], 0
        for v in self.variables:
            size = size_of(v)
            part = np.asarray(theta[start : start + size]).reshape(tuple(v.shape))
            self.parts.append(part.astype(dtype))  # a copy: theta may change
            start += size

    def __call__(self):
        for v, part in zip(self.variables, self.parts, strict=True):
            if not np.array_equal(v.numpy(), part, equal_nan=True):
                v.assign(part)


def _target_rows(y, n_rows, n_outputs):
    """Targets as (n_samples, n_outputs) float64, the same layout as the rows.

    ``y`` is one array, or for a model with several outputs a list or dict
    like the model's outputs (each leaf flattened per sample and joined in
    ``tf.nest.flatten`` order, dict keys sorted).
    """
    nested = isinstance(y, dict) or (
        isinstance(y, (list, tuple)) and y and all(hasattr(e, "shape") for e in y)
    )
    leaves = tf.nest.flatten(y) if nested else [y]
    try:
        rows = [np.asarray(leaf, np.float64) for leaf in leaves]
        rows = [r.reshape(len(r), -1) if r.ndim else r for r in rows]
        y2d = np.concatenate(rows, axis=1) if nested else rows[0]
    except ValueError:
        y2d = None
    if y2d is None or y2d.shape[:1] != (n_rows,) or y2d[0].size != n_outputs:
        shape = "its leaves" if nested else f"shape {np.shape(y)}"
        raise ValueError(
            f"y has {shape}; the model gives {n_outputs} outputs for each of "
            f"the {n_rows} samples of x, so y should have shape ({n_rows}, "
            f"{n_outputs}), or be a list or dict like the model's outputs with "
            f"{n_rows} samples first in each."
        )
    return y2d.reshape(n_rows, n_outputs)


def least_squares_problem(
    model,
    x,
    y=None,
    *,
    variables=None,
    training=False,
    chunk_size=None,
    memory_budget=None,
    jacobian="formed",
):
    """``fun``, ``jac`` and ``theta0`` for ``scipy.optimize.least_squares``.

    ``fun(theta)`` writes ``theta`` into the model and returns the residuals
    ``f(x) - y`` (float64, length n*l); ``jac(theta)`` returns their (n*l) x m
    Jacobian (float64) from :func:`chunked_jacobian` on the layer rules
    (where the plan is proved on x; else the per-sample stage), whose one
    compiled function is reused by every call: nothing is retraced. Both write theta
    before computing, so the model holds the last point evaluated (or, with
    ``jacobian="operator"``, the point of the last operator applied);
    ``jac`` needs no forward pass of ``fun``, so nothing is cached. After the
    fit, ``set_params(result.x)`` puts the solution into the model (the last
    point SciPy evaluated may be a rejected trial).
    ``normal_equations(theta)`` gives JtJ and Jtr without the whole J.

    ``jacobian="operator"``: ``jac`` returns a ``LinearOperator`` (products
    with J by forward and reverse mode, ``jacutil.matrix_free.products``), for when
    n*l*m numbers do not fit; fit with ``least_squares(..., tr_solver="lsmr")``
    or ``levenberg_marquardt(problem, solver="cg")`` (notebook 09); it stays J
    at ``theta`` (see :meth:`LeastSquaresProblem.jac`).
    Introduced in ``05-scipy-least-squares``.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        x: the n samples, or a dataset of ``model.fit``'s ``(x, y)`` batches
            (then no ``y``), read as ``jacutil.jacobian`` reads it.
        y: the targets, shape (n, l) or the model's output shape per sample.
        variables, training, chunk_size, memory_budget: as
            :func:`chunked_jacobian` takes them (the variables are fitted).
        jacobian: ``"formed"`` (J as an (n*l, m) array) or ``"operator"``.

    Returns:
        A :class:`LeastSquaresProblem`: ``fun(theta)`` (n*l,), ``jac(theta)``
        (n*l, m), ``theta0`` (m,).

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, least_squares_problem
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> problem = least_squares_problem(model, x, np.zeros((4, 2)))
        >>> theta = problem.theta0  # (m,)
        >>> theta.shape, problem.fun(theta).shape, problem.jac(theta).shape
        ((8,), (8,), (8, 8))
    """
    return LeastSquaresProblem(
        model, x, y, variables, training, chunk_size, memory_budget, jacobian
    )


def fit_least_squares(model, x, y=None, **least_squares_options):
    """Fit ``model`` to ``(x, y)`` with ``scipy.optimize.least_squares``.

    ``model``, ``x`` and ``y`` as :func:`least_squares_problem` takes them;
    the options (``method=``, ``max_nfev=``, ...) go to SciPy. The solution is
    written into the model; SciPy's ``OptimizeResult`` is returned
    (``result.x`` has shape (m,)). Introduced in ``05-scipy-least-squares``.
    """
    from scipy.optimize import least_squares

    problem = least_squares_problem(model, x, y)
    result = least_squares(
        problem.fun, problem.theta0, jac=problem.jac, **least_squares_options
    )
    problem.set_params(result.x)
    return result
