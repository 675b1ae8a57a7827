"""One entry: ``jacutil.jacobian(model, x)`` picks the path (notebook 00-welcome).

The staged functions (notebooks 01 to 07) are the lessons; this is the one
call to use. It takes, for this model and this size:

1. **forward mode** (``jacutil.matrix_free.forward``) when the outputs outnumber the
   parameters many times over (notebook 09): one JVP per parameter;
2. **the layer rules** (``jacutil.rules``) when the model is a Keras chain
   they can read, in inference mode: each layer writes its own blocks, no
   pfor over the model;
3. otherwise **the compiled per-sample stage** (``tf.vectorized_map`` in a
   ``tf.function``, recurrent layers unrolled; see ``jacutil.core.formulation``);
4. the rules or the compiled stage **in chunks** written into ``out`` when
   the working memory would pass ``memory_budget`` (default: half the
   memory free now), or when ``out`` is given (an array or a memmap).

The compiled functions are cached per model (weakly), so the second call on
the same model traces nothing. ``explain=True`` returns the choice and why.
"""

from dataclasses import dataclass, field, replace

from .core._shared import is_path
from .core.batch import as_batch, n_samples
from .core.data import read_data
from .core.formulation import ForwardModeBlindSpot
from .core.outputs import output_layout
from .core.planner import (
    bytes_per_sample,
    chunk_size_for,
    memory_budget_for,
    plan_chunks,
)
from .core.resume import check_key, recorded_chunk_size
from .core.target import variable_list
from .matrix_free.forward import forward_for
from .stages.chunked import chunked_jacobian
from .stages.compiled import compiled_for


@dataclass
class Choice:
    """Which path ``jacobian`` took, and why. ``print(choice)`` says it in words.

    ``formulation``: how the Jacobian was computed (the compiled stage's);
    ``chunks`` of ``chunk_size`` samples (1 and None: one call);
    ``working_bytes``: the working memory predicted for the call, held to
    ``budget_bytes``.
    """

    path: str  # "layer rules" or "per-sample autodiff"
    why: str
    formulation: str
    layers: list = field(default_factory=list)  # [(layer name, rule)], rules path
    chunks: int = 1
    chunk_size: int | None = None
    working_bytes: int = 0
    budget_bytes: int = 0
    traced: bool = False  # this call traced (compiled) a new function

    def __str__(self):
        lines = [f"path: {self.path} ({self.why})"]
        if self.layers:
            lines += [f"  layer {name}: {rule}" for name, rule in self.layers]
        else:
            lines.append(f"how: {self.formulation}")
        memory = (
            f"working memory about {self.working_bytes / 2**20:,.0f} MiB, "
            f"budget {self.budget_bytes / 2**20:,.0f} MiB"
        )
        if self.chunks > 1:
            lines.append(
                f"chunks: {self.chunks} of {self.chunk_size} samples ({memory})"
            )
        else:
            lines.append(f"one call, no chunks ({memory})")
        lines.append(
            "traced in this call" if self.traced else "compiled function reused"
        )
        return "\n".join(lines)


# Forward mode (one JVP per parameter) beat every reverse-mode path only where
# the outputs outnumber the parameters many times over (notebook 09).
FORWARD_WHEN_OUTPUTS_PER_PARAMETER = 100


RULES_WHY = "every layer has a rule or passes its signal by autodiff"


def choice_for(jac, plan, on_rules, formulation, traced, fallback=None):
    """The :class:`Choice` of a call on ``jac``'s layer rules or its fallback
    (``jacobian`` and the per-sample loss gradients say it the same way),
    for the call's :class:`jacutil.core.planner.Plan`; ``fallback`` says why
    not the layer rules (default ``jac.fallback``)."""
    why = RULES_WHY if on_rules else f"no layer rules: {fallback or jac.fallback}"
    return Choice(
        path="layer rules" if on_rules else "per-sample autodiff",
        why=why,
        formulation=formulation,
        layers=jac.plan.layers() if on_rules else [],
        chunks=plan.n_chunks,
        chunk_size=plan.chunk_size,
        working_bytes=plan.working,
        budget_bytes=plan.budget,
        traced=traced,
    )


