"""Grouped and depthwise convolutions without a loop over the groups, and the
rules of the weightless spatial layers (padding, cropping, up-sampling,
pooling) - issue 56.

Every rule alone against autodiff in float64 (``check_rule``); the grouped
convolution of ``jacutil.core._grouped`` against one ordinary convolution
per group, by a float64 tape per sample, under pfor, on CPU, under XLA and
in forward mode inside a ``tf.function``; the traced graph of a
``Conv2D(groups=96)`` counted; the plans of keras.applications models; and
one of them end to end against a tape per sample.
"""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, rules, testing, tf
from jacutil.core import _grouped
from jacutil.core._grouped import convolutions_by_group, grouped_convolution
from jacutil.core.formulation import Ladder
from jacutil.core.target import watched
from jacutil.rules.autodiff import AutodiffRule
from tests.generated import tape_jacobian

layers = keras.layers
F64 = {"dtype": "float64"}


def checked(layer, shape, **options):
    """check_rule of a float64 copy of ``layer`` (a weightless layer is built
    at construction, in float32)."""
    layer = type(layer).from_config({**layer.get_config(), "dtype": "float64"})
    report = testing.check_rule(layer, input_shape=shape, **options)
    assert report.passed, report.why()
    return report


# --- grouped and depthwise convolution rules ----------------------------------


@pytest.fixture(params=["default", "depthwise_always"])
def route(request, monkeypatch):
    """Both routes of grouped_convolution: its cost rule (one convolution per
    group up to FEW_GROUPS groups) and the depthwise one forced."""
    if request.param == "depthwise_always":
        monkeypatch.setattr(_grouped, "FEW_GROUPS", 0)
    return request.param


GROUPED = [
    # (layer options, input shape): groups 2, 3, c_in; strides, dilation, padding
    (dict(filters=6, kernel_size=3, groups=2, padding="same", activation="tanh"),
     (6, 5, 4)),
    (dict(filters=6, kernel_size=(2, 3), groups=3, strides=2), (7, 8, 6)),
    (dict(filters=12, kernel_size=3, groups=6, dilation_rate=2, padding="same"),
     (7, 7, 12)),
    (dict(filters=12, kernel_size=2, groups=6, strides=(2, 1), use_bias=False),
     (6, 5, 12)),
    (dict(filters=5, kernel_size=3, groups=5, padding="same", activation="relu"),
     (5, 6, 5)),
    (dict(filters=10, kernel_size=3, groups=5, strides=2, padding="same"), (7, 6, 5)),
]  # fmt: skip

GROUPED_1D = [
    (dict(filters=8, kernel_size=3, groups=4, padding="causal", dilation_rate=2),
     (9, 8)),
    (dict(filters=6, kernel_size=2, groups=2, strides=2, activation="sigmoid"),
     (9, 4)),
    (dict(filters=12, kernel_size=3, groups=6, padding="same"), (7, 12)),
    (dict(filters=8, kernel_size=3, groups=8, padding="causal"), (7, 8)),
]  # fmt: skip


@pytest.mark.parametrize("options, shape", GROUPED)
def test_grouped_conv2d_rule(options, shape, route):
    report = checked(layers.Conv2D(**options), shape)
    assert report.rule.startswith("conv2d")


@pytest.mark.parametrize("options, shape", GROUPED_1D)
def test_grouped_conv1d_rule(options, shape, route):
    checked(layers.Conv1D(**options), shape)


DEPTHWISE = [
    (dict(kernel_size=3, depth_multiplier=1, padding="same", activation="relu"),
     (5, 6, 3)),
    (dict(kernel_size=3, depth_multiplier=2), (5, 6, 3)),
    (dict(kernel_size=(3, 2), depth_multiplier=2, strides=2, padding="same"),
     (7, 6, 2)),
    (dict(kernel_size=3, depth_multiplier=1, dilation_rate=2, padding="same",
          use_bias=False), (7, 7, 3)),
    (dict(kernel_size=3, depth_multiplier=2, strides=2, dilation_rate=2,
          padding="same"), (9, 8, 2)),  # both: Keras's dilated conv subsampled
    (dict(kernel_size=2, depth_multiplier=2), (4, 4, 1)),  # one channel: no groups
]  # fmt: skip

DEPTHWISE_1D = [
    (dict(kernel_size=3, depth_multiplier=1, activation="tanh"), (7, 3)),
    (dict(kernel_size=3, depth_multiplier=2, strides=2, padding="same"), (9, 3)),
    (dict(kernel_size=2, depth_multiplier=2, dilation_rate=3, use_bias=False),
     (9, 2)),
]  # fmt: skip


