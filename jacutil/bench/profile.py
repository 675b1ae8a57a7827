"""Where the hand-derived path's time goes, piece by piece (``07-benchmark``)."""

from ..core._tf import tf
from ..core.target import resolve_target
from ..rules import plan_for
from ..stages.dense import compiled_dense_jacobian
from ..teaching.timing import time_call
from .floor import fill_floor, preallocated, write_floor


def _layer_blocks(model, x):
    """``blocks(x)``: each Dense layer's column block on its own, not joined.

    One plan per layer (its kernel and bias, one block) and no ``tf.concat``;
    each plan repeats the forward pass and the signals above its layer (small
    next to the blocks).
    """
    plans = []
    for layer in model.layers:
        if layer.trainable_variables:
            target = resolve_target(model, layer.trainable_variables)
            plan, reason = plan_for(model, target.variables)
            reason = reason or plan.check(target, x)
            if reason is not None:
                raise ValueError(f"no rules for layer {layer.name!r}: {reason}.")
            plans.append(plan)
    spec = [tf.TensorSpec([None, x.shape[1]], x.dtype)]
    return tf.function(
        lambda x: [plan.tensor(x) for plan in plans], input_signature=spec
    )


def profile_dense(model, x, repeats=5):
    """Where the hand-derived path's time goes at one n: ``{piece: seconds}``.

    Each piece includes the ones before it: the forward pass alone, the
    column blocks (one plan per layer, not joined), the joined tensor,
    ``jac(x)`` (a NumPy view of it), ``jac(x, copy=True)``; and both floors.

    Args:
        model: a Keras chain of Dense layers (the hand-derived path applies).
        x: the n samples, shape (n, n_inputs).
        repeats: the timed calls per piece.

    Returns:
        A dict from piece (in words) to its median seconds.

    Raises:
        ValueError: the hand-derived path does not apply to the model.
    """
    jac = compiled_dense_jacobian(model)
    if jac.fallback:
        raise ValueError(f"the hand-derived path does not apply: {jac.fallback}.")
    x_tensor = tf.constant(x)
    spec = [tf.TensorSpec([None, x.shape[1]], x_tensor.dtype)]
    forward = tf.function(lambda x: model(x, training=False), input_signature=spec)
    blocks = _layer_blocks(model, x_tensor)
    shape = (len(x), int(model.outputs[0].shape[-1]), jac.target.n_params)
    out = preallocated(shape)
    pieces = {
        "forward pass only": lambda: forward(x_tensor),
        "column blocks, not joined": lambda: blocks(x_tensor),
        "joined: the (n, l, m) tensor": lambda: jac.tensor(x_tensor),
        "jac(x): a read-only NumPy view": lambda: jac(x),
        "jac(x, copy=True): writable": lambda: jac(x, copy=True),
        "floor: fill a preallocated array": lambda: fill_floor(out),
        "floor, new array: np.full": lambda: write_floor(shape),
    }
    # each piece's first call (trace, compile) is a warm-up, timed apart
    return {name: time_call(f, repeats=repeats).median for name, f in pieces.items()}
