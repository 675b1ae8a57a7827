"""How the per-sample Jacobian is vectorized for a given model (notebook
08-your-own-model).

``jacutil.stages.vectorized.per_sample_tensor`` maps a one-sample Jacobian
over the batch with pfor (``tf.vectorized_map``), and falls back on the tools
here. Four kinds of model need more:

* **Recurrent layers** (``LSTM``, ``GRU``, ``SimpleRNN``, ``Bidirectional``):
  a Keras RNN runs a ``tf.while_loop``, and pfor cannot vectorize the gradient
  of a ``while_loop`` inside another pfor. While the Jacobian is traced, each
  RNN layer is *unrolled* (its ``unroll`` flag set, the same layer and
  weights): the loop becomes one step per time step, which pfor vectorizes.
  Tracing then takes longer for long sequences.
* **Random layers in training mode** (``Dropout`` with ``training=True``):
  inside pfor every sample would share one random mask. ``tf.map_fn`` runs
  the samples one after another, so each draws its own mask - the same
  semantics as ``model(x, training=True)`` and the other stages.
* **Grouped convolutions** (``Conv2D(groups=2)``): Keras runs them in a
  nested ``tf.function(jit_compile=True)`` that reads the kernel inside;
  pfor mis-converts their filter gradient, and in a graph forward mode
  carries no tangent into a nested function's variable reads. While
  jacutil calls the model, each runs as one ordinary convolution per group
  (:func:`jacutil.core._grouped.convolutions_by_group`): the same numbers.
* **Anything else pfor cannot convert**: ``tf.map_fn`` too, with a
  :class:`SlowPathWarning`.

And one TensorFlow 2.21 bug: for attention layers pfor writes broadcasting
batch matmuls on which oneDNN corrupts memory and crashes the process; a
Jacobian whose graph holds one runs under XLA. ``jac.formulation`` says which
of these applied, with what pfor itself noted while tracing.
"""

import contextlib
import functools
import logging
import warnings

from ._tf import keras, tf
from .graph_calls import SignatureCalls
from .guards import JacobianError
from .target import stack_columns

# Errors with which pfor refuses a graph it cannot vectorize.
PFOR_ERRORS = (ValueError, TypeError, NotImplementedError, tf.errors.OpError)


class SlowPathWarning(UserWarning):
    """pfor could not vectorize the model, so samples run one at a time."""


def recurrent_layers(target):
    """The Keras RNN layers of ``target`` that may be unrolled while traced
    (nested ones and Bidirectional's included), in ``target.layers`` order.

    Not a Bidirectional's layers in a model that makes a mask: Keras 3.15
    computes another function when those are unrolled (up to 0.06 apart on
    a masked sequence), so they keep their loop - and the stage that cannot
    vectorize it falls back (``tf.map_fn``) or refuses (forward mode).
    """
    masked = any(
        getattr(layer, "mask_zero", False) or isinstance(layer, keras.layers.Masking)
        for layer in target.layers
    )
    kept = set()
    if masked:
        for layer in target.layers:
            if isinstance(layer, keras.layers.Bidirectional):
                kept |= {id(layer.forward_layer), id(layer.backward_layer)}
    return [
        layer
        for layer in target.layers
        if isinstance(layer, keras.layers.RNN) and id(layer) not in kept
    ]


def kept_loops(target):
    """The target's RNN layers that keep their loop (see
    :func:`recurrent_layers`): a list, empty for most models."""
    unrolled_ids = {id(layer) for layer in recurrent_layers(target)}
    return [
        layer
        for layer in target.layers
        if isinstance(layer, keras.layers.RNN) and id(layer) not in unrolled_ids
    ]


