"""Random Keras models for the generated-model test (issue 21).

Hypothesis draws each model as a short Python program, ``Case.source``: the
layers and options that ``jacutil.rules`` claims (Dense on any rank and every
built-in activation, Conv1D/Conv2D with strides, dilation, padding and groups,
pooling, Embedding with and without a mask, LayerNorm and BatchNorm options,
LSTM/GRU/SimpleRNN and Bidirectional with their options, Dropout and the other
layers that are the identity at inference), and functional graphs (branches,
``Add``/``Concatenate`` and the other merges, ``keras.ops`` between layers,
custom layers with call arguments, shared and frozen layers, nested
Sequentials, several inputs and outputs as lists or dicts), in float32 and
float64, with a subset of the variables or all of them, and the input batch,
the chunk size and, for a loss, its targets.

A case prints as that program (``repr(case)``), so the falsifying example
Hypothesis shows is a standalone reproduction: paste it after
``from tests.generated import *``. ``case.build()`` runs it and returns its
namespace (``model``, ``x``, ``variables``, ``chunk_size``, ``loss``, ``y``).

The module also holds the reference every entry is checked against: one
``tf.GradientTape`` per sample (:func:`tape_jacobian`,
:func:`tape_loss_gradients`), written here, independent of jacutil.

The strategies:

* :func:`chain_cases`: one input, one output, a chain of layers as a
  ``keras.Sequential``, a functional chain or a Sequential with a nested one
  (what the layer rules read);
* :func:`graph_cases`: functional graphs;
* :func:`loss_cases`: either, ending in a head that matches a Keras loss
  (mean squared error; softmax with (sparse) categorical cross-entropy;
  sigmoid with binary cross-entropy; logits with ``from_logits=True``).
"""

import functools
import random
import re
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hypothesis import reject
from hypothesis import strategies as st

import jacutil
from jacutil import keras, tf
from jacutil.core.guards import JacobianError

layers = keras.layers
ops = keras.ops

MAX_PARAMS = 400  # the reference takes one gradient per sample and output
MAX_OUTPUTS = 12  # per sample, after flattening every output leaf
MAX_SAMPLES = 6


# --- custom layers (no rule: autodiff passes their signal) --------------------


class Clip(layers.Layer):
    """Clips to [-limit, limit]: a call argument whose default differs."""

    def call(self, x, limit=1.0):
        return ops.clip(x, -limit, limit)


class Scale(layers.Layer):
    """``x * factor``: a call argument and no weights."""

    def call(self, x, factor=1.0):
        return x * factor


class Affine(layers.Layer):
    """``x * w + b + shift``: weights, a call argument, and a weight never used."""

    def build(self, input_shape):
        width = input_shape[-1:]
        self.w = self.add_weight(shape=width, initializer="ones", name="w")
        self.b = self.add_weight(shape=width, initializer="zeros", name="b")
        self.unused = self.add_weight(shape=(2,), initializer="ones", name="unused")

    def call(self, x, shift=0.0):
        return x * self.w + self.b + shift


class Halve(layers.Layer):
    """Halves its input in training mode only: ``training`` must reach it."""

    def call(self, x, training=None):
        return x * 0.5 if training else x


CUSTOM_LAYERS = {"Clip": Clip, "Scale": Scale, "Affine": Affine, "Halve": Halve}


# --- what a case's program may use --------------------------------------------


def perturb(model, seed):
    """Move every float weight by 0.1 * N(0, 1) so nothing sits at an
    initializer's 0 or 1; BatchNorm's moving mean ~ 0.3 * N(0, 1) and moving
    variance ~ U(0.5, 2), so that inference-mode statistics matter."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        if not tf.as_dtype(v.dtype).is_floating:
            continue
        shape, path = tuple(v.shape), v.path
        if path.endswith("moving_variance"):
            value = rng.uniform(0.5, 2.0, shape)
        elif path.endswith("moving_mean"):
            value = 0.3 * rng.standard_normal(shape)
        else:
            value = np.asarray(v) + 0.1 * rng.standard_normal(shape)
        v.assign(value.astype(v.dtype))


def namespace(dtype="float32"):
    """The names a case's program runs with."""
    return {
        "np": np,
        "tf": tf,
        "keras": keras,
        "layers": layers,
        "ops": ops,
        "functools": functools,
        "perturb": perturb,
        "dtype": dtype,
        "brier_score": brier_score,
        "confidence_penalty": confidence_penalty,
        "focal_plus_brier": focal_plus_brier,
        **CUSTOM_LAYERS,
    }


# --- the reference: one tape per sample ---------------------------------------


def _sample(x, i):
    return tf.nest.map_structure(lambda a: a[i : i + 1], x)


def _n_samples(x):
    return len(tf.nest.flatten(x)[0])


def _watched(v):
    return v.value if isinstance(v, keras.Variable) else v


def _flat_gradient(grads, variables, dtype):
    return np.concatenate(
        [
            np.zeros(int(np.prod(v.shape)), dtype)
            if g is None
            else np.ravel(tf.convert_to_tensor(g).numpy())
            for g, v in zip(grads, variables, strict=True)
        ]
    )


def flat_outputs(y):
    """A sample's outputs as one row: every leaf flattened, ``tf.nest`` order."""
    return tf.concat([tf.reshape(leaf, [-1]) for leaf in tf.nest.flatten(y)], 0)


def runs_on_its_batch(model, x):
    """Call the model on the whole batch, as its user would; Keras's own error
    if it cannot. The tapes below call it one sample at a time, where a model
    can run that fails on its batch: a Softmax under an Embedding's mask
    broadcasts the mask (n, T) against its scores (n, T, features), which
    works for n = 1 (or n = T) only (make fuzz, seed 20261205)."""
    model(x, training=False)


def tape_jacobian(model, x, variables):
    """(n, l, m): one persistent tape per sample, one gradient per output."""
    watched = [_watched(v) for v in variables]
    dtype = np.dtype(tf.as_dtype(variables[0].dtype).as_numpy_dtype)
    rows = []
    for i in range(_n_samples(x)):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(watched)
            y = flat_outputs(model(_sample(x, i), training=False))
            outputs = [y[k] for k in range(int(y.shape[0]))]
        rows.append(
            np.stack(
                [
                    _flat_gradient(tape.gradient(out, watched), variables, dtype)
                    for out in outputs
                ]
            )
        )
        del tape
    return np.stack(rows)


def tape_loss_gradients(model, loss_fn, x, y, variables):
    """(n, m): each sample's loss (averaged over its own extra axes) by its tape."""
    watched = [_watched(v) for v in variables]
    dtype = np.dtype(tf.as_dtype(variables[0].dtype).as_numpy_dtype)
    rows = []
    for i in range(_n_samples(x)):
        with tf.GradientTape() as tape:
            tape.watch(watched)
            prediction = model(_sample(x, i), training=False)
            loss = tf.reduce_mean(loss_fn(y[i : i + 1], prediction))
        rows.append(_flat_gradient(tape.gradient(loss, watched), variables, dtype))
    return np.stack(rows)


class SampleLoss(layers.Layer):
    """An identity that adds a loss of each sample's activations (as an
    activity regularizer does: a mean over the batch), for ``make_private``'s
    generated check: Keras adds it to the loss each sample's gradient is
    clipped on."""

    def call(self, h):
        self.add_loss(0.1 * ops.mean(ops.square(h)))
        return h


