"""Data as Keras users hold it (issue 35): a tf.data.Dataset or a Keras
PyDataset of model.fit's batches gives, in every entry that takes x, exactly
what the same data as arrays gives; a source that cannot serve is refused with
what to do instead."""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, tf
from jacutil.curvature.diagonal import ggn_diagonal
from jacutil.curvature.ggn import ggn_operator
from jacutil.curvature.kfac import kfac
from jacutil.curvature.laplace import laplace

N = 23  # batches of 5: the last one short


@pytest.fixture(scope="module")
def data():
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="float64"),
            keras.layers.Dense(6, activation="tanh", dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )
    rng = np.random.default_rng(3)
    x = rng.standard_normal((N, 4))
    y = rng.standard_normal((N, 3))
    w = rng.uniform(0.5, 2.0, N)
    return model, x, y, w


def dataset(*arrays, batch=5):
    return tf.data.Dataset.from_tensor_slices(
        arrays if len(arrays) > 1 else arrays[0]
    ).batch(batch)


class Batches(keras.utils.PyDataset):
    """model.fit's other data type: batches by index."""

    def __init__(self, *arrays, batch=5):
        super().__init__()
        self.arrays, self.batch = arrays, batch

    def __len__(self):
        return -(-len(self.arrays[0]) // self.batch)

    def __getitem__(self, k):
        part = tuple(a[k * self.batch : (k + 1) * self.batch] for a in self.arrays)
        return part if len(part) > 1 else part[0]


@pytest.mark.parametrize("source", ["dataset", "pydataset"])
def test_jacobians_from_a_dataset_equal_those_from_arrays(data, source):
    model, x, y, _ = data
    make = dataset if source == "dataset" else Batches
    J = ju.jacobian(model, x)
    np.testing.assert_array_equal(ju.jacobian(model, make(x, y)), J)
    np.testing.assert_array_equal(ju.jacobian(model, make(x)), J)
    chunked = ju.chunked_jacobian(model, make(x, y), chunk_size=7, progress=False)
    np.testing.assert_array_equal(
        chunked, ju.chunked_jacobian(model, x, chunk_size=7, progress=False)
    )


def test_per_sample_gradients_from_a_dataset_equal_those_from_arrays(data):
    model, x, y, _ = data
    mse = keras.losses.mean_squared_error
    G = ju.per_sample_gradients(model, mse, x, y)
    # a source's first batch runs eagerly, the next ones in the traced graph
    # (issue 64): equal to float64 rounding, not bit for bit
    exact = dict(rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(
        ju.per_sample_gradients(model, mse, dataset(x, y)), G, **exact
    )
    np.testing.assert_allclose(
        ju.per_sample_gradient_norms(model, mse, Batches(x, y)),
        ju.per_sample_gradient_norms(model, mse, x, y),
        **exact,
    )
    # and each row is that sample's own gradient (one tape per sample)
    for i in (0, N - 1):
        with tf.GradientTape() as tape:
            loss = mse(y[i : i + 1], model(x[i : i + 1]))
        row = np.concatenate(
            [g.numpy().ravel() for g in tape.gradient(loss, model.trainable_variables)]
        )
        np.testing.assert_allclose(G[i], row, rtol=1e-12, atol=1e-14)


def test_curvature_from_a_dataset_equals_that_from_arrays(data):
    model, x, y, w = data
    v = np.random.default_rng(0).standard_normal(ju.flat_params(model).size)
    loss = keras.losses.MeanSquaredError()
    from_arrays = ggn_operator(model, x, loss, y=y, sample_weight=w) @ v
    np.testing.assert_array_equal(
        ggn_operator(model, dataset(x, y, w), loss) @ v, from_arrays
    )
    # the dataset's weights reach every entry (kfac hands them on to G's diagonal)
    np.testing.assert_array_equal(
        ggn_diagonal(model, dataset(x, y, w), loss),
        ggn_diagonal(model, x, loss, y=y, sample_weight=w),
    )
    np.testing.assert_array_equal(
        kfac(model, dataset(x, y, w), loss).matvec(v),
        kfac(model, x, loss, y=y, sample_weight=w).matvec(v),
    )
    assert not np.array_equal(
        ggn_diagonal(model, x, loss, y=y),
        ggn_diagonal(model, x, loss, y=y, sample_weight=w),
    )  # the weights matter: a lost weight would show
    fitted = laplace(model, x, y)
    from_data = laplace(model, dataset(x, y))
    np.testing.assert_array_equal(
        from_data.predictive_variance(x[:4]), fitted.predictive_variance(x[:4])
    )


def test_several_inputs_as_a_dict(data):
    keras.utils.set_random_seed(1)
    a, b = keras.Input((2,), name="a"), keras.Input((3,), name="b")
    out = keras.layers.Dense(2)(keras.layers.Concatenate()([a, b]))
    model = keras.Model({"a": a, "b": b}, out)
    rng = np.random.default_rng(1)
    x = {"a": rng.standard_normal((11, 2)), "b": rng.standard_normal((11, 3))}
    x = {k: v.astype("float32") for k, v in x.items()}
    np.testing.assert_array_equal(
        ju.jacobian(model, tf.data.Dataset.from_tensor_slices(x).batch(4)),
        ju.jacobian(model, x),
    )


def test_a_dataset_is_refused_where_it_cannot_serve(data, tmp_path):
    model, x, y, w = data
    mse = keras.losses.mean_squared_error
    with pytest.raises(ValueError, match=r"never ends \(\.repeat\(\)"):
        ju.jacobian(model, dataset(x).repeat())
    with pytest.raises(ValueError, match="y must not be given with a dataset"):
        ju.per_sample_gradients(model, mse, dataset(x, y), y)
    with pytest.raises(ValueError, match="y is missing"):
        ju.per_sample_gradients(model, mse, dataset(x))
    with pytest.raises(ValueError, match="carry sample weights"):
        ju.per_sample_gradients(model, mse, dataset(x, y, w))
    with pytest.raises(ValueError, match="the dataset is empty"):
        ju.jacobian(model, dataset(x).take(0))
    with pytest.raises(TypeError, match="Dataset.from_generator"):
        ju.jacobian(model, (x[k : k + 5] for k in range(0, N, 5)))


def test_a_resumable_file_needs_the_same_order_each_pass(data, tmp_path):
    model, x, _, _ = data
    shuffled = tf.data.Dataset.from_tensor_slices(x).shuffle(N).batch(5)
    with pytest.raises(ValueError, match="another order each time"):
        ju.chunked_jacobian(model, shuffled, out=tmp_path / "J.npy", progress=False)
    # a seeded shuffle, the same each pass: resumable, and its rows in its order
    fixed = (
        tf.data.Dataset.from_tensor_slices(x)
        .shuffle(N, seed=5, reshuffle_each_iteration=False)
        .batch(5)
    )
    order = np.concatenate(list(fixed.as_numpy_iterator()))
    J = ju.chunked_jacobian(
        model, fixed, out=tmp_path / "J.npy", chunk_size=6, progress=False
    )
    np.testing.assert_array_equal(J, ju.jacobian(model, order))


# -- every source model.fit and model.predict take (issue 55) -----------------


def test_an_unbatched_dataset_reads_as_its_samples(data):
    """Single samples, not batches: with a scalar target (model.fit's
    ``(x, label)`` elements) or inputs one rank below the model's."""
    model, x, y, _ = data
    labels = np.arange(N) % 3
    J = ju.jacobian(model, x)
    with_labels = tf.data.Dataset.from_tensor_slices((x, labels))
    np.testing.assert_array_equal(ju.jacobian(model, with_labels), J)
    np.testing.assert_array_equal(
        ju.jacobian(model, tf.data.Dataset.from_tensor_slices(x)), J
    )
    loss = keras.losses.sparse_categorical_crossentropy
    np.testing.assert_array_equal(
        ju.per_sample_gradients(model, lambda t, p: loss(t, p, from_logits=True),
                                with_labels),
        ju.per_sample_gradients(model, lambda t, p: loss(t, p, from_logits=True),
                                x, labels),
    )  # fmt: skip


def masked_sequence_model():
    keras.utils.set_random_seed(2)
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(9, 4, mask_zero=True)(tokens)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(2)(h))


def test_padded_batches_of_their_own_lengths_run_batch_by_batch():
    """``padded_batch`` pads each batch to its own longest sequence, as
    model.predict takes it: each shape runs apart, in order, and J equals
    each batch's own J."""
    model = masked_sequence_model()
    lengths = [2, 5, 3, 3, 6, 1, 4]
    sequences = [np.arange(1, n + 1) % 8 + 1 for n in lengths]
    source = tf.data.Dataset.from_generator(
        lambda: iter(sequences), output_signature=tf.TensorSpec([None], tf.int32)
    ).padded_batch(3)
    source = source.apply(tf.data.experimental.assert_cardinality(3))
    batches = list(source.as_numpy_iterator())
    expected = np.concatenate([ju.jacobian(model, b) for b in batches])
    np.testing.assert_array_equal(ju.jacobian(model, source), expected)
    np.testing.assert_array_equal(
        ju.chunked_jacobian(model, source, chunk_size=2, progress=False), expected
    )
    mse = keras.losses.mean_squared_error
    pairs = source.map(lambda t: (t, tf.zeros([tf.shape(t)[0], 2])))
    G = ju.per_sample_gradients(model, mse, pairs)
    assert G.shape == (len(lengths), ju.flat_params(model).size)


class ListBatches(Batches):
    """A PyDataset whose batches are lists ``[x, y]``: Keras reads them as
    ``(x, y)``."""

    def __getitem__(self, k):
        return list(super().__getitem__(k))


def test_a_pydataset_of_lists_and_one_with_workers(data):
    model, x, y, _ = data
    mse = keras.losses.mean_squared_error
    expected = ju.per_sample_gradients(model, mse, x, y)
    np.testing.assert_array_equal(
        ju.per_sample_gradients(model, mse, ListBatches(x, y)), expected
    )
    threaded = Batches(x, y)
    threaded.workers = 2  # Keras's enqueuer, as model.fit runs it
    np.testing.assert_array_equal(
        ju.per_sample_gradients(model, mse, threaded), expected
    )


def test_a_source_of_unknown_length_is_refused_at_once_or_read_for_steps(data):
    model, x, _, _ = data

    def endless():
        while True:
            yield x[:5]

    spec = tf.TensorSpec([None, 4], tf.float64)
    source = tf.data.Dataset.from_generator(endless, output_signature=spec)
    with pytest.raises(ValueError, match="does not know its length"):
        ju.jacobian(model, source)  # at once: it never ends
    np.testing.assert_array_equal(
        ju.jacobian(model, source, steps=2), ju.jacobian(model, np.tile(x[:5], (2, 1)))
    )
    # a Python generator of batches, each a tuple as Keras requires
    generator = ((x[k : k + 5],) for k in range(0, N, 5))
    np.testing.assert_array_equal(
        ju.jacobian(model, generator, steps=3), ju.jacobian(model, x[:15])
    )


def test_every_entry_that_takes_x_takes_a_dataset(data):
    model, x, y, _ = data
    v = np.random.default_rng(0).standard_normal(ju.flat_params(model).size)
    np.testing.assert_array_equal(
        ju.jacobian_operator(model, dataset(x)) @ v,
        ju.jacobian_operator(model, x) @ v,
    )
    from jacutil.curvature.ntk import empirical_ntk

    np.testing.assert_array_equal(
        empirical_ntk(model, dataset(x), dataset(x[:7])),
        empirical_ntk(model, x, x[:7]),
    )
    fitted = laplace(model, x, y)
    np.testing.assert_array_equal(
        fitted.predictive_variance(dataset(x[:6])), fitted.predictive_variance(x[:6])
    )
    theta = ju.flat_params(model).astype(np.float64)
    from_data = ju.least_squares_problem(model, dataset(x, y))
    from_arrays = ju.least_squares_problem(model, x, y)
    np.testing.assert_array_equal(from_data.fun(theta), from_arrays.fun(theta))
    np.testing.assert_array_equal(from_data.jac(theta), from_arrays.jac(theta))
    with pytest.raises(ValueError, match="least squares needs x and y"):
        ju.least_squares_problem(model, dataset(x))


def test_padded_batches_refuse_a_resumable_file(tmp_path):
    model = masked_sequence_model()
    sequences = [np.ones(n, np.int32) for n in (2, 2, 5, 5)]
    source = tf.data.Dataset.from_generator(
        lambda: iter(sequences), output_signature=tf.TensorSpec([None], tf.int32)
    ).padded_batch(2)
    with pytest.raises(ValueError, match="needs batches of one shape"):
        ju.chunked_jacobian(model, source, out=tmp_path / "J.npy", steps=2)


@pytest.mark.parametrize("entry", ["jacobian", "chunked_jacobian"])
def test_a_source_streams_into_a_given_out(data, entry):
    """Into a given array, the source is read batch by batch (one batch of
    inputs in memory), to the rows the arrays give; padded batches too; an out
    without a row for each sample is refused, naming the rows it needs."""
    model, x, y, _ = data
    run = getattr(ju, entry)
    expected = ju.jacobian(model, x)
    out = np.full_like(expected, np.nan)
    found = run(model, dataset(x, y), out=out, progress=False)
    assert found is out
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-15)  # batches of 5
    with pytest.raises(ValueError, match="out has 24 rows, but the source gave 23"):
        run(model, dataset(x), out=np.empty((24, *expected.shape[1:])))
    with pytest.raises(ValueError, match=r"so far need \(25, \*\(3, 51\)\)"):
        run(model, dataset(np.concatenate([x, x[:2]])), out=np.empty_like(expected))


