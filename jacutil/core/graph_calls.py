"""The call a loop repeats: a ``tf.function`` run by its concrete function.

A ``tf.function`` call looks its arguments' signature up among its traces and
binds them before the graph runs: about 0.4 ms on a 2-core CPU, more than the
graph of a small model's step or Jacobian. :class:`SignatureCalls` finds the
concrete function of each signature once and then runs it on the flat
tensors (``internals.flat_caller``). Introduced in ``09-matrix-free``.
"""

from ._tf import tf
from .internals import flat_caller


class SignatureCalls:
    """``calls(*args)``: ``function(*args)`` for a ``tf.function`` of tensors.

    The first call with a signature (the shape and dtype of every tensor in
    the nested ``args``) gets its concrete function (tracing, as
    ``function(*args)`` would); later calls with it run that function on the
    flat tensors, with no lookup or binding. Arguments that are not all
    eager tensors (NumPy arrays, Python numbers, variables), and calls inside
    a graph, take ``function(*args)`` itself.
    """

    def __init__(self, function):
        self.function = function
        self._by_signature = {}

    def __call__(self, *args):
        flat = tf.nest.flatten(args)
        if not tf.executing_eagerly() or not all(
            isinstance(t, tf.Tensor) and hasattr(t, "numpy") for t in flat
        ):
            return self.function(*args)
        key = tuple((t.dtype, t.shape) for t in flat)  # eager: fully known
        run = self._by_signature.get(key)
        if run is None:
            run = flat_caller(self.function.get_concrete_function(*args))
            self._by_signature[key] = run
        return run(flat)
