"""The settings on which every registered rule is checked (:func:`check_rule`).

One :class:`Setting` is a layer type, its keyword arguments and an input
shape; ``SETTINGS`` covers every layer type in ``jacutil.rules.RULES``
(a test fails when a newly registered type has none) with the options its
rule reads: each activation, padding, strides, dilation and groups, the
normalized axis, ``return_sequences``.
"""

from dataclasses import dataclass, field

from ..core._tf import keras, tf
from ..rules.shape import IDENTITY_AT_INFERENCE

layers = keras.layers


@dataclass(frozen=True)
class Setting:
    """One layer configuration to check a rule on.

    ``layer_type(**kwargs, dtype="float64")`` (a Keras layer class and its
    keyword arguments) on inputs of shape ``(n, *input_shape)``, of
    ``input_dtype`` (floats unless given; ``"int32"`` for an Embedding's ids).
    """

    layer_type: type
    input_shape: tuple
    kwargs: dict = field(default_factory=dict)
    input_dtype: str = "float64"

    def make(self):
        """A fresh, unbuilt float64 layer of ``layer_type``."""
        return self.layer_type(**self.kwargs, dtype="float64")

    @property
    def label(self):
        """E.g. ``Conv1D(filters=4, kernel_size=3, padding='causal') on (6, 2)``."""
        options = ", ".join(f"{k}={_shown(v)}" for k, v in self.kwargs.items())
        return f"{self.layer_type.__name__}({options}) on {self.input_shape}"


def _shown(value):
    return getattr(value, "__name__", None) or repr(value)


def wavy(z):
    """``z * sin(z)``: an activation jacutil does not know, so its signal
    passes by autodiff."""
    return z * tf.sin(z)


def _dense():
    activations = [
        None, "relu", "tanh", "sigmoid", "softmax", "log_softmax", "gelu", "swish",
        wavy,
    ]  # fmt: skip
    found = [Setting(layers.Dense, (4,), {"units": 3, "activation": a})
             for a in activations]  # fmt: skip
    found += [
        Setting(layers.Dense, (4,), {"units": 3, "use_bias": False}),
        Setting(layers.Dense, (2, 4), {"units": 3, "activation": "tanh"}),
    ]
    return found


def _conv():
    one = {"filters": 4, "kernel_size": 3}
    two = {"filters": 4, "kernel_size": 2}
    return [
        Setting(layers.Conv1D, (6, 2), {**one, "activation": "tanh"}),
        Setting(layers.Conv1D, (6, 2), {**one, "padding": "same", "strides": 2}),
        Setting(layers.Conv1D, (6, 2), {**one, "padding": "causal",
                                        "dilation_rate": 2}),
        Setting(layers.Conv1D, (6, 4), {**one, "groups": 2, "use_bias": False}),
        Setting(layers.Conv2D, (5, 5, 2), {**two, "activation": "elu"}),
        Setting(layers.Conv2D, (5, 5, 2), {**two, "padding": "same", "strides": 2}),
        Setting(layers.Conv2D, (5, 5, 2), {**two, "dilation_rate": 2,
                                           "activation": "softplus"}),
        Setting(layers.Conv2D, (4, 4, 4), {**two, "groups": 2, "activation": "relu"}),
    ]  # fmt: skip


def _normalization():
    return [
        Setting(layers.LayerNormalization, (4,)),
        Setting(layers.LayerNormalization, (3, 4), {"center": False}),
        Setting(layers.LayerNormalization, (4,), {"scale": False}),
        Setting(layers.LayerNormalization, (3, 4), {"axis": [-2, -1]}),
        Setting(layers.BatchNormalization, (4,)),
        Setting(layers.BatchNormalization, (3, 3, 2), {"scale": False}),
        Setting(layers.LayerNormalization, (4,), {"rms_scaling": True}),
        Setting(layers.RMSNormalization, (3, 4), {"epsilon": 0.3}),
    ]


