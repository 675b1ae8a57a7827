"""Private training the Keras way (notebook 09-matrix-free).

``make_private(model, epsilon=..., delta=..., l2_norm_clip=..., batch_size=...,
epochs=..., train_size=...)`` on a compiled model, then plain ``model.fit``:
DP-SGD steps by ghost clipping (:class:`jacutil.fitting.dp_sgd.DPSGD`), sigma
calibrated to the target epsilon by dp-accounting, a validator that refuses
what would break the guarantee.
"""

from ..core.lazy import lazy_face

_NAMES = {
    "PrivateTraining": "keras_fit",
    "make_private": "keras_fit",
    "noise_multiplier_for": "accounting",
    "per_sample_loss": "keras_fit",
    "load_model": "ledger",
    "PrivacyLedger": "ledger",
    "KerasLoss": "keras_loss",
    "CanaryAudit": "audit",
    "AuditResult": "audit",
    "epsilon_lower_bound": "audit",
    "validate_private": "validator",
}
__all__, __getattr__, __dir__ = lazy_face(
    __name__, _NAMES, modules="accounting audit keras_fit keras_loss ledger validator"
)