@pytest.mark.parametrize("options, shape", DEPTHWISE)
def test_depthwise_conv2d_rule(options, shape):
    report = checked(layers.DepthwiseConv2D(**options), shape)
    assert report.rule.startswith("depthwise_conv2d")


@pytest.mark.parametrize("options, shape", DEPTHWISE_1D)
def test_depthwise_conv1d_rule(options, shape):
    report = checked(layers.DepthwiseConv1D(**options), shape)
    assert report.rule.startswith("depthwise_conv1d")


SEPARABLE = [
    (layers.SeparableConv2D, dict(filters=4, kernel_size=3, depth_multiplier=2,
                                  activation="tanh"), (7, 7, 3)),
    (layers.SeparableConv2D, dict(filters=5, kernel_size=(3, 2), strides=2,
                                  padding="same", use_bias=False), (8, 9, 2)),
    (layers.SeparableConv2D, dict(filters=3, kernel_size=3, dilation_rate=2,
                                  padding="same", activation="relu"), (9, 9, 2)),
    (layers.SeparableConv1D, dict(filters=4, kernel_size=3, depth_multiplier=2,
                                  activation="tanh"), (9, 3)),
    (layers.SeparableConv1D, dict(filters=4, kernel_size=2, strides=2,
                                  padding="same"), (9, 3)),
]  # fmt: skip


@pytest.mark.parametrize("kind, options, shape", SEPARABLE)
def test_separable_conv_rule(kind, options, shape):
    """Issue 64: NASNet's and Xception's layer, a depthwise then a 1x1
    convolution, by the two rules in a row (every check of check_rule)."""
    report = checked(kind(**options), shape)
    assert report.rule.startswith(f"separable_conv{len(shape) - 1}d")


def test_a_separable_block_is_on_the_rules_and_equals_the_float64_tape():
    keras.utils.set_random_seed(2)
    model = keras.Sequential(
        [keras.Input((8, 8, 3), **F64),
         layers.SeparableConv2D(6, 3, padding="same", activation="relu", **F64),
         layers.SeparableConv2D(4, 3, strides=2, depth_multiplier=2, **F64),
         layers.GlobalAveragePooling2D(**F64), layers.Dense(3, **F64)]
    )  # fmt: skip
    x = np.random.default_rng(3).standard_normal((5, 8, 8, 3))
    J, choice = ju.jacobian(model, x, explain=True)
    assert choice.path == "layer rules"
    assert [rule for _, rule in choice.layers][:2] == [
        "separable_conv2d+relu", "separable_conv2d",
    ]  # fmt: skip
    reference = tape_jacobian(model, x, model.trainable_variables)
    np.testing.assert_allclose(J, reference, rtol=1e-10, atol=1e-12)
    y = np.random.default_rng(4).standard_normal((5, 3))
    loss = keras.losses.mean_squared_error
    norms = ju.per_sample_gradient_norms(model, loss, x, y)
    gradients = ju.per_sample_gradients(model, loss, x, y)
    np.testing.assert_allclose(norms, np.linalg.norm(gradients, axis=1), rtol=1e-10)


def test_depthwise_and_grouped_rules_refuse_what_they_do_not_cover(monkeypatch):
    for layer in (
        layers.DepthwiseConv2D(3, data_format="channels_first"),
        layers.Conv2D(4, 3, groups=2, data_format="channels_first"),
    ):
        layer.build((None, 2, 5, 5))
        rule, why = rules.rule_for(layer)
        assert rule is None and "channels_first" in why
    quantized = layers.DepthwiseConv2D(3)
    quantized.build((None, 5, 5, 2))
    monkeypatch.setattr(  # what quantize() leaves
        layers.DepthwiseConv2D, "quantization_mode", property(lambda self: "int8")
    )
    rule, why = rules.rule_for(quantized)
    assert rule is None and "quantized" in why


