"""Per-sample gradients of a loss, and their norms (notebook 09-matrix-free).

Differential-privacy clipping and influence estimates need, for every
sample i, the gradient of its own loss ``L_i = loss(y_i, f(x_i))`` with
respect to theta: an (n, m) array, the per-sample Jacobian contracted with
``dL_i/df`` - without forming the (n, l, m) Jacobian; the norms need not even
the gradients where a rule knows how (see each entry). Both are compiled once
per model, loss and variables (:class:`LossGradients`, cached by
:func:`gradients_for`): the call a training loop repeats traces nothing, and
a batch larger than the memory budget runs in chunks.
"""

import time
import weakref

import numpy as np

from ..core import cache
from ..core._shared import joined_gradients, sizes_of
from ..core._tf import tf
from ..core.arguments import refuse_non_finite
from ..core.batch import (
    as_batch,
    n_samples,
    pad_with_last,
    signature,
    signature_key,
    take,
)
from ..core.data import BatchesOfShapes, inputs_of, read_data, rows_by_shape
from ..core.formulation import (
    PFOR_ERRORS,
    Ladder,
    NeedsXla,
    PforFailed,
    first_line,
    kept_loops,
    new_ops,
    onednn_hazards,
    quiet_function,
    recurrent_layers,
    unrolled,
)
from ..core.guards import JacobianError
from ..core.planner import bytes_per_sample, plan_chunks, run_chunks
from ..core.target import watched
from ..engine.choice import choice_for, spent_since
from ..engine.compiled import bucket_size, compiled_for
from ..rules.logits import logits_of
from ..rules.registry import LogitsSignal
from ..rules.walk import LogitsNotOnRules


def losses_per_sample(loss_fn, y, prediction, n):
    """One loss per sample; a loss with more axes (per time step, say) is
    averaged over them per sample, as Keras averages when it reduces."""
    losses = loss_fn(y, prediction)
    if losses.shape.rank is not None and losses.shape.rank > 1:
        losses = tf.reduce_mean(losses, axis=list(range(1, losses.shape.rank)))
    wrong_rank = losses.shape.rank != 1
    if wrong_rank or (n is not None and losses.shape[0] not in (None, n)):
        raise JacobianError(
            f"loss_fn returned shape {tuple(losses.shape)}; per-sample gradients "
            "(and DP-SGD's clipping) need one loss per sample, shape (n_samples,). "
            "Use a loss that does not reduce over the batch, e.g. the function "
            "keras.losses.mean_squared_error or keras.losses.MeanSquaredError("
            "reduction=None), not keras.losses.MeanSquaredError() (which averages)."
        )
    return losses


def loss_signal(loss_fn, y):
    """``prediction -> dL_i / d prediction_i``, shaped (n, 1, *output); or,
    when the loss reads the logits, ``dL_i / d logits_i`` as a LogitsSignal.

    A loss may read both the probabilities and Keras's cached logits (a focal
    loss weights the cross-entropy of the logits by the probabilities): then
    the signal at the probabilities is carried down to the logits too, so
    that the signal at the logits holds every path the loss reads.
    """

    def signal(prediction):
        logits = logits_of(prediction)
        watched = [prediction] if logits is None else [prediction, logits]
        with tf.GradientTape() as tape:
            tape.watch(watched)
            losses = losses_per_sample(loss_fn, y, prediction, None)
        found = tape.gradient(losses, watched)
        # a loss that gathers (per sample, in vectorized_map) gives slices
        at_output, *at_logits = [None if g is None else tf.convert_to_tensor(g)
                                 for g in found]  # fmt: skip
        at_logits = at_logits[0] if at_logits else None
        if at_logits is None:
            if at_output is None:
                raise JacobianError(
                    "loss_fn does not depend on the model's output: check that "
                    "it is called as loss_fn(y_true, y_pred)."
                )
            return at_output[:, None]
        if at_output is not None:  # both paths: the probabilities' too
            at_logits = at_logits + _down_to_logits(prediction, logits, at_output)
        return LogitsSignal(at_logits[:, None])

    return signal


