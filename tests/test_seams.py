"""One step off the tested path: a regression test for each defect of issue 21.

Each test names what went wrong on the main of 2026-12-01 (silently wrong
numbers, a crash, or rows the ledger called done that were zeros) and checks
the right answer against one ``tf.GradientTape`` per sample (``tape_rows``,
written here, independent of jacutil) or a clear error.
"""

import json
import os
import threading

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, tf
from jacutil.core.resume import ResumeMismatch

layers = keras.layers


# --- the reference: one tape per sample ---------------------------------------


def tape_rows(call, x, variables):
    """(n, l, m) by one tape and one ``tape.jacobian`` per sample, in float64."""
    rows = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            y = tf.reshape(call(x[i : i + 1]), [-1])
        parts = tape.jacobian(y, variables)
        rows.append(
            np.concatenate(
                [
                    np.zeros((y.shape[0], int(np.prod(v.shape))))
                    if p is None
                    else np.reshape(p, (y.shape[0], -1))
                    for p, v in zip(parts, variables, strict=True)
                ],
                axis=1,
            )
        )
    return np.stack(rows)


def tape_loss_gradients(model, loss_fn, x, y):
    """(n, m): each sample's loss gradient by its own tape."""
    rows = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(y[i : i + 1], model(x[i : i + 1])))
        grads = tape.gradient(loss, model.trainable_variables)
        rows.append(np.concatenate([np.ravel(g) for g in grads]))
    return np.stack(rows)


# --- models one step off the path ---------------------------------------------


class Clip(layers.Layer):
    """Clips to [-limit, limit]: the default limit differs from the call's."""

    def call(self, x, limit=1.0):
        return tf.clip_by_value(x, -limit, limit)


class Scale(layers.Layer):
    def call(self, x, factor=1.0):
        return x * factor


def keyword_model(kind):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    h = layers.Dense(8, activation="tanh")(inputs)
    h = Clip()(h, limit=0.3) if kind == "clip" else Scale()(h, factor=3.0)
    return keras.Model(inputs, layers.Dense(2)(h))


def quiet_first_sample(n=12, seed=0):
    """Sample 0 near zero (its hidden units stay inside the clip), the rest not."""
    x = np.random.default_rng(seed).standard_normal((n, 4)).astype("float32") * 3
    x[0] *= 1e-3
    return x


@pytest.mark.parametrize("kind", ["clip", "scale"])
def test_item01_keyword_call_arguments_are_kept(kind):
    model, x = keyword_model(kind), quiet_first_sample()
    expected = tape_rows(model, x, model.trainable_variables)
    J, choice = ju.jacobian(model, x, explain=True)
    np.testing.assert_allclose(J, expected, rtol=1e-4, atol=1e-5)
    assert choice.path in ("layer rules", "per-sample autodiff")
    for method in ("rules", "per_sample"):
        jac = ju.compiled_jacobian(model, method=method)
        np.testing.assert_allclose(jac(x), expected, rtol=1e-4, atol=1e-5)


def test_item02_per_sample_gradients_do_not_depend_on_call_order():
    loss = keras.losses.mean_squared_error
    model, x = keyword_model("clip"), quiet_first_sample()
    y = np.ones((len(x), 2), "float32")
    expected = tape_loss_gradients(model, loss, x, y)
    G = ju.per_sample_gradients(model, loss, x, y)  # the first call on the model
    np.testing.assert_allclose(G, expected, rtol=1e-4, atol=1e-5)
    norms = ju.per_sample_gradient_norms(model, loss, x, y)
    np.testing.assert_allclose(norms, np.linalg.norm(expected, axis=1), rtol=1e-4)


# --- 3: the resume fingerprint ------------------------------------------------


def test_item03_other_variables_are_another_run(tmp_path):
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((4,)), layers.Dense(4, activation="tanh"),
         layers.Dense(4, activation="tanh"), layers.Dense(4)]
    )  # fmt: skip
    x = np.random.default_rng(2).standard_normal((20, 4)).astype("float32")
    path = tmp_path / "J.npy"
    first = model.layers[0].trainable_variables
    second = model.layers[1].trainable_variables  # the same shapes
    ju.chunked_jacobian(model, x, out=path, chunk_size=5, variables=first,
                        progress=False)  # fmt: skip
    with pytest.raises(ResumeMismatch):
        ju.chunked_jacobian(model, x, out=path, chunk_size=5, variables=second,
                            progress=False)  # fmt: skip


