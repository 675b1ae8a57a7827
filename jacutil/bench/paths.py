"""The registries: ``PATHS``, the ways to compute J, and ``MODELS``, what to time.

Adding a path is one entry in :data:`PATHS`: ``build(model)`` returns
``jac(x)`` (or None when a library is missing), and ``applies(model)``, if
given, says on which models it runs by default. Adding a model is one entry
in :data:`MODELS`. Introduced in ``07-benchmark``.
"""

from dataclasses import dataclass

from .. import peers
from ..auto import jacobian
from ..core._shared import count_params, size_of
from ..core._tf import tf
from ..core.target import resolve_target
from ..engine.compiled import compiled_jacobian
from ..engine.rows import chunked_jacobian
from ..stages.dense import compiled_dense_jacobian, dense_plan
from ..stages.loop import loop_jacobian
from ..stages.vectorized import per_sample_jacobian, vectorized_jacobian
from ..teaching.models import (
    image_data,
    question_mlp,
    regression_data,
    sequence_data,
    sequence_lstm,
    small_cnn,
)
from .models import flat_data, residual_mlp, two_head

SIZES = (100, 1000, 10_000)  # the question's network; other models name theirs
REFERENCE = "compiled"  # every path is checked against this one, at every n
PEER_NAMES = {"jax": "JAX", "torch": "PyTorch"}  # the other libraries, in words
PEERS = tuple(PEER_NAMES)  # "x peer" is to the faster one


def not_installed(what, library):
    """The note that ``what`` (a path or peer, in words) is skipped: ``library``
    is not installed."""
    return (
        f"note: {what} skipped: {library} is not installed "
        "(make bench-peers installs it)."
    )


@dataclass
class Path_:
    """One way to compute the Jacobian, ``label`` in words: ``build(model)``
    returns ``jac(x)``."""

    label: str
    build: object
    exponent: int = 1  # time and memory grow like n**exponent
    applies: object = None  # applies(model) -> bool; None: every model


def _bind(function, model, **options):
    return lambda x: function(model, x, **options)


def _view(jac):
    """``jac(x)`` with no copy out of TensorFlow, as ``jacutil.jacobian`` returns."""
    return lambda x: jac(x, copy=False)


def _dense_chain(model):
    """Whether the hand-derived path applies (elsewhere it falls back)."""
    return dense_plan(model, resolve_target(model))[0] is not None


PATHS = {
    "loop": Path_("loop_jacobian (nested loop)", lambda m: _bind(loop_jacobian, m)),
    "vectorized": Path_(
        "vectorized_jacobian (tape.jacobian, eager)",
        lambda m: _bind(vectorized_jacobian, m),
        exponent=2,
    ),
    "compiled_batch": Path_(
        "tape.jacobian, tf.function",
        lambda m: compiled_jacobian(m, method="batch"),
        exponent=2,
    ),
    "per_sample": Path_(
        "per_sample_jacobian (vectorized_map, eager)",
        lambda m: _bind(per_sample_jacobian, m),
    ),
    "compiled": Path_("vectorized_map, tf.function", compiled_jacobian),
    "compiled_xla": Path_(
        "vectorized_map, XLA", lambda m: compiled_jacobian(m, jit_compile=True)
    ),
    "chunked": Path_(
        "chunked_jacobian (the default budget)",
        lambda m: _bind(chunked_jacobian, m, progress=False),
    ),
    "dense": Path_(
        "hand-derived, tf.function", compiled_dense_jacobian, applies=_dense_chain
    ),
    "dense_xla": Path_(
        "hand-derived, XLA",
        lambda m: compiled_dense_jacobian(m, jit_compile=True),
        applies=_dense_chain,
    ),
    "rules": Path_(
        "layer rules, tf.function",
        lambda m: _view(compiled_jacobian(m, method="rules")),
    ),
    "jacobian": Path_(
        "jacutil.jacobian (picks the path)", lambda m: _bind(jacobian, m)
    ),
    "jax": Path_("JAX jit(vmap(jacrev))", peers.jax_jacobian),
    "torch": Path_("torch.func vmap(jacrev)", peers.torch_jacobian),
}


@dataclass
class BenchModel:
    """A model to time, ``label`` in words: ``build(seed)`` returns the Keras
    model, ``inputs(n, seed)`` n samples; ``sizes`` are the default n."""

    label: str
    build: object
    inputs: object
    sizes: tuple = SIZES
    paths: tuple = ()  # default paths (empty: every path that applies)
    targets: object = None  # targets(n, seed) for a loss; None: models.targets


MODELS = {
    "mlp": BenchModel(
        "the question's network (10-64-32-2, float32)",
        lambda seed: question_mlp(seed=seed),
        lambda n, seed: regression_data(n, seed=seed)[0],
        targets=lambda n, seed: regression_data(n, seed=seed)[1],
    ),
    "cnn": BenchModel(
        "CNN: Conv2D(8) -> Conv2D(8) -> Dense(4) on 12 x 12 x 1 (float32)",
        lambda seed: small_cnn(seed=seed),
        lambda n, seed: image_data(n, seed=seed),
        sizes=(100, 2000),
    ),
    "lstm": BenchModel(
        "LSTM(16) -> Dense(2) on 16 steps x 4 (float32)",
        lambda seed: sequence_lstm(seed=seed),
        lambda n, seed: sequence_data(n, seed=seed),
        sizes=(100, 2000),
    ),
    "residual": BenchModel(
        "residual MLP: 32 -> Dense(56) -> 3 x [Dense(56, relu) + Add skip] -> "
        "Dense(1) (float32)",
        lambda seed: residual_mlp(seed=seed),
        lambda n, seed: flat_data(n, 32, seed=seed),
        sizes=(100, 2000),
    ),
    "two_head": BenchModel(
        "two heads: 10 -> 64 -> 32 (relu) -> Dense(2) and Dense(1) (float32)",
        lambda seed: two_head(seed=seed),
        lambda n, seed: flat_data(n, 10, seed=seed),
        sizes=(100, 2000),
    ),
}


def default_paths(model_name, network):
    """The paths (a list of names) a run times on ``network``, the built model
    ``model_name`` of ``MODELS``, when none are named: those that apply."""
    chosen = MODELS[model_name].paths
    if chosen:
        return list(chosen)
    return [
        name
        for name, path in PATHS.items()
        if path.applies is None or path.applies(network)
    ]


def count_outputs(model, x):
    """l: the outputs of one sample, every output of the model counted (one
    sample of the inputs ``x`` is run)."""
    leaves = tf.nest.flatten(model(x[:1]))
    return sum(size_of(leaf.shape[1:]) for leaf in leaves)


def jacobian_shape(model, x, n):
    """The tuple (n, l, m) of the model's per-sample Jacobian, from one sample
    of its inputs x."""

    return (n, count_outputs(model, x), count_params(model.trainable_variables))