def _down_to_logits(prediction, logits, at_output):
    """``at_output`` (a signal at the softmax's or sigmoid's output) carried
    back through the activation to its logits, in the traced graph."""
    if tf.executing_eagerly():  # no graph to follow: autodiff of the whole model
        raise LogitsNotOnRules("the loss reads both the output and its logits")
    (below,) = tf.gradients(prediction, logits, grad_ys=at_output)
    if below is None:
        raise LogitsNotOnRules("the output does not depend on its logits")
    return below


def _autodiff_gradients(target, x, y, loss_fn, vectorize=True, xla=False):
    """(n, m) by one gradient per sample, vectorized over samples (or, with
    ``vectorize=False``, one after another in ``tf.map_fn``)."""
    tracked = [watched(v) for v in target.variables]
    sizes = sizes_of(target.variables)

    def one(row):
        x_i, y_i = tf.nest.map_structure(lambda t: t[None], row)
        of_sample = getattr(loss_fn, "of_sample", None)
        with tf.GradientTape() as tape:
            tape.watch(tracked)
            prediction = target.call(x_i)
            if getattr(loss_fn, "reads_forward", False):  # model.losses too
                loss = of_sample(x_i, y_i, prediction)
            else:
                loss = tf.reduce_sum(losses_per_sample(loss_fn, y_i, prediction, 1))
        grads = tape.gradient(loss, tracked)
        return joined_gradients(grads, sizes, target.dtype)

    if not vectorize:
        signature = tf.TensorSpec([sum(sizes)], target.dtype)
        return tf.map_fn(one, (x, y), fn_output_signature=signature)
    with unrolled(recurrent_layers(target)), new_ops() as created:
        try:
            G = tf.vectorized_map(one, (x, y))
        except PFOR_ERRORS as error:
            if isinstance(error, JacobianError):
                raise
            raise PforFailed(first_line(error)) from None
    if onednn_hazards(created) and not xla:
        raise NeedsXla()
    return G


# The norms on Dense layers (``Rule.fast_under_xla``) are a few small products
# per layer: up to this many rows, XLA fuses them, and a call costs about a
# third of the same graph without XLA (the question's MLP at n = 1,000).
# Larger batches run without XLA: its products are slower there, and each new
# size would compile again. Convolutions and recurrences are about 2x slower
# under XLA at any size (the bench's CNN and LSTM): they never use it.
XLA_NORMS_ROWS = 1024


