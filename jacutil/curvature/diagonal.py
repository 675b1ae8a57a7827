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
from tqdm.auto import tqdm

from ..core._tf import tf
from ..core.batch import as_batch, n_samples, signature, take
from ..core.formulation import quiet_function
from ..rules.engine import OutputRows
from .losses import output_loss


class DiagonalOfG:
    """The compiled diagonal of G of one model, loss and variables.

    Args:
        jac: the model's ``CompiledJacobian`` (method ``"rules"``).
        loss: an :class:`jacutil.curvature.losses.OutputLoss`.
    """

    def __init__(self, jac, loss):
        self.jac = jac
        self.target = jac.target
        self.loss = loss
        self._functions = {}
        self.formulation = None
        self.trace_count = 0

    def _signal(self, x):
        """The signals ``S_i.T`` as rows (n, l, l), or None for the identity."""
        if self.loss.name == "squared_error":
            return None
        S = self.loss.sqrt_hessian_tf(self.target.forward(x))
        return OutputRows(tf.transpose(S, [0, 2, 1]))

    def _on_rules(self, x, plan):
        key = tuple((tuple(t.shape[1:]), t.dtype.name) for t in tf.nest.flatten(x))
        if key not in self._functions:

            def squares(x):
                self.trace_count += 1  # Python side effect: once per trace
                return plan.squared_columns(x, self._signal(x))

            self._functions[key] = quiet_function(
                squares, input_signature=[signature(x)], autograph=plan.user_code
            )
        return self._functions[key](x).numpy()

    def _formed(self, x):
        J = np.asarray(self.jac.tensor(x))  # the compiled stage's per-sample J
        if self.loss.name != "squared_error":
            S = self.loss.sqrt_hessian(self.target.forward(x).numpy())
            J = np.einsum("ikc,ikm->icm", S, J)
        return np.einsum("icm,icm->m", J, J)

    def __call__(self, x):
        """The diagonal of one checked chunk's G, a NumPy array (m,)."""
        plan = self.jac.checked_plan(x)
        if plan is not None:
            self.formulation = plan.describe() + ", started from sqrt(H)"
            return self._on_rules(x, plan)
        self.formulation = (
            "the per-sample J of each chunk, contracted with sqrt(H) "
            f"(no layer rules: {self.jac.fallback})"
        )
        return self._formed(x)


def ggn_diagonal(
    model, x, loss="squared_error", *, variables=None, memory_budget=None,
    progress=False, explain=False,
):  # fmt: skip
    """The exact diagonal of G = sum_i J_i.T H_i J_i, shape (m,).

    Introduced in ``11-curvature-and-uncertainty``. On the layer rules the
    backward pass starts from a square root of each sample's ``H_i`` (one
    signal per output) and the blocks are squared and summed inside the
    compiled graph; elsewhere from each chunk's formed per-sample J.

    Args:
        model: a Keras model (for a cross-entropy: one that outputs logits),
            or a callable ``f(x)`` with ``variables=``.
        x: the n samples.
        loss: ``"squared_error"``, ``"softmax_cross_entropy"`` or
            ``"sigmoid_cross_entropy"``.
        variables: the variables (default: the trainable ones).
        memory_budget: bytes of working memory per chunk (default: as
            ``jacutil.jacobian``).
        progress: show a progress bar over the chunks.
        explain: also return how it was computed, in words.

    Returns:
        A NumPy array (m,), float64 - or ``(diagonal, how)`` with ``explain``.

    Raises:
        ValueError: an unknown loss, or a cross-entropy on a model that ends
            in a softmax or sigmoid.
        jacutil.core.guards.JacobianError: no variable reaches the outputs.
    """
    from ..auto import memory_budget_for
    from ..core.cache import compiled_for, curvature_for
    from ..core.outputs import output_layout
    from ..core.target import variable_list
    from ..stages.chunked import bytes_per_sample

    loss = output_loss(loss, model)
    variables = None if variables is None else variable_list(variables)
    jac = compiled_for(model, variables, False, False, "rules")
    target = jac.target
    batch = as_batch(x, target)
    rows = int(n_samples(batch))
    job = curvature_for(
        model,
        variables,
        ("diagonal", loss.name, loss.classes),
        lambda _: DiagonalOfG(jac, loss),
    )
    n_outputs = output_layout(target, batch).n_outputs  # known after the first call
    per_sample = bytes_per_sample(
        n_outputs,
        target.n_params,
        target.dtype.itemsize,
        jac.activation_elements(batch),
    )
    budget = memory_budget_for(memory_budget, per_sample * rows)
    chunk = max(1, min(rows, budget // max(per_sample, 1)))
    total = np.zeros(target.n_params)
    starts = range(0, rows, chunk)
    for start in tqdm(starts, disable=not progress, unit="chunk"):
        total += job(take(batch, start, min(start + chunk, rows)))
    if explain:
        return total, f"{job.formulation}; {len(starts)} chunk(s) of {chunk} samples"
    return total
