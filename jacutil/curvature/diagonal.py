"""The exact diagonal of the Gauss-Newton matrix
(notebook 11-curvature-and-uncertainty).

``diag(G)[p] = sum_i sum_c (S_i[:, c] . J_i[:, p])^2`` with ``H_i = S_i S_i.T``
(``jacutil.curvature.losses``): each column of ``S_i`` is a signal that the
backward pass starts from, instead of the identity rows that give J. On the
layer rules (``jacutil.rules``) the backward pass runs once per chunk with
the l signals of every sample, and each layer's blocks are squared and summed
over samples and signals inside it (``Rule.backward_squares``) - the
(n, l, m) Jacobian of a chunk is never formed whole. A Dense layer on flat
inputs forms no block at all: its kernel's entry (j, k) is
``sum_i a_ij^2 sum_c delta_ick^2``, one product of the squared inputs with
the squared signals, as BackPACK's ``DiagGGNExact`` does for ``nn.Linear``.
Where the rules do not apply, each chunk's per-sample J is formed by the
compiled stage and contracted with ``S``: the same numbers. Both run in
chunks sized by the memory budget.
"""

import numpy as np

from ..core._tf import tf
from ..core.arguments import check_memory_budget
from ..core.batch import signature, take
from ..core.cache import PerSignature
from ..core.data import read_data
from ..core.formulation import quiet_function
from ..core.planner import bytes_per_sample, plan_chunks, sum_chunks
from ..core.target import variable_list
from ..engine.compiled import compiled_for
from ..rules.walk import OutputRows
from .compiled import curvature_for, curvature_inputs


class OnRules:
    """One chunk's piece of curvature, compiled on the layer rules once per
    input shape (``_on_rules(x, *args, plan)``), or, where the rules do not
    apply, from the chunk's formed per-sample J (``_formed(x, *args)``).
    ``formulation`` says which, in words.

    Args:
        jac: the model's ``CompiledJacobian`` (method ``"rules"``).
    """

    start = "the rows"  # what the backward pass starts from, in words

    def __init__(self, jac):
        self.jac = jac
        self.target = jac.target
        self._functions = PerSignature()
        self.formulation = None
        self.trace_count = 0

    def __call__(self, x, *args):
        """The piece of one checked chunk ``x``, NumPy."""
        plan = self.jac.checked_plan(x)
        if plan is not None:
            self.formulation = f"{plan.describe()}, started from {self.start}"
            return self._on_rules(x, *args, plan)
        self.formulation = (
            f"the per-sample J of each chunk, contracted with {self.start} "
            f"(no layer rules: {self.jac.fallback})"
        )
        return self._formed(x, *args)


class DiagonalOfG(OnRules):
    """The compiled diagonal of G of one model, loss and variables, (m,) per
    chunk: ``job(x, w, t)`` with ``w`` the weights (n, l) or None for the
    identity H, and ``t`` the heads' targets or None.

    Args:
        jac: the model's ``CompiledJacobian`` (method ``"rules"``).
        loss: a :class:`jacutil.curvature.losses.HeadLosses`.
    """

    start = "sqrt(H)"

    def __init__(self, jac, loss):
        super().__init__(jac)
        self.loss = loss

    def _signal(self, x, w, t):
        """The signals ``(sqrt(W_i) S_i).T`` as rows (n, l, l), or None for
        the identity (w None)."""
        if w is None:
            return None
        S = self.loss.sqrt_hessian_tf(self.target.forward(x), t)
        S = tf.sqrt(w)[:, :, None] * S
        return OutputRows(tf.transpose(S, [0, 2, 1]))

    def _on_rules(self, x, w, t, plan):
        key = (
            tuple((tuple(s.shape[1:]), s.dtype.name) for s in tf.nest.flatten(x)),
            None if w is None else w.shape[1],
            None if t is None else tuple(a.shape[1] for a in t),
        )
        dtype = self.target.dtype
        specs, args = [signature(x)], [x]
        if w is not None:
            specs.append(tf.TensorSpec([None, w.shape[1]], dtype))
            args.append(tf.constant(w))
        if t is not None:
            specs.append([tf.TensorSpec([None, a.shape[1]], dtype) for a in t])
            args.append([tf.constant(a) for a in t])

        def squares(x, w=None, t=None):
            self.trace_count += 1  # Python side effect: once per trace
            return plan.squared_columns(x, self._signal(x, w, t))

        function = self._functions.get(
            key,
            lambda: quiet_function(squares, input_signature=specs, autograph=False),
        )
        return function(*args).numpy()

    def _formed(self, x, w, t):
        J = np.asarray(self.jac.tensor(x))  # the compiled stage's per-sample J
        if w is not None:
            f = self.target.forward(x)
            t = None if t is None else [tf.constant(a) for a in t]
            S = self.loss.sqrt_hessian_tf(f, t).numpy() * np.sqrt(w)[:, :, None]
            J = np.einsum("ikc,ikm->icm", S, J)
        return np.einsum("icm,icm->m", J, J)


def ggn_diagonal(
    model, x, loss="squared_error", *, y=None, sample_weight=None, variables=None,
    memory_budget=None, progress=False, explain=False,
):  # fmt: skip
    """The exact diagonal of G = sum_i w_i J_i.T H_i J_i, shape (m,).

    Introduced in ``11-curvature-and-uncertainty``. On the layer rules the
    backward pass starts from a square root of each sample's ``H_i`` (one
    signal per output) and the blocks are squared and summed inside the
    compiled graph; elsewhere from each chunk's formed per-sample J.

    Arguments as :func:`jacutil.curvature.ggn.ggn_operator`, with
    ``memory_budget`` (bytes of working memory per chunk; default: as
    ``jacutil.jacobian``) in place of ``chunk_size``, ``progress`` (a
    progress bar over the chunks) and ``explain`` (also return how it was
    computed, in words).

    Returns:
        A NumPy array (m,), float64 - or ``(diagonal, how)`` with ``explain``.

    Raises:
        ValueError: an unknown loss, a cross-entropy on a head that outputs
            probabilities, a bad memory_budget, an empty x, NaN in x or y.
        jacutil.core.guards.JacobianError: no variable reaches the outputs.
    """
    memory_budget = check_memory_budget(memory_budget)
    x, y, sample_weight = read_data(x, y, sample_weight)
    variables = None if variables is None else variable_list(variables)
    jac = compiled_for(model, variables, False, False, "rules")
    target = jac.target
    given = curvature_inputs(model, target, x, loss, y, sample_weight)
    batch, rows, n_outputs = given.batch, given.n, given.n_outputs
    identity = given.trivial_weights() and all(
        h.name == "squared_error" and h.scale == 1 for h in given.loss.heads
    )
    w = None if identity else given.weights
    t = given.targets if given.loss.needs_targets else None
    job = curvature_for(
        model,
        variables,
        ("diagonal", given.loss.key),
        lambda _: DiagonalOfG(jac, given.loss),
    )
    per_sample = bytes_per_sample(
        n_outputs,
        target.n_params,
        target.dtype.itemsize,
        jac.activation_elements(batch),
    )
    plan = plan_chunks(rows, per_sample=per_sample, memory_budget=memory_budget)
    total = sum_chunks(
        plan,
        lambda start, stop: job(
            take(batch, start, stop),
            None if w is None else w[start:stop],
            None if t is None else [a[start:stop] for a in t],
        ),
        progress=progress,
    )
    if explain:
        return total, f"{job.formulation}; {plan}"
    return total
