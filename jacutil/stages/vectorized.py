"""Stage 2: vectorized Jacobians (notebook 02-vectorized).

Two ways to vectorize, with very different costs:

* ``vectorized_jacobian`` - one tape over the whole batch and
  ``tape.jacobian`` (pfor over the n * l output rows). Each row is
  back-propagated through the *whole batch*, so time and memory grow with n**2.
* ``per_sample_jacobian`` - ``tf.vectorized_map`` over samples of a one-sample
  Jacobian: TensorFlow's counterpart of JAX's ``vmap(jacrev)``, linear in n.
"""

from ..core._tf import tf
from ..core.batch import as_batch, n_samples
from ..core.outputs import output_layout
from ..core.target import resolve_target, stack_columns


def batch_tape_jacobian(target, x):
    """(n, l, m) tensor: ``tape.jacobian`` of the whole batch's outputs.

    Args:
        target: what is differentiated (``jacutil.core.target``).
        x: the n samples, as a batch.

    Returns:
        A tensor of shape (n, l, m).
    """
    with tf.GradientTape() as tape:
        target.watch(tape)
        y = target.forward(x)
    jacobians = tape.jacobian(y, target.variables)
    return stack_columns(jacobians, target.variables, n_samples(x))


def per_sample_tape_jacobian(target, x):
    """(n, l, m) tensor: a one-sample Jacobian, vectorized over samples.

    Args:
        target: what is differentiated (``jacutil.core.target``).
        x: the n samples, as a batch.

    Returns:
        A tensor of shape (n, l, m).
    """

    def one_sample(xi):
        xi = tf.nest.map_structure(lambda t: t[None], xi)  # a batch of one
        with tf.GradientTape() as tape:
            target.watch(tape)
            y = target.forward(xi)  # (1, l)
        jacobians = tape.jacobian(y, target.variables)
        return stack_columns(jacobians, target.variables, 1)[0]

    return tf.vectorized_map(one_sample, x)


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
    from ..core.formulation import batch_tensor

    target = resolve_target(model, variables, training, x)
    x = as_batch(x, target)
    output_layout(target, x)  # checks the outputs first, with a clear message
    return batch_tensor(target, x)[0].numpy()


def per_sample_jacobian(model, x, *, variables=None, training=False):
    """Per-sample Jacobian, vectorized over samples with ``tf.vectorized_map``.

    The Jacobian of one sample's outputs is written once and mapped over the
    batch, so each sample is differentiated through itself only: linear in n.
    Recurrent layers are unrolled while it is traced, and a model that pfor
    cannot vectorize runs sample by sample (``jacutil.core.formulation``).
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
        >>> from jacutil import keras, per_sample_jacobian
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> per_sample_jacobian(model, x).shape  # (n, l, m)
        (4, 2, 8)
    """
    from ..core.formulation import per_sample_tensor

    target = resolve_target(model, variables, training, x)
    x = as_batch(x, target)
    output_layout(target, x)
    return per_sample_tensor(target, x)[0].numpy()
