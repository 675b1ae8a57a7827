"""The same model in float64: what float32's rounding hides.

A float32 model whose inputs sit far from zero before a normalization (raw
pixel values into a LayerNormalization, say) loses digits in the forward
pass itself, and two correct ways of differentiating it then differ by more
than float32's usual error. Copied to float64 with the same weights, the
two agree again: that is how the layer rules' check tells a rounding
problem from a wrong rule (``jacutil.rules.verify``). Notebook
``04-chunked``'s exercise checks its answer against such a copy too.
"""

import numpy as np

from ._tf import keras, tf
from .target import declared_inputs


def float64_copy(model):
    """``model`` with every layer cloned in float64 and the same weights.

    Raises whatever ``keras.models.clone_model`` raises for a model it cannot
    clone (a subclassed model, a layer without ``get_config``).
    """

    def in_float64(layer):
        config = layer.get_config()
        config["dtype"] = "float64"
        return layer.__class__.from_config(config)

    def input_in_float64(t):  # a float32 Input would round float64 inputs
        dtype = "float64" if tf.as_dtype(t.dtype).is_floating else t.dtype
        return keras.Input(batch_shape=t.shape, dtype=dtype, name=t.name)

    inputs = tf.nest.map_structure(input_in_float64, declared_inputs(model))
    copy = keras.models.clone_model(
        model, input_tensors=inputs, clone_function=in_float64
    )
    copy.set_weights([np.asarray(w, "float64") for w in model.get_weights()])
    return copy


def as_float64(x):
    """Every float input of a batch (a tensor or a nest of them) in float64;
    integer inputs (ids) as they are."""

    def cast(t):
        t = tf.convert_to_tensor(t)
        return tf.cast(t, tf.float64) if t.dtype.is_floating else t

    return tf.nest.map_structure(cast, x)