def test_item03_a_plain_callable_needs_a_key(tmp_path):
    w = tf.Variable(np.random.default_rng(0).standard_normal((3, 2)))
    x = np.random.default_rng(1).standard_normal((10, 3))
    path = tmp_path / "J.npy"

    def f1(t):
        return tf.tanh(t @ w)

    def f2(t):
        return tf.sin(t @ w)

    with pytest.raises(TypeError, match="key="):
        ju.chunked_jacobian(f1, x, out=path, variables=[w], progress=False)
    J1 = ju.chunked_jacobian(f1, x, out=path, variables=[w], key="tanh",
                             chunk_size=5, progress=False)  # fmt: skip
    np.testing.assert_allclose(J1, tape_rows(f1, x, [w]), rtol=1e-10)
    with pytest.raises(ResumeMismatch):
        ju.chunked_jacobian(f2, x, out=path, variables=[w], key="sin",
                            chunk_size=5, progress=False)  # fmt: skip


# --- 4 and 12: Levenberg-Marquardt with conjugate gradients -------------------


def test_item04_cg_after_a_rejected_step_uses_j_at_theta():
    model = ju.question_mlp(seed=4, hidden=(16,))
    x, y = ju.regression_data(200, seed=5)
    problem = ju.least_squares_problem(model, x, y, jacobian="operator")
    theta = problem.theta0
    system = ju.fitting.gauss_newton.GaussNewtonProducts(problem, theta, 200)
    before = system.step(1.0)
    problem.fun(theta + 0.5)  # a rejected trial writes its theta into the model
    after = system.step(1.0)
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-8)


def test_item12_cg_on_a_formed_problem():
    model = ju.question_mlp(seed=4, hidden=(8,))
    x, y = ju.regression_data(100, seed=5)
    formed = ju.least_squares_problem(model, x, y)
    fit = ju.levenberg_marquardt(formed, solver="cg", max_steps=3)
    assert fit["history"][-1, 1] < fit["history"][0, 1]


# --- 5, 6, 8: files you can trust ---------------------------------------------


def _mlp_run(n=400):
    return ju.question_mlp(seed=1, hidden=(8,)), ju.regression_data(n, seed=3)[0]


def test_item05_a_truncated_file_is_refused(tmp_path):
    model, x = _mlp_run()
    path = tmp_path / "J.npy"
    ju.chunked_jacobian(model, x, out=path, chunk_size=25, progress=False)
    ledger = json.loads((tmp_path / "J.npy.progress.json").read_text())
    ledger["done"] = [[0, 8]]  # killed at 8 of 16 chunks
    (tmp_path / "J.npy.progress.json").write_text(json.dumps(ledger))
    size = os.path.getsize(path)
    os.truncate(path, size // 4)
    with pytest.raises(ResumeMismatch, match="bytes"):
        ju.chunked_jacobian(model, x, out=path, chunk_size=25, progress=False)
    # with a complete ledger too: a clear error, not a bare mmap message
    ledger["done"] = [[0, 16]]
    (tmp_path / "J.npy.progress.json").write_text(json.dumps(ledger))
    with pytest.raises(ResumeMismatch, match="bytes"):
        ju.chunked_jacobian(model, x, out=path, chunk_size=25, progress=False)


def test_item05_a_corrupted_ledger_says_what_to_do(tmp_path):
    model, x = _mlp_run(40)
    path = tmp_path / "J.npy"
    ju.chunked_jacobian(model, x, out=path, chunk_size=10, progress=False)
    (tmp_path / "J.npy.progress.json").write_text('{"fingerprint": "ab')
    with pytest.raises(ResumeMismatch, match="delete"):
        ju.chunked_jacobian(model, x, out=path, chunk_size=10, progress=False)


def test_item05_a_second_writer_is_refused(tmp_path):
    model, x = _mlp_run(40)
    path = tmp_path / "J.npy"
    from jacutil.core.resume import writer_lock

    with writer_lock(path):
        errors = []

        def other():
            try:
                ju.chunked_jacobian(model, x, out=path, chunk_size=10,
                                    progress=False)  # fmt: skip
            except Exception as error:  # noqa: BLE001
                errors.append(error)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert errors and "another" in str(errors[0])
    J = ju.chunked_jacobian(model, x, out=path, chunk_size=10, progress=False)
    np.testing.assert_allclose(J, ju.chunked_jacobian(model, x, progress=False))


def test_item06_a_worker_that_sees_another_folder_fails(tmp_path):
    """A worker's own copy of ``out`` (node-local scratch) is not the run's."""
    from jacutil.core.resume import RunFileError
    from jacutil.scale.distributed import model_spec, rows_task

    model, x = _mlp_run(40)
    run = tmp_path / "J"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"token": "the-runs"}))
    other = tmp_path / "node" / "J"  # what another node sees at that path
    other.mkdir(parents=True)
    (other / "run.json").write_text(json.dumps({"token": "an-older-runs"}))
    spec = model_spec(model, x)
    options = {"training": False, "jit_compile": False, "method": "rules"}
    rows_task(spec, x[:10], 0, options=options, folder=str(run), token="the-runs")
    assert len(list(run.glob("rows-*.npy"))) == 1
    with pytest.raises(RunFileError, match="shared file system"):
        rows_task(spec, x[:10], 0, options=options, folder=str(other), token="the-runs")
    assert not list(other.glob("rows-*"))


