"""Per-sample gradients of a loss, and their norms (notebook 09-matrix-free).

Differential-privacy clipping and influence estimates need, for every
sample i, the gradient of its own loss ``L_i = loss(y_i, f(x_i))`` with
respect to theta: an (n, m) array, the per-sample Jacobian contracted with
``dL_i/df`` - without forming the (n, l, m) Jacobian. On the layer-rules
path (``jacutil.rules``) the backward pass simply starts from ``dL_i/df``
instead of the identity; other models take one gradient per sample in
``tf.vectorized_map``.

For a chain of Dense layers the norms need not even the gradients: a
kernel's per-sample gradient is the outer product ``a delta^T``, whose norm is
``|a| |delta|``, so ``|g_i|^2`` is a sum over layers of
``(|a_i|^2 + 1) |delta_i|^2`` (the 1 for the bias).
"""

import numpy as np

from ..core._shared import joined_gradients, sizes_of
from ..core._tf import tf
from ..core.batch import as_batch, n_samples, pad_with_last
from ..core.cache import compiled_for
from ..core.formulation import (
    PFOR_ERRORS,
    first_line,
    kept_loops,
    new_ops,
    onednn_hazards,
    pfor_failed_when_run,
    quiet_function,
    recurrent_layers,
    unrolled,
    warn_sample_by_sample,
)
from ..core.guards import JacobianError
from ..core.target import watched
from ..rules.dense import DenseRule
from ..rules.engine import LogitsNotOnRules
from ..rules.registry import LogitsSignal


def _losses(loss_fn, y, prediction, n):
    """One loss per sample; a loss with more axes (per time step, say) is
    averaged over them per sample, as Keras averages when it reduces."""
    losses = loss_fn(y, prediction)
    if losses.shape.rank is not None and losses.shape.rank > 1:
        losses = tf.reduce_mean(losses, axis=list(range(1, losses.shape.rank)))
    wrong_length = n is not None and losses.shape[0] not in (None, n)
    if losses.shape.rank != 1 or wrong_length:
        raise JacobianError(
            f"loss_fn returned shape {tuple(losses.shape)}; per-sample gradients need "
            "one loss per sample, shape (n_samples,). Use a loss function that does "
            "not reduce over the batch, e.g. keras.losses.mean_squared_error (the "
            "function), not keras.losses.MeanSquaredError() (which averages)."
        )
    return losses


LOGIT_OPS = ("Softmax", "Sigmoid")


def _logits_of(prediction):
    """The logits a Keras loss reads instead of ``prediction``, or None.

    Keras 3 computes cross-entropy from the logits of a softmax or sigmoid
    output, for accuracy: from ``prediction._keras_logits``, or in a graph
    from the input of the ``Softmax``/``Sigmoid`` op that made it.
    """
    logits = getattr(prediction, "_keras_logits", None)
    if logits is None and not tf.executing_eagerly():
        if getattr(prediction, "op", None) is not None:
            if prediction.op.type in LOGIT_OPS:
                logits = prediction.op.inputs[0]
    return logits


def _signal(loss_fn, y):
    """``prediction -> dL_i / d prediction_i``, shaped (n, 1, *output); or,
    when the loss reads the logits, ``dL_i / d logits_i`` as a LogitsSignal."""

    def signal(prediction):
        logits = _logits_of(prediction)
        with tf.GradientTape() as tape:
            tape.watch(prediction)
            if logits is not None:
                tape.watch(logits)
            losses = _losses(loss_fn, y, prediction, None)
        at_output, at_logits = tape.gradient(
            losses, [prediction, prediction if logits is None else logits]
        )
        if at_output is not None:
            return at_output[:, None]
        if logits is not None and at_logits is not None:
            return LogitsSignal(at_logits[:, None])
        raise JacobianError(
            "loss_fn does not depend on the model's output: check that it is "
            "called as loss_fn(y_true, y_pred)."
        )

    return signal


