"""The model zoo: small models of the shapes users bring, in float32 and float64.

Each entry is a maker ``maker(dtype) -> (model, variables)``: ``model`` is a Keras
model (``variables`` is None) or a plain callable ``f(x)`` (``variables`` lists the
tf.Variables it reads). ``build(name, seed)`` makes both precisions with the same
seeded, perturbed weights and returns a ``Case`` with a seeded input maker, so that
every Jacobian stage can be checked against float64 central finite differences.

The models are tiny (at most ~160 parameters) because the finite-difference
reference runs two forward passes of the whole batch per parameter.

Output layout (what ``n_outputs`` counts): a sample's output row is every leaf of
the model's (possibly nested) output, flattened per sample and concatenated in
``tf.nest.flatten`` order (dict keys sorted).
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import jacutil as ju
from jacutil import keras, tf

layers = keras.layers


# --- Inputs ------------------------------------------------------------------


@dataclass(frozen=True)
class _Floats:
    """A float input of per-sample ``shape``, drawn standard normal in float64."""

    shape: tuple

    def draw(self, rng, n_samples):
        return rng.standard_normal((n_samples, *self.shape))


@dataclass(frozen=True)
class _Ids:
    """Integer ids in [0, high) of per-sample ``shape``, with repeats in each row.

    The last ``shape[-1] // 2`` positions copy the first ones, so every sample looks
    up some embedding rows more than once (their gradients must add up).
    """

    shape: tuple
    high: int

    def draw(self, rng, n_samples):
        ids = rng.integers(0, self.high, (n_samples, *self.shape))
        n_repeats = self.shape[-1] // 2
        ids[..., -n_repeats:] = ids[..., :n_repeats]
        return ids.astype("int32")


def _floats(*shape):
    return _Floats(shape)


def _ids(*shape, high):
    return _Ids(shape, high)


# --- Registry ----------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    maker: Callable
    inputs: object  # a _Floats/_Ids, or a list or dict of them (the model's inputs)
    n_outputs: int
    recurrent: bool


_ENTRIES = {}
ARCHITECTURES = {}  # name -> maker(dtype) returning (model, variables or None)


def _entry(inputs, n_outputs, recurrent=False):
    """Register a maker under its function name, with its inputs and output width."""

    def register(maker):
        _ENTRIES[maker.__name__] = _Entry(maker, inputs, n_outputs, recurrent)
        ARCHITECTURES[maker.__name__] = maker
        return maker

    return register


def _dense(width, activation=None, **kwargs):
    return layers.Dense(width, activation=activation, **kwargs)


def _stack(input_dtype, input_shape, *stack):
    """(Sequential of Input(input_shape, input_dtype) then ``stack``, None)."""
    return keras.Sequential([keras.Input(input_shape, dtype=input_dtype), *stack]), None


# --- Plain stacks ------------------------------------------------------------


@_entry(_floats(4), n_outputs=3)
def mlp(dtype):
    """The question's architecture, made small enough for finite differences."""
    return ju.question_mlp(n_inputs=4, n_outputs=3, hidden=(8, 6), dtype=dtype), None


@_entry(_floats(4, 3), n_outputs=8)
def matrix_output(dtype):
    """Per-sample output of shape (4, 2): n_outputs = 8 after flattening."""
    return _stack(dtype, (4, 3), _dense(5, "tanh", dtype=dtype), _dense(2, dtype=dtype))


@_entry(_floats(5), n_outputs=2)
def frozen_layer(dtype):
    """A frozen Dense layer and BatchNorm (inference mode) before a trainable one."""
    return _stack(
        dtype,
        (5,),
        _dense(6, "tanh", dtype=dtype, trainable=False),
        layers.BatchNormalization(dtype=dtype),
        _dense(2, dtype=dtype),
    )


@_entry(_floats(6, 6, 2), n_outputs=2)
def convolution(dtype):
    """A 3x3 convolution (valid padding, two input channels) before a Dense head."""
    return _stack(
        dtype,
        (6, 6, 2),
        layers.Conv2D(3, 3, activation="tanh", dtype=dtype),
        layers.Flatten(dtype=dtype),
        _dense(2, dtype=dtype),
    )