def test_item08_chunked_to_a_path_without_chunk_size(tmp_path):
    model, x = _mlp_run(100)
    J = ju.chunked_jacobian(model, x, out=tmp_path / "J.npy", progress=False)
    np.testing.assert_array_equal(J, ju.chunked_jacobian(model, x, progress=False))


# --- 7 and 12: grouped convolutions -------------------------------------------


def grouped_conv():
    keras.utils.set_random_seed(7)
    return keras.Sequential(
        [
            keras.Input((5, 5, 4), dtype="float64"),
            layers.Conv2D(4, 3, groups=2, activation="tanh", dtype="float64"),
            layers.Flatten(dtype="float64"),
            layers.Dense(2, dtype="float64"),
        ]
    )


def tape_rows_without_pfor(model, x):
    """``tape_rows`` by one ``tape.gradient`` per output: TensorFlow's own
    ``tape.jacobian`` (pfor) fails on a grouped convolution's gradient."""
    variables = model.trainable_variables
    rows = []
    for i in range(len(x)):
        with tf.GradientTape(persistent=True) as tape:
            y = tf.reshape(model(x[i : i + 1]), [-1])
            outputs = [y[k] for k in range(y.shape[0])]
        grads = [tape.gradient(out, variables) for out in outputs]
        rows.append([np.concatenate([np.ravel(g) for g in row]) for row in grads])
    return np.array(rows)


def test_item07_grouped_convolution_forward_mode_and_jvp():
    model = grouped_conv()
    x = np.random.default_rng(0).standard_normal((3, 5, 5, 4))
    expected = tape_rows_without_pfor(model, x)
    np.testing.assert_allclose(ju.forward_jacobian(model, x), expected, atol=1e-10)
    v = np.random.default_rng(1).standard_normal(expected.shape[2])
    np.testing.assert_allclose(ju.jvp(model, x, v), expected @ v, atol=1e-10)


@pytest.mark.parametrize("method", ["per_sample", "batch", "rules"])
def test_item12_grouped_convolution_in_reverse_mode(method):
    model = grouped_conv()
    x = np.random.default_rng(0).standard_normal((3, 5, 5, 4))
    expected = tape_rows_without_pfor(model, x)
    J = ju.compiled_jacobian(model, method=method)(x)
    np.testing.assert_allclose(J, expected, atol=1e-10)
    np.testing.assert_allclose(ju.jacobian(model, x), expected, atol=1e-10)


# --- 9: the standard classifiers ----------------------------------------------


