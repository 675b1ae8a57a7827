"""jacutil: fast per-sample Jacobians of neural networks in TensorFlow 2.

``jacutil.jacobian(model, x)`` is the one call to use: it picks the fastest
correct path (``jacutil.rules``, the compiled stage, chunks) and, with
``explain=True``, says which. Every path returns
``J[i, k, p] = d f(x)[i, k] / d theta[p]``, shape
(n_samples, n_outputs, n_params), with theta in ``flat_params(model)`` order.
Each function's docstring names the notebook that introduces it.
"""

from . import (
    batch,
    cache,
    distributed,
    formulation,
    guards,
    matrix_free,
    memory,
    notebook,
    outputs,
    plots,
    resume,
    rules,
)
from ._tf import keras, tf
from .auto import Choice, jacobian
from .chunked import chunk_size_for, chunked_jacobian
from .compiled import CompiledJacobian, compiled_jacobian
from .dense_jacobian import compiled_dense_jacobian, dense_jacobian
from .distributed import DistributedLeastSquares, LocalWorkers, distributed_jacobian
from .forward import forward_jacobian
from .gauss_newton import levenberg_marquardt
from .layout import (
    flat_params,
    from_lm_by_n,
    set_flat_params,
    split_outputs,
    to_lm_by_n,
)
from .loop import loop_jacobian
from .loss_gradients import per_sample_gradient_norms, per_sample_gradients
from .matrix_free import jacobian_operator, jvp, products, vjp
from .models import (
    image_data,
    question_mlp,
    regression_data,
    sequence_data,
    sequence_lstm,
    small_cnn,
)
from .reference import finite_difference_jacobian
from .scipy_bridge import LeastSquaresProblem, fit_least_squares, least_squares_problem
from .timing import Timing, time_call
from .vectorized import per_sample_jacobian, vectorized_jacobian

__version__ = "0.1.0"

__all__ = [
    "Choice",
    "CompiledJacobian",
    "DistributedLeastSquares",
    "LeastSquaresProblem",
    "LocalWorkers",
    "Timing",
    "batch",
    "cache",
    "chunk_size_for",
    "chunked_jacobian",
    "compiled_dense_jacobian",
    "compiled_jacobian",
    "dense_jacobian",
    "distributed",
    "distributed_jacobian",
    "finite_difference_jacobian",
    "fit_least_squares",
    "formulation",
    "flat_params",
    "forward_jacobian",
    "from_lm_by_n",
    "guards",
    "image_data",
    "jacobian",
    "jacobian_operator",
    "jvp",
    "keras",
    "least_squares_problem",
    "levenberg_marquardt",
    "loop_jacobian",
    "matrix_free",
    "memory",
    "notebook",
    "outputs",
    "per_sample_gradient_norms",
    "per_sample_gradients",
    "per_sample_jacobian",
    "plots",
    "products",
    "resume",
    "question_mlp",
    "rules",
    "regression_data",
    "sequence_data",
    "sequence_lstm",
    "set_flat_params",
    "small_cnn",
    "split_outputs",
    "tf",
    "time_call",
    "to_lm_by_n",
    "vectorized_jacobian",
    "vjp",
]
