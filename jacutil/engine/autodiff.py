"""The autodiff formulations of the per-sample Jacobian, in a graph.

What stage 2 teaches (notebook 02-vectorized) and every compiled path runs:
``tape.jacobian`` over the whole batch (quadratic in n) and a one-sample
Jacobian vectorized over samples (``tf.vectorized_map``, linear in n), with
the fallbacks of :mod:`jacutil.core.formulation` (recurrent layers unrolled,
``tf.map_fn`` where pfor cannot vectorize).
"""

import functools

from ..core._shared import few_names
from ..core._tf import tf
from ..core.batch import n_samples, pad_with_last
from ..core.formulation import (
    PFOR_ERRORS,
    UNDER_XLA,
    XLA_ERRORS,
    first_line,
    kept_loops,
    map_fn_jacobian,
    pfor_failed_when_run,
    quiet_function,
    recurrent_layers,
    unrolled,
    vectorize,
    warn_sample_by_sample,
)
from ..core.guards import JacobianError, random_layers
from ..core.target import stack_columns


def batch_tape_jacobian(target, x):
    """(n, l, m) tensor: ``tape.jacobian`` of the whole batch's outputs.

    Args:
        target: what is differentiated (``jacutil.core.target``).
        x: the n samples, as a batch.

    Returns:
        A tensor of shape (n, l, m).
    """
    with tf.GradientTape() as tape:
        target.watch(tape)
        y = target.forward(x)
    jacobians = tape.jacobian(y, target.variables)
    return stack_columns(jacobians, target.variables, n_samples(x))


def per_sample_tape_jacobian(target, x):
    """(n, l, m) tensor: a one-sample Jacobian, vectorized over samples.

    Args:
        target: what is differentiated (``jacutil.core.target``).
        x: the n samples, as a batch.

    Returns:
        A tensor of shape (n, l, m).
    """

    def one_sample(xi):
        xi = tf.nest.map_structure(lambda t: t[None], xi)  # a batch of one
        return batch_tape_jacobian(target, xi)[0]  # (l, m)

    return tf.vectorized_map(one_sample, x)


def _padded_per_sample(target, x):
    """pfor's unrolled recurrent gradient fails at run time on a batch of one
    sample (TF 2.21): run one copy of the last sample more, and drop it."""
    rows = n_samples(x)
    return per_sample_tape_jacobian(target, pad_with_last(x, rows + 1))[:rows]


def _in_a_graph(method):
    """Eagerly, trace ``method(target, x, xla)`` in a new tf.function first:
    the graph is what tells the formulation (pfor's limits, oneDNN hazards)."""

    def run(target, x, xla=False):
        if not tf.executing_eagerly():
            return method(target, x, xla)
        said = {}

        def traced(x):
            J, said["formulation"] = method(target, x, xla)
            return J

        try:
            return quiet_function(traced)(x), said["formulation"]
        except XLA_ERRORS as error:  # pfor's graph, or XLA's compile, failed
            if not (pfor_failed_when_run(error) or UNDER_XLA in said["formulation"]):
                raise
            reason = first_line(error)
        if not said["formulation"].startswith("tf.map_fn"):  # not said yet
            warn_sample_by_sample(reason)
        J = quiet_function(lambda x: map_fn_jacobian(target, x))(x)
        return J, f"tf.map_fn over samples: pfor failed when run ({reason})"

    return functools.wraps(method)(run)


@_in_a_graph
def per_sample_tensor(target, x, xla=False):
    """The per-sample Jacobian of ``x`` and the formulation that computed it.

    Returns ``(tensor, formulation)``: ``tf.vectorized_map`` (recurrent
    layers unrolled) when pfor can vectorize the model, ``tf.map_fn``
    otherwise; ``xla`` says the caller compiles with XLA already.
    Introduced in ``08-your-own-model``.
    """
    random = random_layers(target.layers) if target.training else []
    if random:
        return map_fn_jacobian(target, x), (
            "tf.map_fn over samples: random layers in training mode "
            f"({few_names(random)}) draw one mask per sample"
        )
    kept = kept_loops(target)
    if kept:  # pfor cannot vectorize a while_loop's gradient
        return map_fn_jacobian(target, x), (
            "tf.map_fn over samples: recurrent layers that keep their loop "
            f"({few_names(layer.name for layer in kept)})"
        )
    rnns = recurrent_layers(target)
    formulation = ["tf.vectorized_map over samples"]
    if rnns:
        names = few_names(layer.name for layer in rnns)
        formulation.append(f"recurrent layers unrolled while traced ({names})")
    jacobian = _padded_per_sample if rnns else per_sample_tape_jacobian
    try:
        with unrolled(rnns):
            J, notes = vectorize(jacobian, target, x, xla)
        return J, "; ".join(formulation + notes)
    except PFOR_ERRORS as error:
        if isinstance(error, JacobianError):
            raise
        reason = first_line(error)
    warn_sample_by_sample(reason)
    return map_fn_jacobian(target, x), f"tf.map_fn over samples: pfor failed ({reason})"


@_in_a_graph
def batch_tensor(target, x, xla=False):
    """``(J, formulation)`` by ``tape.jacobian`` over the batch; arguments as
    :func:`per_sample_tensor`."""
    J, notes = vectorize(batch_tape_jacobian, target, x, xla)
    return J, "; ".join(["tape.jacobian over the batch", *notes])