def refuse_kept_loops(target):
    """Raise :class:`ForwardModeBlindSpot` when a recurrent layer of
    ``target`` keeps its loop: forward mode carries no tangent through a
    ``while_loop``'s variable reads (TF 2.21)."""
    kept = kept_loops(target)
    if kept:
        raise ForwardModeBlindSpot(
            f"forward mode cannot differentiate this model: its recurrent "
            f"layer {kept[0].name!r} is part of a Bidirectional over a masked "
            "sequence, which keeps its loop (Keras computes another function "
            "when it is unrolled), and TensorFlow 2.21's forward mode carries "
            "no tangent through a loop. Use reverse mode: jacutil.jacobian "
            'for J, products(mode="double_backward") for J @ v.'
        )


@contextlib.contextmanager
def unrolled(layers):
    """Trace ``layers`` (Keras RNNs) unrolled: the same layers and weights."""
    saved = [layer.unroll for layer in layers]
    for layer in layers:
        layer.unroll = True
    try:
        yield
    finally:
        for layer, unroll in zip(layers, saved, strict=True):
            layer.unroll = unroll


class _PforLog(logging.Filter):
    """Keep pfor's messages out of the user's log while we trace: its errors
    (we fall back) are dropped, its warnings noted for ``jac.formulation``."""

    SOURCES = ("parallel_for/pfor.py", "parallel_for/control_flow_ops.py")

    def __init__(self):
        super().__init__()
        self.notes = []

    def filter(self, record):
        path = record.pathname.replace("\\", "/")
        if not path.endswith(self.SOURCES):
            return True
        if record.levelno < logging.ERROR:
            note = record.getMessage().split(". ")[0].split("(")[0].strip()
            if note.startswith("Converting IndexedSlices"):
                note = "an Embedding's sparse gradient made dense (IndexedSlices)"
            if note not in self.notes:
                self.notes.append(note)
        return False


@contextlib.contextmanager
def pfor_log():
    """Capture pfor's own log lines inside the block (see :class:`_PforLog`);
    in nested blocks the innermost takes the notes. Introduced in
    ``08-your-own-model``.

    Yields:
        A list of ``str``: pfor's notes, filled while the block runs.
    """
    logger, capture = tf.get_logger(), _PforLog()
    logger.filters.insert(0, capture)  # before any outer block's filter
    try:
        yield capture.notes
    finally:
        logger.removeFilter(capture)


# oneDNN's batch matmul corrupts the heap (malloc errors, segfaults) on some
# broadcasting operands in TensorFlow 2.21 (tensorflow/tensorflow#117700 and
# #123109). pfor writes such operands for attention (EinsumDense) gradients.
# Where the traced Jacobian holds one, it runs under XLA instead.
BATCH_MATMULS = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
UNDER_XLA = (
    "run under XLA: oneDNN's broadcasting batch matmul corrupts memory in "
    "TensorFlow 2.21 (tensorflow#117700)"
)


def _broadcasts(op):
    """Whether a batch matmul broadcasts its batch dimensions (ranks or sizes)."""
    a, b = (t.shape for t in op.inputs[:2])
    if a.rank is None or b.rank is None or a.rank != b.rank:
        return True
    pairs = zip(a.as_list()[:-2], b.as_list()[:-2], strict=True)
    return any((d == 1) != (e == 1) for d, e in pairs)


def quiet_function(python_function, **options):
    """``tf.function(python_function, **options)`` for jacutil's own traces,
    which TensorFlow does not count.

    jacutil traces by design (jacutil's RetracingWarning watches for the real
    trap), so TensorFlow's retracing warning is off; each trace runs inside
    :func:`pfor_log`.
    """

    def traced(*args, **kwargs):
        with pfor_log():
            return python_function(*args, **kwargs)

    function = tf.function(functools.wraps(python_function)(traced), **options)
    function._omit_frequent_tracing_warning = True  # noqa: SLF001 (TF 2.21)
    return function


class ForwardModeBlindSpot(JacobianError):
    """A second-order derivative that TensorFlow 2.21 gets wrong in a graph:
    forward mode (and the double-backward JVP) would return zeros."""


MAX_POOLS = ("MaxPool", "MaxPoolV2", "MaxPool3D")