@_entry(_floats(6, 6, 1), n_outputs=2)
def strided_conv(dtype):
    """A strided, same-padded convolution: windows that skip and overhang the edge."""
    return _stack(
        dtype,
        (6, 6, 1),
        layers.Conv2D(2, 3, strides=2, padding="same", activation="tanh", dtype=dtype),
        layers.Flatten(dtype=dtype),
        _dense(2, dtype=dtype),
    )


@_entry(_floats(4), n_outputs=2)
def activation_layers(dtype):
    """Activations as separate layers (tanh, ReLU) and a Dropout idle at inference."""
    return _stack(
        dtype,
        (4,),
        _dense(5, dtype=dtype),
        layers.Activation("tanh", dtype=dtype),
        # A positive bias keeps most ReLU units active for most samples.
        _dense(4, dtype=dtype, bias_initializer=keras.initializers.Constant(0.3)),
        layers.ReLU(dtype=dtype),
        layers.Dropout(0.5, dtype=dtype),
        _dense(2, dtype=dtype),
    )


@_entry(_floats(8, 2), n_outputs=2)
def causal_conv1d(dtype):
    """Conv1D, causal and dilated, then strided; LayerNorm; pooling; softmax head.

    gelu and swish have no formula in the layer rules: their slope is autodiff's.
    """
    return _stack(
        dtype,
        (8, 2),
        layers.Conv1D(
            3, 3, padding="causal", dilation_rate=2, activation="gelu", dtype=dtype
        ),
        layers.LayerNormalization(dtype=dtype),
        layers.Conv1D(2, 2, strides=2, activation="swish", dtype=dtype),
        layers.GlobalAveragePooling1D(dtype=dtype),
        _dense(2, "softmax", dtype=dtype),
    )


@_entry(_floats(7, 7, 1), n_outputs=3)
def dilated_conv(dtype):
    """A dilated, same-padded Conv2D, max pooling, a second Conv2D, log-softmax."""
    return _stack(
        dtype,
        (7, 7, 1),
        layers.Conv2D(
            2, 3, padding="same", dilation_rate=2, activation="elu", dtype=dtype
        ),
        layers.MaxPooling2D(2, dtype=dtype),
        layers.Conv2D(2, 2, activation=tf.nn.softplus, dtype=dtype),
        layers.Flatten(dtype=dtype),
        _dense(3, "log_softmax", dtype=dtype),
    )


class Scale(layers.Layer):
    """A custom layer: ``x * scale``; its ``unused`` weight never reaches the output."""

    def build(self, input_shape):
        self.scale = self.add_weight(
            shape=input_shape[-1:], initializer="ones", name="scale"
        )
        self.unused = self.add_weight(shape=(2,), initializer="ones", name="unused")

    def call(self, x):
        return x * self.scale


@_entry(_floats(4), n_outputs=2)
def custom_layer(dtype):
    """A custom layer (no rule: autodiff), an unknown activation, a nested Sequential.

    ``Scale.unused`` is a trainable variable that the outputs do not use: its
    columns are zeros, beside connected ones.
    """
    inner = keras.Sequential(
        [_dense(3, tf.nn.tanh, dtype=dtype), layers.LeakyReLU(0.2, dtype=dtype)]
    )
    return _stack(
        dtype,
        (4,),
        _dense(5, lambda t: t * tf.sigmoid(2 * t), dtype=dtype),
        Scale(dtype=dtype),
        inner,
        _dense(2, dtype=dtype),
    )


@_entry(_floats(4), n_outputs=2)
def shared_layer(dtype):
    """One Dense object applied twice: its variables get two contributions each."""
    shared = _dense(4, "tanh", dtype=dtype)
    return _stack(dtype, (4,), shared, shared, _dense(2, dtype=dtype))


# --- Recurrent and sequence layers ----------------------------------------------


@_entry(_floats(4, 3), n_outputs=2, recurrent=True)
def lstm(dtype):
    """An LSTM returning its last state: gradients through the time loop."""
    return _stack(dtype, (4, 3), layers.LSTM(3, dtype=dtype), _dense(2, dtype=dtype))


@_entry(_floats(4, 2), n_outputs=8, recurrent=True)
def gru_sequences(dtype):
    """A GRU returning every step: per-sample output (4, 2), n_outputs = 8."""
    return _stack(
        dtype,
        (4, 2),
        layers.GRU(3, return_sequences=True, dtype=dtype),
        _dense(2, dtype=dtype),
    )