class LossGradients:
    """Per-sample gradients of one loss, and their norms, compiled once.

    One object per model, loss function, variables and ``training``
    (:func:`gradients_for` keeps it as long as the model
    lives): each input shape traces once (``trace_count``), then every call
    reuses the graph - a training loop's second step traces nothing. The
    layer rules run when the plan is proved on the batch's shape
    (``CompiledJacobian.checked_plan``); otherwise one gradient per sample,
    vectorized by pfor, under XLA where oneDNN would mishandle the trace, or
    one sample at a time where pfor fails (``ladder``, a
    :class:`jacutil.core.formulation.Ladder`). ``jac`` is the model's
    :class:`jacutil.engine.compiled.CompiledJacobian` with ``method="rules"``;
    ``loss_fn(y, prediction)``, one loss per sample, is held weakly: the cache
    never keeps a closure (or what it captures) alive.
    """

    def __init__(self, jac, loss_fn):
        self.jac = jac
        self.target = jac.target
        try:
            self._loss = weakref.ref(loss_fn)
        except TypeError:  # a builtin: held (it captures nothing)
            self._loss = lambda: loss_fn
        self.trace_count = 0
        self.formulation = None  # how the last call computed, in words
        self.ladder = Ladder(  # keyed by (what, x and y signatures)
            lambda key, mode, xla, x, y: self._build(key[0], mode, xla, x, y),
            jac.checked_plan,
            pfor=not kept_loops(self.target),  # pfor cannot vectorize a loop
            not_on_rules=LogitsNotOnRules,
            eager=lambda key, x, y: self._compute(key[0], Ladder.RULES, x, y),
        )

    @property
    def loss_fn(self):
        """The loss function (None once it is gone)."""
        return self._loss()

    def __call__(self, x, y, what="gradients"):
        """Gradients (n, m) or norms (n,) (``what="norms"``) of ``x`` checked
        by ``as_batch`` and targets ``y`` (:func:`prepared`), as a read-only
        NumPy view of TensorFlow's result."""
        rows = int(n_samples(x))
        if rows == 1:  # pfor fails on some graphs with one sample (TF 2.21)
            x, y = pad_with_last(x, 2), pad_with_last(y, 2)
        key = (what, signature_key(x), signature_key(y))
        xla = (Ladder.RULES,) if self._norms_under_xla(key, x, rows) else ()
        if xla:  # padded to a power of two: at most log2(XLA_NORMS_ROWS) compiles
            padded = bucket_size(rows, XLA_NORMS_ROWS)
            x, y = pad_with_last(x, padded), pad_with_last(y, padded)
        with self.jac.timed_call(self):
            result, mode, under_xla = self.ladder(key, (x, y), xla)
        under, rules = ", under XLA" if under_xla else "", mode == Ladder.RULES
        self.formulation = self.jac.plan.describe() + under if rules else mode
        return np.asarray(result)[:rows]  # a view: no eager slicing op

    def norms_graph(self, x, y):
        """The norms of a batch like ``(x, y)`` as a plain ``tf.function``
        that another compiled function can call, or None.

        Only where an earlier call on this signature ran on the layer rules
        and the batch has two rows or more: the other modes (XLA, pfor, one
        sample at a time) are chosen by an eager call that can fall back.
        ``DPSGD.sampled_step`` fuses it into its compiled step. ``x``, ``y``
        as :func:`prepared` gives them; ``f(x, y)`` gives norms (rows,).
        """
        key = ("norms", signature_key(x), signature_key(y))
        if self.ladder.modes.get(key) != Ladder.RULES or int(n_samples(x)) < 2:
            return None
        return self.ladder.function(key, Ladder.RULES, False, (x, y)).function

    def _norms_under_xla(self, key, x, rows):
        return (
            key[0] == "norms"
            and self.ladder.mode(key, x) == Ladder.RULES
            and rows <= XLA_NORMS_ROWS
            and key not in self.ladder.without_xla
            and all(
                step.fast_under_xla
                for step in self.jac.plan.steps
                if step.variables or step.runs_user_code
            )
        )

    def _compute(self, what, mode, x, y):
        """The gradients or norms of ``(x, y)`` in ``mode``: what a trace
        holds, or (the layer rules, a first call) what runs eagerly."""
        if mode == Ladder.RULES and getattr(self.loss_fn, "reads_forward", False):
            # the rules start from the output: losses added inside the
            # model (or a loss the model computes itself) need autodiff
            raise LogitsNotOnRules("each sample's loss reads its forward pass")
        signal = loss_signal(self.loss_fn, y)
        plan = self.jac.plan
        if mode == Ladder.RULES and what == "norms":
            return tf.sqrt(plan.squared_norms(x, signal)[:, 0])
        if mode == Ladder.RULES:
            return plan.tensor(x, signal)[:, 0]
        G = _autodiff_gradients(
            self.target,
            x,
            y,
            self.loss_fn,
            vectorize=mode != Ladder.MAP_FN,
            xla=mode == Ladder.UNDER_XLA,
        )
        return tf.norm(G, axis=1) if what == "norms" else G

    def _build(self, what, mode, xla, x, y):
        def traced(x, y):
            self.trace_count += 1  # Python side effect: runs once per trace
            return self._compute(what, mode, x, y)

        specs = [signature(x), signature(y)]
        return quiet_function(
            traced,
            input_signature=specs,
            jit_compile=xla,
            autograph=False,
        )