def refuse_shape_preserving_max_pools(ops):
    """Raise :class:`ForwardModeBlindSpot` when one of ``ops`` is a max pool
    whose output has its input's shape (``padding="same"`` with stride 1, or
    a 1-wide window): in a graph, TF 2.21's JVP of such a pool is zero
    (eager is right; valid padding or stride 2 are right too). ``ops``:
    ``tf.Operation`` objects, as from :func:`new_ops`.
    """
    for op in ops:
        if op.type in MAX_POOLS:
            before, after = op.inputs[0].shape, op.outputs[0].shape
            if before.rank and before[1:].as_list() == after[1:].as_list():
                raise ForwardModeBlindSpot(
                    "forward mode cannot differentiate this model: it has a max "
                    "pooling layer whose output keeps its input's shape "
                    '(padding="same" with strides=1), whose second derivative '
                    "TensorFlow 2.21 computes as zero in a graph (the columns "
                    "would be silently zero). Use reverse mode (jacutil.jacobian, "
                    "compiled_jacobian) for J, and for J @ v multiply J; or pool "
                    'with padding="valid" or a stride of 2.'
                )


def refuse_hidden_reads(ops, variables):
    """Raise :class:`ForwardModeBlindSpot` when one of ``ops`` (traced in
    forward mode) calls a nested ``tf.function`` that reads one of
    ``variables`` (TF 2.21's ForwardAccumulator carries no tangent into it),
    and for the max pools of :func:`refuse_shape_preserving_max_pools`.
    """
    graph = tf.compat.v1.get_default_graph()
    handles = {id(v.handle) for v in variables}
    inside = {inner.name for outer, inner in graph.captures if id(outer) in handles}
    hidden = [  # a call that reads a variable is stateful (the accumulator's
        op.get_attr("f").name  # own JVP helpers take handles, and are not)
        for op in ops
        if op.type == "StatefulPartitionedCall"
        and any(t.name in inside for t in op.inputs)
    ]
    refuse_shape_preserving_max_pools(ops)
    if hidden:
        raise ForwardModeBlindSpot(
            f"forward mode cannot differentiate this model: {hidden[0]} is a "
            "nested tf.function that reads a differentiated variable inside, and "
            "TensorFlow 2.21's ForwardAccumulator carries no tangent into it (the "
            "columns would be silently zero). Use reverse mode: jacutil.jacobian "
            'or compiled_jacobian for J, products(mode="double_backward") for '
            "J @ v - or pass the variable to the nested function as an argument."
        )


def onednn_hazards(ops):
    """The batch matmuls among ``ops`` whose batch dimensions broadcast."""
    return [op for op in ops if op.type in BATCH_MATMULS and _broadcasts(op)]


@contextlib.contextmanager
def new_ops():
    """The operations added to the graph being traced inside the block: a
    list, filled when the block ends."""
    graph = tf.compat.v1.get_default_graph()
    start = len(graph.get_operations())
    created = []
    yield created
    created.extend(graph.get_operations()[start:])


def vectorize(jacobian, target, x, xla=False):
    """``(J, notes)``: the tensor ``jacobian(target, x)`` traced, and moved
    under XLA if it needs to be (not when ``xla``: the caller compiles with
    XLA already); ``notes``, a list of ``str``, say what pfor said and whether
    it runs under XLA. Call it inside a ``tf.function`` trace."""
    with pfor_log() as notes, new_ops() as created:
        J = jacobian(target, x)
    if xla or not onednn_hazards(created):
        return J, notes
    compiled = quiet_function(lambda x: jacobian(target, x), jit_compile=True)
    with pfor_log():
        J = compiled(x)
    return J, [*notes, UNDER_XLA]


