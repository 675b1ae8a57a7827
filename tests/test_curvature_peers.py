"""The curvature peers (BackPACK, curvlinops, laplace-torch, JAX) equal jacutil.

Each test is skipped when its peer library is absent (they are not
dependencies: ``make bench-peers`` installs them). Where present, each
peer's result and jacutil's are both checked against a brute-force
reference built in NumPy from the formed float64 J (``jacutil.jacobian``
on a float64 model) and the loss's H: ``G = sum_i J_i.T H_i J_i``, its
diagonal, ``G v``, ``J J.T`` and ``J* (G / sigma^2 + delta I)^-1 J*.T``.
Notebook 11-curvature-and-uncertainty.
"""

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras
from jacutil.bench.models import residual_mlp
from jacutil.curvature.losses import output_loss
from tests.architectures import build

N = 5
LOSSES = ("squared_error", "softmax_cross_entropy")
DELTA, SIGMA = 0.7, 0.4  # neither is 1, so a missing factor shows


def two_convolutions(dtype="float64"):
    """Two convolutions (same and valid padding, a dilation), every activation
    the peers know, a Flatten of 3 x 3 x 2 (where Keras's and PyTorch's
    orders differ), then Dense: 160 parameters."""
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((6, 6, 2), dtype=dtype),
            keras.layers.Conv2D(
                3, 3, padding="same", activation="sigmoid", dtype=dtype
            ),
            keras.layers.Conv2D(2, 2, dilation_rate=2, activation="relu", dtype=dtype),
            keras.layers.Flatten(dtype=dtype),
            keras.layers.Dense(4, activation="tanh", dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )


def cases():
    """(name, float64 model, x): zoo MLP and CNN, and the two-convolution CNN."""
    out = []
    for name in ("mlp", "convolution"):
        case = build(name, seed=1)
        out.append((name, case.model64, case.batch(N)))
    x = np.random.default_rng(2).standard_normal((N, 6, 6, 2))
    out.append(("two_convolutions", two_convolutions(), x))
    return out


CASES = cases()
IDS = [name for name, _, _ in CASES]


def reference(model, x, loss):
    """(J (n, l, m), G (m, m)) in float64 from the formed J and the loss's H."""
    J = np.asarray(ju.jacobian(model, x), dtype=np.float64)
    H = output_loss(loss, model).hessian(np.asarray(model(x), dtype=np.float64))
    return J, np.einsum("nkp,nkj,njq->pq", J, H, J)


