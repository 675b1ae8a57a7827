"""The empirical and the Monte Carlo Fisher, and the Hessian's diagonal
(notebook 11-curvature-and-uncertainty).

Both Fishers are sums of outer products of per-sample gradients,
``F = sum_i sum_c (J_i.T r_ic)(J_i.T r_ic).T``; only the rows ``r_ic`` at
the outputs differ:

* the **empirical** Fisher takes one row per sample, the gradient of its
  loss at its *true* target, ``r_i = sqrt(W_i) * dL_i/df_i``;
* the **Monte Carlo** Fisher (BackPACK's ``DiagGGNMC``, curvlinops'
  ``FisherMCLinearOperator``) takes ``mc_samples`` rows per sample, each the
  gradient at a target *drawn from the model's own predictive distribution*
  (``OutputLoss.sample_signals``: ``E[s s.T] = H_i``), divided by
  ``sqrt(mc_samples)``, so that its expectation is G exactly.

``W_i`` (n, l) is each sample's weight per output, ``sample_weight`` times
each head's reduction (``HeadLosses.row_weights``), exactly as G carries it:
for a loss averaged over the batch, F carries the same 1/n. The products
``J_i.T r_ic`` of a chunk come from one backward pass started from the rows
(the layer rules' per-sample machinery, as ``per_sample_gradients`` and
``ggn_diagonal`` use it), or, without rules, from the chunk's per-sample J.
:func:`hessian_diagonal` is the diagonal of the loss's Hessian.
"""

import math

import numpy as np

from ..core._tf import tf
from ..core.arguments import check_memory_budget
from ..core.batch import as_batch, signature, signature_key, take
from ..core.data import read_data
from ..core.formulation import quiet_function
from ..core.planner import bytes_per_sample, plan_chunks, sum_chunks
from ..core.target import variable_list
from ..engine.compiled import compiled_for
from ..rules.walk import OutputRows
from .compiled import curvature_for, curvature_inputs
from .diagonal import OnRules
from .hessian import hessian_operator
from .losses import losses_for
from .output_losses import AutodiffLoss
from .spectra import Estimate, hutchinson_diagonal

EXACT_UP_TO = 2000  # hessian_diagonal(method="auto"): exact up to this many parameters
METHODS = ("auto", "exact", "hutchinson")


class GradientRows(OnRules):
    """``J_i.T r_ic`` of a chunk, compiled once per model, variables, input
    shape and number of rows: ``job(x, rows)``, ``rows`` (n, r, l) NumPy in,
    (n, r, m) NumPy out.

    Args:
        jac: the model's ``CompiledJacobian`` (method ``"rules"``).
    """

    def _on_rules(self, x, rows, plan):
        dtype = self.target.dtype
        specs = [signature(x), tf.TensorSpec([None, *rows.shape[1:]], dtype)]

        def pieces(x, rows):
            self.trace_count += 1  # Python side effect: once per trace
            return plan.tensor(x, OutputRows(rows))

        function = self._functions.get(
            (signature_key(x), rows.shape[1], rows.shape[2]),
            lambda: quiet_function(pieces, input_signature=specs, autograph=False),
        )
        return function(x, tf.constant(rows, dtype)).numpy()

    def _formed(self, x, rows):
        J = np.asarray(self.jac.tensor(x))
        return np.einsum("irk,ikm->irm", rows, J)