def keras_loss_gradients(model, x, y):
    """(n, m): each sample's gradient of Keras's own loss
    (``model.compute_loss`` on a batch of that sample alone: the compiled
    loss of every output with its ``loss_weights``, plus ``model.losses`` of
    its forward pass) less the weight regularizers (which ``make_private``
    adds once, outside the clipping), by one tape per sample in the model's
    own dtype (Keras's compiled loss computes in float32 inside it)."""
    rows = []
    for i in range(_n_samples(x)):
        y_i = tf.nest.map_structure(lambda t, i=i: np.asarray(t)[i : i + 1], y)
        rows.append(_keras_loss_gradient(model, _sample(x, i), y_i))
    return np.stack(rows)


def _keras_loss_gradient(model, x, y):
    """The gradient of ``model.compute_loss`` of the batch ``x``, ``y`` less
    the weight regularizers, by a tape, flat (m,)."""
    variables = model.trainable_variables
    watched = [_watched(v) for v in variables]
    dtype = np.dtype(tf.as_dtype(variables[0].dtype).as_numpy_dtype)
    with tf.GradientTape() as tape:
        tape.watch(watched)
        loss = model.compute_loss(x, y, model(x, training=False))
        for v in variables:
            if getattr(v, "regularizer", None) is not None:
                loss -= tf.cast(v.regularizer(v), loss.dtype)
    return _flat_gradient(tape.gradient(loss, watched), variables, dtype)


def keras_batch_divisor(model, x, y, G):
    """What Keras's own loss of the whole batch divides the sum of the
    samples' gradients by: n (a mean: ``sum_over_batch_size``) or 1 (a sum:
    ``reduction="sum"``), from its batch gradient by a tape; None when it is
    neither (the batch's loss couples its samples)."""
    batch = _keras_loss_gradient(model, x, y)
    total = G.sum(axis=0)
    scale = max(np.abs(total).max(), 1e-30)
    for divisor in (len(G), 1):
        if np.abs(total / divisor - batch).max() <= 1e-3 * scale / divisor:
            return divisor
    return None


# --- refusals: clear, or a crash ---------------------------------------------

JACUTIL = Path(jacutil.__file__).resolve().parent
REFUSALS = (JacobianError, ValueError, TypeError, NotImplementedError)


def _raised_in_jacutil(error):
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(JACUTIL)


def clear_refusal(error, features):
    """Whether ``error`` is a clear refusal (allowed) rather than a crash.

    A clear refusal is

    * a ``jacutil.core.guards.JacobianError``, wherever it was raised (it passes
      through ``tf.function`` traces unchanged), or a ``ValueError``,
      ``TypeError`` or ``NotImplementedError`` raised by jacutil's own code
      (the innermost frame of its traceback is in the jacutil package),
    * whose message names a feature of the model: a layer type or name, an
      option, a ``keras.ops`` function, a custom layer, a variable (see
      ``tests.generated.Case.features``).

    Everything else is a crash: ``tf.errors.*`` (an ``OpError`` is no
    ``ValueError``), ``AttributeError``, ``KeyError``, ``IndexError``,
    autograph's ``StagingError``, a ``TypeError`` or ``ValueError`` raised
    inside TensorFlow or Keras, and a jacutil error that does not say what it
    refuses.
    """
    if not isinstance(error, REFUSALS):
        return False
    if not isinstance(error, JacobianError) and not _raised_in_jacutil(error):
        return False
    message = str(error).lower()
    return any(len(f) >= 3 and f.lower() in message for f in features)


# --- a case: the program that builds the model and its inputs -----------------


class Case:
    """A drawn model as a program; ``repr`` prints it, ``build`` runs it.

    ``family`` says which strategy drew it; ``features`` holds the words a
    clear refusal of it may use (layer types, options, ops, custom layers).
    """

    def __init__(self, family, dtype, source, features=frozenset()):
        self.family = family
        self.dtype = dtype
        self.source = source
        self.features = frozenset(features)

    def __repr__(self):
        return f"Case({self.family!r}) <<<\n{self.source}\n>>>"

    def build(self):
        ns = namespace(self.dtype)
        exec(self.source, ns)  # noqa: S102 - the program this module wrote
        return ns


class _Code(str):
    """Source text that prints as itself inside a call (an activation function)."""

    def __repr__(self):
        return str(self)


def _call(name, *args, prefix="layers.", dtype=True, **options):
    """``layers.Name(args, option=value, dtype=dtype)``, defaults left out."""
    parts = [repr(a) for a in args]
    parts += [f"{k}={v!r}" for k, v in options.items() if v is not None]
    if dtype:
        parts.append("dtype=dtype")
    return f"{prefix}{name}({', '.join(parts)})"


# --- activations --------------------------------------------------------------

KERAS_ACTIVATIONS = (
    "linear", "tanh", "relu", "sigmoid", "softmax", "log_softmax", "elu", "selu",
    "gelu", "silu", "swish", "softplus", "softsign", "exponential", "hard_sigmoid",
    "hard_silu", "hard_swish", "leaky_relu", "relu6", "mish", "log_sigmoid", "celu",
    "hard_tanh", "tanh_shrink", "soft_shrink", "hard_shrink", "squareplus",
    "sparse_plus", "sparse_sigmoid", "sparsemax",
)  # fmt: skip
# "glu" halves the last axis (and Keras's symbolic shapes miss it): heads only.
# "threshold" needs arguments: it is not an activation by name.
FUNCTION_ACTIVATIONS = tuple(
    _Code(a)
    for a in (
        "tf.nn.relu", "tf.tanh", "tf.nn.softplus", "tf.nn.softsign", "tf.nn.gelu",
        "tf.nn.leaky_relu", "tf.nn.elu", "tf.math.sigmoid", "keras.activations.gelu",
        "lambda t: t * tf.sigmoid(2 * t)",
        "functools.partial(tf.nn.leaky_relu, alpha=0.3)",
        "lambda t: ops.tanh(t) * 2",
    )
)  # fmt: skip
activations = st.one_of(
    st.sampled_from(KERAS_ACTIVATIONS), st.sampled_from(FUNCTION_ACTIVATIONS)
)
RECURRENT_ACTIVATIONS = ("tanh", "relu", "sigmoid", "softsign", "linear")
GATE_ACTIVATIONS = ("sigmoid", "hard_sigmoid", "tanh")

# words a refusal may use for a feature (besides the names in the program)
STEMS = {
    "Conv1D": ("conv", "convolution"),
    "Conv2D": ("conv", "convolution"),
    "groups": ("group",),
    "mask_zero": ("mask",),
    "go_backwards": ("backward",),
    "return_state": ("state",),
    "rms_scaling": ("rms",),
    "lora_rank": ("lora",),
    "EinsumDense": ("einsum",),
    "use_causal_mask": ("causal", "mask"),
    "reset_after": ("reset_after",),
    "LSTM": ("recurrent", "rnn"),
    "GRU": ("recurrent", "rnn"),
    "SimpleRNN": ("recurrent", "rnn"),
    "Bidirectional": ("recurrent", "rnn"),
    "Embedding": ("embedding", "ids", "int"),
    "from_logits": ("logits",),
    "softmax": ("logits", "softmax"),
    "sigmoid": ("logits", "sigmoid"),
    "trainable": ("frozen", "trainable"),
    "variables": ("variable",),
}


def stems(word):
    """``word`` and what a message may call it instead: "MaxPooling1D" is also
    "max pooling" and "pool", "groups" also "group"."""
    found = {word, *STEMS.get(word, ())}
    spaced = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", re.sub(r"\d+D$", "", word)).lower()
    found.add(spaced)
    if "Pooling" in word:
        found.add("pool")
    if "Attention" in word:
        found.add("attention")
    return found