def _spatial():
    """Depthwise convolutions, padding, cropping, upsampling and pooling."""
    return [
        Setting(layers.DepthwiseConv2D, (5, 5, 2), {"kernel_size": 3,
                "depth_multiplier": 2, "activation": "tanh"}),
        Setting(layers.DepthwiseConv1D, (6, 3), {"kernel_size": 2,
                "padding": "same", "strides": 2}),
        Setting(layers.SeparableConv2D, (5, 5, 2), {"filters": 3,
                "kernel_size": 3, "depth_multiplier": 2, "activation": "tanh"}),
        Setting(layers.SeparableConv1D, (6, 3), {"filters": 2,
                "kernel_size": 2, "padding": "same", "strides": 2}),
        Setting(layers.ZeroPadding2D, (3, 3, 2), {"padding": (1, 2)}),
        Setting(layers.ZeroPadding1D, (4, 2), {"padding": 1}),
        Setting(layers.Cropping2D, (5, 5, 2), {"cropping": ((1, 0), (0, 2))}),
        Setting(layers.Cropping1D, (5, 2), {"cropping": (1, 2)}),
        Setting(layers.UpSampling2D, (2, 3, 2), {"size": 2}),
        Setting(layers.UpSampling1D, (3, 2), {"size": 2}),
        Setting(layers.GlobalAveragePooling2D, (3, 3, 2)),
        Setting(layers.GlobalAveragePooling1D, (4, 2), {"keepdims": True}),
        Setting(layers.AveragePooling2D, (5, 5, 2), {"pool_size": 2,
                "padding": "same"}),
        Setting(layers.AveragePooling1D, (5, 2), {"pool_size": 2}),
        Setting(layers.GlobalMaxPooling2D, (3, 3, 2)),
        Setting(layers.GlobalMaxPooling1D, (4, 2)),
        Setting(layers.MaxPooling2D, (4, 4, 2), {"pool_size": 2}),
        Setting(layers.MaxPooling1D, (5, 2), {"pool_size": 2, "strides": 1}),
    ]  # fmt: skip


def _einsum():
    """EinsumDense's projections as attention uses them (per head, and back)."""
    return [
        Setting(layers.EinsumDense, (3, 4), {"equation": "abc,cde->abde",
                "output_shape": (None, 2, 3), "bias_axes": "de"}),
        Setting(layers.EinsumDense, (3, 2, 4), {"equation": "abcd,cde->abe",
                "output_shape": (None, 5), "activation": "tanh"}),
    ]  # fmt: skip


NOISE = {
    "Dropout": ((4,), {"rate": 0.5}),
    "SpatialDropout1D": ((4, 3), {"rate": 0.5}),
    "SpatialDropout2D": ((3, 3, 2), {"rate": 0.5}),
    "SpatialDropout3D": ((2, 2, 2, 2), {"rate": 0.5}),
    "GaussianNoise": ((4,), {"stddev": 0.1}),
    "GaussianDropout": ((4,), {"rate": 0.2}),
    "AlphaDropout": ((4,), {"rate": 0.2}),
    "ActivityRegularization": ((4,), {"l1": 0.01}),
}


def _weightless():
    found = [
        Setting(kind, *NOISE.get(kind.__name__, ((4,), {})))
        for kind in IDENTITY_AT_INFERENCE
    ]
    found += [
        Setting(layers.Flatten, (3, 2, 2)),
        Setting(layers.Reshape, (12,), {"target_shape": (4, 3)}),
        Setting(layers.Reshape, (3, 4), {"target_shape": (2, -1)}),
    ]
    found += [
        Setting(layers.Activation, (2, 3), {"activation": a})
        for a in ("tanh", "relu", "softmax", "gelu", wavy)
    ]
    found += [
        Setting(layers.ReLU, (4,), {"max_value": 1.5, "negative_slope": 0.1,
                                    "threshold": 0.2}),
        Setting(layers.LeakyReLU, (4,), {"negative_slope": 0.2}),
        Setting(layers.ELU, (4,), {"alpha": 0.5}),
    ]  # fmt: skip
    return found


def _recurrent():
    found = []
    for kind in (layers.LSTM, layers.GRU, layers.SimpleRNN):
        for sequences in (False, True):
            options = {"units": 3, "return_sequences": sequences}
            found.append(Setting(kind, (4, 2), options))
    found.append(Setting(layers.LSTM, (4, 2), {"units": 2, "use_bias": False}))
    return found


SETTINGS = [
    *_dense(),
    *_conv(),
    Setting(layers.Embedding, (5,), {"input_dim": 6, "output_dim": 3}, "int32"),
    *_normalization(),
    *_einsum(),
    *_spatial(),
    *_weightless(),
    *_recurrent(),
]