def _autodiff_gradients(target, x, y, loss_fn, vectorize=True, xla=False):
    """(n, m) by one gradient per sample, vectorized over samples (or, with
    ``vectorize=False``, one after another in ``tf.map_fn``)."""
    tracked = [watched(v) for v in target.variables]
    sizes = sizes_of(target.variables)

    def one(row):
        x_i, y_i = row
        x_i = tf.nest.map_structure(lambda t: t[None], x_i)
        with tf.GradientTape() as tape:
            tape.watch(tracked)
            loss = tf.reduce_sum(_losses(loss_fn, y_i[None], target.call(x_i), 1))
        grads = tape.gradient(loss, tracked)
        return joined_gradients(grads, sizes, loss.dtype)

    if not vectorize:
        signature = tf.TensorSpec([sum(sizes)], target.dtype)
        return tf.map_fn(one, (x, y), fn_output_signature=signature)
    with unrolled(recurrent_layers(target)), new_ops() as created:
        try:
            G = tf.vectorized_map(one, (x, y))
        except PFOR_ERRORS as error:
            if isinstance(error, JacobianError):
                raise
            raise _PforFailed(first_line(error)) from None
    if onednn_hazards(created) and not xla:
        raise _NeedsXla()
    return G


class _PforFailed(Exception):
    """pfor could not vectorize the trace: trace again, sample by sample."""


class _NeedsXla(Exception):
    """The trace holds a batch matmul that oneDNN mishandles
    (``jacutil.core.formulation.onednn_hazards``): trace again under XLA."""


def _dense_norms(plan, x, signal):
    """|g_i| of a Dense chain on flat inputs, without the gradients."""
    a, saved = x, []
    for step in plan.steps:
        a, kept = step.forward(a)
        saved.append(kept)
    delta, total = signal(a), 0.0
    if isinstance(delta, LogitsSignal) and not plan.steps[-1].takes_logits_signal:
        raise LogitsNotOnRules(plan.steps[-1].describe())
    for j in reversed(range(plan.lowest, len(plan.steps))):
        step, wanted = plan.steps[j], plan.wanted[j]
        if not isinstance(step, DenseRule):
            _, delta = step.backward(saved[j], delta, {}, True)
            continue
        inputs, slope = saved[j]
        delta = step.activation.backward(slope, delta)
        squared = tf.reduce_sum(delta * delta, [1, 2])  # |delta_i|^2
        if id(step.layer.kernel) in wanted:
            total += tf.reduce_sum(inputs * inputs, -1) * squared
        if step.bias is not None and id(step.bias) in wanted:
            total += squared
        if j > plan.lowest:
            delta = tf.einsum("nkq,pq->nkp", delta, step.layer.kernel)
    return tf.sqrt(total)


def _flat_input(layer):
    try:
        return len(layer.input.shape) == 2
    except (AttributeError, ValueError):
        return False


def _dense_only(plan):
    """Every layer with weights is a Dense layer on flat inputs."""
    return all(
        isinstance(s, DenseRule) and _flat_input(s.layer)
        for s in plan.steps
        if s.variables
    )


