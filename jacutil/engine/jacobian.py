"""The path choice of ``jacutil.jacobian`` (notebook 00-welcome), on the
engine: for this model and this size, forward mode (when the caller gives
it and the outputs outnumber the parameters many times over), the layer
rules when the model is a chain they read, the compiled per-sample stage
otherwise, in chunks when the working memory would pass the budget or
``out`` is given. ``jacutil.auto.jacobian`` is its public face."""

import time
from dataclasses import replace

from ..core._shared import is_path
from ..core.batch import as_batch, n_samples
from ..core.data import (
    BatchesOfShapes,
    inputs_of,
    is_data_source,
    read_data,
    rows_by_shape,
    stream_rows,
)
from ..core.formulation import ForwardModeBlindSpot
from ..core.outputs import output_layout
from ..core.planner import (
    bytes_per_sample,
    chunk_size_for,
    memory_budget_for,
    plan_chunks,
)
from ..core.resume import check_key, recorded_chunk_size
from ..core.target import variable_list
from .choice import choice_for, spent_since
from .compiled import compiled_for
from .rows import chunked_jacobian

# Forward mode (one JVP per parameter) beat every reverse-mode path only where
# the outputs outnumber the parameters many times over (notebook 09).
FORWARD_WHEN_OUTPUTS_PER_PARAMETER = 100


def best_jacobian(
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
    steps=None,
    forward_for=None,
):
    """``jacutil.jacobian``'s work (its arguments and result), with
    ``steps`` the batches of a dataset to read (as ``model.predict``), and
    ``forward_for(model, variables, training)`` the compiled forward-mode
    Jacobian to consider (None: reverse mode only, as the consumers in the
    engine's layer take it)."""
    start = time.perf_counter()
    check_key(key, model, out)
    variables = None if variables is None else variable_list(variables)

    def group(x, y, sample_weight):  # a batch, or batches of one shape
        return best_jacobian(
            model, x, memory_budget=memory_budget, variables=variables,
            training=training, explain=explain, forward_for=forward_for,
        )  # fmt: skip

    if is_data_source(x) and out is not None and not is_path(out):  # streamed
        return stream_rows(x, group, out, steps=steps, inputs=inputs_of(model),
                           progress=progress)  # fmt: skip
    try:
        x = read_data(x, repeatable=is_path(out), steps=steps,
                      inputs=inputs_of(model))[0]  # fmt: skip
    except BatchesOfShapes as shapes:  # padded_batch: one group at a time
        return rows_by_shape(shapes, group, out, resumable=is_path(out))
    jac = compiled_for(model, variables, training, False, "rules", x)
    traces, before = jac.trace_count, dict(jac.spent)
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
        forward_for is not None
        and out is None
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
        jac, plan, on_rules, jac.formulation or "", ran.trace_count > traces,
        spent=spent_since(jac, before, start),
    )  # fmt: skip
    if forward:
        choice = replace(
            choice,
            path="forward mode",
            why=f"{n_outputs} outputs, {target.n_params} parameters: "
            "one JVP per parameter",
            formulation="forward mode, vectorized over parameter columns",
        )
    return J, choice