def safe_vectorized_map(fn, elems):
    """``tf.vectorized_map(fn, elems)``, run under XLA where its vectorized
    graph holds oneDNN's broadcasting batch matmul (above), which corrupts
    the heap in TensorFlow 2.21: what the layer rules' autodiff of a layer
    (an attention block, say) runs, as :func:`vectorize` guards the engine's
    Jacobian. Called eagerly, it traces itself first, so that the graph can
    be looked at before anything runs."""
    if tf.executing_eagerly():
        return quiet_function(lambda e: safe_vectorized_map(fn, e))(elems)
    with pfor_log(), new_ops() as created:
        out = tf.vectorized_map(fn, elems)
    if not onednn_hazards(created):
        return out
    compiled = quiet_function(lambda e: tf.vectorized_map(fn, e), jit_compile=True)
    with pfor_log():
        return compiled(elems)


def map_fn_jacobian(target, x):
    """J (n, l, m): the one-sample Jacobian in a ``tf.map_fn`` loop, its rows
    not vectorized either: the slow, safe path without pfor."""

    def one_sample(xi):
        xi = tf.nest.map_structure(lambda t: t[None], xi)
        with tf.GradientTape() as tape:
            target.watch(tape)
            y = target.forward(xi)
        jacobians = tape.jacobian(y, target.variables, experimental_use_pfor=False)
        return stack_columns(jacobians, target.variables, 1)[0]

    signature = tf.TensorSpec(None, target.dtype)
    return tf.map_fn(one_sample, x, fn_output_signature=signature)


NOT_THE_MESSAGE = ("File ", "[[", "Detected at node", "Graph execution error")


def first_line(error):
    """The line of ``error`` that says what went wrong (not where), at most
    200 characters."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith(NOT_THE_MESSAGE)]
    last = lines[-1] if lines else type(error).__name__
    message = next((line for line in lines if "Error" in line), last)
    return str(message)[:200]


def pfor_failed_when_run(error):
    """Whether ``error`` is pfor's converted graph failing when it runs."""
    return isinstance(error, tf.errors.InvalidArgumentError) and "/pfor/" in str(error)


def warn_sample_by_sample(reason, stacklevel=4):
    """Warn (:class:`SlowPathWarning`) that the samples run one at a time,
    because of ``reason``; ``stacklevel`` as for ``warnings.warn``."""
    warnings.warn(
        f"tf.vectorized_map could not vectorize this model ({reason}), so its "
        "samples run one at a time in tf.map_fn: correct, and much slower. "
        "Please report the model if it is a standard Keras one.",
        SlowPathWarning,
        stacklevel=stacklevel,
    )


XLA_ERRORS = (
    tf.errors.InvalidArgumentError,
    tf.errors.UnimplementedError,
    tf.errors.InternalError,
)


class PforFailed(Exception):
    """pfor could not vectorize the trace: trace again, sample by sample."""


class NeedsXla(Exception):
    """The trace holds a batch matmul oneDNN mishandles: trace it under XLA."""


