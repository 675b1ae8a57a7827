"""How a layer with a kernel writes its columns: one matrix product.

For ``z[t, q] = sum_p a[t, p] W[p, q] + b[q]`` at positions t (one position
for Dense on a flat input; every output pixel for a convolution, with ``a``
its patches), a per-sample signal ``delta[i, k, t, q]`` at z gives

    d y[i, k] / d W[p, q] = sum_t a[i, t, p] * delta[i, k, t, q]
    d y[i, k] / d b[q]    = sum_t delta[i, k, t, q]

the per-example-gradient trick (Goodfellow 2015; BackPACK). A kernel
and its bias are one product: ``a`` with a column of ones appended gives the
kernel's rows and then the bias's, one joint block that the engine places
(``jacutil.rules.engine.place_blocks``).
"""

from ..core._tf import tf
from .registry import Blocks


def outer_blocks(a, delta):
    """(n, l, p * q) block: ``sum_t a[i, t, p] * delta[i, k, t, q]``.

    ``a`` is (n, *positions, p) and ``delta`` (n, l, *positions, q).
    """
    n_samples, n_outputs = tf.shape(delta)[0], tf.shape(delta)[1]
    p, q = a.shape[-1], delta.shape[-1]
    if a.shape.rank == 2:  # one position: a batch of (p, 1) @ (1, q) products
        column = tf.broadcast_to(a[:, None, :, None], [n_samples, n_outputs, p, 1])
        product = tf.matmul(column, delta[:, :, None, :])  # (n, l, p, q)
        return tf.reshape(product, [n_samples, n_outputs, p * q])
    delta = tf.reshape(delta, [n_samples, n_outputs, -1, q])  # (n, l, t, q)
    return outer_by_position(a, tf.transpose(delta, [0, 2, 1, 3]))


def outer_by_position(a, by_position):
    """:func:`outer_blocks` of a signal laid out (n, t, l, q), positions first.

    Args:
        a: the layer's input, shape ``(n, *positions, p)``, t positions in all.
        by_position: the signal, shape ``(n, *positions, l, q)``.

    Returns:
        The kernel's block, shape (n, l, p * q).
    """
    n_samples, n_outputs = tf.shape(by_position)[0], tf.shape(by_position)[2]
    p, q = a.shape[-1], by_position.shape[-1]
    a = tf.reshape(a, [n_samples, -1, p])  # (n, t, p)
    by_position = tf.reshape(by_position, [n_samples, -1, n_outputs * q])
    product = tf.matmul(a, by_position, transpose_a=True)  # (n, p, l * q)
    product = tf.reshape(product, [n_samples, p, n_outputs, q])
    product = tf.transpose(product, [0, 2, 1, 3])
    return tf.reshape(product, [n_samples, n_outputs, p * q])


def sum_positions(delta, width):
    """(n, l, width): ``delta`` ``(n, l, *positions, width)`` summed over positions.

    Args:
        delta: a tensor of shape ``(n, l, *positions, width)``.
        width: the last dimension.

    Returns:
        A tensor of shape (n, l, width).
    """
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
