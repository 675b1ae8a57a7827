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
                (02), compiled (03), chunked (04); lessons, shown as the
                engine runs them
- ``rules``     layer rules: each known layer writes its own columns (07, 08)
- ``engine``    the one compiled machinery every entry runs on: the compiled
                Jacobian, its rows in chunks, the path choice
- ``matrix_free``  products with J without forming it, forward mode (09)
- ``fitting``   SciPy least squares, Levenberg-Marquardt, per-sample gradients (05)
- ``privacy``   DP-SGD by ghost clipping, and make_private, then plain
                model.fit: sigma from a target epsilon, the ledger, the audit (09)
- ``scale``     resumable files and several processes or machines (10)
- ``curvature`` G and its diagonal, KFAC, Hessian products, the empirical NTK,
                spectra and Laplace uncertainty (11)
- ``core``      what every path shares: the target, batches, outputs, layout,
                memory, the cache, guards
- ``teaching``  the notebooks' checks, plots, models and helpers
- ``testing``   independent references for tests: finite differences, check_rule
- ``bench``, ``peers``  the benchmark (``make bench``) and its PyTorch/JAX peers
"""

from .core.lazy import lazy_face

__version__ = "0.1.0"

# Each name the package shows -> the module (under jacutil) that defines it,
# imported on first use: ``import jacutil`` loads no TensorFlow.
_FACE = {
    # the one call: picks the fastest correct path
    "jacobian": "auto", "Choice": "auto",
    # the stages, one notebook each (01-04)
    "loop_jacobian": "stages.loop", "vectorized_jacobian": "stages.vectorized",
    "per_sample_jacobian": "stages.vectorized",
    "compiled_jacobian": "stages.compiled", "CompiledJacobian": "stages.compiled",
    "chunked_jacobian": "stages.chunked", "chunk_size_for": "core.planner",
    # the hand-derived Dense path, a view of the layer rules (07)
    "dense_jacobian": "stages.dense",
    "compiled_dense_jacobian": "stages.dense",
    # products without J, and forward mode (09)
    "jvp": "matrix_free.products", "vjp": "matrix_free.products",
    "products": "matrix_free.products", "jacobian_operator": "matrix_free.products",
    "forward_jacobian": "matrix_free.forward",
    # fitting with the Jacobian (05), per-sample gradients
    "least_squares_problem": "fitting.scipy_bridge",
    "LeastSquaresProblem": "fitting.scipy_bridge",
    "fit_least_squares": "fitting.scipy_bridge",
    "levenberg_marquardt": "fitting.gauss_newton",
    "per_sample_gradients": "fitting.loss_gradients",
    "per_sample_gradient_norms": "fitting.loss_gradients",
    # DP-SGD by ghost clipping (09)
    "DPSGD": "privacy.dp_sgd", "make_private": "privacy",
    # beyond one machine (10)
    "distributed_jacobian": "scale.distributed",
    "DistributedLeastSquares": "scale.distributed", "LocalWorkers": "scale.distributed",
    # parameters and layouts
    "flat_params": "core.layout", "set_flat_params": "core.layout",
    "split_outputs": "core.layout", "to_lm_by_n": "core.layout",
    "from_lm_by_n": "core.layout",
    # the notebooks' models, data and timing
    "question_mlp": "teaching.models", "small_cnn": "teaching.models",
    "sequence_lstm": "teaching.models", "regression_data": "teaching.models",
    "image_data": "teaching.models", "sequence_data": "teaching.models",
    "time_call": "teaching.timing", "Timing": "teaching.timing",
    # an independent reference
    "finite_difference_jacobian": "testing",
    # the package by job (see above)
    "stages": "stages", "engine": "engine", "rules": "rules",
    "matrix_free": "matrix_free", "fitting": "fitting", "privacy": "privacy",
    "scale": "scale",
    "curvature": "curvature", "core": "core", "teaching": "teaching",
    "testing": "testing",
    # TensorFlow and Keras, imported quietly (jacutil.tf, jacutil.keras)
    "tf": "core._tf", "keras": "core._tf",
    # the benchmark and its peers (make bench)
    "bench": "bench", "peers": "peers",
}  # fmt: skip
__all__, __getattr__, __dir__ = lazy_face(
    __name__, _FACE, hidden=("tf", "keras", "bench", "peers")
)