def _features(source):
    """Names a clear refusal of this program may mention."""
    found = set(re.findall(r"layers\.(\w+)", source))
    found |= set(re.findall(r"ops\.(\w+)", source))
    found |= set(re.findall(r"tf\.(?:nn\.|math\.)?(\w+)", source))
    found |= set(re.findall(r"(\w+)=", source)) - {"dtype"}
    found |= {name for name in CUSTOM_LAYERS if name + "(" in source}
    found |= set(re.findall(r"activation='(\w+)'", source))
    found |= {"lambda"} if "lambda" in source else set()
    return frozenset(set().union(*(stems(word) for word in found)))


# --- the program, drawn a line at a time --------------------------------------


@dataclass(eq=False)
class _T:
    """A tensor of the program: its name, per-sample shape, and for an input of
    integer ids, the vocabulary (0 for floats)."""

    name: str
    shape: tuple
    vocabulary: int = 0

    @property
    def rank(self):
        return len(self.shape)

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))


@contextmanager
def _global_random_kept():
    """Python's and NumPy's global random states as they were: Keras seeds
    each new layer's initializers from Python's ``random``, and a strategy
    that moved it would draw from outside Hypothesis (which then could not
    shrink or replay the draw, and warns)."""
    python, numpy = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


class _Program:
    """Lines run as they are drawn, so every tensor's shape is known."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.lines = []
        self.ns = namespace(dtype)
        self.count = 0

    def line(self, text):
        try:
            with _global_random_kept():
                exec(text, self.ns)  # noqa: S102
        except Exception:  # a combination Keras does not build: draw another
            reject()
        self.lines.append(text)

    def tensor(self, expr):
        name = f"h{self.count}"
        self.count += 1
        self.line(f"{name} = {expr}")
        return _T(name, tuple(self.ns[name].shape[1:]))

    def apply(self, layer, t, suffix=""):
        """``layer(t)``; ``suffix`` is ``", keyword=value"`` (call arguments)
        or ``"[k]"`` (an item of a list the layer returns)."""
        if suffix.startswith("["):
            return self.tensor(f"{layer}({t.name}){suffix}")
        return self.tensor(f"{layer}({t.name}{suffix})")

    def input(self, shape, vocabulary=0, name=None):
        dtype = "'int32'" if vocabulary else "dtype"
        named = f", name={name!r}" if name else ""
        t = self.tensor(f"keras.Input({shape!r}, dtype={dtype}{named})")
        t.vocabulary = vocabulary
        return t


def _input(draw, program, kinds=("vector", "sequence", "image", "ids"), name=None):
    """One input: a vector, a sequence, an image, or integer ids."""
    kind = draw(st.sampled_from(kinds))
    if kind == "vector":
        return program.input((draw(st.integers(2, 5)),), name=name)
    if kind == "sequence":
        shape = (draw(st.integers(3, 4)), draw(st.integers(1, 3)))
        return program.input(shape, name=name)
    if kind == "image":
        side = st.integers(4, 6)
        shape = (draw(side), draw(side), draw(st.integers(1, 2)))
        return program.input(shape, name=name)
    length, vocabulary = draw(st.integers(3, 5)), draw(st.integers(4, 7))
    return program.input((length,), vocabulary, name=name)


def _maybe(draw, value, default=None):
    return value if draw(st.booleans()) else default


def _rarely(draw, value, one_in=4):
    return value if draw(st.integers(1, one_in)) == 1 else None


# --- layers by the rank of their input ----------------------------------------


def _dense(draw, units=None, activation=None, glu=False, lora=False):
    """Dense with an activation, perhaps without bias, perhaps frozen.

    ``glu`` (heads only) may draw "glu", which halves the last axis; ``lora``
    may enable LoRA (``lora_rank``: the kernel frozen, its two factors
    trainable; Keras makes them float32, so only in float32 programs).
    """
    if units is None:
        units = draw(st.integers(1, 4))
    if activation is None:
        activation = draw(activations)
        if glu and draw(st.integers(1, 10)) == 1:
            activation, units = "glu", 2 * units
    return _call(
        "Dense",
        units,
        activation=None if activation == "linear" else activation,
        use_bias=_maybe(draw, False),
        trainable=_rarely(draw, False, 6),
        lora_rank=_rarely(draw, 2, 4) if lora else None,
    )


# equation, output shape and the output axes a bias may take, by the rank
# of the input (samples left out) and a width u: the projections of a
# transformer (per head, heads back), a Dense on positions, transposed
EINSUM_EQUATIONS = {
    1: [lambda shape, u: ("ab,bc->ac", (u,), "c")],
    2: [
        lambda shape, u: ("abc,cd->abd", (shape[0], u), "d"),
        lambda shape, u: ("abc,cde->abde", (shape[0], 2, u), "de"),
        lambda shape, u: ("abc,cd->adb", (u, shape[0]), "b"),
        lambda shape, u: ("...b,bc->...c", (u,), "c"),
    ],
    3: [
        lambda shape, u: ("abcd,cde->abe", (shape[0], u), "e"),
        lambda shape, u: ("...b,bc->...c", (u,), "c"),
    ],
}


def _einsum_dense(draw, t, lora=False):
    """EinsumDense on ``t``: an equation of its rank, perhaps a bias, an
    activation, LoRA (``lora``, as :func:`_dense`)."""
    make = draw(st.sampled_from(EINSUM_EQUATIONS[t.rank]))
    equation, output_shape, bias_axes = make(t.shape, draw(st.integers(1, 3)))
    return _call(
        "EinsumDense",
        equation,
        output_shape,
        bias_axes=_maybe(draw, bias_axes),
        activation=_maybe(draw, draw(st.sampled_from(["tanh", "relu", "gelu"]))),
        lora_rank=_rarely(draw, 2, 3) if lora else None,
    )


def _activation_layer(draw):
    kind = draw(st.sampled_from(["Activation", "ReLU", "LeakyReLU", "ELU",
                                 "Softmax", "PReLU"]))  # fmt: skip
    if kind == "Activation":
        return _call("Activation", draw(activations))
    if kind == "ReLU":
        return _call(
            "ReLU",
            max_value=_maybe(draw, draw(st.sampled_from([0.5, 1.0, 6.0]))),
            negative_slope=_maybe(draw, 0.1),
            threshold=_maybe(draw, draw(st.sampled_from([-0.2, 0.1]))),
        )
    if kind == "LeakyReLU":
        return _call("LeakyReLU", negative_slope=draw(st.sampled_from([0.05, 0.3])))
    if kind == "ELU":
        return _call("ELU", alpha=draw(st.sampled_from([0.5, 1.0, 1.5])))
    if kind == "Softmax":
        return _call("Softmax", axis=-1)
    return _call("PReLU")


def _identity_layer(draw, t):
    """Layers that are the identity at inference."""
    names = ["Dropout", "GaussianNoise", "GaussianDropout", "AlphaDropout",
             "ActivityRegularization"]  # fmt: skip
    if t.rank == 2:
        names.append("SpatialDropout1D")
    if t.rank == 3:
        names.append("SpatialDropout2D")
    name = draw(st.sampled_from(names))
    if name == "GaussianNoise":
        return _call(name, 0.1)
    if name == "ActivityRegularization":
        return _call(name, l1=0.01, l2=0.01)
    return _call(name, 0.3)


def _normalization(draw, t):
    """LayerNormalization (perhaps RMS-scaled), RMSNormalization or
    BatchNormalization, any axis and option."""
    kind = draw(st.sampled_from(["LayerNormalization", "BatchNormalization",
                                 "RMSNormalization"]))  # fmt: skip
    axes = [-1]
    if t.rank > 1:
        axes += list(range(1, t.rank))
        if kind != "BatchNormalization":
            axes.append(list(range(1, t.rank + 1)))
    if kind == "RMSNormalization":  # Keras's scale broadcasts on the last axes only
        axes = [a for a in axes if a == -1 or isinstance(a, list)]
    axis = draw(st.sampled_from(axes))
    if kind == "RMSNormalization":
        return _call(kind, axis=None if axis == -1 else axis,
                     epsilon=_maybe(draw, 0.01))  # fmt: skip
    options = {
        "axis": None if axis == -1 else axis,
        "center": _maybe(draw, False),
        "scale": _maybe(draw, False),
        "epsilon": _maybe(draw, 0.01),
        "trainable": _rarely(draw, False, 5),
    }
    if kind == "LayerNormalization" and axis == -1:
        options["rms_scaling"] = _rarely(draw, True, 3)
    return _call(kind, **options)


CALL_ARGUMENTS = {
    "Clip": ("limit", [0.3, 0.8]),
    "Scale": ("factor", [3.0, -0.5]),
    "Affine": ("shift", [0.5, -1.0]),
}


def _custom_layer(draw, functional):
    """A custom layer, with a keyword call argument in a functional model."""
    name = draw(st.sampled_from(sorted(CUSTOM_LAYERS)))
    layer = _call(name, prefix="")
    if not functional or name not in CALL_ARGUMENTS or not draw(st.booleans()):
        return layer, ""
    keyword, values = CALL_ARGUMENTS[name]
    return layer, f", {keyword}={draw(st.sampled_from(values))!r}"


def _conv(draw, t):
    """Conv1D on (steps, channels) or Conv2D on (h, w, channels): kernel,
    strides, padding (causal for 1D), dilation, groups, activation, bias."""
    spatial, channels = t.shape[:-1], t.shape[-1]
    two = len(spatial) == 2
    kernel = draw(st.integers(1, 3))
    dilation = _maybe(draw, 2, 1)
    strides = 1 if dilation > 1 else draw(st.sampled_from([1, 1, 2]))
    padding = draw(st.sampled_from(["valid", "same"] + ([] if two else ["causal"])))
    if padding == "valid" and (kernel - 1) * dilation + 1 > min(spatial):
        kernel, dilation = 1, 1
    groups = 1
    divisors = [g for g in range(2, channels + 1) if channels % g == 0]
    if divisors and draw(st.integers(0, 2)) == 0:
        groups = draw(st.sampled_from(divisors))
    filters = groups * draw(st.integers(1, 3 if groups == 1 else 2))
    if two and draw(st.booleans()):
        kernel = (kernel, draw(st.integers(1, min(2, *spatial))))
    return _call(
        "Conv2D" if two else "Conv1D",
        filters,
        kernel,
        strides=strides if strides > 1 else None,
        padding=padding if padding != "valid" else None,
        dilation_rate=dilation if dilation > 1 else None,
        groups=groups if groups > 1 else None,
        activation=_maybe(draw, draw(activations)),
        use_bias=_maybe(draw, False),
        trainable=_rarely(draw, False, 6),
    )


def _pooling(draw, t):
    suffix = "2D" if t.rank == 3 else "1D"
    kind = draw(st.sampled_from(["Max", "Average", "GlobalMax", "GlobalAverage"]))
    if kind.startswith("Global"):
        return _call(f"{kind}Pooling{suffix}", keepdims=_maybe(draw, True))
    padding = draw(st.sampled_from(["valid", "same"]))
    return _call(
        f"{kind}Pooling{suffix}",
        2,
        strides=_maybe(draw, 1),
        padding=None if padding == "valid" else padding,
    )


def _recurrent(draw, functional):
    """LSTM, GRU or SimpleRNN with their options, perhaps in a Bidirectional.

    Returns the layer and the call's suffix: with ``return_state=True`` the
    result is a list (the output, then the states), indexed here.
    """
    kind = draw(st.sampled_from(["LSTM", "GRU", "SimpleRNN"]))
    options = {
        "return_sequences": _maybe(draw, True),
        "go_backwards": _rarely(draw, True),
        "activation": _maybe(draw, draw(st.sampled_from(RECURRENT_ACTIVATIONS))),
        "use_bias": _maybe(draw, False),
        "dropout": _rarely(draw, 0.2),
        "recurrent_dropout": _rarely(draw, 0.2),
        "unroll": _rarely(draw, True),
    }
    if kind != "SimpleRNN":
        options["recurrent_activation"] = _maybe(
            draw, draw(st.sampled_from(GATE_ACTIVATIONS))
        )
    if kind == "GRU":
        options["reset_after"] = _maybe(draw, False)
    units = draw(st.integers(1, 3))
    bidirectional = draw(st.integers(1, 4)) == 1
    state = functional and not bidirectional and draw(st.integers(1, 5)) == 1
    if state:
        options["return_state"] = True
    layer = _call(kind, units, **options)
    if bidirectional:
        merge = draw(st.sampled_from(["concat", "sum", "ave", "mul"]))
        layer = _call("Bidirectional", _Code(layer), merge_mode=merge)
    if not state:
        return layer, ""
    return layer, f"[{draw(st.integers(0, 2 if kind == 'LSTM' else 1))}]"


def _reshape(draw, t):
    """Flatten, or a reshape to another rank."""
    if t.rank == 1:
        if draw(st.booleans()):
            return _call("Reshape", (t.shape[0], 1))
        return _call("RepeatVector", 2)
    if t.rank == 3 and draw(st.booleans()):
        return _call("Reshape", (t.shape[0] * t.shape[1], t.shape[2]))
    if t.rank == 2 and draw(st.booleans()):
        return _call("Permute", (2, 1))
    return _call("Flatten")


def _padding_layer(draw, t):
    suffix = "1D" if t.rank == 2 else "2D"
    return _call(draw(st.sampled_from(["ZeroPadding", "UpSampling"])) + suffix, 1)


def _other_layer(draw, t):
    """Common layers without a rule of their own (autodiff passes their signal)."""
    names = ["Lambda", "Rescaling", "UnitNormalization", "Identity"]
    if t.rank == 2:
        names += ["DepthwiseConv1D", "SeparableConv1D", "Conv1DTranspose",
                  "TimeDistributed", "Cropping1D"]  # fmt: skip
    if t.rank == 3:
        names += ["DepthwiseConv2D", "SeparableConv2D", "Conv2DTranspose"]
    channels = t.shape[-1]
    groups = [g for g in (2, 3) if t.rank > 1 and channels % g == 0]
    if groups:
        names.append("GroupNormalization")
    name = draw(st.sampled_from(names))
    if name == "Lambda":
        return _call(name, _Code("lambda t: t * 2 - ops.tanh(t)"))
    if name == "Rescaling":
        return _call(name, 0.5, offset=0.1)
    if name == "TimeDistributed":
        return _call(name, _Code(_dense(draw)))
    if name == "Cropping1D":
        return _call(name, (1, 0))
    if name == "GroupNormalization":
        return _call(name, groups=draw(st.sampled_from(groups)))
    if name.startswith(("Depthwise", "Separable", "Conv")):
        options = {"padding": _maybe(draw, "same")}
        if name.startswith("Depthwise"):
            options["depth_multiplier"] = _maybe(draw, 2)
            return _call(name, 2, **options)
        return _call(name, draw(st.integers(1, 2)), 2, **options)
    return _call(name)


def _layer(draw, t, functional, lora=False):
    """One layer for a float tensor ``t``: (layer expression, call suffix);
    ``lora``: Dense and EinsumDense may have LoRA (float32 programs)."""
    kinds = ["dense", "dense", "activation", "identity", "normalization",
             "custom", "reshape", "other", "einsum"]  # fmt: skip
    if t.rank >= 2:
        kinds += ["conv", "conv", "pooling", "padding"]
    if t.rank == 2:
        kinds += ["recurrent", "recurrent"]
    kind = draw(st.sampled_from(kinds))
    if kind == "custom":
        return _custom_layer(draw, functional)
    if kind == "recurrent":
        return _recurrent(draw, functional)
    make = {
        "dense": lambda: _dense(draw, lora=lora),
        "einsum": lambda: _einsum_dense(draw, t, lora=lora),
        "activation": lambda: _activation_layer(draw),
        "identity": lambda: _identity_layer(draw, t),
        "normalization": lambda: _normalization(draw, t),
        "reshape": lambda: _reshape(draw, t),
        "conv": lambda: _conv(draw, t),
        "pooling": lambda: _pooling(draw, t),
        "padding": lambda: _padding_layer(draw, t),
        "other": lambda: _other_layer(draw, t),
    }[kind]
    return make(), ""


def _embedding(draw, t):
    return _call(
        "Embedding", t.vocabulary, draw(st.integers(2, 3)), mask_zero=_maybe(draw, True)
    )


def _head(draw, program, t, loss=None):
    """Layers that make ``t`` an output: at most MAX_OUTPUTS wide, or the head
    a loss needs (Dense(width, activation) on a flat input). Returns the new
    tensor and the layer expressions applied."""
    applied = []

    def apply(layer):
        applied.append(layer)
        return program.apply(layer, t)

    if loss is not None and loss.keep_rank and t.rank == 2:
        t = apply(_dense(draw, units=loss.width, activation=loss.activation))
        return t, applied
    if t.size <= MAX_OUTPUTS and loss is None:
        return t, applied
    if t.rank > 1:
        if t.rank in (2, 3) and draw(st.booleans()):
            pool = draw(st.sampled_from(["GlobalAveragePooling", "GlobalMaxPooling"]))
            t = apply(_call(f"{pool}{t.rank - 1}D"))
        else:
            t = apply(_call("Flatten"))
    if loss is not None:
        t = apply(_dense(draw, units=loss.width, activation=loss.activation))
    elif t.size > MAX_OUTPUTS:
        t = apply(_dense(draw, glu=True))
    return t, applied


# --- losses -------------------------------------------------------------------

LOSSES = {
    # name: (loss function, head activation (None: any), target kind)
    "mse": ("keras.losses.mean_squared_error", None, "values"),
    "sparse_ce": ("keras.losses.sparse_categorical_crossentropy", "softmax", "ids"),
    "ce": ("keras.losses.categorical_crossentropy", "softmax", "one_hot"),
    "bce": ("keras.losses.binary_crossentropy", "sigmoid", "binary"),
    "sparse_ce_logits": (
        "functools.partial(keras.losses.sparse_categorical_crossentropy, "
        "from_logits=True)",
        "linear",
        "ids",
    ),
    "bce_logits": (
        "functools.partial(keras.losses.binary_crossentropy, from_logits=True)",
        "linear",
        "binary",
    ),
    # Keras's other built-in losses, with their options (issue 34)
    "ce_smoothing": (
        "functools.partial(keras.losses.categorical_crossentropy, label_smoothing=0.2)",
        "softmax",
        "one_hot",
    ),
    "bce_smoothing": (
        "functools.partial(keras.losses.binary_crossentropy, label_smoothing=0.2)",
        "sigmoid",
        "binary",
    ),
    "focal": ("keras.losses.binary_focal_crossentropy", "sigmoid", "binary"),
    "focal_balanced": (
        "functools.partial(keras.losses.binary_focal_crossentropy, "
        "apply_class_balancing=True, gamma=1.5)",
        "sigmoid",
        "binary",
    ),
    "focal_logits": (
        "functools.partial(keras.losses.binary_focal_crossentropy, from_logits=True)",
        "linear",
        "binary",
    ),
    "categorical_focal": (
        "keras.losses.categorical_focal_crossentropy",
        "softmax",
        "one_hot",
    ),
    "kld": ("keras.losses.kl_divergence", "softmax", "one_hot"),
    "mae": ("keras.losses.mean_absolute_error", None, "values"),
    "huber": ("keras.losses.huber", None, "values"),
    "log_cosh": ("keras.losses.log_cosh", None, "values"),
    "cosine": ("keras.losses.cosine_similarity", None, "values"),
    "poisson": ("keras.losses.poisson", "softplus", "values"),
    "hinge": ("keras.losses.hinge", "linear", "binary"),
    "categorical_hinge": ("keras.losses.categorical_hinge", "linear", "one_hot"),
    # custom losses reading the probabilities, the logits, or both
    "brier": ("brier_score", "softmax", "one_hot"),
    "ce_plus_entropy": ("confidence_penalty", "softmax", "ids"),
    "focal_plus_brier": ("focal_plus_brier", "sigmoid", "binary"),
}


def brier_score(y, p):
    """A custom loss that reads only the probabilities (not Keras's logits)."""
    return tf.reduce_sum(tf.square(p - y), axis=-1)


def confidence_penalty(y, p):
    """Cross-entropy (Keras reads the cached logits) plus a penalty on
    confident predictions (reads the probabilities): both paths at once."""
    entropy = tf.reduce_sum(p * tf.math.log(p + 1e-7), axis=-1)
    return keras.losses.sparse_categorical_crossentropy(y, p) + 0.3 * entropy


def focal_plus_brier(y, p):
    """Keras's focal loss (logits and probabilities) plus a Brier term."""
    return keras.losses.binary_focal_crossentropy(y, p) + tf.reduce_mean(
        tf.square(p - y), axis=-1
    )


@dataclass
class _Loss:
    name: str
    activation: str
    width: int
    keep_rank: bool  # mean squared error on a (steps, width) output

    @property
    def function(self):
        return LOSSES[self.name][0]

    def target_line(self, n, out_shape):
        kind = LOSSES[self.name][2]
        return "y = " + target_expression(kind, self.width, (n, *out_shape))


def target_expression(kind, width, shape):
    """Source that draws targets of ``kind`` for an output of ``shape``."""
    n = shape[0]
    if kind == "ids":
        return f"rng.integers(0, {width}, ({n},))"
    if kind == "one_hot":
        return f"np.eye({width}, dtype=dtype)[rng.integers(0, {width}, {n})]"
    if kind == "binary":
        return f"rng.integers(0, 2, ({n}, {width})).astype(dtype)"
    return f"rng.standard_normal({tuple(shape)!r}).astype(dtype)"


@st.composite
def losses(draw):
    """A Keras loss and the head activation that matches it."""
    name = draw(st.sampled_from(sorted(LOSSES)))
    activation, target = LOSSES[name][1:]
    width = draw(st.integers(1, 3) if target == "binary" else st.integers(2, 4))
    if activation is None:
        activation = draw(st.sampled_from(KERAS_ACTIVATIONS))
    return _Loss(name, activation, width, name == "mse" and draw(st.booleans()))


# --- inputs, variables, the batch ---------------------------------------------


def _data_lines(inputs, style, n):
    """``x = ...``: one array per input, in the model's own structure."""
    arrays = []
    for t in inputs:
        shape = (n, *t.shape)
        if t.vocabulary:
            arrays.append(f"rng.integers(0, {t.vocabulary}, {shape!r}).astype('int32')")
        else:
            arrays.append(f"rng.standard_normal({shape!r}).astype(dtype)")
    if style == "one":
        x = arrays[0]
    elif style == "dict":
        pairs = zip(inputs, arrays, strict=True)
        x = "{" + ", ".join(f"{t.name!r}: {a}" for t, a in pairs) + "}"
    else:
        x = f"[{', '.join(arrays)}]"
    return ["rng = np.random.default_rng(seed)", f"x = {x}"]


def _variable_lines(draw, model):
    """``variables = ...``: the trainable ones, a subset, reordered, or with
    non-trainable ones (a frozen layer's kernel, BatchNorm's moving mean).
    Returns the lines and whether they pick variables themselves."""
    trainable = {id(v) for v in model.trainable_variables}
    floats = [
        i for i, v in enumerate(model.weights) if tf.as_dtype(v.dtype).is_floating
    ]
    ours = [i for i in floats if id(model.weights[i]) in trainable]
    if not ours:
        reject()  # every layer frozen: no columns
    mode = draw(st.sampled_from(["trainable", "trainable", "subset", "reordered",
                                 "with_frozen"]))  # fmt: skip
    if mode == "trainable" or len(floats) == 1:
        return ["variables = model.trainable_variables"], False
    pool = floats if mode == "with_frozen" else ours
    chosen = draw(st.lists(st.sampled_from(pool), min_size=1, unique=True))
    if mode != "reordered":
        chosen = sorted(chosen)
    return [f"variables = [model.weights[i] for i in {tuple(chosen)!r}]"], True


def _finish(draw, program, family, inputs, style, model_line, out, loss=None):
    """The whole program: the model, its weights, the batch, the variables,
    the chunk size and (for a loss) the loss and its targets."""
    program.line(model_line)
    model = program.ns["model"]
    if model.count_params() > MAX_PARAMS:
        reject()
    variable_lines, explicit = _variable_lines(draw, model)
    seed = draw(st.integers(0, 2**16))
    n = draw(st.integers(1, MAX_SAMPLES))
    if n > 1 and draw(st.booleans()):
        chunk_size = n - 1  # the last chunk holds one sample
    else:
        chunk_size = draw(st.integers(1, n))
    lines = [
        "keras.utils.set_random_seed(seed)",
        *program.lines,
        "perturb(model, seed)",
        *_data_lines(inputs, style, n),
        *variable_lines,
        f"chunk_size = {chunk_size}",
    ]
    if loss is not None:
        lines += [f"loss = {loss.function}", loss.target_line(n, out.shape)]
        family += f"/{loss.name}"
    source = f"dtype = {program.dtype!r}\nseed = {seed}\n" + "\n".join(lines)
    features = _features(source) | ({"variables"} if explicit else set())
    return Case(family, program.dtype, source, features)


dtypes = st.sampled_from(["float32", "float64"])


# --- chains -------------------------------------------------------------------


def _sequential_line(x, chain, nested):
    dtype = "'int32'" if x.vocabulary else "dtype"
    items = [f"keras.Input({x.shape!r}, dtype={dtype})"]
    if nested and len(chain) >= 2:
        cut = len(chain) // 2
        items.append(f"keras.Sequential([{', '.join(chain[:cut])}])")
        chain = chain[cut:]
    items += chain
    return "model = keras.Sequential([\n    " + ",\n    ".join(items) + ",\n])"


@st.composite
def chain_cases(draw, loss=None):
    """One input and one output through a chain of layers: a Sequential, a
    functional chain, or a Sequential holding a nested one."""
    program = _Program(draw(dtypes))
    style = draw(st.sampled_from(["sequential", "functional", "nested"]))
    functional = style == "functional"
    x = _input(draw, program)
    t, chain = x, []
    if x.vocabulary:
        chain.append(_embedding(draw, x))
        t = program.apply(chain[-1], t)
    for _ in range(draw(st.integers(1, 3 if loss else 4))):
        layer, suffix = _layer(draw, t, functional, program.dtype == "float32")
        chain.append(layer)
        t = program.apply(layer, t, suffix)
    t, applied = _head(draw, program, t, loss)
    chain += applied
    if functional:
        model_line = f"model = keras.Model({x.name}, {t.name})"
    else:
        model_line = _sequential_line(x, chain, style == "nested")
        program.lines = []  # the Sequential holds the layers itself
    return _finish(draw, program, f"chain/{style}", [x], "one", model_line, t, loss)


@st.composite
def wide_cases(draw):
    """Many outputs, few columns: 100 or more outputs per parameter, where
    ``jacutil.jacobian`` picks forward mode itself. A same-padded 10x10 image
    stack, the columns one bias (or a LayerNorm's beta) of one element."""
    program = _Program(draw(dtypes))
    x = program.input((10, 10, 1))
    chain = [
        _call("Conv2D", 1, 3, padding="same", activation=draw(activations)),
        _call("Conv2D", 1, draw(st.integers(1, 3)), padding="same",
              activation=_maybe(draw, draw(activations))),
    ]  # fmt: skip
    if draw(st.booleans()):
        chain.insert(1, _call("LayerNormalization", axis=draw(st.sampled_from(
            [-1, [1, 2, 3]]))))  # fmt: skip
    t = x
    for layer in chain:
        t = program.apply(layer, t)
    model_line = _sequential_line(x, chain, False)
    program.lines = []
    program.line(model_line)
    model = program.ns["model"]
    columns = [i for i, v in enumerate(model.weights)
               if int(np.prod(v.shape)) == 1 and v.trainable]  # fmt: skip
    index = draw(st.sampled_from(columns))
    seed = draw(st.integers(0, 2**16))
    n = draw(st.integers(1, 3))
    lines = [
        "keras.utils.set_random_seed(seed)",
        *program.lines,
        "perturb(model, seed)",
        *_data_lines([x], "one", n),
        f"variables = [model.weights[{index}]]",
        f"chunk_size = {max(1, n - 1)}",
    ]
    source = f"dtype = {program.dtype!r}\nseed = {seed}\n" + "\n".join(lines)
    return Case("wide", program.dtype, source, _features(source) | {"variables"})


# --- graphs -------------------------------------------------------------------

OPS_UNARY = (
    "ops.tanh({})", "{} * 2.0", "ops.sin({})", "{} + 1.0", "ops.square({})",
    "ops.relu({})", "ops.sigmoid({})", "ops.exp(-ops.square({}))", "1.0 - {}",
    "ops.softplus({})", "ops.mean({}, axis=-1, keepdims=True)", "ops.abs({})",
)  # fmt: skip
GRAPH_STEPS = ("layer", "ops", "branch", "concatenate", "shared", "nested", "custom",
               "attention")  # fmt: skip
OPS_BINARY = ("{} + {}", "{} * {}", "ops.maximum({}, {})")
MERGES = ("Add", "Subtract", "Multiply", "Average", "Maximum", "Concatenate")


def _branches(draw, program, t):
    """Two branches from ``t`` with one shape (one may be ``t``: a residual)."""
    units = draw(st.integers(1, 4))
    left = program.apply(_dense(draw, units=units), t)
    if t.shape[-1] == units and draw(st.booleans()):
        return t, left
    return left, program.apply(_dense(draw, units=units), t)


def _merged(draw, program, a, b):
    """A merge layer of two same-shaped tensors, or a keras.ops between them."""
    if draw(st.integers(1, 4)) == 1:
        return program.tensor(draw(st.sampled_from(OPS_BINARY)).format(a.name, b.name))
    name = draw(st.sampled_from(MERGES))
    return program.tensor(f"{_call(name)}([{a.name}, {b.name}])")


@st.composite
def graph_cases(draw, loss=None):
    """Functional graphs: branches, merges, keras.ops, custom layers with call
    arguments, shared, frozen and nested layers; one or two inputs (one
    array, a list or a dict) and one or two outputs (one, a list or a dict)."""
    program = _Program(draw(dtypes))
    n_inputs = draw(st.integers(1, 2))
    names = ["a", "b"] if n_inputs > 1 and draw(st.booleans()) else [None, None]
    kinds = ("vector", "vector", "sequence", "ids")
    inputs = [_input(draw, program, kinds, name) for name in names[:n_inputs]]
    pool = []
    for t in inputs:
        pool.append(program.apply(_embedding(draw, t), t) if t.vocabulary else t)
    dangling = list(pool)

    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(GRAPH_STEPS))
        t = draw(st.sampled_from(pool))
        used = [t]
        if kind == "attention" and t.rank == 2:  # self- or cross-attention
            layer = _call("MultiHeadAttention", num_heads=draw(st.integers(1, 2)),
                          key_dim=2)  # fmt: skip
            u = draw(st.sampled_from(pool))
            u = u if u.rank == 2 else t
            used.append(u)
            causal = _rarely(draw, ", use_causal_mask=True", 3) or ""
            new = program.tensor(f"{layer}({t.name}, {u.name}{causal})")
        elif kind in ("layer", "attention"):
            layer, suffix = _layer(draw, t, True, program.dtype == "float32")
            new = program.apply(layer, t, suffix)
        elif kind == "custom":
            layer, suffix = _custom_layer(draw, True)
            new = program.apply(layer, t, suffix)
        elif kind == "ops":
            new = program.tensor(draw(st.sampled_from(OPS_UNARY)).format(t.name))
        elif kind == "branch":
            new = _merged(draw, program, *_branches(draw, program, t))
        elif kind == "concatenate":
            u = draw(st.sampled_from(pool))
            if u is t or u.shape[:-1] != t.shape[:-1]:
                u = program.apply(_dense(draw), t)
            used.append(u)
            new = program.tensor(f"{_call('Concatenate')}([{t.name}, {u.name}])")
        elif kind == "shared":  # one Dense applied twice
            shared = f"shared{program.count}"
            program.line(f"{shared} = {_dense(draw, units=t.shape[-1])}")
            new = program.apply(shared, program.apply(shared, t))
        else:  # a Sequential as a layer
            inner = ", ".join([_dense(draw), _dense(draw)])
            new = program.apply(f"keras.Sequential([{inner}])", t)
        dangling = [d for d in dangling if d not in used]
        pool.append(new)
        dangling.append(new)

    # every input reaches an output: join what is left, then the heads
    flat = [d if d.rank == 1 else program.apply(_call("Flatten"), d) for d in dangling]
    joined = flat[0]
    if len(flat) > 1:
        joined = program.tensor(
            f"{_call('Concatenate')}([{', '.join(t.name for t in flat)}])"
        )
    outputs = "one" if loss else draw(st.sampled_from(["one", "list", "dict"]))
    out, _ = _head(draw, program, joined, loss)
    model_outputs = out.name
    if outputs != "one":
        other = program.apply(_dense(draw, glu=True), joined)
        if outputs == "list":
            model_outputs = f"[{out.name}, {other.name}]"
        else:  # sorted keys ("score", "vector") are not the insertion order
            model_outputs = f"{{'vector': {out.name}, 'score': {other.name}}}"
    if n_inputs == 1:
        model_inputs, style = inputs[0].name, "one"
    elif names[0] is not None:
        items = ", ".join(f"{n!r}: {t.name}" for n, t in zip(names, inputs,
                                                              strict=True))  # fmt: skip
        model_inputs, style = "{" + items + "}", "dict"
        pairs = zip(names, inputs, strict=True)
        inputs = [_T(n, t.shape, t.vocabulary) for n, t in pairs]
    else:
        model_inputs, style = f"[{', '.join(t.name for t in inputs)}]", "list"
    model_line = f"model = keras.Model({model_inputs}, {model_outputs})"
    return _finish(draw, program, "graph", inputs, style, model_line, out, loss)