def test_nothing_is_computed_for_an_unwanted_kernel():
    """A grouped convolution whose kernel is not wanted forms no patches:
    its backward step reads no kernel offset (no strided slice of the image)."""
    layer = layers.Conv2D(12, 3, groups=6, **F64)
    layer.build((None, 6, 6, 12))
    rule = rules.rule_for(layer)[0]
    x = tf.constant(np.random.default_rng(0).standard_normal((2, 6, 6, 12)))

    def backward(wanted):
        y, saved = rule.forward(x)
        delta = tf.ones([2, 3, *y.shape[1:]], tf.float64)
        return rule.backward(saved, delta, wanted, True)

    def traced(wanted):
        blocks, below = backward(wanted)
        return [block for _, block in blocks.items()], below

    def slices(wanted):
        graph = tf.function(lambda: traced(wanted)).get_concrete_function().graph
        types = [op.type for op in graph.get_operations()]
        return types.count("StridedSlice"), types.count("Einsum")

    none, kernel = slices([]), slices([layer.kernel])
    assert kernel[0] >= none[0] + 9 and kernel[1] == 1  # a slice per kernel offset
    bias = slices([layer.bias])
    assert bias[0] < none[0] + 9 and bias[1] == 0  # the bias alone: no patches
    blocks, _ = backward([layer.bias])
    assert [key for key in blocks.keys()] == [(layer.bias,)]


# --- the grouped convolution while jacutil runs a model -----------------------


def _grouped_model(groups, rank=2):
    keras.utils.set_random_seed(56)
    conv = {1: layers.Conv1D, 2: layers.Conv2D}[rank]
    shape = (7, 12) if rank == 1 else (6, 5, 12)
    return keras.Sequential(
        [keras.Input(shape, **F64),
         conv(12, 3, groups=groups, padding="same", activation="tanh", **F64),
         layers.Flatten(**F64), layers.Dense(2, **F64)]
    )  # fmt: skip


def _by_group_call(model, rank=2):
    """The model with its grouped convolution as one ordinary convolution per
    group: the reference, independent of jacutil and of Keras's conv."""
    conv, dense = model.layers[0], model.layers[-1]

    def call(x):
        x = tf.convert_to_tensor(x)
        image = x[:, None] if rank == 1 else x
        kernel = conv.kernel[None] if rank == 1 else tf.convert_to_tensor(conv.kernel)
        groups = conv.groups
        z = tf.concat(
            [tf.nn.convolution(a, k, 1, "SAME") for a, k in zip(
                tf.split(image, groups, -1), tf.split(kernel, groups, -1),
                strict=True)], -1,
        ) + conv.bias  # fmt: skip
        z = tf.tanh(z[:, 0] if rank == 1 else z)
        return tf.reshape(z, [tf.shape(z)[0], -1]) @ dense.kernel + dense.bias

    return call


def _reference(model, x, rank=2):
    """(n, l, m): a float64 tape per sample of the per-group reference."""
    variables = model.trainable_variables
    call = _by_group_call(model, rank)
    rows = []
    for i in range(len(x)):
        with tf.GradientTape(persistent=True) as tape:
            y = call(x[i : i + 1])[0]
            outputs = [y[k] for k in range(y.shape[0])]
        rows.append([np.concatenate([np.ravel(g) for g in tape.gradient(
            out, variables)]) for out in outputs])  # fmt: skip
    return np.array(rows)


def _batch(model, n=3):
    return np.random.default_rng(1).standard_normal((n, *model.input_shape[1:]))