@_entry(_floats(5, 2), n_outputs=2, recurrent=True)
def simple_rnn(dtype):
    """A SimpleRNN over five steps."""
    return _stack(
        dtype, (5, 2), layers.SimpleRNN(3, dtype=dtype), _dense(2, dtype=dtype)
    )


@_entry(_floats(4, 2), n_outputs=2, recurrent=True)
def bidirectional(dtype):
    """A Bidirectional LSTM: a wrapper holding a forward and a backward copy.

    The wrapper needs its own dtype: with only the inner LSTM in float64 it casts
    its output to float32.
    """
    return _stack(
        dtype,
        (4, 2),
        layers.Bidirectional(layers.LSTM(2, dtype=dtype), dtype=dtype),
        _dense(2, dtype=dtype),
    )


@_entry(_ids(5, high=7), n_outputs=2)
def embedding(dtype):
    """An Embedding fed int32 ids (some repeated): a sparse gradient to the table."""
    return _stack(
        "int32",
        (5,),
        layers.Embedding(7, 3, dtype=dtype),
        layers.Flatten(dtype=dtype),
        _dense(2, dtype=dtype),
    )


@_entry(_floats(3, 4), n_outputs=2)
def attention(dtype):
    """Self-attention with a residual connection and LayerNormalization.

    The key projection's bias has an identically zero Jacobian (it shifts every
    score of a query equally, which softmax ignores): its 4 columns are zero.
    """
    x = keras.Input((3, 4), dtype=dtype)
    attended = layers.MultiHeadAttention(num_heads=2, key_dim=2, dtype=dtype)(x, x)
    h = layers.Add(dtype=dtype)([x, attended])
    h = layers.LayerNormalization(dtype=dtype)(h)
    h = layers.Flatten(dtype=dtype)(h)
    return keras.Model(x, _dense(2, dtype=dtype)(h)), None


# --- Several outputs or inputs ---------------------------------------------------


@_entry(_floats(4), n_outputs=5)
def two_heads_list(dtype):
    """Two heads of widths 2 and 3 returned as a list: row = [head_a, head_b]."""
    x = keras.Input((4,), dtype=dtype)
    h = _dense(5, "tanh", dtype=dtype)(x)
    heads = [_dense(2, dtype=dtype)(h), _dense(3, "tanh", dtype=dtype)(h)]
    return keras.Model(x, heads), None


@_entry(_floats(4), n_outputs=4)
def dict_heads(dtype):
    """Dict outputs whose sorted order (score, vector) is not insertion order."""
    x = keras.Input((4,), dtype=dtype)
    h = _dense(5, "tanh", dtype=dtype)(x)
    heads = {"vector": _dense(3, dtype=dtype)(h), "score": _dense(1, dtype=dtype)(h)}
    return keras.Model(x, heads), None


@_entry([_floats(3), _floats(2, 2)], n_outputs=2)
def two_inputs(dtype):
    """Two inputs given as a list, one of them a matrix that is flattened."""
    a = keras.Input((3,), dtype=dtype)
    b = keras.Input((2, 2), dtype=dtype)
    h = layers.Concatenate(dtype=dtype)([a, layers.Flatten(dtype=dtype)(b)])
    h = _dense(4, "tanh", dtype=dtype)(h)
    return keras.Model([a, b], _dense(2, dtype=dtype)(h)), None


@_entry({"a": _floats(3), "b": _floats(2)}, n_outputs=5)
def two_inputs_two_heads(dtype):
    """Inputs as a dict {"a", "b"} and two heads (widths 2 and 3) as a list."""
    a = keras.Input((3,), dtype=dtype, name="a")
    b = keras.Input((2,), dtype=dtype, name="b")
    h = layers.Concatenate(dtype=dtype)([a, b])
    h = _dense(4, "tanh", dtype=dtype)(h)
    heads = [_dense(2, dtype=dtype)(h), _dense(3, "tanh", dtype=dtype)(h)]
    return keras.Model({"a": a, "b": b}, heads), None


# --- Subclasses and plain callables ----------------------------------------------