@st.composite
def loss_cases(draw):
    """A chain or a one-output graph ending in the head a Keras loss needs."""
    loss = draw(losses())
    if draw(st.booleans()):
        return draw(chain_cases(loss=loss))
    return draw(graph_cases(loss=loss))


# --- curvature: heads, each with its own Keras loss (issue 34) ----------------

CURVATURE_LOSSES = {
    # name: (the loss as the program writes it, the head's activation
    # (None: any), the target kind)
    "mse": ("keras.losses.MeanSquaredError(reduction={reduction!r})", None, "values"),
    "sparse_ce": (
        "keras.losses.SparseCategoricalCrossentropy(from_logits=True, "
        "reduction={reduction!r})",
        "linear",
        "ids",
    ),
    "ce": (
        "keras.losses.CategoricalCrossentropy(from_logits=True, "
        "label_smoothing={smoothing}, reduction={reduction!r})",
        "linear",
        "one_hot",
    ),
    "bce": (
        "keras.losses.BinaryCrossentropy(from_logits=True, "
        "label_smoothing={smoothing}, reduction={reduction!r})",
        "linear",
        "binary",
    ),
    "huber": ("keras.losses.Huber(delta=0.5, reduction={reduction!r})", None, "values"),
    "mse_name": ("'mse'", None, "values"),
    "log_cosh_function": ("keras.losses.log_cosh", None, "values"),
    "squared_error": ("'squared_error'", None, "values"),
    "softmax_cross_entropy": ("'softmax_cross_entropy'", "linear", "ids"),
    "sigmoid_cross_entropy": ("'sigmoid_cross_entropy'", "linear", "binary"),
}
HEAD_ACTIVATIONS = ("linear", "tanh", "softplus")