class _Fisher:
    """What both Fishers share: the checked inputs, the chunks (sized by the
    memory budget as ``ggn_diagonal`` sizes them) and ``J_i.T r_ic`` per
    chunk. ``rows(start, stop, f)`` gives a chunk's rows (n_c, r, l)."""

    def __init__(
        self, model, x, loss, y, sample_weight, variables, memory_budget, check=None
    ):  # fmt: skip

        self.memory_budget = check_memory_budget(memory_budget)
        x, y, sample_weight = read_data(x, y, sample_weight)
        variables = None if variables is None else variable_list(variables)
        jac = compiled_for(model, variables, False, False, "rules")
        self.target = jac.target
        if check is not None:  # the loss, before y is asked for
            batch = as_batch(x, self.target)
            check(losses_for(loss, model, call=self.target.call, spec=signature(batch)))
        self.given = curvature_inputs(model, self.target, x, loss, y, sample_weight)
        self.job = curvature_for(
            model, variables, ("fisher rows",), lambda _: GradientRows(jac)
        )
        self.n, self.m = self.given.n, self.target.n_params
        self.itemsize = self.target.dtype.itemsize
        self.activations = jac.activation_elements(self.given.batch)

    def plan(self, r):
        """The chunks for r rows per sample (sized as ``ggn_diagonal`` sizes
        its chunks: :func:`jacutil.core.planner.plan_chunks`)."""
        l = self.given.n_outputs  # noqa: E741 (l, as in the design)
        per_sample = bytes_per_sample(
            max(r, l), self.m, self.itemsize, self.activations
        )
        return plan_chunks(
            self.n, per_sample=per_sample, memory_budget=self.memory_budget
        )

    def outputs(self, start, stop):
        """The model's outputs on a chunk, (n_c, l) NumPy."""
        return self.target.forward(take(self.given.batch, start, stop)).numpy()

    def pieces(self, rows, start, stop):
        """``J_i.T r_ic`` of a chunk, (n_c, r, m)."""
        return self.job(take(self.given.batch, start, stop), rows(start, stop))

    def squares(self, rows, r, progress):
        """``sum_i (J_i.T r_ic)^2`` per row c, (r, m), over every chunk."""
        plan = self.plan(r)

        def squares(start, stop):
            piece = self.pieces(rows, start, stop)
            return np.einsum("irm,irm->rm", piece, piece)

        total = sum_chunks(plan, squares, progress=progress)
        self.how = f"{self.job.formulation}; {plan}"
        return total

    def operator(self, rows, r):
        """``F v = sum over chunks of P.T (P v)``, P the chunk's (n_c r, m)
        gradients: held when all n r m numbers fit in the budget, else
        recomputed chunk by chunk in every product."""
        from scipy.sparse.linalg import LinearOperator

        plan = self.plan(r)
        held = None  # chunk start -> its gradients, when all fit in the budget
        if self.n * r * self.m * self.itemsize <= plan.budget:
            held = {a: self.pieces(rows, a, b) for a, b in plan}

        def matmat(V):
            V = np.asarray(V, np.float64).reshape(self.m, -1)

            def product(a, b):
                P = held[a] if held is not None else self.pieces(rows, a, b)
                P = P.reshape(-1, self.m)
                return P.T @ (P @ V)

            return sum_chunks(plan, product)

        def matvec(v):
            return matmat(np.ravel(v))[:, 0]

        return LinearOperator(
            (self.m, self.m), matvec=matvec, rmatvec=matvec, matmat=matmat,
            dtype=np.float64,
        )  # fmt: skip


def _empirical(model, x, y, loss, sample_weight, variables, memory_budget):
    if y is None:
        raise ValueError(
            "the empirical Fisher is made of the gradients at the true targets: "
            "pass y= (one array per output, as model.fit takes them). For the "
            "Fisher without targets use mc_fisher_operator or ggn_operator."
        )
    fisher = _Fisher(model, x, loss, y, sample_weight, variables, memory_budget)
    given = fisher.given
    root = np.sqrt(given.weights)

    def rows(start, stop):
        f = fisher.outputs(start, stop)
        t = [tf.constant(a[start:stop]) for a in given.targets]
        e = given.loss.gradient(f, t)  # dL_i/df_i at the true targets
        return (root[start:stop] * e)[:, None, :]

    return fisher, rows


def empirical_fisher_operator(
    model, x, y, loss="squared_error", *, sample_weight=None, variables=None,
    memory_budget=None,
):  # fmt: skip
    """F = sum_i g_i g_i.T, g_i = J_i.T (sqrt(W_i) dL_i/df_i), a LinearOperator.

    Introduced in ``11-curvature-and-uncertainty``. ``g_i`` is sample i's
    loss gradient at its true target ``y_i``, weighted as G weights
    ``H_i`` (``W_i``: ``sample_weight`` times each head's reduction), so for
    one head ``F = sum_i w_i g_i g_i.T`` with the same 1/n as G for a loss
    averaged over the batch. Unlike G it needs y, and it is not G's
    estimate: near a minimum the gradients are small where G is not.

    **Memory.** ``F v = P.T (P v)`` over chunks of the (n, m) matrix P of the
    gradients ``g_i``: when its n*m numbers fit in ``memory_budget`` they are
    computed once, when the operator is made, and held (each product is then
    two matrix-vector products); otherwise nothing but the outputs' weights
    is held and each product recomputes P one chunk at a time (one backward
    pass per chunk). The operator is of the variables' values when it was
    made.

    Arguments as for ``ggn_operator``, except that ``y`` is needed (one
    array per head as a list or dict like the outputs), and
    ``memory_budget`` (bytes of working memory; default: as
    ``jacutil.jacobian``) takes the place of ``chunk_size``.

    Returns:
        A symmetric positive semi-definite ``LinearOperator`` (m, m), float64.

    Raises:
        ValueError: no y, an unknown loss, y of the wrong shape, a bad
            memory_budget, an empty x, NaN in x or y.

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras
        >>> from jacutil.curvature.fisher import empirical_fisher_operator
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))
        >>> F = empirical_fisher_operator(model, x, np.zeros((4, 2)), "mse")
        >>> F.shape
        (8, 8)
    """
    fisher, rows = _empirical(
        model, x, y, loss, sample_weight, variables, memory_budget
    )
    return fisher.operator(rows, 1)


