"""Adaptive clipping for DP-SGD (Andrew et al., 2021), notebook 09-matrix-free.

A clip norm C that is too large adds noise for nothing; one too small throws
the gradients' size away. Andrew, Thakkar, McMahan and Ramaswamy
("Differentially Private Learning with Adaptive Clipping", NeurIPS 2021) let
C follow a quantile ``gamma`` of the per-sample gradient norms, privately.
Each step releases the *centred* count of the samples whose norm is at most
C, with Gaussian noise of standard deviation ``sigma_b``,

    released = sum_i (b_i - 1/2) + N(0, sigma_b^2),    b_i = [|g_i| <= C],

and moves C geometrically by the noisy fraction ``released / B + 1/2`` (B
the expected batch size):

    C <- C * exp(-eta * (released / B + 1/2 - gamma)).

Each term ``b_i - 1/2`` is +-1/2, so adding or removing one sample moves the
released sum by at most 1/2: a Gaussian mechanism of noise multiplier
``2 sigma_b``. Their Theorem 1 composes it with the gradient's: the two cost
what one Gaussian mechanism of noise multiplier ``z`` costs when the
gradient's noise multiplier is

    z_grad = (z^-2 - (2 sigma_b)^-2)^(-1/2)  >  z,

so the accountant sees ``z`` unchanged, and the price of adapting is the
larger noise on the gradient. The raw count ``sum_i b_i`` would have
sensitivity 1 (noise multiplier ``sigma_b``), which the formula does not pay
for: centring is what makes it hold. TF-Privacy's ``QuantileEstimatorQuery``
releases the same centred sum; Opacus's ``AdaClipDPOptimizer`` the same
steps.
"""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveClip:
    """How the clip norm follows a quantile of the norms. Introduced in
    ``09-matrix-free``.

    Attributes:
        target_quantile: gamma, the fraction of samples meant to be left
            unclipped, in (0, 1) (0.5: the median norm).
        learning_rate: eta, the geometric step of C (0.2, the paper's).
        count_noise: sigma_b, the count's noise standard deviation, in
            samples (the paper's default: the expected batch size / 20).
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise: float = 1.0

    def __post_init__(self):
        if not 0 < self.target_quantile < 1:
            raise ValueError(
                f"target_quantile is {self.target_quantile!r}; the fraction of "
                "samples left unclipped, in (0, 1) (0.5 follows the median norm)."
            )
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate is {self.learning_rate!r}; > 0 (0.2).")
        if not self.count_noise >= 0 or not math.isfinite(self.count_noise):
            raise ValueError(
                f"count_noise is {self.count_noise!r}; a number >= 0 (the count's "
                "noise in samples: the expected batch size / 20 is the usual)."
            )

    def gradient_noise_multiplier(self, noise_multiplier):
        """z_grad for the accountant's ``noise_multiplier`` z (Theorem 1 of
        Andrew et al.); a ValueError when the count's noise alone would
        spend z's privacy (``2 sigma_b <= z``)."""
        z = float(noise_multiplier)
        if z == 0:
            return 0.0
        if not 2 * self.count_noise > z:
            raise ValueError(
                f"count_noise={self.count_noise:g} is too small for the noise "
                f"multiplier {z:.4g}: the count's noise must exceed z / 2 = "
                f"{z / 2:.4g}, else counting alone spends the privacy the "
                "gradient's noise is calibrated for. Raise count_noise (the "
                "expected batch size / 20 is the usual)."
            )
        return (z**-2 - (2 * self.count_noise) ** -2) ** -0.5

    def released_count(self, unclipped, sampled, noise):
        """The noisy centred count a step releases: ``unclipped - sampled / 2``
        (the sum of ``b_i - 1/2`` over the ``sampled`` samples of its batch,
        ``unclipped`` of which had norm at most C) plus ``count_noise *
        noise`` (``noise`` a standard normal draw). Adding or removing a
        sample moves it by at most 1/2: the sensitivity Theorem 1 assumes."""
        return float(unclipped) - 0.5 * float(sampled) + self.count_noise * noise

    def next_clip(self, clip, released, expected_batch):
        """C after a step that released the noisy centred count ``released``
        (:meth:`released_count`): the noisy fraction of unclipped samples,
        ``released / expected_batch + 1/2``, against the target."""
        fraction = released / expected_batch + 0.5
        return clip * math.exp(-self.learning_rate * (fraction - self.target_quantile))
