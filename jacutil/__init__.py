"""jacutil: fast per-sample Jacobians of neural networks in TensorFlow 2.

``jacutil.jacobian(model, x)`` is the one call to use: it picks the fastest
correct path (the layer rules, the compiled stage, chunks) and, with
``explain=True``, says which.

The index convention, everywhere: n samples, l outputs per sample (every
output element, flattened), m parameters (every trainable variable,
flattened in ``flat_params(model)`` order). Every Jacobian path returns

    J[i, k, p] = d f(x)[i, k] / d theta[p],   shape (n, l, m),

and ``to_lm_by_n`` lays it out as the (l * m, n) matrix of the questions we
grew from. Each function's docstring names the notebook that introduces it.

The package, by job:

- ``stages``    the four stages, one notebook each: loop (01), vectorized
                (02), compiled (03), chunked (04)
- ``rules``     layer rules: each known layer writes its own columns (07, 08)
- ``matrix_free``  products with J without forming it, forward mode (09)
- ``fitting``   SciPy least squares, Levenberg-Marquardt, per-sample gradients (05),
                DP-SGD by ghost clipping (09)
- ``privacy``   make_private, then plain model.fit: DP-SGD with sigma from a
                target epsilon, and a validator (09)
- ``scale``     resumable files and several processes or machines (10)
- ``curvature`` G and its diagonal, KFAC, Hessian products, the empirical NTK,
                spectra and Laplace uncertainty (11)
- ``core``      what every path shares: the target, batches, outputs, layout,
                memory, the cache, guards
- ``teaching``  the notebooks' checks, plots, models and helpers
- ``testing``   independent references for tests: finite differences, check_rule
- ``bench``, ``peers``  the benchmark (``make bench``) and its PyTorch/JAX peers
"""

from . import (
    core,
    curvature,
    fitting,
    matrix_free,
    privacy,
    rules,
    scale,
    stages,
    teaching,
    testing,
)
from .auto import Choice, jacobian
from .core._tf import keras, tf  # noqa: F401 (jacutil.tf, jacutil.keras for the notebooks)
from .core.layout import (
    flat_params,
    from_lm_by_n,
    set_flat_params,
    split_outputs,
    to_lm_by_n,
)
from .core.planner import chunk_size_for
from .fitting.dp_sgd import DPSGD
from .fitting.gauss_newton import levenberg_marquardt
from .fitting.loss_gradients import per_sample_gradient_norms, per_sample_gradients
from .fitting.scipy_bridge import (
    LeastSquaresProblem,
    fit_least_squares,
    least_squares_problem,
)
from .matrix_free.forward import forward_jacobian
from .matrix_free.products import jacobian_operator, jvp, products, vjp
from .privacy import make_private
from .rules.dense_jacobian import compiled_dense_jacobian, dense_jacobian
from .scale.distributed import (
    DistributedLeastSquares,
    LocalWorkers,
    distributed_jacobian,
)
from .stages.chunked import chunked_jacobian
from .stages.compiled import CompiledJacobian, compiled_jacobian
from .stages.loop import loop_jacobian
from .stages.vectorized import per_sample_jacobian, vectorized_jacobian
from .teaching.models import (
    image_data,
    question_mlp,
    regression_data,
    sequence_data,
    sequence_lstm,
    small_cnn,
)
from .teaching.timing import Timing, time_call
from .testing import finite_difference_jacobian

__version__ = "0.1.0"

__all__ = [
    # the one call: picks the fastest correct path
    "jacobian", "Choice",
    # the stages, one notebook each (01-04)
    "loop_jacobian", "vectorized_jacobian", "per_sample_jacobian",
    "compiled_jacobian", "CompiledJacobian", "chunked_jacobian", "chunk_size_for",
    # the hand-derived Dense path, a view of the layer rules (07)
    "dense_jacobian", "compiled_dense_jacobian",
    # products without J, and forward mode (09)
    "jvp", "vjp", "products", "jacobian_operator", "forward_jacobian",
    # fitting with the Jacobian (05), per-sample gradients
    "least_squares_problem", "LeastSquaresProblem", "fit_least_squares",
    "levenberg_marquardt", "per_sample_gradients", "per_sample_gradient_norms",
    # DP-SGD by ghost clipping (09)
    "DPSGD", "make_private",
    # beyond one machine (10)
    "distributed_jacobian", "DistributedLeastSquares", "LocalWorkers",
    # parameters and layouts
    "flat_params", "set_flat_params", "split_outputs", "to_lm_by_n", "from_lm_by_n",
    # the notebooks' models, data and timing
    "question_mlp", "small_cnn", "sequence_lstm", "regression_data",
    "image_data", "sequence_data", "time_call", "Timing",
    # an independent reference
    "finite_difference_jacobian",
    # the package by job (see above)
    "stages", "rules", "matrix_free", "fitting", "privacy", "scale", "curvature",
    "core", "teaching", "testing",
]  # fmt: skip