@dataclass
class _HeadLoss(_Loss):
    expression: str = ""

    @property
    def function(self):
        return self.expression

    def target_expression(self, n):
        kind = CURVATURE_LOSSES[self.name][2]
        return target_expression(kind, self.width, (n, self.width))


@st.composite
def curvature_losses(draw):
    """One head's loss for curvature: a Keras loss object (its reduction and
    label smoothing drawn), a Keras name, a plain function or one of
    jacutil's names; the head outputs logits where the loss needs them."""
    name = draw(st.sampled_from(sorted(CURVATURE_LOSSES)))
    template, activation, target = CURVATURE_LOSSES[name]
    few = target in ("binary", "values")
    width = draw(st.integers(1, 3) if few else st.integers(2, 4))
    reduction = draw(st.sampled_from(["sum", "sum_over_batch_size"]))
    smoothing = draw(st.sampled_from([0.0, 0.2]))
    expression = template.format(reduction=reduction, smoothing=smoothing)
    if activation is None:
        activation = draw(st.sampled_from(HEAD_ACTIVATIONS))
    return _HeadLoss(name, activation, width, False, expression)


@st.composite
def head_cases(draw):
    """A trunk of one to two layers, then one or two Dense heads (as a list
    or a dict), each with its own loss and class count; sample weights half
    the time. The program defines ``loss`` (one, or one per head, as
    ``model.compile`` takes them), ``y`` in the heads' structure and
    ``sample_weight`` (or None)."""
    program = _Program(draw(dtypes))
    x = _input(draw, program, ("vector", "sequence", "image"))
    t = x
    for _ in range(draw(st.integers(1, 2))):
        layer, suffix = _layer(draw, t, True)
        t = program.apply(layer, t, suffix)
    if t.rank > 1:
        t = program.apply(_call("Flatten"), t)
    losses = [draw(curvature_losses()) for _ in range(draw(st.integers(1, 2)))]
    heads = [
        program.apply(_dense(draw, units=h.width, activation=h.activation), t)
        for h in losses
    ]
    style = "one" if len(heads) == 1 else draw(st.sampled_from(["list", "dict"]))
    if style == "one":
        outputs = heads[0].name
    elif style == "list":
        outputs = f"[{', '.join(h.name for h in heads)}]"
    else:  # keys out of insertion order: flatten sorts them
        outputs = f"{{'b': {heads[0].name}, 'a': {heads[1].name}}}"
    model_line = f"model = keras.Model({x.name}, {outputs})"
    case = _finish(draw, program, f"heads/{style}", [x], "one", model_line, heads[0])
    n = int(re.search(r"x = rng.standard_normal\(\((\d+),", case.source).group(1))
    names = [h.name for h in losses]
    expressions = [h.function for h in losses]
    targets = [h.target_expression(n) for h in losses]
    if style == "one":
        lines = [f"loss = {expressions[0]}", f"y = {targets[0]}"]
    elif style == "list":
        lines = [f"loss = [{', '.join(expressions)}]", f"y = [{', '.join(targets)}]"]
    else:
        lines = [
            f"loss = {{'b': {expressions[0]}, 'a': {expressions[1]}}}",
            f"y = {{'b': {targets[0]}, 'a': {targets[1]}}}",
        ]
    weighted = f"rng.uniform(0.5, 2.0, {n})" if draw(st.booleans()) else "None"
    lines.append(f"sample_weight = {weighted}")
    source = case.source + "\n" + "\n".join(lines)
    family = f"{case.family}/{'+'.join(names)}"
    return Case(family, case.dtype, source, case.features | _features(source))