@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("groups", [2, 6, 12])
def test_pfor_gradient_of_a_grouped_convolution(groups, rank, route):
    """TF 2.21's pfor could not convert Keras's grouped filter gradient."""
    model = _grouped_model(groups, rank)
    x, variables = _batch(model), model.trainable_variables
    w = np.random.default_rng(2).standard_normal((3, 2))

    def one(row):
        x_i, w_i = row
        with tf.GradientTape() as tape:
            score = tf.reduce_sum(w_i * model(x_i[None], training=False))
        return tape.gradient(score, variables)

    with convolutions_by_group():
        grads = tf.function(lambda: tf.vectorized_map(one, (x, w)))()
    found = np.concatenate([np.reshape(g, (3, -1)) for g in grads], 1)
    expected = np.einsum("nl,nlm->nm", w, _reference(model, x, rank))
    np.testing.assert_allclose(found, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("groups", [2, 6, 12])
def test_cpu_and_xla_gradient_of_a_grouped_convolution(groups, jit_compile, route):
    """TensorFlow has no CPU gradient of a grouped convolution outside XLA."""
    model = _grouped_model(groups)
    x, variables = _batch(model), model.trainable_variables
    w = np.random.default_rng(3).standard_normal((3, 2))

    def gradients():
        with tf.GradientTape() as tape:
            score = tf.reduce_sum(w * model(x, training=False))
        return tape.gradient(score, variables)

    with convolutions_by_group():
        run = tf.function(gradients, jit_compile=True) if jit_compile else gradients
        grads = run()
    found = np.concatenate([np.ravel(g) for g in grads])
    expected = np.einsum("nl,nlm->m", w, _reference(model, x))
    np.testing.assert_allclose(found, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("groups", [2, 6, 12])
def test_forward_mode_tangent_of_a_grouped_convolution_in_a_function(groups, route):
    """ForwardAccumulator carried no tangent into Keras's kernel read inside
    its nested function (zeros, no error)."""
    model = _grouped_model(groups)
    x, variables = _batch(model), model.trainable_variables
    expected = _reference(model, x)
    u = np.random.default_rng(4).standard_normal(expected.shape[2])
    cuts = np.cumsum([int(np.prod(v.shape)) for v in variables])[:-1]
    tangents = [np.reshape(t, v.shape) for t, v in zip(np.split(u, cuts), variables,
                                                      strict=True)]  # fmt: skip

    @tf.function
    def jvp():
        sources = [watched(v) for v in variables]
        with tf.autodiff.ForwardAccumulator(sources, tangents) as accumulator:
            y = model(x, training=False)
        return accumulator.jvp(y)

    with convolutions_by_group():
        found = jvp().numpy()
    np.testing.assert_allclose(found, expected @ u, rtol=1e-10, atol=1e-12)
    assert np.abs(found).max() > 0.1


def test_grouped_convolution_equals_one_convolution_per_group():
    rng = np.random.default_rng(5)
    for c_in, groups, q, strides, rates, padding in [
        (12, 6, 2, (1, 1), (2, 2), "SAME"), (12, 6, 1, (2, 3), (1, 1), "SAME"),
        (12, 6, 1, (2, 3), (1, 1), "VALID"), (8, 8, 2, (2, 2), (1, 1), "SAME"),
        (6, 2, 3, (1, 2), (1, 1), "VALID"),
    ]:  # fmt: skip
        x = tf.constant(rng.standard_normal((2, 9, 10, c_in)))
        k = tf.constant(rng.standard_normal((3, 2, c_in // groups, groups * q)))
        expected = tf.concat(
            [tf.nn.convolution(a, b, strides, padding, dilations=rates)
             for a, b in zip(tf.split(x, groups, -1), tf.split(k, groups, -1),
                             strict=True)], -1,
        )  # fmt: skip
        found = grouped_convolution(x, k, strides, padding, rates)
        np.testing.assert_allclose(found, expected, rtol=1e-12, atol=1e-12)


# --- no Python loop over the groups -------------------------------------------


def _wide_grouped(groups=96):
    keras.utils.set_random_seed(57)
    return keras.Sequential(
        [keras.Input((8, 8, groups)),
         layers.Conv2D(groups, 7, groups=groups, padding="same"),
         layers.GlobalAveragePooling2D(), layers.Dense(2)]
    )  # fmt: skip


def test_a_wide_grouped_convolution_builds_without_a_loop_over_groups():
    """Conv2D(groups=96, 7x7): 96 groups x 49 kernel offsets were sliced one
    by one (thousands of ops, 18 s to build); the rules' graph now holds a
    few hundred, and the model's own call one convolution."""
    groups, offsets = 96, 49
    model = _wide_grouped(groups)
    x = np.random.default_rng(6).standard_normal((2, 8, 8, groups)).astype("float32")
    jac = ju.compiled_jacobian(model, method="rules")
    assert jac.plan is not None, jac.fallback
    assert "autodiff" not in jac.plan.describe(), jac.plan.describe()
    J = jac(x)  # checks the plan on x's shape first
    assert jac.plan is not None, jac.fallback
    graph = jac.build(x, Ladder.RULES, False).get_concrete_function(x).graph
    n_ops = len(graph.get_operations())
    assert n_ops < groups * offsets / 8, n_ops

    def call(x):
        with convolutions_by_group():
            return model(x, training=False)

    ops = tf.function(call).get_concrete_function(x).graph.get_operations()
    convolutions = [op for op in ops if "Conv" in op.type]
    assert len(convolutions) == 1, [op.type for op in convolutions]
    expected = tape_jacobian(model, x, model.trainable_variables)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(J / scale, expected / scale, rtol=0, atol=1e-4)


# --- the weightless spatial layers --------------------------------------------

SPATIAL = [
    (layers.ZeroPadding1D((1, 2)), (5, 3), "zero_padding"),
    (layers.ZeroPadding2D(((1, 2), (0, 1))), (4, 3, 2), "zero_padding"),
    (layers.ZeroPadding2D(1), (3, 3, 2), "zero_padding"),
    (layers.Cropping1D((1, 2)), (6, 3), "cropping"),
    (layers.Cropping2D(((1, 0), (2, 1))), (5, 6, 2), "cropping"),
    (layers.UpSampling1D(2), (4, 3), "up_sampling"),
    (layers.UpSampling2D((2, 3)), (3, 2, 2), "up_sampling"),
    (layers.GlobalAveragePooling1D(), (5, 3), "global_average_pooling"),
    (layers.GlobalAveragePooling1D(keepdims=True), (5, 3), "global_average_pooling"),
    (layers.GlobalAveragePooling2D(), (4, 3, 2), "global_average_pooling"),
    (layers.GlobalAveragePooling2D(keepdims=True), (4, 3, 2),
     "global_average_pooling"),
    (layers.AveragePooling1D(2), (5, 3), "average_pooling"),
    (layers.AveragePooling1D(3, strides=2, padding="same"), (6, 2), "average_pooling"),
    (layers.AveragePooling2D(2), (5, 4, 2), "average_pooling"),
    (layers.AveragePooling2D((3, 2), strides=(2, 1), padding="same"), (5, 4, 2),
     "average_pooling"),
    (layers.GlobalMaxPooling1D(), (5, 3), "global_max_pooling"),
    (layers.GlobalMaxPooling1D(keepdims=True), (5, 3), "global_max_pooling"),
    (layers.GlobalMaxPooling2D(), (4, 3, 2), "global_max_pooling"),
    (layers.GlobalMaxPooling2D(keepdims=True), (4, 3, 2), "global_max_pooling"),
    (layers.MaxPooling1D(2), (5, 3), "max_pooling"),
    (layers.MaxPooling1D(3, padding="same"), (7, 2), "max_pooling"),
    (layers.MaxPooling1D(3, strides=1), (6, 2), "max_pooling (tiled)"),
    (layers.MaxPooling2D(2), (5, 5, 2), "max_pooling"),
    (layers.MaxPooling2D((2, 3), padding="same"), (5, 7, 2), "max_pooling"),
    (layers.MaxPooling2D(3, strides=2, padding="same"), (6, 5, 2),
     "max_pooling (tiled)"),
]  # fmt: skip


@pytest.mark.parametrize(
    "layer, shape, name", SPATIAL, ids=[f"{type(c[0]).__name__}-{i}"
                                        for i, c in enumerate(SPATIAL)]
)  # fmt: skip
def test_spatial_rule(layer, shape, name):
    report = checked(layer, shape)
    assert report.rule == name


def test_spatial_rules_refuse_what_they_do_not_cover():
    refused = [
        layers.ZeroPadding2D(1, data_format="channels_first"),
        layers.Cropping2D(1, data_format="channels_first"),
        layers.GlobalAveragePooling2D(data_format="channels_first"),
        layers.AveragePooling2D(2, data_format="channels_first"),
        layers.MaxPooling1D(2, data_format="channels_first"),
        layers.GlobalMaxPooling2D(data_format="channels_first"),
        layers.UpSampling2D(2, data_format="channels_first"),
        layers.UpSampling2D(2, interpolation="bilinear"),
    ]
    for layer in refused:
        rule, why = rules.rule_for(layer)
        assert rule is None, type(layer).__name__
    ids = keras.Input((5,), dtype="int32")
    embedded = layers.Embedding(10, 3, mask_zero=True)(ids)
    pooling = layers.GlobalAveragePooling1D()
    pooling(embedded)  # Keras passes the embedding's mask
    rule, why = rules.rule_for(pooling)
    assert rule is None and "mask" in why


def test_max_pooling_ties_go_where_autodiff_sends_them():
    """After a ReLU many windows hold only zeros (ties): the signal goes
    where TensorFlow's own gradient sends it, as autodiff's."""
    keras.utils.set_random_seed(58)
    model = keras.Sequential(
        [keras.Input((6, 6, 2), **F64),
         layers.Conv2D(3, 2, padding="same", activation="relu",
                       bias_initializer=keras.initializers.Constant(-0.8), **F64),
         layers.MaxPooling2D(2, **F64), layers.MaxPooling2D(2, strides=1, **F64),
         layers.GlobalMaxPooling2D(**F64), layers.Dense(2, **F64)]
    )  # fmt: skip
    x = np.random.default_rng(7).standard_normal((4, 6, 6, 2))
    jac = ju.compiled_jacobian(model, method="rules")
    assert "autodiff" not in jac.plan.describe(), jac.plan.describe()
    assert np.mean(model.layers[0](x).numpy() == 0) > 0.3  # ties, in earnest
    expected = tape_jacobian(model, x, model.trainable_variables)
    np.testing.assert_allclose(jac(x), expected, rtol=1e-10, atol=1e-12)
    assert jac.plan is not None, jac.fallback


def test_a_chain_of_spatial_layers_end_to_end():
    """Every spatial rule in one model, its signal shared and per sample."""
    keras.utils.set_random_seed(59)
    model = keras.Sequential(
        [keras.Input((7, 6, 2), **F64), layers.ZeroPadding2D(1, **F64),
         layers.Conv2D(4, 3, **F64), layers.Cropping2D(((1, 0), (0, 1)), **F64),
         layers.AveragePooling2D(2, padding="same", **F64),
         layers.DepthwiseConv2D(2, depth_multiplier=2, padding="same",
                                activation="tanh", **F64),
         layers.UpSampling2D(2, **F64), layers.MaxPooling2D(2, **F64),
         layers.Conv2D(4, 1, groups=8 // 4 * 2, **F64),
         layers.GlobalAveragePooling2D(**F64), layers.Dense(3, **F64)]
    )  # fmt: skip
    x = np.random.default_rng(8).standard_normal((3, 7, 6, 2))
    variables = model.trainable_variables
    for subset in (variables, variables[-2:], variables[:2]):
        jac = ju.compiled_jacobian(model, method="rules", variables=subset)
        assert jac.plan is not None, jac.fallback
        assert "autodiff" not in jac.plan.describe(), jac.plan.describe()
        expected = tape_jacobian(model, x, subset)
        np.testing.assert_allclose(jac(x), expected, rtol=1e-10, atol=1e-12)


# --- keras.applications -------------------------------------------------------

COVERED = (
    layers.Conv1D, layers.Conv2D, layers.DepthwiseConv1D, layers.DepthwiseConv2D,
    layers.ZeroPadding1D, layers.ZeroPadding2D, layers.Cropping1D, layers.Cropping2D,
    layers.UpSampling1D, layers.UpSampling2D, layers.GlobalAveragePooling1D,
    layers.GlobalAveragePooling2D, layers.AveragePooling1D, layers.AveragePooling2D,
    layers.GlobalMaxPooling1D, layers.GlobalMaxPooling2D, layers.MaxPooling1D,
    layers.MaxPooling2D,
)  # fmt: skip


def _application(name):
    keras.utils.set_random_seed(60)
    options = dict(weights=None, input_shape=(32, 32, 3), classes=3)
    if name == "ConvNeXtTiny":
        return keras.applications.ConvNeXtTiny(include_preprocessing=False, **options)
    minimalistic = name.endswith("minimalistic")
    return keras.applications.MobileNetV3Small(
        minimalistic=minimalistic, include_preprocessing=False, **options
    )


@pytest.mark.parametrize(
    "name", ["ConvNeXtTiny", "MobileNetV3Small", "MobileNetV3Small-minimalistic"]
)
def test_applications_leave_no_covered_layer_to_autodiff(name):
    model = _application(name)
    plan, why = rules.plan_for(model, model.trainable_variables)
    assert plan is not None, why
    left = [
        (step.layer.name, step.describe()) for step in plan.steps
        if isinstance(step, AutodiffRule) and type(step.layer) in COVERED
    ]  # fmt: skip
    assert not left, left
    covered = [step for step in plan.steps if type(step.layer) in COVERED]
    assert len(covered) > 10


def test_mobilenet_v3_small_end_to_end():
    model = _application("MobileNetV3Small")
    kinds = (layers.DepthwiseConv2D, layers.Conv2D, layers.Dense)
    with_weights = [layer for layer in model.layers if isinstance(layer, kinds)]
    variables = [
        v for layer in with_weights[:3] + with_weights[-2:]
        for v in layer.trainable_weights
    ]  # fmt: skip
    x = np.random.default_rng(9).standard_normal((2, 32, 32, 3)).astype("float32")
    J, choice = ju.jacobian(model, x, variables=variables, explain=True)
    assert "rules" in choice.path, choice
    expected = tape_jacobian(model, x, variables)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(J / scale, expected / scale, rtol=0, atol=1e-4)