class _Gradients:
    """Everything both functions share: the compiled stage, x and y checked."""

    def __init__(self, model, x, y, variables, training):
        self.jac = compiled_for(model, variables, training, False, "rules", x)
        self.target = self.jac.target
        self.x = as_batch(x, self.target)
        self.rows = int(n_samples(self.x))
        self.y = tf.convert_to_tensor(np.asarray(y), self.target.dtype)
        if self.y.shape.rank == 0 or self.y.shape[0] != self.rows:
            raise ValueError(
                f"y has shape {tuple(self.y.shape)}; it needs one target per sample "
                f"({self.rows} rows, like x)."
            )

        self.plan = self.jac.checked_plan(self.x)  # the rules, proved on x

    def run(self, function):
        return quiet_function(function, autograph=False)(self.x, self.y).numpy()

    def on_rules(self, function):
        """``run(function)``, or None when the top rule cannot start from the
        logits that the loss reads (then autodiff gives the gradients)."""
        try:
            return self.run(function)
        except LogitsNotOnRules:
            return None

    def by_autodiff(self, loss_fn):
        """One gradient per sample, vectorized by pfor - under XLA where the
        trace holds a batch matmul that oneDNN mishandles, one sample at a
        time (``tf.map_fn``) where pfor fails. pfor fails on some graphs with
        one sample (TF 2.21), so a batch of one runs as two copies of it."""
        x, y = self.x, self.y
        if self.rows == 1:
            x, y = pad_with_last(x, 2), tf.concat([y, y], 0)

        def gradients(vectorize, xla=False):
            def traced(x, y):
                return _autodiff_gradients(self.target, x, y, loss_fn, vectorize, xla)

            return quiet_function(traced, autograph=False, jit_compile=xla)

        if kept_loops(self.target):  # pfor cannot vectorize a while_loop
            return gradients(vectorize=False)(x, y).numpy()[: self.rows]
        try:
            try:
                G = gradients(vectorize=True)(x, y)
            except _NeedsXla:
                G = gradients(vectorize=True, xla=True)(x, y)
        except (_PforFailed, tf.errors.InvalidArgumentError) as error:
            if not isinstance(error, _PforFailed) and not pfor_failed_when_run(error):
                raise
            warn_sample_by_sample(first_line(error), stacklevel=3)
            G = gradients(vectorize=False)(x, y)
        return G.numpy()[: self.rows]


def per_sample_gradients(model, loss_fn, x, y, *, variables=None, training=False):
    """The gradient of each sample's own loss, in ``flat_params`` order.

    On the layer-rules path the backward pass starts from ``dL_i/df`` (from
    the logits, where a Keras cross-entropy reads them); otherwise one
    gradient per sample in ``tf.vectorized_map``. Introduced in
    ``09-matrix-free``.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        loss_fn: ``loss_fn(y, prediction)`` returning one loss per sample,
            shape (n,), e.g. ``keras.losses.mean_squared_error``.
        x: the n samples.
        y: the targets, one per sample.
        variables: the variables to differentiate (default: trainable ones).
        training: run the model in training mode.

    Returns:
        A NumPy array of shape (n, m).

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, per_sample_gradients
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> mse = keras.losses.mean_squared_error
        >>> per_sample_gradients(model, mse, x, np.zeros((4, 2))).shape  # (n, m)
        (4, 8)
    """
    job = _Gradients(model, x, y, variables, training)
    plan = job.plan
    if plan is not None:
        G = job.on_rules(lambda x, y: plan.tensor(x, _signal(loss_fn, y))[:, 0])
        if G is not None:
            return G
    return job.by_autodiff(loss_fn)


def per_sample_gradient_norms(model, loss_fn, x, y, *, variables=None, training=False):
    """(n,): the norm of each sample's loss gradient (what DP clipping needs).

    For a chain of Dense layers on flat inputs, computed without the
    gradients (``|a|^2 |delta|^2`` per layer); for any other model, the norms
    of :func:`per_sample_gradients`. Introduced in ``09-matrix-free``.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        loss_fn: ``loss_fn(y, prediction)`` with one loss per sample.
        x: the n samples.
        y: the targets, one per sample.
        variables: the variables differentiated (default: trainable ones).
        training: run the model in training mode.

    Returns:
        A NumPy array of shape (n,).
    """
    job = _Gradients(model, x, y, variables, training)
    plan = job.plan
    flat = not isinstance(job.x, (list, tuple, dict)) and job.x.shape.rank == 2
    if plan is not None and flat and _dense_only(plan):
        norms = job.on_rules(lambda x, y: _dense_norms(plan, x, _signal(loss_fn, y)))
        if norms is not None:
            return norms
    G = per_sample_gradients(
        model, loss_fn, x, y, variables=variables, training=training
    )
    return np.linalg.norm(G, axis=1)