JACUTIL_SUMS = {
    # jacutil's plain names: the sum over samples of each sample's loss
    "squared_error": lambda y, f: 0.5 * tf.reduce_sum(tf.square(f - y), axis=-1),
    "softmax_cross_entropy": lambda y, f: (
        -tf.reduce_sum(
            tf.one_hot(
                tf.cast(tf.reshape(y, [-1]), tf.int32), f.shape[-1], dtype=f.dtype
            )
            * tf.nn.log_softmax(f),
            axis=-1,
        )
    ),
    "sigmoid_cross_entropy": lambda y, f: tf.reduce_sum(
        tf.math.softplus(f) - y * f, axis=-1
    ),
}


def _head_terms(loss, y, outputs, sample_weight, summed=False):
    """Each head's ``(values, coefficient)`` as Keras reduces them: the head's
    unreduced loss per sample (n,), summed over its positions, and each
    sample's share of it in the batch's loss (n,): the sample weight over the
    head's reduction (a plain function: Keras's default mean, over the
    values; jacutil's names sum over samples). ``outputs`` is the model's
    output structure, float64. ``summed``: every head summed over samples
    (a likelihood, as Laplace takes it), whatever its reduction."""
    heads = tf.nest.flatten(outputs)
    if isinstance(loss, dict):
        losses, targets = [loss[k] for k in sorted(loss)], [y[k] for k in sorted(y)]
    elif isinstance(loss, (list, tuple)):
        losses, targets = list(loss), list(y)
    else:
        losses, targets = [loss] * len(heads), [y]
    n = int(heads[0].shape[0])
    weights = np.ones(n) if sample_weight is None else np.asarray(sample_weight)
    for fn, t, f in zip(losses, targets, heads, strict=True):
        t = tf.constant(np.asarray(t), tf.float64)
        if isinstance(fn, str) and fn in JACUTIL_SUMS:
            yield JACUTIL_SUMS[fn](t, f), weights
            continue
        if isinstance(fn, str):
            fn = keras.losses.get(fn)
        mean = True  # a function: Keras's default, the mean over the values
        if isinstance(fn, keras.losses.Loss):
            # its values, reduced here: calling the object would compute in
            # its own dtype (float32 by default), whatever the model's
            mean, fn = fn.reduction == "sum_over_batch_size", fn.call
        values = tf.cast(fn(t, f), tf.float64)
        size = int(np.prod(values.shape)) if mean and not summed else 1
        per_sample = tf.reduce_sum(tf.reshape(values, [n, -1]), axis=1)
        yield per_sample, weights / size


