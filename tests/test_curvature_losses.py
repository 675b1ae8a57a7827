"""Curvature from the user's loss, one head at a time (issue 34, items 2-3).

Every reference is formed here in float64, independently of
``jacutil.curvature.losses``: J from one tape per sample, and the loss's
Hessian at the outputs by nested tapes of the loss itself (Keras' own loss
objects, with their reduction and sample weights, or a loss written out),
so ``G = sum_ij J_i.T d2L/df_i df_j J_j``. The Hessian of the loss in the
parameters is nested tapes of the whole loss. Notebook
11-curvature-and-uncertainty.
"""

import numpy as np
import pytest

from jacutil import keras, tf
from jacutil.curvature.diagonal import ggn_diagonal
from jacutil.curvature.ggn import ggn_operator
from jacutil.curvature.hessian import hessian_operator
from jacutil.curvature.kfac import kfac
from jacutil.curvature.losses import output_loss
from jacutil.curvature.output_losses import OutputLoss
from jacutil.curvature.spectra import top_eigenvalues

D = "float64"
N = 4
RTOL = 1e-8


def heads_model(widths=(2, 4), names=None, seed=0):
    """Input(3) -> Dense(4, tanh) -> one Dense(k) per head (logits)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((3,), dtype=D)
    h = keras.layers.Dense(4, activation="tanh", dtype=D)(inputs)
    outs = [keras.layers.Dense(k, dtype=D)(h) for k in widths]
    if names:
        outs = dict(zip(names, outs, strict=True))
    return keras.Model(inputs, outs)


def inputs(n=N, seed=1):
    return np.random.default_rng(seed).standard_normal((n, 3))


def rows(out):
    return tf.concat(
        [tf.reshape(t, [tf.shape(t)[0], -1]) for t in tf.nest.flatten(out)], 1
    )


def jacobian_rows(tape, entries, sources):
    """d entries / d sources, one ``tape.gradient`` per entry (a persistent
    tape, the entries unstacked under it; eager and quick for these small
    sizes): (len(entries), sum of the sources' sizes)."""
    out = []
    for entry in entries:
        grads = tape.gradient(entry, sources)
        out.append(
            np.concatenate(
                [
                    np.zeros(int(np.prod(s.shape))) if g is None else np.ravel(g)
                    for g, s in zip(grads, sources, strict=True)
                ]
            )
        )
    return np.stack(out)


def per_sample_J(model, x):
    """(n, l, m): one tape per sample."""
    blocks = []
    for i in range(len(x)):
        with tf.GradientTape(persistent=True) as tape:
            f = tf.unstack(rows(model(x[i : i + 1]))[0])
        blocks.append(jacobian_rows(tape, f, model.trainable_variables))
    return np.stack(blocks)


def output_hessian(model, x, total_loss):
    """d2 total_loss(f) / df df, (n, l, n, l), f the rows of model(x)."""
    out = model(x)
    leaves = tf.nest.flatten(out)
    sizes = [int(np.prod(t.shape[1:])) for t in leaves]
    f = tf.Variable(rows(out))
    with tf.GradientTape(persistent=True) as outer:
        with tf.GradientTape() as inner:
            parts = tf.split(f, sizes, axis=1)
            heads = [tf.reshape(p, t.shape) for p, t in zip(parts, leaves, strict=True)]
            value = total_loss(tf.nest.pack_sequence_as(out, heads))
        g = tf.unstack(tf.reshape(inner.gradient(value, f), [-1]))
    n, width = f.shape
    return jacobian_rows(outer, g, [f]).reshape(n, width, n, width)


def reference_G(model, x, total_loss):
    J = per_sample_J(model, x)
    H = output_hessian(model, x, total_loss)
    return np.einsum("ikp,ikjl,jlq->pq", J, H, J, optimize=True)


def reference_hessian(model, x, total_loss):
    """d2 total_loss(model(x)) / d theta2, by nested tapes."""
    variables = model.trainable_variables
    with tf.GradientTape(persistent=True) as outer:
        with tf.GradientTape() as inner:
            value = total_loss(model(x))
        g = tf.unstack(
            tf.concat(
                [tf.reshape(a, [-1]) for a in inner.gradient(value, variables)], 0
            )
        )
    return jacobian_rows(outer, g, variables)


def dense(operator):
    return operator @ np.eye(operator.shape[0])


def close(found, expected, rtol=RTOL):
    scale = np.max(np.abs(expected))
    np.testing.assert_allclose(found, expected, rtol=0, atol=rtol * scale)


def cross_entropy(logits, labels):
    """sum_i -log softmax(f_i)[y_i], written out."""
    return -tf.reduce_sum(tf.gather(tf.nn.log_softmax(logits), labels, batch_dims=1))


# --- item 2: several heads, each its own class count ---------------------------


def test_two_softmax_heads_with_2_and_4_classes():
    model = heads_model((2, 4))
    x = inputs()
    y = [np.array([0, 1, 1, 0]), np.array([3, 0, 2, 1])]

    def total(out):
        return sum(cross_entropy(f, t) for f, t in zip(out, y, strict=True))

    G = reference_G(model, x, total)
    found = ggn_operator(model, x, "softmax_cross_entropy", chunk_size=3)
    close(dense(found), G)
    v = np.random.default_rng(2).standard_normal(G.shape[0])
    close(found @ v, G @ v)
    close(ggn_diagonal(model, x, "softmax_cross_entropy"), np.diag(G))
    H = hessian_operator(model, x, y, "softmax_cross_entropy")
    close(dense(H), reference_hessian(model, x, total))
    loss = output_loss("softmax_cross_entropy", model)
    assert loss.classes == (2, 4)
    f = rows(model(x)).numpy()
    blocks = loss.hessian(f)
    assert np.all(blocks[:, :2, 2:] == 0)  # one softmax per head


def test_a_dict_of_heads_takes_a_dict_of_keras_losses():
    model = heads_model((3, 2), names=("label", "value"))
    x = inputs()
    y = {
        "label": np.array([2, 0, 1, 1]),
        "value": np.random.default_rng(3).normal(size=(N, 2)),
    }
    losses = {
        "label": keras.losses.SparseCategoricalCrossentropy(dtype=D, from_logits=True),
        "value": keras.losses.MeanSquaredError(dtype=D),
    }

    def total(out):
        return sum(losses[k](y[k], out[k]) for k in losses)

    G = reference_G(model, x, total)
    close(dense(ggn_operator(model, x, losses)), G)
    close(ggn_diagonal(model, x, losses), np.diag(G))
    H = hessian_operator(model, x, y, losses, chunk_size=3)
    close(dense(H), reference_hessian(model, x, total))


def test_a_softmax_head_and_an_mse_head_in_a_list():
    model = heads_model((3, 2))
    x = inputs()
    y = [np.array([2, 0, 1, 1]), np.random.default_rng(4).normal(size=(N, 2))]
    losses = [
        keras.losses.SparseCategoricalCrossentropy(
            dtype=D, from_logits=True, reduction="sum"
        ),
        "mse",
    ]
    keras_losses = [losses[0], keras.losses.MeanSquaredError(dtype=D)]

    def total(out):
        return sum(fn(t, f) for fn, t, f in zip(keras_losses, y, out, strict=True))

    close(dense(ggn_operator(model, x, losses)), reference_G(model, x, total))


# --- every Keras loss with its options ------------------------------------------


def _labels(k):
    return np.random.default_rng(5).integers(0, k, N)


CASES = {
    "mse": (lambda: keras.losses.MeanSquaredError(dtype=D), "values"),
    "mse_sum": (
        lambda: keras.losses.MeanSquaredError(dtype=D, reduction="sum"),
        "values",
    ),
    "sparse": (
        lambda: keras.losses.SparseCategoricalCrossentropy(dtype=D, from_logits=True),
        "labels",
    ),
    "categorical_smoothed": (
        lambda: keras.losses.CategoricalCrossentropy(
            dtype=D, from_logits=True, label_smoothing=0.2
        ),
        "one_hot",
    ),
    "binary_smoothed": (
        lambda: keras.losses.BinaryCrossentropy(
            dtype=D, from_logits=True, label_smoothing=0.1
        ),
        "binary",
    ),
    "huber_autodiff": (lambda: keras.losses.Huber(dtype=D, delta=0.5), "values"),
    "mean_with_sample_weight": (
        lambda: keras.losses.SparseCategoricalCrossentropy(
            dtype=D, from_logits=True, reduction="mean_with_sample_weight"
        ),
        "labels",
    ),
}


def _targets(kind, k):
    rng = np.random.default_rng(6)
    if kind == "values":
        return rng.normal(size=(N, k))
    if kind == "labels":
        return _labels(k)
    if kind == "one_hot":
        return np.eye(k)[_labels(k)]
    return rng.integers(0, 2, (N, k)).astype(float)


WEIGHTED = {"mse", "sparse", "binary_smoothed", "mean_with_sample_weight"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_keras_losses_with_their_options(name):
    make, kind = CASES[name]
    weighted = name in WEIGHTED  # half of them with sample_weight
    model = heads_model((3,), seed=7)
    x = inputs(seed=8)
    y = _targets(kind, 3)
    w = np.array([0.5, 2.0, 0.0, 1.5]) if weighted else None
    loss = make()

    def total(out):
        return loss(y, tf.nest.flatten(out)[0], sample_weight=w)

    G = reference_G(model, x, total)
    needs_y = {"y": y} if name == "huber_autodiff" else {}
    close(dense(ggn_operator(model, x, loss, sample_weight=w, **needs_y)), G)
    close(ggn_diagonal(model, x, loss, sample_weight=w, **needs_y), np.diag(G))
    H = hessian_operator(model, x, y, loss, sample_weight=w)
    close(dense(H), reference_hessian(model, x, total))


def test_label_smoothing_changes_the_targets_not_h():
    model = heads_model((3,), seed=9)
    x = inputs()
    plain = keras.losses.CategoricalCrossentropy(dtype=D, from_logits=True)
    smooth = keras.losses.CategoricalCrossentropy(
        dtype=D, from_logits=True, label_smoothing=0.3
    )
    close(dense(ggn_operator(model, x, smooth)), dense(ggn_operator(model, x, plain)))
    f = rows(model(x)).numpy()
    y = np.eye(3)[_labels(3)]
    assert not np.allclose(
        output_loss(smooth, model).value(f, y), output_loss(plain, model).value(f, y)
    )


def test_a_callable_loss_by_autodiff():
    model = heads_model((2, 3), seed=10)
    x = inputs()
    y = [np.random.default_rng(11).normal(size=(N, 2)), _labels(3)]

    def log_cosh(y_true, y_pred):  # one value per sample, convex
        return tf.reduce_sum(tf.math.log(tf.cosh(y_pred - y_true)), axis=-1)

    losses = [log_cosh, "softmax_cross_entropy"]

    def total(out):
        return tf.reduce_mean(log_cosh(y[0], out[0])) + cross_entropy(out[1], y[1])

    G = reference_G(model, x, total)
    close(dense(ggn_operator(model, x, losses, y=y)), G)
    close(ggn_diagonal(model, x, losses, y=y), np.diag(G))
    with pytest.raises(ValueError, match="pass y="):
        ggn_operator(model, x, losses)


def test_kfac_takes_sample_weight_and_a_keras_loss():
    keras.utils.set_random_seed(12)
    model = keras.Sequential(
        [keras.Input((3,), dtype=D), keras.layers.Dense(4, dtype=D)]
    )
    x = inputs(n=1)
    loss = keras.losses.SparseCategoricalCrossentropy(
        dtype=D, from_logits=True, reduction="sum"
    )
    y = np.array([2])
    w = np.array([2.5])

    def total(out):
        return loss(y, tf.nest.flatten(out)[0], sample_weight=w)

    G = reference_G(model, x, total)  # one sample, one layer: KFAC is exact
    close(kfac(model, x, loss, sample_weight=w).to_dense(), G)


# --- item 3: what is not logits is refused, whatever describes the loss ------


def _nested_softmax():
    inner = keras.Sequential(
        [
            keras.Input((3,), dtype=D),
            keras.layers.Dense(3, dtype=D),
            keras.layers.Softmax(dtype=D),
        ]
    )
    x = keras.Input((3,), dtype=D)
    return keras.Model(x, inner(x))


def _ops_softmax():
    x = keras.Input((3,), dtype=D)
    return keras.Model(x, keras.ops.softmax(keras.layers.Dense(3, dtype=D)(x)))


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3, dtype=D)

    def call(self, x):
        return tf.nn.softmax(self.dense(x))


def _subclassed():
    model = Subclassed()
    model(np.zeros((1, 3)))
    return model


def _dense_softmax():
    return keras.Sequential(
        [
            keras.Input((3,), dtype=D),
            keras.layers.Dense(3, activation="softmax", dtype=D),
        ]
    )


def _activation_layer():
    return keras.Sequential(
        [
            keras.Input((3,), dtype=D),
            keras.layers.Dense(3, dtype=D),
            keras.layers.Activation("softmax", dtype=D),
        ]
    )


def _second_head_sigmoid():
    x = keras.Input((3,), dtype=D)
    return keras.Model(
        x,
        [
            keras.layers.Dense(2, dtype=D)(x),
            keras.layers.Dense(3, activation="sigmoid", dtype=D)(x),
        ],
    )


PROBABILITIES = {
    "nested_softmax": _nested_softmax,
    "keras_ops_softmax": _ops_softmax,
    "subclassed_tf_nn_softmax": _subclassed,
    "dense_softmax": _dense_softmax,
    "activation_layer": _activation_layer,
    "second_head_sigmoid": _second_head_sigmoid,
}


@pytest.mark.parametrize("name", sorted(PROBABILITIES))
def test_a_head_that_outputs_probabilities_is_refused(name):
    model = PROBABILITIES[name]()
    with pytest.raises(ValueError, match="remove|no activation"):
        ggn_operator(model, inputs(), "softmax_cross_entropy")


@pytest.mark.parametrize(
    "loss",
    [
        OutputLoss("softmax_cross_entropy", classes=3),
        keras.losses.CategoricalCrossentropy(dtype=D, from_logits=True),
        keras.losses.SparseCategoricalCrossentropy(dtype=D),  # from_logits=False
    ],
    ids=["output_loss_object", "keras_from_logits", "keras_probabilities"],
)
def test_every_object_describing_the_loss_is_checked(loss):
    with pytest.raises(ValueError, match="from_logits=True"):
        ggn_diagonal(_nested_softmax(), inputs(), loss)


def test_from_logits_false_on_logits_is_refused_too():
    with pytest.raises(ValueError, match="from_logits=True"):
        ggn_operator(
            heads_model((3,)), inputs(), keras.losses.CategoricalCrossentropy(dtype=D)
        )


def test_squared_error_on_probabilities_is_fine():
    G = ggn_operator(_dense_softmax(), inputs(), "mse")
    assert G.shape == (12, 12)


# --- argument checks --------------------------------------------------------------


@pytest.mark.parametrize(
    "chunk_size, error", [(-2, ValueError), (0, ValueError), (2.5, TypeError)]
)
def test_a_bad_chunk_size_is_refused(chunk_size, error):
    model, x = heads_model((3,)), inputs()
    for entry in (
        lambda: ggn_operator(model, x, chunk_size=chunk_size),
        lambda: hessian_operator(model, x, np.zeros((N, 3)), chunk_size=chunk_size),
        lambda: kfac(_dense_softmax(), x, chunk_size=chunk_size),
    ):
        with pytest.raises(error, match="chunk_size"):
            entry()


def test_empty_x_and_non_finite_values_are_refused():
    model = heads_model((3,))
    with pytest.raises(ValueError, match="no samples"):
        ggn_operator(model, np.zeros((0, 3)))
    with pytest.raises(ValueError, match="no samples"):
        ggn_diagonal(model, np.zeros((0, 3)))
    x = inputs()
    bad = x.copy()
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"x holds NaN.*indices 2"):
        ggn_operator(model, bad)
    with pytest.raises(ValueError, match=r"x holds NaN.*indices 2"):
        kfac(_dense_softmax(), bad)
    y = np.zeros((N, 3))
    y[3, 0] = np.inf
    with pytest.raises(ValueError, match=r"y holds NaN.*indices 3"):
        hessian_operator(model, x, y)
    with pytest.raises(ValueError, match="negative"):
        ggn_operator(model, x, sample_weight=-np.ones(N))


