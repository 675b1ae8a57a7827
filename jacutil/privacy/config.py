"""DP-SGD's configuration, frozen and checked when built (notebook
09-matrix-free), as jax_privacy's ``DPKerasConfig``: what the clipping and
the accounting rest on cannot drift after the first step.

Frozen: the clip norms (flat or per group), the adaptive clipping's
settings, the physical batch size and the randomness. The noise multiplier
given here is only the *first*: a step reads sigma from a variable each
time it runs, and the ledger counts each step under the sigma it read
(:class:`jacutil.privacy.ledger.PrivacyLedger`), so a noise schedule is
accounted as what ran.
"""

import math
from dataclasses import dataclass

from .adaptive_clip import AdaptiveClip


def check_noise_multiplier(value):
    """``value`` as a float, or a ValueError unless it is a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            value = float(value)  # a NumPy or TensorFlow scalar
        except (TypeError, ValueError):
            value = math.nan
    if not value >= 0 or not math.isfinite(value):
        raise ValueError(
            f"noise_multiplier is {value!r}; it must be a finite number >= 0: "
            "the noise's standard deviation is noise_multiplier * l2_norm_clip "
            "(0 means no noise, and no privacy)."
        )
    return float(value)


@dataclass(frozen=True)
class DPConfig:
    """What a :class:`jacutil.privacy.dp_sgd.DPSGD` is built with, checked
    here and never changed after. Introduced in ``09-matrix-free``.

    Attributes:
        l2_norm_clip: C (> 0), or ``{layer name: C_g}`` for per-layer
            clipping (checked against the model by
            :class:`jacutil.privacy.clip_groups.ClipGroups`).
        noise_multiplier: sigma at the first step (>= 0).
        adaptive_clip: an :class:`AdaptiveClip`, or None (C stays fixed).
        max_physical_batch_size: the most rows one pass holds, or None.
        seed: the randomness's seed (teaching and tests only), or None.
        secure_mode: draw from ``os.urandom`` (refuses a seed).
    """

    l2_norm_clip: object
    noise_multiplier: float
    adaptive_clip: AdaptiveClip | None = None
    max_physical_batch_size: int | None = None
    seed: int | None = None
    secure_mode: bool = False

    def __post_init__(self):
        object.__setattr__(
            self, "noise_multiplier", check_noise_multiplier(self.noise_multiplier)
        )
        physical = self.max_physical_batch_size
        if physical is not None and not (int(physical) == physical and physical >= 1):
            raise ValueError(
                f"max_physical_batch_size is {physical!r}; a whole number >= 1 "
                "(the most rows one pass holds), or None."
            )
        if self.adaptive_clip is not None:
            if not isinstance(self.adaptive_clip, AdaptiveClip):
                raise ValueError(
                    f"adaptive_clip is {self.adaptive_clip!r}; an "
                    "jacutil.privacy.adaptive_clip.AdaptiveClip, or None."
                )
            if isinstance(self.l2_norm_clip, dict):
                raise ValueError(
                    "adaptive clipping follows one quantile of the whole "
                    "gradient's norms: give l2_norm_clip as one number (the "
                    "starting C), not a clip norm per layer."
                )
            # refuses a count noise too small for sigma, before any step
            self.adaptive_clip.gradient_noise_multiplier(self.noise_multiplier)
        if self.secure_mode and self.seed is not None:
            raise ValueError(
                f"seed is {self.seed!r} with secure_mode=True; leave seed out: "
                "secure mode draws from the operating system's secure source, "
                "which a seed would make repeatable (and an attacker able to "
                "replay it)."
            )
