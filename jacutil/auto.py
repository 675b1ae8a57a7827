"""One entry: ``jacutil.jacobian(model, x)`` picks the path (notebook 00-welcome).

The staged functions (notebooks 01 to 07) are the lessons; this is the one
call to use. It takes, for this model and this size:

1. **forward mode** (``jacutil.matrix_free.forward``) when the outputs outnumber the
   parameters many times over (notebook 09): one JVP per parameter;
2. **the layer rules** (``jacutil.rules``) when the model is a Keras chain
   they can read, in inference mode: each layer writes its own blocks, no
   pfor over the model;
3. otherwise **the compiled per-sample stage** (``tf.vectorized_map`` in a
   ``tf.function``, recurrent layers unrolled; see ``jacutil.core.formulation``);
4. the rules or the compiled stage **in chunks** written into ``out`` when
   the working memory would pass ``memory_budget`` (default: half the
   memory free now), or when ``out`` is given (an array or a memmap).

The compiled functions are cached per model (weakly), so the second call on
the same model traces nothing. ``explain=True`` returns the choice and why.
"""

from .engine.choice import Choice, choice_for  # noqa: F401 (the face's names)
from .engine.jacobian import FORWARD_WHEN_OUTPUTS_PER_PARAMETER, best_jacobian  # noqa: F401
from .matrix_free.forward import forward_for


def jacobian(
    model,
    x,
    *,
    out=None,
    memory_budget=None,
    variables=None,
    training=False,
    explain=False,
    copy=False,
    progress=False,
    key=None,
    steps=None,
):
    """The per-sample Jacobian of ``model`` at ``x`` by the fastest correct path.

    Without ``out`` and in one piece, J is a read-only view of TensorFlow's
    result (a copy would cost as long as the Jacobian on a small network):
    pass ``copy=True`` for an array you may write to. With ``out``, or when
    the working memory would pass ``memory_budget``, the batch runs in
    chunks written into ``out``. Introduced in ``00-welcome``.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        x: the n samples: an array, or a list or dict of arrays for several
            inputs, or what ``model.predict`` takes: a ``tf.data.Dataset``
            (batched or not, ``padded_batch`` too), a ``keras.utils.PyDataset``
            or a generator of batches (``x`` or ``(x, y, ...)``; read once by
            Keras's data adapter: :func:`jacutil.core.data.read_data`).
        out: None, an array or ``np.lib.format.open_memmap`` of shape
            (n, l, m), or a ``.npy`` path: a resumable run, as in
            :func:`jacutil.chunked_jacobian`.
        memory_budget: bytes of working memory before it runs in chunks
            (default: half the memory free now).
        variables: the variables to differentiate (default: the model's
            trainable variables).
        training: run the model in training mode.
        explain: also return a :class:`Choice`: the path, why, each layer's
            rule and the chunks.
        copy: return an array you may write to.
        progress: show a progress bar over chunks.
        key: with ``out=path`` and a callable: a name for what it computes.
        steps: the batches of a dataset or generator to read (as in
            ``model.predict``); needed where its length is not known.

    Returns:
        J, shape (n, l, m), columns in ``flat_params`` order; with
        ``explain=True``, ``(J, choice)``.

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras, jacobian
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,), dtype="float64"),
        ...                           keras.layers.Dense(2, dtype="float64")])
        >>> x = np.random.default_rng(0).normal(size=(4, 3))  # n = 4 samples
        >>> jacobian(model, x).shape  # (n, l, m): m = 3 * 2 + 2
        (4, 2, 8)
        >>> J, choice = jacobian(model, x, explain=True)
        >>> choice.path
        'layer rules'
    """
    return best_jacobian(
        model, x, out=out, memory_budget=memory_budget, variables=variables,
        training=training, explain=explain, copy=copy, progress=progress,
        key=key, steps=steps, forward_for=forward_for,
    )  # fmt: skip