def _targets(y, target, rows):
    """``y`` as tensors, one row per sample: an array, or a list or dict of
    arrays (one per head, as ``model.fit`` takes them), given to ``loss_fn``
    as that structure, in the variables' dtype."""

    def leaf(value, name):
        try:
            array = np.asarray(value)
        except ValueError as error:
            raise ValueError(
                f"{name} could not be read as one array ({error}). For a model "
                "of several outputs pass y as a list (or dict) of arrays, one "
                "per head, each with one row per sample, as model.fit takes it."
            ) from None
        if array.dtype.kind not in "biuf":
            raise TypeError(f"{name} must hold numbers; its dtype is {array.dtype}.")
        if array.ndim == 0 or array.shape[0] != rows:
            raise ValueError(
                f"{name} has shape {array.shape}; it needs one target per sample "
                f"({rows} rows, like x)."
            )
        return tf.convert_to_tensor(array.astype(np.dtype(target.dtype), copy=False))

    if isinstance(y, (list, tuple, dict)) and not _is_one_array(y):
        leaves = tf.nest.flatten(y)
        names = (
            [f"y[{k!r}]" for k in sorted(y)]
            if isinstance(y, dict)
            else [f"y[{i}]" for i in range(len(leaves))]
        )
        if len(names) != len(leaves):
            names = [f"y (target {i})" for i in range(len(leaves))]
        y = tf.nest.pack_sequence_as(
            y, [leaf(v, name) for v, name in zip(leaves, names, strict=True)]
        )
    else:
        y = leaf(y, "y")
    refuse_non_finite(y, "y")
    return y


def prepared(job, x, y):
    """``(x, y)`` checked and cast as the norms of ``job`` take them (the
    batch as ``as_batch`` gives it, the targets in the variables' dtype),
    for :meth:`LossGradients.norms_graph`."""
    batch = as_batch(x, job.target)
    return batch, _targets(y, job.target, int(n_samples(batch)))


def _is_one_array(y):
    """A list of numbers or of equal rows is one array, not several targets."""
    return isinstance(y, (list, tuple)) and not any(
        hasattr(e, "shape") and np.ndim(e) > 0 for e in y
    )


def gradients_for(model, loss_fn, variables, training, x=None):
    """The compiled per-sample gradients of ``loss_fn`` on ``model``, kept in
    :mod:`jacutil.core.cache` as long as the model lives.

    Keyed by the loss function's identity: pass the same function each call
    (a new lambda each step compiles each step). Arguments as
    :func:`per_sample_gradients`; ``x`` (optional) builds a model not built yet.
    """
    jac = compiled_for(model, variables, training, False, "rules", x)
    key = (id(loss_fn), training, *map(id, jac.target.variables))
    return cache.kept(
        "gradients",
        model,
        key,
        lambda: LossGradients(jac, loss_fn),
        # a new function at a dead one's address, or new columns
        still_valid=lambda found: found.loss_fn is loss_fn and found.jac is jac,
    )


def _refuse_weights(weights):
    if weights is not None:
        raise ValueError(
            "the dataset's batches carry sample weights, and a per-sample "
            "gradient is each sample's own, unweighted loss: give batches of "
            "(x, y), or scale each row by its weight afterwards."
        )


def _run(
    what, model, loss_fn, x, y, variables, training, memory_budget, explain, copy,
    progress, steps,
):  # fmt: skip
    """What both public functions share (their options are documented in
    :func:`per_sample_gradients`): the cached compiled object, x and y checked,
    the memory budget, chunks and the explanation."""
    try:
        x, y, weights = read_data(x, y, steps=steps, inputs=inputs_of(model))
    except BatchesOfShapes as shapes:  # padded_batch: one group at a time

        def group(x, y, weights):
            _refuse_weights(weights)
            return _run(what, model, loss_fn, x, y, variables, training,
                        memory_budget, explain, copy, progress, None)  # fmt: skip

        return rows_by_shape(shapes, group)
    _refuse_weights(weights)
    start = time.perf_counter()
    if y is None:
        raise ValueError(
            "y is missing: pass the targets, or a dataset of (x, y) batches."
        )
    job = gradients_for(model, loss_fn, variables, training, x)
    traces, before = job.trace_count, dict(job.jac.spent)
    target = job.target
    batch = as_batch(x, target)
    rows = int(n_samples(batch))
    y = _targets(y, target, rows)
    activations = job.jac.activation_elements(batch)
    per_sample = bytes_per_sample(
        1, target.n_params, target.dtype.itemsize, activations
    )
    plan = plan_chunks(
        rows, per_sample=per_sample, memory_budget=memory_budget, look=explain
    )

    def compute(start, stop):  # the whole batch as it is: no slicing op
        if stop - start == rows:
            return job(batch, y, what)
        return job(take(batch, start, stop), take(y, start, stop), what)

    width = () if what == "norms" else (target.n_params,)
    out = run_chunks(
        plan, compute, shape=(rows, *width), dtype=np.dtype(target.dtype),
        progress=progress,
    )  # fmt: skip
    if copy and plan.n_chunks == 1:
        out = np.array(out)
    if not explain:
        return out
    on_rules = job.formulation.startswith("layer rules")
    fallback = job.jac.fallback or "the loss reads logits"
    traced = job.trace_count > traces
    spent = spent_since(job.jac, before, start)
    return out, choice_for(
        job.jac, plan, on_rules, job.formulation, traced, fallback, spent
    )


