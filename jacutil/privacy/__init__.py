"""Private training the Keras way (notebook 09-matrix-free).

``make_private(model, epsilon=..., delta=..., l2_norm_clip=..., batch_size=...,
epochs=..., train_size=...)`` on a compiled model, then plain ``model.fit``:
DP-SGD steps by ghost clipping (:class:`jacutil.fitting.dp_sgd.DPSGD`), sigma
calibrated to the target epsilon by dp-accounting, a validator that refuses
what would break the guarantee.
"""

from .accounting import noise_multiplier_for
from .keras_fit import PrivateTraining, make_private, per_sample_loss
from .validator import validate_private

__all__ = [
    "PrivateTraining",
    "make_private",
    "noise_multiplier_for",
    "per_sample_loss",
    "validate_private",
]