def total_loss(loss, y, outputs, sample_weight, summed=False):
    """The scalar loss of a batch as Keras computes it: each head's loss
    with its own reduction, the heads added (:func:`_head_terms`)."""
    total = tf.constant(0.0, tf.float64)
    for values, coefficient in _head_terms(loss, y, outputs, sample_weight, summed):
        total += tf.reduce_sum(tf.constant(coefficient, tf.float64) * values)
    return total


def _flat_outputs(model, x):
    """The model's outputs as (n, l) float64 rows, their sizes and shapes."""
    outputs = model(x, training=False)
    leaves = [tf.cast(tf.reshape(f, [f.shape[0], -1]), tf.float64)
              for f in tf.nest.flatten(outputs)]  # fmt: skip
    sizes = [int(leaf.shape[1]) for leaf in leaves]
    shapes = [tuple(f.shape) for f in tf.nest.flatten(outputs)]
    return outputs, tf.concat(leaves, axis=1), sizes, shapes


def _packed(outputs, flat, sizes, shapes):
    pieces = tf.split(flat, sizes, axis=1)
    parts = [tf.reshape(p, s) for p, s in zip(pieces, shapes, strict=True)]
    return tf.nest.pack_sequence_as(outputs, parts)


def fisher_rows(model, x, loss, y, sample_weight):
    """(n, l): each sample's ``sum_h sqrt(c_ih) dL_ih/df_i``, ``c_ih`` its
    share of head h's loss in the batch's (:func:`_head_terms`), by a
    float64 tape: the empirical Fisher is ``sum_i J_i.T r_i r_i.T J_i``."""
    outputs, flat, sizes, shapes = _flat_outputs(model, x)
    with tf.GradientTape() as tape:
        tape.watch(flat)
        packed = _packed(outputs, flat, sizes, shapes)
        terms = _head_terms(loss, y, packed, sample_weight)
        score = tf.add_n([
            tf.reduce_sum(tf.constant(np.sqrt(c), tf.float64) * values)
            for values, c in terms
        ])  # fmt: skip
    return tape.gradient(score, flat).numpy()