def empirical_fisher_diagonal(
    model, x, y, loss="squared_error", *, sample_weight=None, variables=None,
    memory_budget=None, progress=False, explain=False,
):  # fmt: skip
    """diag(F) = sum_i g_i * g_i, the empirical Fisher's diagonal, shape (m,).

    Introduced in ``11-curvature-and-uncertainty``. ``g_i`` as for
    :func:`empirical_fisher_operator`; the gradients of one chunk at a time
    (sized by ``memory_budget``) are squared and summed. Arguments as
    :func:`empirical_fisher_operator`, and ``progress`` (a progress bar over
    the chunks) and ``explain`` (also return how it was computed, in words).

    Returns:
        A NumPy array (m,), float64 - or ``(diagonal, how)`` with ``explain``.

    Raises:
        ValueError: as :func:`empirical_fisher_operator`.
    """
    fisher, rows = _empirical(
        model, x, y, loss, sample_weight, variables, memory_budget
    )
    diagonal = fisher.squares(rows, 1, progress)[0]
    return (diagonal, fisher.how) if explain else diagonal


def _count(value, name, least):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a whole number; got {value!r}.")
    if value < least:
        raise ValueError(f"{name} must be at least {least}; got {value}.")
    return int(value)


def _has_likelihood(losses):
    """Refuse a head whose loss is differentiated as given: no targets to draw."""
    for head in losses.heads:
        if isinstance(head, AutodiffLoss):
            head.sample_signals(None, 1, None)  # raises, naming the loss


def _monte_carlo(
    model, x, loss, y, sample_weight, variables, memory_budget, draws, seed
):
    draws = _count(draws, "mc_samples", 1)
    fisher = _Fisher(
        model, x, loss, y, sample_weight, variables, memory_budget, _has_likelihood
    )
    given = fisher.given
    f = np.concatenate([fisher.outputs(a, b) for a, b in fisher.plan(draws)])
    rng = np.random.default_rng(seed)
    signals = given.loss.sample_signals(f, draws, rng)  # (n, draws, l)
    weighted = np.sqrt(given.weights)[:, None, :] * signals / math.sqrt(draws)

    def rows(start, stop):
        return weighted[start:stop]

    return fisher, rows, draws


def mc_fisher_operator(
    model, x, loss="squared_error", *, y=None, sample_weight=None, variables=None,
    mc_samples=1, seed=None, memory_budget=None,
):  # fmt: skip
    """F = sum_i (1/S) sum_s J_i.T W_i s_is s_is.T J_i, E[F] = G, a LinearOperator.

    Introduced in ``11-curvature-and-uncertainty``. The Monte Carlo Fisher
    (curvlinops' ``FisherMCLinearOperator``): for each sample, ``mc_samples``
    targets drawn from the model's own predictive distribution and the
    loss's gradient at the outputs for each, ``s_is``, as
    :meth:`jacutil.curvature.losses.OutputLoss.sample_signals` draws them;
    ``E[s s.T] = H_i``, so the expectation of F is G (``ggn_operator``). The
    draws are made once, with the operator: one fixed matrix of rank at
    most n * mc_samples; the same ``seed`` gives the same operator.

    **Memory.** The draws (n, mc_samples, l) are held; ``F v = P.T (P v)``
    over chunks of the (n * mc_samples, m) matrix P of ``J_i.T s_is``, held
    when it fits in ``memory_budget``, otherwise recomputed one chunk at a
    time in every product.

    Arguments as for :func:`empirical_fisher_operator`, except: ``loss``
    needs a closed form (a loss differentiated as given is refused: no
    likelihood); ``y`` is not used (the targets are drawn; accepted as the
    other curvature entries take it); ``mc_samples``: targets drawn per
    sample (at least 1); ``seed``: the seed of NumPy's generator, or None
    for fresh draws.

    Returns:
        A symmetric positive semi-definite ``LinearOperator`` (m, m), float64.

    Raises:
        ValueError: a loss with no likelihood (``AutodiffLoss``), an unknown
            loss, a bad mc_samples or memory_budget, an empty x, NaN in x.
    """
    fisher, rows, draws = _monte_carlo(
        model, x, loss, y, sample_weight, variables, memory_budget, mc_samples, seed
    )
    return fisher.operator(rows, draws)


