"""How a layer with a kernel writes its columns: one matrix product.

For ``z[t, q] = sum_p a[t, p] W[p, q] + b[q]`` at positions t (one position
for Dense on a flat input; every output pixel for a convolution, with ``a``
its patches), a per-sample signal ``delta[i, k, t, q]`` at z gives

    d y[i, k] / d W[p, q] = sum_t a[i, t, p] * delta[i, k, t, q]
    d y[i, k] / d b[q]    = sum_t delta[i, k, t, q]

the per-example-gradient trick (Goodfellow 2015; BackPACK). A kernel
and its bias are one product: ``a`` with a column of ones appended gives the
kernel's rows and then the bias's, one joint block that the engine places
(``jacutil.rules.walk.place_blocks``).

Their squared norms need no block ("ghost norms", Goodfellow 2015; Li et
al. 2021, arXiv:2110.05679): with the Gram matrices of the positions,

    |sum_t a[t] delta[t]^T|^2 = sum_{t, s} (a[t] . a[s]) (delta[t] . delta[s])
    |sum_t delta[t]|^2        (the bias)

with one position ``|a|^2 |delta|^2``. As Opacus's norm samplers for ghost
clipping (``opacus/grad_sample/linear.py``, ``compute_linear_norm_sample``:
``ggT`` and ``aaT``, used by ``GradSampleModuleFastGradientClipping``) and
BackPACK's ``BatchL2Grad`` (``backpack/extensions/firstorder/batch_l2_grad/
linear.py`` and ``convnd.py``, ``einsum("nmi,nki,nmj,nkj->n", ...)``).

Per sample and signal row that route takes T * T * (p + q) multiply-adds
and holds (T, T) numbers; the block takes T * p * q and holds (p, q). A rule
takes the cheaper (:func:`gram_is_cheaper`: ``T (p + q) <= p q``, which
also makes the Gram matrix no larger than the block; Bu et al.'s "mixed
ghost norm", arXiv:2205.10683, decides by the sizes alone).
"""

import math
from contextlib import contextmanager

from ..core._tf import tf
from .registry import Blocks

_FORCED = []  # the route every rule takes inside norms_route(), innermost last


@contextmanager
def norms_route(route):
    """Inside the block every rule computes its squared norms by ``route``,
    ``"ghost"`` (without the blocks) or ``"blocks"``, whatever the sizes: what
    a check of both routes needs. (A bias alone, and LayerNorm's gamma and
    beta, have one route: their own sums.)
    """
    if route not in ("ghost", "blocks"):
        raise ValueError(f"route is 'ghost' or 'blocks', not {route!r}")
    _FORCED.append(route)
    try:
        yield
    finally:
        _FORCED.pop()


def ghost_is_cheaper(ghost_work, block_work):
    """Whether a rule's squared norms take the route without the blocks:
    ``ghost_work <= block_work`` (the multiply-adds per sample and signal row
    of that route and of forming the blocks), unless :func:`norms_route`
    forces a route; an unknown ``ghost_work`` (None: a shape unknown while
    traced) takes the blocks.
    """
    if _FORCED:
        return _FORCED[-1] == "ghost"
    return ghost_work is not None and ghost_work <= block_work


def gram_is_cheaper(positions, p, q):
    """:func:`ghost_is_cheaper` for a kernel's block: the Gram route's
    ``T * T * (p + q)`` against the block's ``T * p * q``, for T =
    ``positions`` (None when unknown), p the kernel's rows (a patch's size for
    a convolution) and q its columns (a group's output channels).
    """
    if positions is None:
        return ghost_is_cheaper(None, 0)
    return ghost_is_cheaper(positions * positions * (p + q), positions * p * q)


def positions_of(shape):
    """T, the product of the axes between the samples and the last of a
    static ``shape`` ``(n, *positions, width)``, or None when one is unknown."""
    inner = list(tf.TensorShape(shape))[1:-1]
    return None if None in inner else math.prod(inner)


def outer_blocks(a, delta):
    """(n, l, p * q) block: ``sum_t a[i, t, p] * delta[i, k, t, q]``.

    ``a`` is (n, *positions, p) and ``delta`` (n, l, *positions, q).
    """
    n_samples, n_outputs = tf.shape(delta)[0], tf.shape(delta)[1]
    p, q = a.shape[-1], delta.shape[-1]
    if a.shape.rank == 2:  # one position: a batch of (p, 1) @ (1, q) products
        # a's batch of n broadcast over the l rows by the product itself: no
        # (n, l, p, 1) copy (a broadcast multiply was slower at every n)
        product = tf.matmul(a[:, None, :, None], delta[:, :, None, :])  # (n, l, p, q)
        return tf.reshape(product, [n_samples, n_outputs, p * q])
    delta = tf.reshape(delta, [n_samples, n_outputs, -1, q])  # (n, l, t, q)
    return outer_by_position(a, tf.transpose(delta, [0, 2, 1, 3]))