def test_kfac_reads_variables_given_as_a_generator_once():
    keras.utils.set_random_seed(13)
    model = keras.Sequential(
        [
            keras.Input((3,), dtype=D),
            keras.layers.Dense(4, activation="tanh", dtype=D),
            keras.layers.Dense(2, dtype=D),
        ]
    )
    x = inputs()
    K = kfac(model, x, variables=(v for v in model.trainable_variables))
    close(
        K.to_dense(),
        kfac(model, x, variables=list(model.trainable_variables)).to_dense(),
    )
    values = top_eigenvalues(K, k=2)
    close(values, np.linalg.eigvalsh(K.to_dense())[::-1][:2])
    with pytest.raises(TypeError, match="square"):
        top_eigenvalues(object())


def test_keras_mse_on_a_matrix_output_divides_by_every_position():
    keras.utils.set_random_seed(14)
    model = keras.Sequential(
        [
            keras.Input((3,), dtype=D),
            keras.layers.Dense(6, dtype=D),
            keras.layers.Reshape((2, 3), dtype=D),
        ]
    )
    x = inputs()
    y = np.random.default_rng(15).normal(size=(N, 2, 3))
    loss = keras.losses.MeanSquaredError(dtype=D)  # values (n, 2): mean over n * 2
    G = reference_G(model, x, lambda out: loss(y, out))
    close(dense(ggn_operator(model, x, loss)), G)