def output_hessians(model, x, loss, y, sample_weight, summed=False):
    """(n, l, l): each sample's Hessian of the batch's loss at its outputs,
    by nested tapes in float64 (the off-diagonal sample blocks are zero for
    every loss here, and are checked to be)."""
    outputs, flat, sizes, shapes = _flat_outputs(model, x)
    n, width = flat.shape
    with tf.GradientTape(persistent=True) as outer:
        outer.watch(flat)
        with tf.GradientTape() as inner:
            inner.watch(flat)
            value = total_loss(loss, y, _packed(outputs, flat, sizes, shapes),
                               sample_weight, summed)  # fmt: skip
        gradient = inner.gradient(value, flat)
    H = outer.jacobian(gradient, flat, experimental_use_pfor=False).numpy()
    H = H.reshape(n, width, n, width)
    blocks = np.stack([H[i, :, i, :] for i in range(n)])
    off = H.copy()
    for i in range(n):
        off[i, :, i, :] = 0
    assert np.abs(off).max(initial=0) <= 1e-12 * max(1.0, np.abs(H).max()), (
        "a loss that couples samples: the test's reference assumes it does not"
    )
    return blocks


def loss_hessian_product(model, x, loss, y, sample_weight, variables, v):
    """H v of the batch's loss in the variables, by reverse over reverse."""
    watched = [_watched(u) for u in variables]
    dtype = np.dtype(tf.as_dtype(variables[0].dtype).as_numpy_dtype)
    parts = np.split(v.astype(dtype), np.cumsum([int(np.prod(u.shape))
                                                 for u in variables])[:-1])  # fmt: skip
    with tf.GradientTape() as outer:
        outer.watch(watched)
        with tf.GradientTape() as inner:
            inner.watch(watched)
            outputs = tf.nest.map_structure(lambda f: tf.cast(f, tf.float64),
                                            model(x, training=False))  # fmt: skip
            value = total_loss(loss, y, outputs, sample_weight)
        grads = inner.gradient(value, watched)
        score = tf.add_n([
            tf.reduce_sum(tf.cast(g, tf.float64) * p.reshape(u.shape))
            for g, p, u in zip(grads, parts, variables, strict=True) if g is not None
        ])  # fmt: skip
    return _flat_gradient(outer.gradient(score, watched), variables, np.float64)
