"""Second-order gradients that TensorFlow 2.21 lacks, registered on first use.

Forward mode (``tf.autodiff.ForwardAccumulator`` in a graph) differentiates
an op's gradient op, and so does a JVP as the gradient of a VJP
(``products(mode="double_backward")``). Where the gradient op has no
gradient, forward mode fails; where TensorFlow marks it not differentiable,
it is silently taken as zero:

* ``SoftsignGrad`` (Keras's ``"softsign"``): no entry, ``LookupError``;
* ``ResizeNearestNeighborGrad``, ``ResizeBicubicGrad`` and
  ``ScaleAndTranslateGrad`` (``Resizing`` with ``"nearest"``, ``"bicubic"``,
  ``"lanczos3"``, ``antialias=True``...): no entry, ``LookupError``;
* ``ResizeBilinearGrad`` (``Resizing``'s default, ``UpSampling2D(
  interpolation="bilinear")``): marked not differentiable, so the tangent
  through the layer was zero - wrong numbers without an error.

A resize is linear in its image and its gradient op is its transpose, so
the gradient of the gradient op is the resize itself. Each registration is
skipped where TensorFlow has a gradient of its own; ``ResizeBilinear``'s
gradient is replaced (the same op, made differentiable) only while
TensorFlow marks ``ResizeBilinearGrad`` not differentiable.

Nothing is registered on import: the entries that differentiate a gradient
op (forward mode, the double-backward JVP, curvature's JVP of a VJP) call
:func:`ensure_second_order` first, and it registers them all once per process.
Call it yourself before nesting tapes through these ops.
"""

import threading

from ._tf import tf
from .internals import gradient_registry

_LOCK = threading.Lock()
_DONE = []  # [True] once registered


def ensure_second_order():
    """Register the second-order gradients above in TensorFlow's registry,
    once per process (idempotent, thread-safe).

    Raises:
        InternalsMoved: TensorFlow's gradient registry is not where jacutil
            expects it (names the versions installed).
    """
    with _LOCK:
        if _DONE:
            return
        entries = gradient_registry()
        _register("SoftsignGrad", _softsign_grad_grad)
        if _not_differentiable(entries, "ResizeBilinearGrad"):  # replaced
            del entries["ResizeBilinear"]
            _register("ResizeBilinear", _resize_bilinear_grad)
        for op_type, resize in _RESIZES.items():
            _register(op_type, _transposed(resize))
        _DONE.append(True)


def _register(op_type, gradient):
    """Register ``gradient`` for ``op_type`` unless TensorFlow has one."""
    try:
        tf.RegisterGradient(op_type)(gradient)
    except KeyError:  # TensorFlow registers it itself now: keep its own
        pass


def _not_differentiable(entries, op_type):
    entry = entries.get(op_type)
    return entry is not None and entry.get("type") is None


def _softsign_grad_grad(op, grad):
    """``SoftsignGrad(g, x) = g / (1 + |x|)**2``: its gradient in g and x."""
    g, x = op.inputs
    scale = 1 / tf.square(1 + tf.abs(x))
    return grad * scale, grad * g * -2 * tf.sign(x) * scale / (1 + tf.abs(x))


def _transposed(resize):
    """The gradient of a resize's gradient op ``(grads, ...) -> image``:
    ``resize`` of the incoming gradient back to the size of ``grads``."""

    def gradient(op, grad):
        grads = op.inputs[0]
        again = resize(op, grad, tf.shape(grads)[1:3])
        return [tf.cast(again, grads.dtype)] + [None] * (len(op.inputs) - 1)

    return gradient


def _corners(op):
    return {
        "align_corners": op.get_attr("align_corners"),
        "half_pixel_centers": op.get_attr("half_pixel_centers"),
    }


def _resize_bilinear_grad(op, grad):
    """TensorFlow's gradient of ``ResizeBilinear`` (``ResizeBilinearGrad``),
    with a gradient of its own: the tape keeps no input of an op marked not
    differentiable, so the gradient op's gradient cannot be registered."""
    image, corners = op.inputs[0], _corners(op)

    @tf.custom_gradient
    def transposed(grads):
        def gradient(upstream):
            size = tf.shape(grads)[1:3]
            again = tf.raw_ops.ResizeBilinear(images=upstream, size=size, **corners)
            return tf.cast(again, grads.dtype)

        below = tf.raw_ops.ResizeBilinearGrad(
            grads=grads, original_image=image, **corners
        )
        return below, gradient

    return [transposed(grad), None]


# The gradient op of each resize -> the resize, in the op's own settings.
_RESIZES = {
    "ResizeNearestNeighborGrad": lambda op, g, size: tf.raw_ops.ResizeNearestNeighbor(
        images=g, size=size, **_corners(op)),
    "ResizeBicubicGrad": lambda op, g, size: tf.raw_ops.ResizeBicubic(
        images=g, size=size, **_corners(op)),
    "ScaleAndTranslateGrad": lambda op, g, size: tf.raw_ops.ScaleAndTranslate(
        images=g, size=size, scale=op.inputs[2], translation=op.inputs[3],
        kernel_type=op.get_attr("kernel_type"), antialias=op.get_attr("antialias")),
}  # fmt: skip