@pytest.mark.parametrize(
    "activation, loss, labels",
    [
        ("softmax", keras.losses.sparse_categorical_crossentropy, "ids"),
        ("softmax", keras.losses.categorical_crossentropy, "one_hot"),
        ("sigmoid", keras.losses.binary_crossentropy, "binary"),
    ],
)
def test_item09_per_sample_gradients_of_classifiers(activation, loss, labels):
    keras.utils.set_random_seed(9)
    width = 1 if labels == "binary" else 3
    model = keras.Sequential(
        [keras.Input((4,)), layers.Dense(6, activation="relu"),
         layers.Dense(width, activation=activation)]
    )  # fmt: skip
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 4)).astype("float32") * 4
    ids = rng.integers(0, 3, 16)
    y = {
        "ids": ids,
        "one_hot": np.eye(3, dtype="float32")[ids],
        "binary": rng.integers(0, 2, (16, 1)).astype("float32"),
    }[labels]
    expected = tape_loss_gradients(model, loss, x, y)
    G = ju.per_sample_gradients(model, loss, x, y)
    np.testing.assert_allclose(G, expected, rtol=1e-4, atol=1e-5)
    norms = ju.per_sample_gradient_norms(model, loss, x, y)
    np.testing.assert_allclose(norms, np.linalg.norm(expected, axis=1), rtol=1e-4)


# --- 10 and 11: what lies between layers --------------------------------------


@pytest.mark.parametrize("between", ["ops.tanh", "times two"])
def test_item10_keras_ops_between_layers(between):
    keras.utils.set_random_seed(10)
    inputs = keras.Input((4,))
    h = layers.Dense(6)(inputs)
    h = keras.ops.tanh(h) if between == "ops.tanh" else h * 2
    model = keras.Model(inputs, layers.Dense(2)(h))
    x = np.random.default_rng(0).standard_normal((5, 4)).astype("float32")
    expected = tape_rows(model, x, model.trainable_variables)
    np.testing.assert_allclose(ju.jacobian(model, x), expected, rtol=1e-4, atol=1e-5)
    J = ju.compiled_jacobian(model, method="rules")(x)
    np.testing.assert_allclose(J, expected, rtol=1e-4, atol=1e-5)
    y = np.zeros((5, 2), "float32")
    loss = keras.losses.mean_squared_error
    np.testing.assert_allclose(
        ju.per_sample_gradients(model, loss, x, y),
        tape_loss_gradients(model, loss, x, y),
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.parametrize("kind", ["lambda", "partial"])
def test_item11_frozen_dense_with_a_lambda_activation(kind):
    import functools

    activation = (
        (lambda t: tf.nn.leaky_relu(t, 0.3))
        if kind == "lambda"
        else functools.partial(tf.nn.leaky_relu, alpha=0.3)
    )
    keras.utils.set_random_seed(11)
    frozen = layers.Dense(2, activation=activation)  # on top: no wanted variable
    model = keras.Sequential(
        [keras.Input((4,)), layers.Dense(6, activation="tanh"), frozen]
    )
    frozen.trainable = False
    x = np.random.default_rng(0).standard_normal((6, 4)).astype("float32")
    expected = tape_rows(model, x, model.trainable_variables)
    np.testing.assert_allclose(ju.jacobian(model, x), expected, rtol=1e-4, atol=1e-5)


# --- 12: the rest of the crashes ----------------------------------------------


@pytest.mark.parametrize(
    "activation",
    [
        "gelu",
        "silu",
        "elu",
        "selu",
        "softplus",
        "hard_sigmoid",
        "mish",
        "log_softmax",
        "softsign",
    ],
)
def test_item12_forward_mode_with_keras_activations(activation):
    keras.utils.set_random_seed(12)
    model = keras.Sequential(
        [keras.Input((3,), dtype="float64"),
         layers.Dense(4, activation=activation, dtype="float64"),
         layers.Dense(2, dtype="float64")]
    )  # fmt: skip
    x = np.random.default_rng(0).standard_normal((4, 3))
    expected = tape_rows(model, x, model.trainable_variables)
    np.testing.assert_allclose(ju.forward_jacobian(model, x), expected, atol=1e-10)


def test_item12_chunked_rules_on_a_residual_add():
    keras.utils.set_random_seed(13)
    inputs = keras.Input((4,))
    h = layers.Dense(4, activation="tanh")(inputs)
    h = layers.Add()([h, inputs])
    model = keras.Model(inputs, layers.Dense(2)(h))
    x = np.random.default_rng(0).standard_normal((30, 4)).astype("float32")
    expected = tape_rows(model, x, model.trainable_variables)
    J = ju.chunked_jacobian(model, x, chunk_size=7, method="rules", progress=False)
    np.testing.assert_allclose(J, expected, rtol=1e-4, atol=1e-5)
