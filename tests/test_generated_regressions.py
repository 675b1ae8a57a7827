"""Each distinct failure the generated-model test found, as a named test.

``tests/test_generated_models.py`` draws random Keras models and checks every
public entry against one ``tf.GradientTape`` per sample. Every failure it
found is here, minimized by hand from the program Hypothesis printed, and
checked against the same reference (``tape_jacobian``,
``tape_loss_gradients`` in ``tests/generated.py``). A test says which commit
it failed on and how (wrong numbers or a crash). None is marked xfail: they
fail until jacutil is fixed.
"""

import functools
import warnings

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, tf
from tests.generated import (
    Clip,
    clear_refusal,
    perturb,
    runs_on_its_batch,
    stems,
    tape_jacobian,
    tape_loss_gradients,
)

layers = keras.layers
ops = keras.ops
F64 = "float64"
MSE = keras.losses.mean_squared_error


def close(got, expected, tolerance=1e-9):
    """Equal within ``tolerance`` times the larger of 1 and the largest |entry|."""
    scale = max(1.0, float(np.abs(expected).max(initial=0)))
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance * scale)


def normal(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def seeded(model, seed=0):
    """The model with every weight moved off its initializer (tests.generated)."""
    perturb(model, seed)
    return model


def error_in_subprocess(script, *args):
    """Run ``script`` in a fresh interpreter (a failure may abort it) and
    return the number it prints after "error"; a crash fails the test."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split("error")[-1])


def close_or_refused(call, expected, feature):
    """A forward-mode entry may refuse a model it cannot differentiate, with a
    clear error naming ``feature`` (tests.generated.clear_refusal); else its
    answer must be right."""
    try:
        got = call()
    except Exception as error:  # noqa: BLE001 - a refusal, or the failure itself
        assert clear_refusal(error, stems(feature)), f"{type(error).__name__}: {error}"
        return
    close(got, expected)


def forward_entry(entry, model, x, feature):
    """forward_jacobian, jvp (both modes) or jacobian_operator.matvec."""
    J = tape_jacobian(model, x, model.trainable_variables)
    v = normal(J.shape[2], seed=2)
    call, expected = {
        "forward_jacobian": (lambda: ju.forward_jacobian(model, x), J),
        "jvp": (lambda: ju.jvp(model, x, v), J @ v),
        "jvp double_backward": (
            lambda: ju.jvp(model, x, v, mode="double_backward"), J @ v
        ),
        "jacobian_operator": (
            lambda: ju.jacobian_operator(model, x).matvec(v), (J @ v).reshape(-1)
        ),
    }[entry]
    close_or_refused(call, expected, feature)
    close(ju.jacobian(model, x), J)  # jacobian() never takes a blind spot


def check_jacobians(model, x, variables=None):
    """jacobian and chunked_jacobian (both methods, a last chunk of one)."""
    options = {} if variables is None else {"variables": variables}
    expected = tape_jacobian(model, x, variables or model.trainable_variables)
    close(ju.jacobian(model, x, **options), expected)
    for method in ("per_sample", "rules"):
        J = ju.chunked_jacobian(model, x, chunk_size=len(x) - 1 or 1, method=method,
                                progress=False, **options)  # fmt: skip
        close(J, expected)
    return expected


def check_gradients(model, loss, x, y):
    expected = tape_loss_gradients(model, loss, x, y, model.trainable_variables)
    close(ju.per_sample_gradients(model, loss, x, y), expected)
    close(
        ju.per_sample_gradient_norms(model, loss, x, y),
        np.linalg.norm(expected, axis=1),
    )


# --- known before the generator (issue 21's list; test_seams.py has them too) --------


def test_keyword_argument_of_a_custom_layer_in_a_functional_chain():
    """Failed on 715c8dc: ``Clip()(h, limit=0.3)`` ran as ``Clip()(h)`` (limit
    1.0) in the rules and in per_sample_gradients: every number wrong."""
    keras.utils.set_random_seed(259)
    inputs = keras.Input((3,), dtype=F64)
    h = Clip(dtype=F64)(inputs, limit=0.3)
    model = seeded(keras.Model(inputs, layers.Dense(2, dtype=F64)(h)))
    x = normal(4, 3)
    logits = functools.partial(keras.losses.binary_crossentropy, from_logits=True)
    # first: a Jacobian call first would check the rules and drop them
    check_gradients(model, logits, x, np.array([[0, 1], [1, 1], [0, 0], [1, 0]], F64))
    check_jacobians(model, x)


@pytest.mark.parametrize(
    "activation, loss, y",
    [
        ("softmax", keras.losses.sparse_categorical_crossentropy, [0, 2, 1]),
        ("softmax", keras.losses.categorical_crossentropy, np.eye(3)[[0, 2, 1]]),
        ("sigmoid", keras.losses.binary_crossentropy, np.eye(3)[[2, 0, 1]]),
    ],
)
@pytest.mark.parametrize("body", ["dense", "conv"])
def test_cross_entropy_after_its_activation(activation, loss, y, body):
    """Crashed on 715c8dc: TypeError 'NoneType' object is not subscriptable
    (the loss reads the logits Keras attaches to a softmax/sigmoid output, so
    its gradient at the probabilities is None): per_sample_gradients on the
    rules path, and the norms on the Dense-only path (``_dense_norms``)."""
    keras.utils.set_random_seed(1)
    below = (
        [layers.Dense(4, activation="tanh", dtype=F64)]
        if body == "dense"
        else [layers.Reshape((4, 1), dtype=F64), layers.Conv1D(2, 2, dtype=F64),
              layers.Flatten(dtype=F64)]
    )  # fmt: skip
    model = seeded(keras.Sequential(
        [keras.Input((4,), dtype=F64), *below,
         layers.Dense(3, activation=activation, dtype=F64)]
    ))  # fmt: skip
    check_gradients(model, loss, normal(3, 4), np.asarray(y, F64))


@pytest.mark.parametrize("between", ["square", "tanh then mean"])
def test_keras_ops_between_layers(between):
    """Crashed on 715c8dc: AttributeError: 'Square' object has no attribute
    'weights' (jacutil.rules.plan.plan_for took a keras.ops call for a
    layer) in per_sample_gradients and its norms."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), dtype=F64)
    if between == "square":
        h = ops.square(inputs)
    else:
        h = ops.mean(ops.tanh(layers.Dense(3, dtype=F64)(inputs)), -1, keepdims=True)
    model = seeded(keras.Model(inputs, layers.Dense(3, "sigmoid", dtype=F64)(h)))
    x = normal(3, 4)
    check_gradients(model, MSE, x, normal(3, 3, seed=1))
    check_jacobians(model, x)


@pytest.mark.parametrize(
    "entry", ["forward_jacobian", "jvp", "jvp double_backward", "jacobian_operator"]
)
def test_softsign_in_forward_mode(entry):
    """Crashed on 715c8dc, fcaf2eb and c0bb5b3: LookupError: gradient registry
    has no entry for: SoftsignGrad (forward mode and the double-backward JVP both
    differentiate softsign's gradient, which TensorFlow does not define). A
    clear refusal naming softsign would pass too."""
    keras.utils.set_random_seed(848)
    model = seeded(keras.Sequential(
        [keras.Input((3,), dtype=F64),
         layers.Dense(3, activation="softsign", dtype=F64),
         layers.Dense(2, dtype=F64)]
    ))  # fmt: skip
    forward_entry(entry, model, normal(2, 3), "softsign")


def test_grouped_convolution_above_a_trainable_layer_per_sample_gradients():
    """Crashed on 715c8dc: InvalidArgumentError: Gradients for grouped
    convolutions are not supported on CPU (the signal through a grouped
    Conv1D to the Dense below it, in per_sample_gradients' autodiff path)."""
    keras.utils.set_random_seed(687)
    model = seeded(keras.Sequential(
        [keras.Input((4, 2), dtype=F64),
         layers.Dense(2, dtype=F64),
         layers.Conv1D(2, 2, groups=2, dtype=F64),
         layers.Flatten(dtype=F64),
         layers.Dense(1, activation="sigmoid", dtype=F64)]
    ))  # fmt: skip
    x = normal(3, 4, 2)
    check_gradients(model, keras.losses.binary_crossentropy, x,
                    np.array([[0.0], [1.0], [1.0]]))  # fmt: skip
    check_jacobians(model, x)


def test_last_chunk_of_one_sample_in_a_two_input_graph():
    """Crashed on 715c8dc: InvalidArgumentError: ConcatOp : Dimension 1 in
    both shapes must be equal: shape[0] = [1,2,2] vs. shape[1] = [1,1,4]
    (pfor over a chunk of one sample; 3 samples in chunks of 2 or 1)."""
    keras.utils.set_random_seed(1)
    a, b = keras.Input((5,), dtype=F64), keras.Input((4,), dtype=F64)
    h = layers.Dense(2, dtype=F64)(a) + layers.Dense(2, dtype=F64)(a)
    joined = layers.Concatenate(dtype=F64)([h, b])
    model = seeded(keras.Model([a, b], [joined, layers.Dense(1, dtype=F64)(joined)]))
    x = [normal(3, 5), normal(3, 4, seed=1)]
    expected = tape_jacobian(model, x, model.trainable_variables)
    for chunk_size in (1, 2):
        for method in ("per_sample", "rules"):
            J = ju.chunked_jacobian(model, x, chunk_size=chunk_size, method=method,
                                    progress=False)  # fmt: skip
            close(J, expected)


def test_grouped_convolution_float32_per_sample_method():
    """Wrong on fcaf2eb and c0bb5b3 (float32; float64 crashed):
    chunked_jacobian(method="per_sample") of a grouped Conv1D gave other
    numbers than the tape for some columns of its kernel (1.7 off),
    silently; the rules were right."""
    keras.utils.set_random_seed(244)
    f32 = "float32"
    inputs = keras.Input((3, 2), dtype=f32)
    h = layers.Conv1D(2, 1, padding="same", groups=2, use_bias=False, dtype=f32)(inputs)
    model = seeded(keras.Model(inputs, layers.Flatten(dtype=f32)(h)), 244)
    x = normal(6, 3, 2, seed=244).astype(f32)
    expected = tape_jacobian(model, x, model.trainable_variables)
    for method in ("per_sample", "rules"):
        J = ju.chunked_jacobian(model, x, chunk_size=5, method=method, progress=False)
        close(J, expected, 1e-5)


# --- new: not on issue 21's list ---------------------------------------------------


def test_dilated_convolution_above_a_trainable_layer():
    """Crashed on 715c8dc, fcaf2eb and c0bb5b3 in jacutil.jacobian itself:
    InvalidArgumentError: Current CPU implementations do not yet support
    dilation rates larger than 1 (the rules' signal below a dilated Conv1D
    was ``tf.nn.conv2d``'s input gradient). Right in fc86099's working tree
    (tf.nn.convolution)."""
    keras.utils.set_random_seed(2129)
    model = seeded(keras.Sequential(
        [keras.Input((4,), dtype=F64),
         layers.Dense(4, dtype=F64),
         layers.Reshape((4, 1), dtype=F64),
         layers.Conv1D(2, 2, dilation_rate=2, padding="causal", dtype=F64),
         layers.Flatten(dtype=F64),
         layers.Dense(2, dtype=F64)]
    ))  # fmt: skip
    x = normal(3, 4)
    check_gradients(model, MSE, x, normal(3, 2, seed=1))
    check_jacobians(model, x)


@pytest.mark.parametrize(
    "entry", ["forward_jacobian", "jvp", "jvp double_backward", "jacobian_operator"]
)
def test_max_pooling_same_stride_one_in_forward_mode(entry):
    """Wrong on 715c8dc, fcaf2eb and c0bb5b3: every forward-mode column is 0.
    TensorFlow 2.21's second derivative of max_pool with padding="same" and
    stride 1 is zero inside a tf.function (eager is right), and
    ForwardAccumulator and the double-backward JVP both rest on it (valid
    padding, or stride 2, is right). fc86099 refuses such a model clearly
    (ForwardModeBlindSpot), which passes."""
    keras.utils.set_random_seed(0)
    model = seeded(keras.Sequential(
        [keras.Input((3, 2), dtype=F64),
         layers.Dense(2, dtype=F64),
         layers.MaxPooling1D(2, strides=1, padding="same", dtype=F64)]
    ))  # fmt: skip
    forward_entry(entry, model, normal(2, 3, 2, seed=1), "MaxPooling1D")


def test_residual_dense_of_one_unit_per_sample_gradients():
    """Crashed on fcaf2eb and c0bb5b3: ValueError: Dimension 1 in both
    shapes must be equal, but are 3 and 1. Shapes are [2,3,3,1] and
    [2,1,3,1] (pfor, in per_sample_gradients' autodiff path, on
    x + Dense(1)(x) over a (steps, 1) input; the Jacobian of the same model
    is right). fc86099 falls back to tf.map_fn there."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3, 1), dtype=F64)
    h = layers.Add(dtype=F64)([inputs, layers.Dense(1, dtype=F64)(inputs)])
    model = seeded(keras.Model(inputs, layers.Flatten(dtype=F64)(h)))
    x = normal(2, 3, 1)
    check_gradients(model, MSE, x, normal(2, 3, seed=1))
    check_jacobians(model, x)


# one kind is enough: which layers keep their loop does not depend on it
@pytest.mark.parametrize("rnn", ["LSTM"])
def test_bidirectional_sequences_under_a_mask(rnn):
    """Wrong on 715c8dc to fc86099 (2026-12-01), in float64 too:
    jacobian 0.2 to 0.65 off, per_sample_gradients 0.04 to 0.07 off, for an
    Embedding(mask_zero=True) under a Bidirectional RNN that returns its
    sequences. Keras 3.15 computes another function when such a layer is
    unrolled (up to 0.06 apart), and jacutil unrolls recurrent layers while
    it traces: it differentiates a model that is not the user's. Now those
    layers keep their loop (the reverse-mode stages fall back to tf.map_fn)
    and forward mode refuses them with a clear error."""
    keras.utils.set_random_seed(1)
    model = seeded(keras.Sequential(
        [keras.Input((3,), dtype="int32"),
         layers.Embedding(5, 2, mask_zero=True, dtype=F64),
         layers.Bidirectional(getattr(layers, rnn)(2, return_sequences=True,
                                                   dtype=F64), dtype=F64),
         layers.GlobalAveragePooling1D(dtype=F64),
         layers.Dense(2, dtype=F64)]
    ), 1)  # fmt: skip
    x = np.array([[1, 0, 2], [3, 4, 0], [0, 0, 1], [2, 2, 2], [4, 1, 0]], "int32")
    check_gradients(model, MSE, x, np.zeros((5, 2)))
    expected = check_jacobians(model, x)
    v = normal(expected.shape[2], seed=2)
    close(ju.jvp(model, x, v, mode="double_backward"), expected @ v)
    for call in (lambda: ju.forward_jacobian(model, x), lambda: ju.jvp(model, x, v)):
        close_or_refused(call, expected, "Bidirectional")


ATTENTION = """
import sys
import numpy as np
from jacutil import keras
import jacutil as ju
from tests.generated import perturb, tape_loss_gradients
layers = keras.layers
keras.utils.set_random_seed(0)
x_in = keras.Input((3, 2))
h = layers.MultiHeadAttention(num_heads=int(sys.argv[1]), key_dim=2)(x_in, x_in)
model = keras.Model(x_in, layers.Dense(2)(layers.Flatten()(h)))
perturb(model, 0)
x = np.random.default_rng(0).standard_normal((6, 3, 2)).astype("float32")
y = np.zeros((6, 2), "float32")
mse = keras.losses.mean_squared_error
G = ju.per_sample_gradients(model, mse, x, y)
expected = tape_loss_gradients(model, mse, x, y, model.trainable_variables)
print("error", float(np.abs(G - expected).max()))
"""


@pytest.mark.parametrize("heads", [1, 2])
def test_attention_per_sample_gradients_float32(heads):
    """Wrong or fatal on 715c8dc to fc86099 (2026-12-01):
    per_sample_gradients of a float32 self-attention model over 6 samples
    gave numbers 0.29 off, or killed the process (SIGSEGV, or SIGABRT with
    "double free or corruption"), from run to run. TensorFlow 2.21's oneDNN batch matmul
    (jacutil.core.formulation runs the Jacobian under XLA for it; the gradients'
    vectorized_map does not). jacobian() of the same model is right. Run in
    a subprocess: the failure may abort the interpreter."""
    error = error_in_subprocess(ATTENTION, str(heads))
    assert error <= 1e-4, f"per_sample_gradients off by {error}"


ATTENTION_FORWARD_MODEL = """
dtype = 'float32'
seed = 0
keras.utils.set_random_seed(seed)
h0 = keras.Input((5,), dtype='int32')
h1 = layers.Embedding(4, 2, dtype=dtype)(h0)
h2 = layers.Dense(4, activation='hard_tanh', use_bias=False, dtype=dtype)(h1)
h3 = layers.Dense(4, activation=tf.nn.leaky_relu, use_bias=False, dtype=dtype)(h1)
h4 = layers.Maximum(dtype=dtype)([h2, h3])
h5 = layers.Dense(1, activation=tf.nn.relu, trainable=False, dtype=dtype)(h1)
h6 = layers.Dense(1, activation=functools.partial(tf.nn.leaky_relu, alpha=0.3),
                  use_bias=False, dtype=dtype)(h1)
h7 = layers.Multiply(dtype=dtype)([h5, h6])
h8 = layers.Dense(3, activation='log_sigmoid', use_bias=False, dtype=dtype)(h4)
h9 = Halve(dtype=dtype)(h8)
h10 = layers.MultiHeadAttention(num_heads=1, key_dim=2, dtype=dtype)(h7, h7)
h11 = layers.Flatten(dtype=dtype)(h9)
h12 = layers.Flatten(dtype=dtype)(h10)
h13 = layers.Concatenate(dtype=dtype)([h11, h12])
h14 = layers.Dense(3, activation=tf.nn.softsign, dtype=dtype)(h13)
model = keras.Model(h0, h14)
perturb(model, seed)
rng = np.random.default_rng(seed)
x = rng.integers(0, 4, (1, 5)).astype('int32')
variables = [model.weights[i]
             for i in (2, 15, 1, 16, 13, 0, 12, 8, 9, 5, 10, 14, 7, 6, 11)]
chunk_size = 1
"""

ATTENTION_FORWARD = """
import sys

import numpy as np

import jacutil as ju
from tests.generated import Case, tape_jacobian

ns = Case("graph", "float32", sys.argv[1]).build()
model, x, variables = ns["model"], ns["x"], ns["variables"]
J = ju.forward_jacobian(model, x, variables=variables)
print("error", float(np.abs(J - tape_jacobian(model, x, variables)).max()))
"""


def test_attention_forward_jacobian_float32():
    """Fatal on a3bb338 (2026-12-01, make fuzz seed 3662795792): forward_jacobian
    of a float32 graph with a self-attention branch over one sample aborted
    the interpreter ("corrupted double-linked list"): the forward-mode trace
    holds a broadcasting batch matmul, which TensorFlow 2.21's oneDNN kernel
    mishandles (jacutil.core.formulation.onednn_hazards). Forward mode now
    compiles such a trace under XLA. Run in a subprocess: the failure aborts."""
    error = error_in_subprocess(ATTENTION_FORWARD, ATTENTION_FORWARD_MODEL)
    assert error <= 1e-4, f"forward_jacobian off by {error}"


@pytest.mark.parametrize("entry", ["jacobian", "compiled_jacobian", "chunked_jacobian"])
def test_attention_below_sparsemax_float32(entry):
    """Crashed on a98b174 (2026-12-01, make fuzz seed 3662795792):
    InvalidArgumentError "TensorListReserve ... on XLA_CPU_JIT". The float32
    attention's broadcasting batch matmul moves the per-sample trace under XLA
    (oneDNN's hazard), but sparsemax makes pfor keep a while_loop, which XLA
    cannot compile. The compiled stage now runs such a model sample by
    sample in tf.map_fn."""
    keras.utils.set_random_seed(0)
    x_in = keras.Input((3, 3))
    h = layers.MultiHeadAttention(num_heads=1, key_dim=2)(x_in, x_in)
    out = layers.Dense(1, activation="sparsemax")(layers.Flatten()(h))
    model = seeded(keras.Model(x_in, out))
    x = normal(1, 3, 3).astype("float32")
    calls = {
        "jacobian": lambda: ju.jacobian(model, x),
        "compiled_jacobian": lambda: ju.compiled_jacobian(model)(x),
        "chunked_jacobian": lambda: ju.chunked_jacobian(
            model, x, chunk_size=1, progress=False
        ),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ju.core.formulation.SlowPathWarning)
        got = calls[entry]()
    close(got, tape_jacobian(model, x, model.trainable_variables), 1e-5)


def test_the_tape_reference_on_a_linear_model():
    w = tf.Variable([[2.0], [3.0]], dtype=F64)
    model = keras.Sequential([keras.Input((2,), dtype=F64),
                              layers.Dense(1, use_bias=False, dtype=F64)])  # fmt: skip
    model.layers[0].kernel.assign(w)
    x = np.array([[1.0, -1.0], [0.5, 2.0]])
    np.testing.assert_array_equal(
        tape_jacobian(model, x, model.trainable_variables), x[:, None, :]
    )


def test_a_model_keras_cannot_run_on_its_batch_is_not_charged_to_jacutil():
    """Failed on 0596803 (make fuzz, seed 20261205, 330 examples), in the
    test, not in jacutil: a Softmax under an Embedding's mask. The tape,
    one sample at a time, gave numbers; on the batch of 2 Keras itself raises
    (the mask (2, 3) against scores (2, 3, 3)), so forward_jacobian, which
    calls the model on the batch, passed Keras's error on and was charged with
    a crash. The reference now calls the model on its batch first, and such
    an example is drawn again."""
    model = keras.Sequential([keras.Input((3,), dtype="int32"),
                              layers.Embedding(4, 3, mask_zero=True),
                              layers.Softmax(axis=-1)])  # fmt: skip
    x = np.array([[1, 0, 2], [3, 1, 0]], dtype="int32")
    assert tape_jacobian(model, x[:1], model.trainable_variables).shape == (1, 9, 12)
    with pytest.raises(ValueError, match="broadcast"):
        runs_on_its_batch(model, x)
    with pytest.raises(ValueError, match="broadcast"):
        ju.forward_jacobian(model, x)  # the user's own model(x) fails alike


@pytest.mark.parametrize("loss", [MSE, keras.losses.binary_crossentropy])
def test_dense_on_positions_below_a_pooling_without_weights(loss):
    """Failed on a7b97c8 (make fuzz, seed 20261203, 150 examples): a crash.
    The autodiff rule of a layer without weights (GlobalMaxPooling1D) gave its
    signal without a static width, and the Dense on positions below it could
    not reshape it ("None values not supported")."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((3, 1), dtype=F64),
        layers.Activation("linear", dtype=F64),
        layers.Dense(1, trainable=False, dtype=F64),
        layers.Dense(1, dtype=F64),
        layers.GlobalMaxPooling1D(dtype=F64),
        layers.Dense(1, activation="sigmoid", trainable=False, dtype=F64),
    ])  # fmt: skip
    perturb(model, 0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 1))
    y = rng.integers(0, 2, (1, 1)).astype(F64)
    expected = tape_loss_gradients(model, loss, x, y, model.trainable_variables)
    close(ju.per_sample_gradients(model, loss, x, y), expected)
    norms = ju.per_sample_gradient_norms(model, loss, x, y)
    close(norms, np.linalg.norm(expected, axis=1))
