"""What a private model may hold (notebook 09-matrix-free), as Opacus's
``ModuleValidator``: a layer that mixes the samples of a batch is refused
before the first step (a loss that mixes them is refused by
:meth:`jacutil.privacy.keras_loss.KerasLoss.check`, at ``fit``)."""

from ..core._tf import keras
from ..core.internals import layers_within

MIXING = (keras.layers.BatchNormalization,)  # their statistics span the batch


def validate_private(model):
    """Refuse what would break DP-SGD's guarantee or go silently wrong.

    - A trainable ``BatchNormalization``: in training it normalizes each
      sample by its batch's mean and variance, so one sample's gradient
      depends on the others and clipping no longer bounds a sample's
      influence (Opacus refuses it too). DP-SGD's steps run the model in
      inference mode, where it would never learn its statistics either.
    - A model with no trainable variables, or not built.

    ``model`` is a Keras 3 model; the ValueError says what is wrong and what
    to use instead. Introduced in ``09-matrix-free``.
    """
    if not getattr(model, "built", False):
        raise ValueError(
            "the model is not built: build it (give it a keras.Input, or call "
            "it on a batch) before make_private."
        )
    if not model.trainable_variables:
        raise ValueError("the model has no trainable variables to train.")
    for layer in layers_within(model, include_self=False):
        if isinstance(layer, MIXING) and layer.trainable:
            raise ValueError(
                f"layer {layer.name!r} is a {type(layer).__name__}: in training "
                "it normalizes each sample by its batch's statistics, so one "
                "sample's gradient depends on the others and clipping no longer "
                "bounds any sample's influence (and DP-SGD runs the model in "
                "inference mode, where it would never learn its statistics). Use "
                "keras.layers.LayerNormalization or GroupNormalization instead, "
                f"or freeze it (model.get_layer({layer.name!r}).trainable = "
                "False) to keep statistics learned on public data."
            )