def close(actual, expected, rtol=1e-10):
    """Equal within rtol of the largest entry (float64 sums in any order)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape
    scale = max(1.0, float(np.max(np.abs(expected))))
    assert np.max(np.abs(actual - expected)) <= rtol * scale


def peers():
    pytest.importorskip("torch")
    from jacutil.peers import curvature_peers

    return curvature_peers


@pytest.mark.parametrize("name, model, x", CASES, ids=IDS)
def test_the_rebuilt_module_gives_the_same_outputs_and_parameters(name, model, x):
    cp = peers()
    rebuilt = cp.torch_module(model)
    out = rebuilt.module(rebuilt.inputs(x)).detach().numpy()
    close(out, np.asarray(model(x)))
    theta = ju.flat_params(model)
    vector = np.concatenate(
        [p.detach().numpy().reshape(-1) for p in rebuilt.module.parameters()]
    )
    close(vector, theta[rebuilt.index], rtol=0)  # the same numbers, permuted
    close(rebuilt.to_ours(rebuilt.to_torch(theta)), theta, rtol=0)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("name, model, x", CASES, ids=IDS)
def test_backpack_diagonal_equals_jacutils(name, model, x, loss):
    cp = peers()
    pytest.importorskip("backpack")
    from jacutil.curvature.diagonal import ggn_diagonal

    _, G = reference(model, x, loss)
    theirs = cp.backpack_ggn_diagonal(model, loss)(x)
    ours = ggn_diagonal(model, x, loss)
    close(theirs, np.diag(G))  # MSELoss's H = 2 I halved: without, twice
    close(ours, np.diag(G))
    close(theirs, ours)


def test_backpack_kflr_is_exact_for_one_sample():
    """With one sample a Dense layer's G block is A kron B exactly: the
    factors are KFLR's (exact H), in PyTorch's (out, in) weight order."""
    cp = peers()
    pytest.importorskip("backpack")
    model = build("mlp", seed=1).model64
    x = build("mlp", seed=1).batch(1)
    for loss in LOSSES:
        _, G = reference(model, x, loss)
        index = cp.torch_module(model).index
        G_torch = G[np.ix_(index, index)]  # rows and columns in PyTorch's order
        start = 0
        for layer, (A, B) in zip(
            [m for m in model.layers if m.weights],
            cp.backpack_kflr(model, loss)(x),
            strict=True,
        ):
            size = A.shape[0] * B.shape[0]
            assert A.shape[0] == layer.kernel.shape[0]  # no bias column
            block = G_torch[start : start + size, start : start + size]
            close(np.kron(B, A), block)
            start += size + layer.bias.shape[0]


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("name, model, x", CASES, ids=IDS)
def test_backpack_kflr_dense_blocks_equal_jacutils_kfac(name, model, x, loss):
    """Dense layers: BackPACK's B kron A is jacutil's A kron B (weights only,
    rows permuted). Conv2D layers differ by definition (see backpack_kflr)."""
    cp = peers()
    pytest.importorskip("backpack")
    from jacutil.curvature.kfac import kfac

    ours = kfac(model, x, loss).factors
    theirs = cp.backpack_kflr(model, loss)(x)
    index = cp.torch_module(model).index
    start, compared = 0, 0
    for layer, (A, B) in zip(ours, theirs, strict=True):
        size = A.shape[0] * B.shape[0]
        torch_order = index[start : start + size] - layer.kernel.start
        start += size + (0 if layer.bias is None else B.shape[0])
        if len(model.get_layer(layer.name).kernel.shape) != 2:
            continue  # a Conv2D
        d_in = A.shape[0]
        expected = np.kron(layer.A[:d_in, :d_in], layer.B)  # kernel's flat order
        block = np.zeros_like(expected)
        block[np.ix_(torch_order, torch_order)] = np.kron(B, A)
        close(block, expected)
        compared += 1
    assert compared >= 1


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("name, model, x", CASES, ids=IDS)
def test_curvlinops_ggn_product_equals_jacutils(name, model, x, loss):
    cp = peers()
    pytest.importorskip("curvlinops")
    from jacutil.curvature.ggn import ggn_operator

    _, G = reference(model, x, loss)
    v = np.random.default_rng(4).standard_normal(G.shape[0])
    theirs = cp.curvlinops_ggn(model, x, loss)(v)
    ours = ggn_operator(model, x, loss).matvec(v)
    close(theirs, G @ v)
    close(ours, G @ v)


@pytest.fixture
def jax_x64():
    """JAX in float64 for one test (it computes in float32 by default)."""
    jax = pytest.importorskip("jax")
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def ntk_cases():
    lstm = build("lstm", seed=1)
    residual = residual_mlp(n_inputs=4, width=5, blocks=2, seed=1, dtype="float64")
    x = np.random.default_rng(5).standard_normal((N, 4))
    return [*CASES, ("lstm", lstm.model64, lstm.batch(N)), ("residual", residual, x)]


@pytest.mark.parametrize("name, model, x", ntk_cases(), ids=[*IDS, "lstm", "residual"])
def test_jax_ntk_equals_jacutils(name, model, x, jax_x64):
    from jacutil.curvature.ntk import empirical_ntk
    from jacutil.peers.curvature_peers import jax_ntk

    J, _ = reference(model, x, "squared_error")
    rows = J.reshape(-1, J.shape[2])
    theirs = jax_ntk(model)(x)
    close(theirs, rows @ rows.T)
    close(empirical_ntk(model, x), rows @ rows.T)


@pytest.mark.parametrize("structure", ["last_layer", "diagonal"])
@pytest.mark.parametrize("name, model, x", CASES, ids=IDS)
def test_laplace_torch_predictive_equals_jacutils(name, model, x, structure):
    cp = peers()
    pytest.importorskip("laplace")
    from jacutil.curvature.laplace import Laplace, last_layer_variables

    rng = np.random.default_rng(6)
    x_test = rng.standard_normal(x.shape)
    y = rng.standard_normal((N, int(np.prod(model.outputs[0].shape[1:]))))
    variables = last_layer_variables(model) if structure == "last_layer" else None
    J = np.asarray(ju.jacobian(model, x, variables=variables))
    J_test = np.asarray(ju.jacobian(model, x_test, variables=variables))
    G = np.einsum("nkp,nkq->pq", J, J)
    if structure == "diagonal":
        G = np.diag(np.diag(G))
    Sigma = np.linalg.inv(G / SIGMA**2 + DELTA * np.eye(G.shape[0]))
    expected = np.einsum("nkp,pq,njq->nkj", J_test, Sigma, J_test)
    theirs = cp.laplace_torch_variance(
        model, x, y, structure=structure, prior_precision=DELTA, sigma_noise=SIGMA
    )(x_test)
    ours = Laplace(
        model, x, y, "squared_error", structure,
        prior_precision=DELTA, sigma_noise=SIGMA,
    ).predictive_variance(x_test)  # fmt: skip
    close(ours, expected)
    # laplace-torch's last-layer G carries float32-sized errors (about 1e-8 of
    # its largest entry) even on float64 weights; its diagonal does not
    close(theirs, expected, rtol=1e-6 if structure == "last_layer" else 1e-10)


def test_the_peers_refuse_what_they_cannot_rebuild():
    cp = peers()
    residual = residual_mlp(n_inputs=4, width=5, blocks=1, dtype="float64")
    with pytest.raises(ValueError, match="chain of layers only"):
        cp.torch_module(residual)
    with pytest.raises(ValueError, match="Dense, Conv2D and Flatten"):
        cp.torch_module(build("lstm").model64)
    with pytest.raises(ValueError, match="squared_error"):
        cp.backpack_ggn_diagonal(build("mlp").model64, "hinge")


def test_a_bench_row_is_checked_then_timed():
    pytest.importorskip("torch")
    pytest.importorskip("curvlinops")
    from jacutil.bench import curvature_rows as rows

    row = rows.Row("ggn", "mlp", 20, "curvlinops GGNLinearOperator", "curvlinops")
    result = rows.run_row(row, repeats=1, log=lambda line: None)
    assert result["peer"] is not None and len(result["peer"]["times"]) == 1
    assert result["max_abs_diff"] <= rows.RTOL
    assert "x |" in rows.table([result])  # a ratio is printed
    with pytest.raises(AssertionError, match="disagrees"):
        rows.check_row(row, np.ones(3), np.ones(3) + 1e-2)


def test_a_row_without_its_peer_says_not_available(monkeypatch):
    from jacutil.bench import curvature_rows as rows

    row = rows.Row("ggn", "mlp", 20, "a peer", "no_such_library_here")
    result = rows.run_row(row, repeats=1, log=lambda line: None)
    assert result["peer"] is None and result["jacutil"] is not None
    assert "no_such_library_here not installed" in result["note"]
    assert "not available" in rows.table([result])


def test_the_command_line_refuses_bad_options():
    from jacutil.bench import curvature_rows as rows

    with pytest.raises(SystemExit):
        rows.main(["--torch-threads", "0"])
    with pytest.raises(ValueError, match="unknown kinds"):
        rows.run_all(["hessian"])