class TanhSkip(keras.Model):
    """Two Dense layers joined by math in ``call`` and a skip from the first feature."""

    def __init__(self, dtype):
        super().__init__(dtype=dtype)
        self.hidden = _dense(4, dtype=dtype)
        self.out = _dense(2, dtype=dtype)

    def call(self, x):
        return self.out(tf.tanh(self.hidden(x)) * 0.5 + x[:, :1])


class DoubledSequential(keras.Sequential):
    """A Sequential whose ``call`` doubles what the plain stack returns."""

    def call(self, inputs, training=None, mask=None):
        return 2 * super().call(inputs, training=training, mask=mask)


@_entry(_floats(3), n_outputs=2)
def subclassed(dtype):
    """A keras.Model subclass: no functional graph, only ``call``."""
    model = TanhSkip(dtype)
    model(np.zeros((1, 3), dtype))  # builds the variables
    return model, None


@_entry(_floats(3), n_outputs=2)
def sequential_subclass(dtype):
    """A keras.Sequential subclass overriding ``call``: the layer list is not f."""
    model = DoubledSequential(
        [
            keras.Input((3,), dtype=dtype),
            _dense(4, "tanh", dtype=dtype),
            _dense(2, dtype=dtype),
        ]
    )
    return model, None


@_entry(_floats(3), n_outputs=2)
def explicit_nontrainable(dtype):
    """A plain callable with explicit variables, the first of them non-trainable.

    ``f(x) = tanh(x W + b) V`` with W, b, V in that order: an explicit variable list
    is differentiated whatever its ``trainable`` flag says.
    """
    W = tf.Variable(keras.random.normal((3, 4), dtype=dtype), trainable=False, name="W")
    b = tf.Variable(keras.random.normal((4,), stddev=0.1, dtype=dtype), name="b")
    V = tf.Variable(keras.random.normal((4, 2), stddev=0.5, dtype=dtype), name="V")

    def f(x):
        # tf.matmul, not @: a NumPy x would turn ``x @ W`` into NumPy (no gradient).
        return tf.matmul(tf.tanh(tf.matmul(x, W) + b), V)

    return f, [W, b, V]


# --- Cases -------------------------------------------------------------------


@dataclass
class Case:
    """One zoo entry in both precisions, with the same weights and a seeded batch."""

    name: str
    model32: object  # a Keras model, or a plain callable f(x)
    model64: object  # the same model in float64, same weights
    variables32: list | None  # None for Keras models; explicit for a callable
    variables64: list | None
    batch: Callable  # batch(n_samples) -> the input for n samples
    n_outputs: int  # per-sample outputs after flattening every output leaf
    recurrent: bool  # contains an RNN layer (LSTM/GRU/SimpleRNN)


def _perturbed(values, rng):
    """float64 copies moved by 0.1 * standard normal noise, so nothing sits at 0
    and BatchNorm's moving statistics move away from 0 and 1 and matter."""
    return [np.asarray(v) + 0.1 * rng.standard_normal(np.shape(v)) for v in values]


def build(name, seed=0):
    """The ``Case`` of entry ``name``: float32 and float64 copies with the same
    seeded weights, and ``batch(n)``, a seeded input for n samples (float64 arrays
    for float inputs, int32 ids for integer ones; different n, different data)."""
    entry = _ENTRIES[name]
    keras.utils.set_random_seed(seed)
    model32, variables32 = entry.maker("float32")
    model64, variables64 = entry.maker("float64")
    rng = np.random.default_rng(seed)
    if variables32 is None:
        weights = _perturbed(model32.get_weights(), rng)
        model32.set_weights([w.astype("float32") for w in weights])
        model64.set_weights([w.astype("float64") for w in weights])
    else:
        weights = _perturbed([v.numpy() for v in variables32], rng)
        for w, v32, v64 in zip(weights, variables32, variables64, strict=True):
            v32.assign(w.astype("float32"))
            v64.assign(w.astype("float64"))

    def batch(n_samples):
        rng = np.random.default_rng(seed + n_samples)
        return tf.nest.map_structure(lambda s: s.draw(rng, n_samples), entry.inputs)

    return Case(
        name=name,
        model32=model32,
        model64=model64,
        variables32=variables32,
        variables64=variables64,
        batch=batch,
        n_outputs=entry.n_outputs,
        recurrent=entry.recurrent,
    )
