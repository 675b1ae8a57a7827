"""Differential privacy for Keras models (notebook 09-matrix-free).

``make_private(model, epsilon=..., delta=..., l2_norm_clip=..., batch_size=...,
epochs=..., train_size=...)`` on a compiled model, then plain ``model.fit``.
The parts, one job each:

- ``keras_fit``     ``make_private``: Keras's fit, DP-SGD steps
- ``keras_loss``    Keras's own loss of each sample (what is clipped)
- ``config``        ``DPConfig``: what a DPSGD is built with, frozen and checked
- ``dp_sgd``        ``DPSGD``: the step, by ghost clipping and book-keeping
- ``sampling``      Poisson sampling, padded batches
- ``clip_groups``   the clip weights, flat or per layer
- ``adaptive_clip`` the clip norm following a quantile of the norms
- ``noise``         the noise's and the sampling's random sources
- ``accounting``    epsilon of the steps, sigma for a target (dp-accounting)
- ``ledger``        the privacy a model spent, kept with it
- ``audit``         a one-run canary audit of a private fit
- ``validator``     what a private model may hold
"""

from ..core.lazy import lazy_face

_NAMES = {
    "PrivateTraining": "keras_fit",
    "make_private": "keras_fit",
    "DPSGD": "dp_sgd",
    "DPConfig": "config",
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
    __name__,
    _NAMES,
    modules="accounting adaptive_clip audit clip_groups config dp_sgd keras_fit "
    "keras_loss ledger noise sampling validator",
)