def per_sample_gradients(
    model,
    loss_fn,
    x,
    y=None,
    *,
    variables=None,
    training=False,
    memory_budget=None,
    explain=False,
    copy=False,
    progress=False,
    steps=None,
):
    """The gradient of each sample's own loss, in ``flat_params`` order.

    On the layer-rules path the backward pass starts from ``dL_i/df`` (from
    the logits, where a Keras cross-entropy reads them); otherwise one
    gradient per sample in ``tf.vectorized_map``. Compiled once per model,
    loss function and variables: the second call with the same ``loss_fn``
    object traces nothing (pass the same function each time, not a new
    lambda). Introduced in ``09-matrix-free``.

    The model's regularizers (``model.losses``: ``kernel_regularizer`` and
    the like) are left out: they belong to no sample (as in Opacus).
    :class:`jacutil.privacy.dp_sgd.DPSGD` adds their gradient once per step.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        loss_fn: ``loss_fn(y, prediction)`` returning one loss per sample,
            shape (n,), e.g. ``keras.losses.mean_squared_error``.
        x: the n samples, or what ``model.fit`` takes: a ``tf.data.Dataset``
            (batched or not, ``padded_batch`` too), a ``keras.utils.PyDataset``
            or a generator of ``(x, y)`` batches (then no ``y``).
        y: the targets, one per sample: an array, or for a model of several
            outputs a list or dict of arrays (one per head, as ``model.fit``
            takes them), passed to ``loss_fn`` as that structure.
        variables: the variables to differentiate (default: trainable ones).
        training: run the model in training mode.
        memory_budget: bytes of working memory before the batch runs in
            chunks (default: half the memory free now, when it matters).
        explain: also return a :class:`jacutil.auto.Choice`: the path, each
            layer's rule, the chunks and whether this call traced.
        copy: return an array you may write to (otherwise, in one piece, a
            read-only view of TensorFlow's result).
        progress: show a progress bar over chunks.
        steps: the batches of a dataset or generator to read (as in
            ``model.predict``); needed where its length is not known.

    Returns:
        A NumPy array of shape (n, m); with ``explain=True``, ``(G, choice)``.

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
    return _run("gradients", **locals())


def per_sample_gradient_norms(
    model,
    loss_fn,
    x,
    y=None,
    *,
    variables=None,
    training=False,
    memory_budget=None,
    explain=False,
    copy=False,
    progress=False,
    steps=None,
):
    """(n,): the norm of each sample's loss gradient (what DP clipping needs).

    On the layer rules, each layer's share comes from its input and its
    output signal without forming the gradient where the rule knows how
    (Dense: ``|a|^2 |delta|^2``; see ``Rule.backward_norms``), compiled by
    XLA up to ``XLA_NORMS_ROWS`` samples a call; otherwise the norms of the
    per-sample gradients, in the same graph. Arguments, options and caching
    as :func:`per_sample_gradients`; returns a NumPy array of shape (n,), or
    ``(norms, choice)`` with ``explain=True``. Introduced in ``09-matrix-free``.
    """
    return _run("norms", **locals())