class Ladder:
    """Per input signature (``key``), the first of ``MODES`` that traces and
    runs, and its ``tf.function``: the layer rules where proved; pfor; pfor
    under XLA on :class:`NeedsXla`; ``tf.map_fn`` (warned once, and later keys
    start there) where pfor fails (:class:`PforFailed`, or when run) or its
    loop fails under that XLA. What XLA cannot compile runs without XLA.

    Args:
        build: ``build(key, mode, xla, *args)``: a ``tf.function`` computing
            arguments like ``args`` in ``mode``, compiled by XLA if ``xla``.
        checked_plan: ``checked_plan(x)``: the rules' plan proved on x, or None.
        pfor: False where pfor cannot run at all (a loop that is kept).
        not_on_rules: the errors with which the rules refuse a trace.
        eager: ``eager(key, *args)``: the layer rules' result computed
            eagerly, no ``tf.function``; None: every call runs a trace. The
            first call of a key on the rules runs it, the second traces
            (:attr:`EAGER_FIRST_CALL`): a trace of a large model's rules
            costs seconds (EfficientNetB0: 14 s), its eager walk a fraction
            of that, and a call made once (a notebook cell) never pays it.
    """

    EAGER_FIRST_CALL = True  # False: trace on the first call, as TensorFlow does

    MODES = ("rules", "vectorized", "vectorized under XLA", "tf.map_fn over samples")
    RULES, VECTORIZED, UNDER_XLA, MAP_FN = MODES

    def __init__(self, build, checked_plan, pfor=True, not_on_rules=(), eager=None):
        self.build, self.checked_plan = build, checked_plan
        self.pfor, self.not_on_rules = pfor, not_on_rules
        self.eager = eager
        self.ran_eagerly = set()  # keys whose first call ran eagerly
        self.modes = {}  # key -> the mode that works
        self.functions = {}  # (key, mode, xla) -> SignatureCalls of a tf.function
        self.without_xla = set()  # the keys that XLA cannot compile
        self.pfor_failed = None  # why pfor failed, once it has

    def mode(self, key, x):
        """The mode for ``key``: the one that worked, or the first to try."""
        if key not in self.modes:
            rules = self.checked_plan(x) is not None
            self.modes[key] = self.RULES if rules else self._below_rules()
        return self.modes[key]

    def _below_rules(self):
        return self.VECTORIZED if self.pfor and not self.pfor_failed else self.MAP_FN

    def function(self, key, mode, xla, args):
        """The ``tf.function`` for ``key`` in ``mode``, built once, called by
        the concrete function of each input signature
        (:class:`jacutil.core.graph_calls.SignatureCalls`: the call a loop
        repeats pays no lookup)."""
        if (key, mode, xla) not in self.functions:
            built = self.build(key, mode, xla, *args)
            self.functions[key, mode, xla] = SignatureCalls(built)
        return self.functions[key, mode, xla]

    def restart(self):
        """Forget every mode and function (the rules' plan was dropped)."""
        self.modes.clear()
        self.functions.clear()

    def __call__(self, key, args, xla=()):
        """``(result, mode, under_xla)``: ``args`` (x first) run in the first
        mode that works for ``key``; ``xla``: the modes the caller compiles
        with XLA."""
        while True:
            mode = self.mode(key, args[0])
            under_xla = mode == self.UNDER_XLA or (
                mode in xla and key not in self.without_xla
            )
            if self._first_eagerly(key, mode, under_xla):
                try:
                    result = self.eager(key, *args)
                except self.not_on_rules:
                    pass  # the trace below refuses it too, and falls back
                else:
                    self.ran_eagerly.add(key)
                    return result, mode, False
            try:
                return self.function(key, mode, under_xla, args)(*args), mode, under_xla
            except Exception as error:  # _below raises the others
                self.modes[key] = self._below(key, mode, under_xla, error)

    def _first_eagerly(self, key, mode, under_xla):
        """Whether this call of ``key`` runs eagerly: the first on the
        rules, where an ``eager`` is given and nothing was traced for it."""
        return (
            self.EAGER_FIRST_CALL
            and self.eager is not None
            and mode == self.RULES
            and key not in self.ran_eagerly
            and (key, mode, under_xla) not in self.functions
            and tf.executing_eagerly()
        )

    def _below(self, key, mode, under_xla, error):
        """The mode to try after ``error`` in ``mode``, or ``error`` raised."""
        if mode == self.RULES and isinstance(error, self.not_on_rules):
            return self._below_rules()
        if isinstance(error, NeedsXla):
            return self.UNDER_XLA
        pfor = mode != self.MAP_FN and pfor_failed_when_run(error)
        # or the loop pfor keeps fails under the XLA for oneDNN (or vectorize's)
        xla = isinstance(error, XLA_ERRORS) and "XLA" in str(error)
        moved = mode == self.UNDER_XLA or (mode == self.VECTORIZED and not under_xla)
        if isinstance(error, PforFailed) or pfor or (xla and moved):
            if self.pfor_failed is None:  # said once
                warn_sample_by_sample(first_line(error), stacklevel=7)
            self.pfor_failed = first_line(error)
            return self.MAP_FN
        if under_xla and isinstance(error, XLA_ERRORS):  # XLA cannot compile it
            self.without_xla.add(key)
            return mode
        raise error