def mc_fisher_diagonal(
    model, x, loss="squared_error", *, y=None, sample_weight=None, variables=None,
    mc_samples=1, seed=None, memory_budget=None, progress=False, explain=False,
):  # fmt: skip
    """diag(F) = sum_i (1/S) sum_s (J_i.T sqrt(W_i) s_is)^2, E = diag(G), an Estimate.

    Introduced in ``11-curvature-and-uncertainty``. BackPACK's
    ``DiagGGNMC``: the diagonal of :func:`mc_fisher_operator` (the same
    draws for the same ``seed``), with its standard error over the
    ``mc_samples`` draws - the spread of the per-draw diagonals
    ``sum_i (J_i.T sqrt(W_i) s_is)^2`` divided by ``sqrt(mc_samples)``. Its
    expectation is ``ggn_diagonal``'s exact one. Arguments as
    :func:`mc_fisher_operator` (a standard error needs ``mc_samples=2``), and
    ``progress`` and ``explain`` as :func:`empirical_fisher_diagonal`.

    Returns:
        A :class:`jacutil.curvature.spectra.Estimate`: ``value`` (m,),
        ``standard_error`` (m,) (NaN for one draw), ``n_probes`` the draws -
        or ``(estimate, how)`` with ``explain``.

    Raises:
        ValueError: as :func:`mc_fisher_operator`.
    """
    fisher, rows, draws = _monte_carlo(
        model, x, loss, y, sample_weight, variables, memory_budget, mc_samples, seed
    )
    per_draw = fisher.squares(rows, draws, progress) * draws  # (draws, m)
    value = per_draw.mean(axis=0)
    if draws > 1:
        error = per_draw.std(axis=0, ddof=1) / math.sqrt(draws)
    else:
        error = np.full(fisher.m, np.nan)
    estimate = Estimate(value, error, draws)
    return (estimate, fisher.how) if explain else estimate


def hessian_diagonal(
    model, x, y, loss="squared_error", *, sample_weight=None, variables=None,
    chunk_size=None, method="auto", n_probes=100, seed=0, exact_up_to=EXACT_UP_TO,
):  # fmt: skip
    """diag(H), H = d^2 (sum_i L_i) / d theta^2 of the reduced loss, an Estimate.

    Introduced in ``11-curvature-and-uncertainty``. ``"exact"``: column j of
    ``hessian_operator`` times the unit vector e_j, m Hessian-vector products
    (each a pass over the data), its standard error zero and ``n_probes``
    0. ``"hutchinson"``: ``spectra.hutchinson_diagonal`` over ``n_probes``
    random sign vectors, with its standard error. ``"auto"``: exact when
    ``m <= exact_up_to`` (``EXACT_UP_TO``, 2,000), else Hutchinson - m
    passes over the data against ``n_probes``. The loss
    is weighted as ``hessian_operator`` weights it (``sample_weight`` and
    each head's reduction).

    Args:
        model, x, y, loss, sample_weight, variables, chunk_size: as for
            :func:`jacutil.curvature.hessian.hessian_operator`.
        method: ``"auto"``, ``"exact"`` or ``"hutchinson"``.
        n_probes: Hutchinson's sign vectors (at least 2).
        seed: Hutchinson's seed.
        exact_up_to: the largest m that ``"auto"`` takes exactly.

    Returns:
        A :class:`jacutil.curvature.spectra.Estimate` whose ``value`` is the
        diagonal (m,): exact when ``n_probes == 0`` (``standard_error``
        zeros), else Hutchinson's with its ``standard_error`` (m,).

    Raises:
        ValueError: an unknown method, too few probes, no y, and as
            ``hessian_operator``.
    """
    if method not in METHODS:
        raise ValueError(
            f"method must be one of {', '.join(map(repr, METHODS))}; got {method!r}."
        )
    exact_up_to = _count(exact_up_to, "exact_up_to", 0)
    if method != "exact":
        n_probes = _count(n_probes, "n_probes", 2)
    H = hessian_operator(
        model, x, y, loss, sample_weight=sample_weight, variables=variables,
        chunk_size=chunk_size,
    )  # fmt: skip
    m = H.shape[0]
    if method == "exact" or (method == "auto" and m <= exact_up_to):
        diagonal = np.empty(m)
        unit = np.zeros(m)
        for j in range(m):
            unit[j] = 1.0
            diagonal[j] = H.matvec(unit)[j]
            unit[j] = 0.0
        return Estimate(diagonal, np.zeros(m), 0)
    return hutchinson_diagonal(H, n_probes, seed)
