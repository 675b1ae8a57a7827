"""Stage 2: vectorized Jacobians (notebook 02-vectorized).

Two ways to vectorize, with very different costs:

* ``vectorized_jacobian`` - one tape over the whole batch and
  ``tape.jacobian`` (pfor over the n * l output rows). Each row is
  back-propagated through the *whole batch*, so time and memory grow with n**2.
* ``per_sample_jacobian`` - ``tf.vectorized_map`` over samples of a one-sample
  Jacobian: TensorFlow's counterpart of JAX's ``vmap(jacrev)``, linear in n.
"""

from ..core.batch import as_batch
from ..core.outputs import output_layout
from ..core.target import resolve_target
from ..engine.autodiff import (  # the code this lesson shows (notebook 02)
    batch_tape_jacobian,
    batch_tensor,
    per_sample_tape_jacobian,
    per_sample_tensor,
)

__all__ = [
    "batch_tape_jacobian", "batch_tensor", "per_sample_jacobian",
    "per_sample_tape_jacobian", "per_sample_tensor", "vectorized_jacobian",
]  # fmt: skip


def vectorized_jacobian(model, x, *, variables=None, training=False):
    """Per-sample Jacobian with one tape and ``tape.jacobian`` over the batch.

    One forward pass; the backward passes are vectorized by pfor over the
    n * l output rows. Far faster than the loop for small n, but every row is
    back-propagated through the whole batch: time and memory grow with n**2.
    Introduced in ``02-vectorized``.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        x: the n samples (an array, or a list or dict of arrays).
        variables: the variables to differentiate (default: trainable ones).
        training: run the model in training mode.

    Returns:
        A NumPy array of shape (n, l, m).

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, vectorized_jacobian
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> vectorized_jacobian(model, x).shape  # (n, l, m)
        (4, 2, 8)
    """
    return _entry(batch_tensor, model, x, variables, training)


def per_sample_jacobian(model, x, *, variables=None, training=False):
    """Per-sample Jacobian, vectorized over samples with ``tf.vectorized_map``.

    The Jacobian of one sample's outputs is written once and mapped over the
    batch, so each sample is differentiated through itself only: linear in n.
    Recurrent layers are unrolled while it is traced, and a model that pfor
    cannot vectorize runs sample by sample (``jacutil.core.formulation``).
    Introduced in ``02-vectorized``. Args and Returns as in
    :func:`vectorized_jacobian`.

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, per_sample_jacobian
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> per_sample_jacobian(model, x).shape  # (n, l, m)
        (4, 2, 8)
    """
    return _entry(per_sample_tensor, model, x, variables, training)


def _entry(tensor, model, x, variables, training):
    """Run ``tensor(target, x)`` for a public entry; the outputs are checked
    first, with a clear message."""
    target = resolve_target(model, variables, training, x)
    x = as_batch(x, target)
    output_layout(target, x)
    return tensor(target, x)[0].numpy()
