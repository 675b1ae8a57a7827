"""DP-SGD's randomness: the noise and the sampling (notebook 09-matrix-free).

By default both come from fresh operating-system entropy each run (a
``tf.random.Generator`` and a NumPy generator from a non-deterministic
state); a seed makes them repeatable, for teaching and tests only (anyone
who knows the seed can replay the noise); ``secure_mode`` draws both from
``os.urandom`` itself (:class:`SecureRandom`).
"""

import math
import os

import numpy as np

from ..core._tf import tf


class SecureRandom:
    """Uniform and Gaussian draws from ``os.urandom`` (``secure_mode``).

    ``random(n)``: n uniforms in [0, 1), each from 53 secure bits (the float64
    mantissa). ``normal(shape, dtype)``: Box-Muller in float64 on those
    uniforms, in a graph through ``tf.numpy_function``. As Opacus's secure
    mode does (Holohan and Braghin's attack on floating-point Gaussian noise:
    a single float64 draw leaks through the gaps between representable
    values), each noise value is the sum of two independent draws divided
    by sqrt(2), which keeps N(0, 1) and blurs those gaps. Introduced in
    ``09-matrix-free``.
    """

    def random(self, n):
        bits = np.frombuffer(os.urandom(8 * int(n)), dtype=np.uint64) >> np.uint64(11)
        return bits.astype(np.float64) * 2.0**-53

    def _normal(self, size):
        u1 = 1.0 - self.random(size)  # (0, 1]: log stays finite
        u2 = self.random(size)
        return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)

    def standard_normal(self, size):
        """``size`` N(0, 1) float64 values, each a sum of two draws / sqrt(2)."""
        size = int(size)
        return (self._normal(size) + self._normal(size)) / math.sqrt(2.0)

    def normal(self, shape, dtype=tf.float32):
        """A tensor of N(0, 1) values of ``shape`` (graph or eager)."""
        dtype = tf.as_dtype(dtype)
        size = math.prod(shape)

        def draw():
            return self.standard_normal(size).astype(dtype.as_numpy_dtype)

        values = tf.numpy_function(draw, [], dtype, stateful=True)
        return tf.reshape(values, shape)


def random_sources(seed=None, secure_mode=False):
    """``(noise, sampler)``: the noise's source (``normal(shape, dtype)``) and
    the sampling's (``random(n)``): :class:`SecureRandom` for both in secure
    mode, else a ``tf.random.Generator`` and a NumPy generator, from the seed
    or (None) from fresh entropy. A seed with ``secure_mode`` is refused."""
    if secure_mode and seed is not None:
        raise ValueError(
            f"seed is {seed!r} with secure_mode=True; leave seed out: secure "
            "mode draws from the operating system's secure source, which a "
            "seed would make repeatable (and an attacker able to replay it)."
        )
    if secure_mode:
        source = SecureRandom()
        return source, source
    if seed is None:  # fresh state from the operating system each run
        fresh = tf.random.Generator.from_non_deterministic_state()
        return fresh, np.random.default_rng()
    # repeatable: for teaching and tests, not private against anyone who
    # knows the seed
    return tf.random.Generator.from_seed(seed), np.random.default_rng([seed, 1])


def standard_normal(noise):
    """One N(0, 1) draw from ``noise`` (either kind of source), a float."""
    if isinstance(noise, SecureRandom):
        return float(noise.standard_normal(1)[0])
    return float(noise.normal([], dtype=tf.float64))