def outer_by_position(a, by_position):
    """:func:`outer_blocks` of a signal laid out (n, *positions, l, q),
    positions first: the kernel's (n, l, p * q) block."""
    n_samples, n_outputs = tf.shape(by_position)[0], tf.shape(by_position)[2]
    p, q = a.shape[-1], by_position.shape[-1]
    a = tf.reshape(a, [n_samples, -1, p])  # (n, t, p)
    by_position = tf.reshape(by_position, [n_samples, -1, n_outputs * q])
    product = tf.matmul(a, by_position, transpose_a=True)  # (n, p, l * q)
    product = tf.reshape(product, [n_samples, p, n_outputs, q])
    product = tf.transpose(product, [0, 2, 1, 3])
    return tf.reshape(product, [n_samples, n_outputs, p * q])


def times_transpose(delta, matrix):
    """``delta @ matrix.T`` over the last axis, as one 2-D product: the signal
    below a kernel."""
    rows = tf.matmul(tf.reshape(delta, [-1, delta.shape[-1]]), matrix, transpose_b=True)
    return tf.reshape(rows, tf.concat([tf.shape(delta)[:-1], [matrix.shape[0]]], 0))


def sum_positions(delta, width):
    """(n, l, width): ``delta`` ``(n, l, *positions, width)`` summed over positions."""
    n_samples, n_outputs = tf.shape(delta)[0], tf.shape(delta)[1]
    return tf.reduce_sum(tf.reshape(delta, [n_samples, n_outputs, -1, width]), 2)


def kernel_and_bias(a, delta, kernel, bias, wanted, by_position=False):
    """:class:`~jacutil.rules.registry.Blocks` of a kernel and its bias.

    Args:
        a: the layer's input at each position, ``(n, *positions, p)``.
        delta: the signal at ``z``, ``(n, l, *positions, q)``; with
            ``by_position``, laid out (n, t, l, q), positions first.
        kernel: the (p, q) kernel variable (its columns row-major).
        bias: the (q,) bias variable, or None.
        wanted: the variables to write (either may be unwanted).

    Returns:
        Blocks: a kernel and bias both wanted share one joint block keyed
        ``(kernel, bias)``, (n, l, p * q + q) - one product of ``a`` with a
        column of ones appended; otherwise one block per wanted variable,
        (n, l, p * q) and (n, l, q). The engine splits a joint block whose
        variables are not adjacent in the columns.
    """
    outer = outer_by_position if by_position else outer_blocks
    blocks = Blocks()
    with_kernel = kernel in wanted
    with_bias = bias is not None and bias in wanted
    if with_kernel and with_bias:
        ones = tf.ones_like(a[..., :1])
        blocks[kernel, bias] = outer(tf.concat([a, ones], -1), delta)
        return blocks
    if with_kernel:
        blocks[kernel] = outer(a, delta)
    if with_bias:
        width = delta.shape[-1]
        blocks[bias] = (
            tf.reduce_sum(delta, 1) if by_position else sum_positions(delta, width)
        )
    return blocks


def gram_norms(a, delta):
    """(n, r): the squared norm of each kernel block of :func:`outer_blocks`,
    without it: ``sum_{t, s} (a[t] . a[s]) (delta[t] . delta[s])``, with one
    position ``|a|^2 |delta|^2``; ``a`` is (n, *positions, p) and ``delta``
    (n, r, *positions, q).
    """
    n_samples, n_rows = tf.shape(delta)[0], tf.shape(delta)[1]
    a = tf.reshape(a, [n_samples, -1, a.shape[-1]])  # (n, T, p)
    delta = tf.reshape(delta, [n_samples, n_rows, -1, delta.shape[-1]])  # (n, r, T, q)
    if a.shape[1] == 1:  # one position
        a_squared = tf.reduce_sum(tf.square(a), [1, 2])
        return a_squared[:, None] * tf.reduce_sum(tf.square(delta), [2, 3])
    a_gram = tf.matmul(a, a, transpose_b=True)  # (n, T, T)
    delta_gram = tf.matmul(delta, delta, transpose_b=True)  # (n, r, T, T)
    return tf.reduce_sum(delta_gram * a_gram[:, None], [2, 3])


def weighted_rows(weights, delta, a):
    """``(w * delta, a)`` with every row of weight 0 exactly zero in both, even
    where a skipped sample holds NaN or inf (``tf.math.multiply_no_nan``,
    cheaper than a ``tf.where``): the inputs of DP-SGD's book-kept sums
    (``Rule._weighted_sums``, notebook 09-matrix-free). ``weights`` is (n,),
    ``delta`` and ``a`` (n, ...)."""

    def by_row(values, tensor):
        shape = [-1] + [1] * (tensor.shape.rank - 1)
        return tf.reshape(tf.cast(values, tensor.dtype), shape)

    return (
        tf.math.multiply_no_nan(delta, by_row(weights, delta)),
        tf.math.multiply_no_nan(a, by_row(weights > 0, a)),
    )


def sum_norms(delta):
    """(n, r): the squared norm of each bias block, ``|sum_t delta[t]|^2``, of
    the signal ``delta`` (n, r, *positions, q) at ``z``."""
    return tf.reduce_sum(tf.square(sum_positions(delta, delta.shape[-1])), -1)