def test_padded_batches_stream_into_a_given_out():
    model = masked_sequence_model()
    sequences = [np.arange(1, n + 1) % 8 + 1 for n in [2, 5, 3, 6, 1]]
    source = tf.data.Dataset.from_generator(
        lambda: iter(sequences), output_signature=tf.TensorSpec([None], tf.int32)
    ).padded_batch(2)
    source = source.apply(tf.data.experimental.assert_cardinality(3))
    expected = np.concatenate(
        [ju.jacobian(model, b) for b in source.as_numpy_iterator()]
    )
    out = np.empty_like(expected)
    ju.chunked_jacobian(model, source, out=out, chunk_size=1, progress=False)
    np.testing.assert_array_equal(out, expected)


# A source four times the budget, made in the graph (never whole in memory),
# into a memmap: the peak stays within the budget's bound. Run in a fresh
# process, as test_chunked_budget's probes (TensorFlow pools what it grew).
STREAM_PROBE = """
import json, tempfile
import numpy as np
import jacutil as ju
from jacutil import keras, tf
from jacutil.core.memory import peak_memory

n, d, budget = 20_000, 2_000, 32 * 2**20
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((d,)), keras.layers.Dense(1)])
zero = tf.constant(0, tf.int64)
sample = lambda i: tf.random.stateless_normal([d], seed=tf.stack([i, zero]))
source = tf.data.Dataset.range(n).map(sample).batch(500)
options = dict(memory_budget=budget, progress=False)
ju.chunked_jacobian(model, source.take(1), **options)  # the trace, outside the measure
folder = tempfile.TemporaryDirectory()
out = np.lib.format.open_memmap(
    folder.name + "/J.npy", mode="w+", dtype="float32", shape=(n, 1, d + 1)
)
use = peak_memory(ju.chunked_jacobian, model, source, out=out, **options)
last = np.stack([sample(tf.constant(i, tf.int64)).numpy() for i in range(n - 3, n)])
error = float(np.abs(out[-3:] - ju.per_sample_jacobian(model, last)).max())
print(json.dumps({"peak": use.peak, "source": n * d * 4, "error": error}))
"""


def test_a_source_larger_than_the_budget_streams_within_it():
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", STREAM_PROBE], capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    budget = 32 * 2**20
    assert found["source"] > 4 * budget  # read whole, the source alone would pass it
    assert found["peak"] < 2 * budget, found
    assert found["error"] < 1e-5, found