def jacobian(
    model,
    x,
    *,
    out=None,
    memory_budget=None,
    variables=None,
    training=False,
    explain=False,
    copy=False,
    progress=False,
    key=None,
):
    """The per-sample Jacobian of ``model`` at ``x`` by the fastest correct path.

    Without ``out`` and in one piece, J is a read-only view of TensorFlow's
    result (a copy would cost as long as the Jacobian on a small network):
    pass ``copy=True`` for an array you may write to. With ``out``, or when
    the working memory would pass ``memory_budget``, the batch runs in
    chunks written into ``out``. Introduced in ``00-welcome``.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        x: the n samples: an array, or a list or dict of arrays for several
            inputs, or a ``tf.data.Dataset`` / ``keras.utils.PyDataset`` of
            ``model.fit``'s batches (``x`` or ``(x, y, ...)``; read once:
            :func:`jacutil.core.data.read_data`).
        out: None, an array or ``np.lib.format.open_memmap`` of shape
            (n, l, m), or a ``.npy`` path: a resumable run, as in
            :func:`jacutil.chunked_jacobian`.
        memory_budget: bytes of working memory before it runs in chunks
            (default: half the memory free now).
        variables: the variables to differentiate (default: the model's
            trainable variables).
        training: run the model in training mode.
        explain: also return a :class:`Choice`: the path, why, each layer's
            rule and the chunks.
        copy: return an array you may write to.
        progress: show a progress bar over chunks.
        key: with ``out=path`` and a callable: a name for what it computes.

    Returns:
        J, shape (n, l, m), columns in ``flat_params`` order; with
        ``explain=True``, ``(J, choice)``.

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, jacobian
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> jacobian(model, x).shape  # (n, l, m): m = 3 * 2 + 2
        (4, 2, 8)
        >>> J, choice = jacobian(model, x, explain=True)
        >>> choice.path
        'layer rules'
    """
    check_key(key, model, out)
    variables = None if variables is None else variable_list(variables)
    x = read_data(x, repeatable=is_path(out))[0]
    jac = compiled_for(model, variables, training, False, "rules", x)
    traces = jac.trace_count
    target = jac.target
    batch = as_batch(x, target)
    n_outputs = output_layout(target, batch).n_outputs
    rows = int(n_samples(batch))
    activations = jac.activation_elements(batch)
    per_sample = bytes_per_sample(
        n_outputs, target.n_params, target.dtype.itemsize, activations
    )
    budget = memory_budget_for(memory_budget, per_sample * rows, explain)
    plan = plan_chunks(
        rows,
        memory_budget=budget,
        per_sample=per_sample,
        chunk_for=lambda budget: chunk_size_for(
            budget,
            n_outputs,
            target.n_params,
            target.dtype.itemsize,
            activations=activations,
        ),
    )
    forward = (
        out is None
        and plan.n_chunks == 1
        and n_outputs >= FORWARD_WHEN_OUTPUTS_PER_PARAMETER * target.n_params
    )
    ran, J = jac, None
    if forward:
        ran = forward_for(model, variables, training)
        traces = ran.trace_count
        try:
            J = ran(batch)
        except ForwardModeBlindSpot:  # forward mode cannot see it: reverse mode
            forward, ran, traces = False, jac, jac.trace_count
    if forward:
        pass  # J came from forward mode, above
    elif out is not None or plan.n_chunks > 1:
        resumable = is_path(out)
        J = chunked_jacobian(
            model, x, chunk_size=None if resumable else plan.chunk_size,
            memory_budget=budget, out=out, progress=progress, variables=variables,
            training=training, method="rules", key=key,
        )  # fmt: skip
        if resumable:  # a resumed file keeps its own chunk size
            plan = replace(plan, chunk_size=recorded_chunk_size(out))
    else:
        J = jac.of_batch(batch, copy=copy)
    if not explain:
        return J
    on_rules = jac.plan is not None and not forward
    choice = choice_for(
        jac, plan, on_rules, jac.formulation or "", ran.trace_count > traces
    )
    if forward:
        choice = replace(
            choice,
            path="forward mode",
            why=f"{n_outputs} outputs, {target.n_params} parameters: "
            "one JVP per parameter",
            formulation="forward mode, vectorized over parameter columns",
        )
    return J, choice
