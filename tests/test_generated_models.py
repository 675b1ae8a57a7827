"""Generated models against one tape per sample: every public entry (issue 21).

Hypothesis draws Keras models from the layers and options jacutil's rules
claim, and functional graphs (``tests/generated.py``), in float32 and
float64, and checks each public entry against ``tape_jacobian`` /
``tape_loss_gradients`` (one ``tf.GradientTape`` per sample):

* ``jacobian`` (as is, and with ``out=``), ``chunked_jacobian`` with
  ``method="per_sample"`` and ``"rules"`` and a chunk size that often leaves
  a short last chunk (one sample, half the time);
* ``forward_jacobian`` (all columns in one pass, or several), ``jvp``
  (forward or double-backward mode, whole or in chunks), ``vjp`` and
  ``jacobian_operator`` (``matvec``, ``rmatvec``, ``matmat``);
* ``ggn_diagonal``, ``ggn_operator`` and ``empirical_ntk`` (notebook 11)
  with the squared error, against ``J``'s sums of squares, ``J.T J v`` and
  ``J J.T``;
* ``ggn_operator``, ``ggn_diagonal``, ``hessian_operator`` and Laplace's
  diagonal posterior with Keras losses, one per head (one or two heads of
  their own class counts, reductions, label smoothing, sample weights),
  against ``J.T H J`` with H by nested float64 tapes (:func:`head_cases`),
  and the empirical Fisher's operator and diagonal against ``P.T P``, P's
  rows each sample's gradient from a float64 tape (``fisher_rows``);
* ``per_sample_gradients`` and ``per_sample_gradient_norms`` with every
  Keras loss (``tests/generated.py``'s ``LOSSES``: built-ins with their
  options, from probabilities or logits, and custom losses that read the
  probabilities, Keras's cached logits or both), and a ``DPSGD`` step with
  no noise: the clip bound on every sample's contribution, and the update
  against the tape's clipped mean; the per-layer step and ``make_private``'s
  ``model.fit`` draw their sampling and noise in ``secure_mode`` for half
  the programs (:func:`secure_case`).

An entry may refuse a model, with a clear error that names the feature
(:func:`clear_refusal`); anything else is a failure, named after the entry
and the kind (``jacobian_wrong``, ``vjp_crash``, ...) so that Hypothesis
reports distinct failures apart. A failing example prints as the program
that builds the model: paste it after ``from tests.generated import *``.

Profiles (this module's tests only, not other Hypothesis tests):

* ``ci`` (default): ``derandomize=True`` (a fixed seed), a budget of about
  two minutes for this file with ``-n 2`` on a 2-core machine, and no
  shrinking (a failure prints as drawn, at once; ``JACUTIL_SHRINK=1``
  shrinks it, for a small reproduction);
* ``fuzz`` (``JACUTIL_FUZZ=1``, what ``make fuzz`` sets): a random seed
  (``--hypothesis-seed`` to repeat one), ``JACUTIL_FUZZ_EXAMPLES`` examples
  per test (default 500), and shrinking, so a failure prints minimal.

Nothing is written into the repository (``database=None``; with a seed, as
``make fuzz`` gives one, Hypothesis keeps none anyway: the seed repeats the
run). Each distinct
failure found so far is a named test in ``tests/test_generated_regressions.py``.
"""

import os
import re
import warnings
import zlib

import numpy as np
import pytest
from hypothesis import (
    HealthCheck,
    Phase,
    assume,
    event,
    given,
    note,
    reject,
    settings,
)
from hypothesis import strategies as st

import jacutil as ju
from jacutil.core.guards import JacobianError
from jacutil.core.internals import layers_within
from tests.generated import (
    SampleLoss,
    chain_cases,
    clear_refusal,
    fisher_rows,
    graph_cases,
    head_cases,
    keras_batch_divisor,
    keras_loss_gradients,
    loss_cases,
    loss_hessian_product,
    output_hessians,
    runs_on_its_batch,
    stems,
    tape_jacobian,
    tape_loss_gradients,
    wide_cases,
)

# a strategy that draws from outside Hypothesis (Python's random, moved by
# Keras's initializers while a program is drawn) cannot be shrunk or
# replayed: an error, not a warning (tests/generated.py keeps the state)
pytestmark = pytest.mark.filterwarnings(
    "error::hypothesis.errors.HypothesisDeprecationWarning"
)
FUZZ = os.environ.get("JACUTIL_FUZZ", "") not in ("", "0")
# examples per test in the ci profile: this file in about two minutes with
# -n 2 on the 2-core machine, shared (measured 2026-12-01: 4-8 s an example,
# load 4; see tests/README-generated.md)
CI_EXAMPLES = {"reverse": 12, "forward": 12, "losses": 15, "curvature": 8,
               "private": 8}  # fmt: skip

_common = {
    "deadline": None,
    "database": None,
    "print_blob": True,
    "suppress_health_check": list(HealthCheck),
}
SHRINK = os.environ.get("JACUTIL_SHRINK", "") not in ("", "0")
settings.register_profile(
    "ci",
    derandomize=True,
    phases=list(Phase) if SHRINK else [Phase.explicit, Phase.reuse, Phase.generate],
    **_common,
)
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("JACUTIL_FUZZ_EXAMPLES", "500")),
    **_common,
)
PROFILE = settings.get_profile("fuzz" if FUZZ else "ci")


def budget(family):
    """This module's settings for a test of ``family`` (not loaded globally:
    other Hypothesis tests keep their own)."""
    if FUZZ:
        return settings(PROFILE)
    return settings(PROFILE, max_examples=CI_EXAMPLES[family])


TOLERANCE = {"float32": 1e-4, "float64": 1e-8}  # times max(1, the scale)


# --- failures, by entry and kind ----------------------------------------------

_FAILURES = {}


def failure(entry, kind):
    """An AssertionError subclass per (entry, kind): Hypothesis tells failures
    apart by their type and where they were raised, so each shows separately."""
    key = (entry.split("(")[0], kind)  # jvp(mode=...) is jvp
    if key not in _FAILURES:
        name = re.sub(r"\W+", "_", "_".join(key)).strip("_")
        _FAILURES[key] = type(name, (AssertionError,), {"__module__": __name__})
    return _FAILURES[key]


def features(case, model, variables):
    """What a refusal of this case may name: the program's words, the
    layers' names and types, the variables' names."""
    found = set(case.features)
    for layer in layers_within(model, include_self=False):
        found |= {layer.name} | stems(type(layer).__name__)
    found |= {v.name for v in variables} | {v.path for v in variables}
    return found


def run(entry, call, known):
    """``call()``, or None when it refuses clearly; a crash is a failure."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return call()
    except Exception as error:  # noqa: BLE001 - sorted into refusal or crash
        if clear_refusal(error, known):
            note(f"{entry} refused: {type(error).__name__}: {error}")
            return None
        raise failure(entry, "crash")(
            f"{entry} raised {type(error).__name__}: {error}"
        ) from error


def _owner(index, variables):
    sizes = np.cumsum([int(np.prod(v.shape)) for v in variables])
    j = int(np.searchsorted(sizes, index, side="right"))
    return variables[j].path if j < len(variables) else "?"


def assert_close(entry, got, expected, dtype, scale, variables=None):
    """``got`` equals ``expected`` within TOLERANCE[dtype] * max(1, scale)."""
    got = np.asarray(got)
    if got.shape != expected.shape:
        raise failure(entry, "shape")(
            f"{entry}: shape {got.shape}, the tape's is {expected.shape}"
        )
    allowed = TOLERANCE[dtype] * max(1.0, float(scale))
    error = np.abs(got.astype(np.float64) - expected)
    if np.all(error <= allowed):  # NaN fails
        return
    where = np.unravel_index(np.nanargmax(np.where(np.isnan(error), np.inf, error)),
                             error.shape)  # fmt: skip
    column = ""
    if variables is not None and got.ndim >= 2:
        column = f" (column of {_owner(where[-1], variables)})"
    raise failure(entry, "wrong")(
        f"{entry}: off by {np.nanmax(error):.3g} (allowed {allowed:.3g}) at "
        f"{tuple(int(i) for i in where)}{column}: got {got[where]!r}, the tape "
        f"gives {expected[where]!r}; {int(np.sum(~(error <= allowed)))} of "
        f"{error.size} entries differ"
    )


# --- building a case ----------------------------------------------------------


def build(case):
    """The case's namespace, its reference Jacobian and the entries' options."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ns = case.build()
    model, variables = ns["model"], ns["variables"]
    note(f"n_params = {sum(int(np.prod(v.shape)) for v in variables)}")
    explicit = "model.weights[" in case.source
    ns["options"] = {"variables": variables} if explicit else {}
    ns["known"] = features(case, model, variables)
    return ns


def reference(case, ns, compute=None):
    """The tape's answer; an example Keras itself cannot run on its batch (a
    Softmax layer under an Embedding's mask, say) or that overflows is drawn
    again."""
    compute = compute or (lambda: tape_jacobian(ns["model"], ns["x"], ns["variables"]))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs_on_its_batch(ns["model"], ns["x"])
            answer = compute()
    except Exception as error:  # noqa: BLE001 - the model, not jacutil
        note(f"the model itself fails: {type(error).__name__}: {error}")
        reject()
    assume(np.all(np.isfinite(answer)))
    return answer


# --- the tests ----------------------------------------------------------------


def check_reverse(case):
    ns = build(case)
    J = reference(case, ns)
    model, x, options, known = ns["model"], ns["x"], ns["options"], ns["known"]
    scale = np.abs(J).max(initial=0)
    chunk = ns["chunk_size"]
    entries = {
        "jacobian": lambda: ju.jacobian(model, x, **options),
        "jacobian(out=, explain=True)": lambda: ju.jacobian(
            model, x, out=np.empty(J.shape, case.dtype), explain=True, **options
        )[0],
    }
    for method in ("per_sample", "rules"):
        entries[f"chunked_jacobian({method}, chunk_size={chunk})"] = (
            lambda method=method: ju.chunked_jacobian(
                model, x, chunk_size=chunk, method=method, progress=False, **options
            )
        )
    for entry, call in entries.items():
        got = run(entry, call, known)
        if got is not None:
            assert_close(entry, got, J, case.dtype, scale, ns["variables"])
    check_curvature(case, ns, J)


def check_curvature(case, ns, J):
    """G's diagonal, G v and the NTK (squared error: H = I) against the
    tape's J: ``sum J^2`` over rows, ``J.T (J v)`` and ``J J.T``."""
    from jacutil.curvature import diagonal, ggn, ntk

    model, x, options, known = ns["model"], ns["x"], ns["options"], ns["known"]
    rows = J.reshape(-1, J.shape[-1]).astype(np.float64)
    v = np.random.default_rng(0).standard_normal(rows.shape[1])
    entries = {
        "ggn_diagonal": (
            lambda: diagonal.ggn_diagonal(model, x, **options),
            np.einsum("rp,rp->p", rows, rows),
        ),
        "ggn_operator": (
            lambda: ggn.ggn_operator(model, x, **options) @ v,
            rows.T @ (rows @ v),
        ),
        "empirical_ntk": (
            lambda: ntk.empirical_ntk(model, x, **options),
            rows @ rows.T,
        ),
    }
    for entry, (call, expected) in entries.items():
        got = run(entry, call, known)
        if got is not None:
            scale = np.abs(expected).max(initial=0)
            assert_close(entry, got, expected, case.dtype, scale)
    if isinstance(model, ju.keras.Sequential):  # KFAC's models
        check_kfac_step(case, ns, rows)


def check_kfac_step(case, ns, rows):
    """Levenberg-Marquardt's KFAC-preconditioned CG step solves the damped
    Gauss-Newton system of the tape's J, ``(J.T J + damping I) s = -J.T r``,
    to CG's tolerance (relative residual 1e-5; float32 products: 1e-4), with
    the damping a tenth of the largest diag(J.T J) (conditioning below 11)."""
    from jacutil.fitting.gauss_newton import GaussNewtonProducts

    model, x, options, known = ns["model"], ns["x"], ns["options"], ns["known"]
    n = len(x)
    damping = 0.1 * np.einsum("rp,rp->p", rows, rows).max(initial=0)
    y = np.zeros((n, rows.shape[0] // n))
    if not damping > 0:
        return

    def step():
        problem = ju.least_squares_problem(
            model, x, y, jacobian="operator", **options
        )
        system = GaussNewtonProducts(problem, problem.theta0, 100, "kfac")
        return system.step(damping), problem.fun(problem.theta0)

    got = run("levenberg_marquardt_kfac", step, known)
    if got is None:
        return
    s, r = got
    b = rows.T @ r
    if not np.linalg.norm(b) > 0:
        return
    residual = rows.T @ (rows @ s) + damping * s + b
    relative = np.linalg.norm(residual) / np.linalg.norm(b)
    bound = 1.01e-5 if case.dtype == "float64" else 1e-4
    if not relative <= bound:
        raise failure("levenberg_marquardt_kfac", "value")(
            f"the KFAC-preconditioned step leaves a relative residual {relative:.2e} "
            f"of the damped system (bound {bound:g})"
        )


@budget("reverse")
@given(case=st.one_of(chain_cases(), wide_cases()))
def test_reverse_entries_on_chains(case):
    check_reverse(case)


@budget("reverse")
@given(case=graph_cases())
def test_reverse_entries_on_graphs(case):
    check_reverse(case)


def check_forward(case, data):
    ns = build(case)
    J = reference(case, ns)
    model, x, options, known = ns["model"], ns["x"], ns["options"], ns["known"]
    variables = ns["variables"]
    n, n_outputs, m = J.shape
    columns = data.draw(st.sampled_from([64, 3]), label="columns_per_pass")
    mode = data.draw(st.sampled_from(["forward", "double_backward"]), label="mode")
    chunk = data.draw(st.sampled_from([None, ns["chunk_size"]]), label="chunk_size")
    rng = np.random.default_rng(n * 1000 + m)
    v = rng.standard_normal(m).astype(case.dtype)
    u = rng.standard_normal((n, n_outputs)).astype(case.dtype)
    V = rng.standard_normal((m, 2)).astype(case.dtype)
    absJ = np.abs(J)

    entry = f"forward_jacobian(columns_per_pass={columns})"
    got = run(entry, lambda: ju.forward_jacobian(
        model, x, columns_per_pass=columns, **options), known)  # fmt: skip
    if got is not None:
        assert_close(entry, got, J, case.dtype, absJ.max(initial=0), variables)

    products = {"mode": mode, "chunk_size": chunk, **options}
    entry = f"jvp(mode={mode!r}, chunk_size={chunk})"
    got = run(entry, lambda: ju.jvp(model, x, v, **products), known)
    if got is not None:
        scale = (absJ @ np.abs(v)).max(initial=0)
        assert_close(entry, got, J @ v, case.dtype, scale)

    entry = f"vjp(chunk_size={chunk})"
    got = run(entry, lambda: ju.vjp(model, x, u, **{**products, "mode": "forward"}),
              known)  # fmt: skip
    expected = np.einsum("nlm,nl->m", J, u)
    scale = np.einsum("nlm,nl->m", absJ, np.abs(u)).max(initial=0)
    if got is not None:
        assert_close(entry, got, expected, case.dtype, scale)

    entry = "jacobian_operator"
    operator = run(entry, lambda: ju.jacobian_operator(model, x, **options), known)
    if operator is None:
        return
    rows = J.reshape(n * n_outputs, m)
    for name, call, want, bound in [
        ("matvec", lambda: operator.matvec(v), rows @ v, np.abs(rows) @ np.abs(v)),
        ("rmatvec", lambda: operator.rmatvec(u.reshape(-1)), expected,
         np.abs(rows).T @ np.abs(u.reshape(-1))),
        ("matmat", lambda: operator.matmat(V), rows @ V, np.abs(rows) @ np.abs(V)),
    ]:  # fmt: skip
        got = run(f"{entry}.{name}", call, known)
        if got is not None:
            assert_close(f"{entry}.{name}", got, want, case.dtype,
                         bound.max(initial=0))  # fmt: skip


@budget("forward")
@given(case=chain_cases(), data=st.data())
def test_forward_entries_on_chains(case, data):
    check_forward(case, data)


@budget("forward")
@given(case=graph_cases(), data=st.data())
def test_forward_entries_on_graphs(case, data):
    check_forward(case, data)


@budget("losses")
@given(case=loss_cases())
def test_per_sample_gradients_with_keras_losses(case):
    ns = build(case)
    model, x, y, loss = ns["model"], ns["x"], ns["y"], ns["loss"]
    options, known, variables = ns["options"], ns["known"], ns["variables"]
    G = reference(case, ns, lambda: tape_loss_gradients(model, loss, x, y, variables))
    scale = np.abs(G).max(initial=0)
    entry = "per_sample_gradients"
    got = run(entry, lambda: ju.per_sample_gradients(model, loss, x, y, **options),
              known)  # fmt: skip
    if got is not None:
        assert_close(entry, got, G, case.dtype, scale, variables)
    entry = "per_sample_gradient_norms"
    got = run(entry, lambda: ju.per_sample_gradient_norms(
        model, loss, x, y, **options), known)  # fmt: skip
    if got is not None:
        norms = np.linalg.norm(G, axis=1)
        assert_close(entry, got, norms, case.dtype, norms.max(initial=0))
    check_dp_step(case, ns, G)


def check_dp_step(case, ns, G):
    """One DP-SGD step with no noise and C the median norm: every sample's
    contribution ``w_i g_i`` to the clipped sum has norm at most C (the
    guarantee DP-SGD rests on), and the update is ``sum_i w_i g_i / n``,
    both from the tape's per-sample gradients."""
    from jacutil.privacy.dp_sgd import DPSGD

    if ns["options"]:  # DPSGD trains the trainable variables, no others
        return
    model, x, y, loss, known = ns["model"], ns["x"], ns["y"], ns["loss"], ns["known"]
    norms = np.linalg.norm(G, axis=1)
    clip = float(np.median(norms))
    if not clip > 0:
        return
    entry = "DPSGD"
    sgd = ju.keras.optimizers.SGD(1.0)
    dp = run(entry, lambda: DPSGD(model, loss, sgd, l2_norm_clip=clip,
                                  noise_multiplier=0.0), known)  # fmt: skip
    if dp is None:
        return
    weights = run("DPSGD.clip_weights", lambda: dp.clip_weights(x, y), known)
    if weights is None:
        return
    slack = 1 + TOLERANCE[case.dtype]
    largest = float(np.linalg.norm(weights[:, None] * G, axis=1).max())
    if not largest <= clip * slack:
        raise failure(entry, "clip")(
            f"DPSGD: a sample's clipped contribution has norm {largest:.6g} > C = "
            f"{clip:.6g}: the clip bound is broken"
        )
    check_private_fit(case, ns, G, clip)
    check_per_layer_step(case, ns, G)
    reference = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
    expected = (reference[:, None] * G).sum(axis=0) / len(G)
    scale = np.abs(G).max(initial=0)
    saved = model.get_weights()
    # rate 1: every sample, in the fused step (book-keeping where the layers
    # allow), then put back for DPSGD.step (the eager path) from the same point
    entry = "DPSGD.sampled_step"
    before = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])
    if run(entry, lambda: dp.sampled_step(x, y, len(G)), known) is None:
        return
    after = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])
    model.set_weights(saved)
    way = "bookkept" if dp.bookkept else "fused" if dp._fused[2] else "eager"
    assert_close(f"{entry} ({way})", before - after, expected, case.dtype, scale)
    event(f"DPSGD.sampled_step checked ({way})")
    if run("DPSGD.step", lambda: dp.step(x, y), known) is None:
        return
    after = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])
    assert_close("DPSGD.step", before - after, expected, case.dtype, scale)


def clip_groups_of(model):
    """Two groups of the layers that own the trainable variables (each
    variable's smallest owning layer), as ``l2_norm_clip`` keys, and each
    group's columns of G; None where those layers' variables overlap."""
    from jacutil.core.internals import layers_within

    variables = model.trainable_variables
    owners = [layer for layer in layers_within(model, include_self=False)
              if layer.trainable_variables]  # fmt: skip
    owner_of = {}
    for v in variables:
        having = [layer for layer in owners
                  if any(w is v for w in layer.trainable_variables)]  # fmt: skip
        if not having:
            return None
        owner_of[id(v)] = min(having, key=lambda layer: len(layer.trainable_variables))
    named = list({id(layer): layer for layer in owner_of.values()}.values())
    if sum(len(layer.trainable_variables) for layer in named) != len(variables):
        return None  # an owner holds another's variables too
    if len({layer.name for layer in named}) != len(named):
        return None
    halves = [named[: (len(named) + 1) // 2], named[(len(named) + 1) // 2 :]]
    sizes = np.cumsum([0] + [int(np.prod(v.shape)) for v in variables])
    groups = []
    for half in filter(None, halves):
        ids = {id(w) for layer in half for w in layer.trainable_variables}
        spans = [np.arange(sizes[j], sizes[j + 1])
                 for j, v in enumerate(variables) if id(v) in ids]  # fmt: skip
        columns = np.concatenate(spans)
        groups.append((tuple(layer.name for layer in half), columns))
    return groups


def secure_case(case):
    """Whether a drawn program's DP checks run in ``secure_mode`` (sampling
    and noise from ``os.urandom``, through ``tf.numpy_function`` in the
    graph): half the programs, chosen by the program's text, so that a
    printed failure repeats in the same mode."""
    return zlib.crc32(case.source.encode()) % 2 == 1


def check_per_layer_step(case, ns, G):
    """DPSGD with a clip norm per group of layers (each C_g the median of
    its group's norms) and passes of about half the batch (gradient
    accumulation): with no noise and SGD(1.0) the update is
    ``sum_i sum_g min(1, C_g / |g_ig|) g_ig / n`` from the tape's G, and
    each group's clipped contribution is at most C_g. The weights are put
    back afterwards."""
    from jacutil.privacy.dp_sgd import DPSGD

    model, x, y, loss, known = ns["model"], ns["x"], ns["y"], ns["loss"], ns["known"]
    groups = clip_groups_of(model)
    if groups is None:
        event("per-layer DPSGD: owning layers overlap, not drawn")
        return
    clips, expected = {}, np.zeros(G.shape[1])
    for names, columns in groups:
        norms = np.linalg.norm(G[:, columns], axis=1)
        clips[names] = float(np.median(norms))
        if not clips[names] > 0:
            return
        scale = np.minimum(1.0, clips[names] / np.maximum(norms, 1e-300))
        expected[columns] = (scale[:, None] * G[:, columns]).sum(axis=0) / len(G)
    rows = max(1, len(G) // 2)
    secure = secure_case(case)
    entry = "DPSGD(per-layer, accumulated" + (", secure_mode)" if secure else ")")
    dp = run(entry, lambda: DPSGD(model, loss, ju.keras.optimizers.SGD(1.0),
                                  l2_norm_clip=clips, noise_multiplier=0.0,
                                  max_physical_batch_size=rows,
                                  secure_mode=secure), known)  # fmt: skip
    if dp is None:
        return
    saved = model.get_weights()
    before = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])
    try:
        # rate 1: every sample, in passes of ``rows`` (fused where it can)
        if run(entry, lambda: dp.sampled_step(x, y, len(G)), known) is None:
            return
        after = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])
    finally:
        model.set_weights(saved)
    np.testing.assert_array_equal(dp.last_index[: len(G)], np.arange(len(G)))
    weights = np.asarray(dp.last_weights).reshape(-1, len(groups))[: len(G)]
    for g, (names, columns) in enumerate(groups):
        contribution = np.linalg.norm(weights[:, g : g + 1] * G[:, columns], axis=1)
        if not contribution.max() <= clips[names] * (1 + TOLERANCE[case.dtype]):
            raise failure(entry, "clip")(
                f"{entry}: group {names}'s clipped contribution has norm "
                f"{contribution.max():.6g} > C_g = {clips[names]:.6g}"
            )
    assert_close(entry, before - after, expected, case.dtype, np.abs(G).max(initial=0))
    fused = "fused" if dp._fused[2] is not None else "eager"
    event(f"per-layer DPSGD ({fused}{', secure_mode' if secure else ''}): "
          f"{len(groups)} group(s), passes of {rows} row(s)")


def check_private_fit(case, ns, G, clip):
    """make_private's ``model.fit`` (issue 36): one epoch of one step at
    rate 1 (every sample in its batch), learning rate 0 (the model stays).
    The clip weights its step used are ``min(1, C / |g_i|)`` of the tape's
    gradients: the clip invariant inside Keras's fit. In ``secure_mode``
    (:func:`secure_case`) the sampling and the noise come from ``os.urandom``
    inside the same step; at rate 1 every sample is still drawn."""
    from jacutil.privacy import make_private

    model, x, y, loss, known = ns["model"], ns["x"], ns["y"], ns["loss"], ns["known"]
    n = len(G)
    model.compile(ju.keras.optimizers.SGD(0.0), loss)
    # the gradients of Keras's own loss, which make_private clips: its
    # compiled loss computes in float32, even in a float64 model
    G = reference(case, ns, lambda: keras_loss_gradients(model, x, y))
    tolerance = "float32"
    secure = secure_case(case)
    entry = "make_private" + ("(secure_mode)" if secure else "")
    training = run(entry, lambda: make_private(
        model, epsilon=8.0, delta=0.1 / n, l2_norm_clip=clip, batch_size=n,
        epochs=1, train_size=n, accountant="rdp", verbose=False,
        secure_mode=secure), known)  # fmt: skip
    if training is None:
        return
    training = training.privacy  # make_private gives the model back
    if run("model.fit (private)", lambda: model.fit(x, y, verbose=0), known) is None:
        return
    index, used = training.dpsgd.last_index, training.dpsgd.last_weights
    np.testing.assert_array_equal(index, np.arange(n))  # rate 1: every sample
    norms = np.linalg.norm(G, axis=1)
    expected = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
    assert_close("model.fit (private): clip weights", used, expected, tolerance, 1.0)
    largest = float(np.linalg.norm(used[:, None] * G, axis=1).max())
    if not largest <= clip * (1 + TOLERANCE[tolerance]):
        raise failure(entry, "clip")(
            f"model.fit (private): a sample's clipped contribution has norm "
            f"{largest:.6g} > C = {clip:.6g}: the clip bound is broken"
        )
    assert training.steps == 1
    assert training.dpsgd.secure_mode == secure
    fused = training.dpsgd._fused[2] is not None
    way = ("fused" if fused else "eager") + (", secure_mode" if secure else "")
    event(f"make_private: fit's clip weights checked ({way})")


def check_curvature_losses(case):
    """G v, G's diagonal, H v and Laplace's diagonal posterior precision for
    Keras losses, one per head, against ``J.T H J`` from the tape's J and
    the loss's Hessian at the outputs by nested float64 tapes, and H v by
    reverse over reverse."""
    from jacutil.curvature import diagonal, fisher, ggn, hessian, laplace

    ns = build(case)
    model, x, options, known = ns["model"], ns["x"], ns["options"], ns["known"]
    loss, y, weights = ns["loss"], ns["y"], ns["sample_weight"]
    J = reference(case, ns).astype(np.float64)
    H = reference(case, ns, lambda: output_hessians(model, x, loss, y, weights))
    G = np.einsum("nkp,nkj,njq->pq", J, H, J)
    v = np.random.default_rng(1).standard_normal(G.shape[0])
    given = {"y": y, "sample_weight": weights, **options}
    hv = reference(case, ns, lambda: loss_hessian_product(
        model, x, loss, y, weights, ns["variables"], v))  # fmt: skip
    entries = {
        "ggn_operator(loss)": (
            lambda: ggn.ggn_operator(model, x, loss, **given) @ v, G @ v,
            np.abs(G) @ np.abs(v)),
        "ggn_diagonal(loss)": (
            lambda: diagonal.ggn_diagonal(model, x, loss, **given), np.diag(G),
            np.abs(np.diag(G))),
        "hessian_operator(loss)": (
            lambda: hessian.hessian_operator(
                model, x, y, loss, sample_weight=weights, **options) @ v,
            hv, np.abs(hv)),
    }  # fmt: skip
    P = np.einsum("nkp,nk->np", J, reference(case, ns, lambda: fisher_rows(
        model, x, loss, y, weights)))  # each sample's weighted gradient  # fmt: skip
    F = P.T @ P
    entries["empirical_fisher_operator(loss)"] = (
        lambda: fisher.empirical_fisher_operator(model, x, y, loss,
                                                 sample_weight=weights,
                                                 **options) @ v,
        F @ v, np.abs(P.T) @ np.abs(P @ v))  # fmt: skip
    entries["empirical_fisher_diagonal(loss)"] = (
        lambda: fisher.empirical_fisher_diagonal(model, x, y, loss,
                                                 sample_weight=weights,
                                                 **options),
        np.diag(F), np.diag(F))  # fmt: skip
    if weights is None:  # Laplace: the likelihood is summed over the data
        H_sum = reference(case, ns, lambda: output_hessians(
            model, x, loss, y, None, summed=True))  # fmt: skip
        diagonal_sum = np.einsum("nkp,nkj,njp->p", J, H_sum, J)
        entries["laplace(diagonal).posterior_precision"] = (
            lambda: laplace.laplace(model, x, y, loss, "diagonal",
                                    **options).posterior_precision(),
            diagonal_sum + 1.0, np.abs(diagonal_sum) + 1.0)  # fmt: skip
        entries.update(last_layer_entries(ns, J, H_sum))
    for entry, (call, expected, bound) in entries.items():
        got = run(entry, call, known)
        if got is not None:
            assert_close(entry, got, expected, case.dtype, bound.max(initial=0))


def last_layer_entries(ns, J, H_sum):
    """Laplace over the last layer (over one Dense layer J* is never formed:
    ``jacobian_form == "dense"``): its posterior precision and predictive
    variance at the training inputs, against the tape's J restricted to the
    last layer's columns, ``P = J.T H J + I`` and ``J P^-1 J.T`` in float64.
    A model with several heads has no one last layer: no entries."""
    from jacutil.curvature import laplace

    model, x, y, loss = ns["model"], ns["x"], ns["y"], ns["loss"]
    options, variables = ns["options"], ns["variables"]
    try:
        last = options.get("variables") or laplace.last_layer_variables(model, x)
    except ValueError:  # several heads: laplace() asks for last_layer=
        return {}
    starts = np.cumsum([0] + [int(np.prod(v.shape)) for v in variables])
    at = {id(v): k for k, v in enumerate(variables)}
    columns = np.concatenate(
        [np.arange(starts[at[id(v)]], starts[at[id(v)] + 1]) for v in last]
    )
    J_last = J[:, :, columns]
    P = np.einsum("nkp,nkj,njq->pq", J_last, H_sum, J_last) + np.eye(len(columns))
    variance = np.einsum("nkp,pq,njq->nkj", J_last, np.linalg.inv(P), J_last)

    def fitted():
        posterior = laplace.laplace(model, x, y, loss, "last_layer", **options)
        event(f"laplace(last_layer): J* {posterior.jacobian_form}")
        return posterior

    return {
        "laplace(last_layer).posterior_precision": (
            lambda: fitted().posterior_precision(), P, np.abs(P)),
        "laplace(last_layer).predictive_variance": (
            lambda: fitted().predictive_variance(x), variance,
            np.abs(variance) + 1.0),
    }  # fmt: skip


@budget("curvature")
@given(case=head_cases())
def test_curvature_with_keras_losses_per_head(case):
    check_curvature_losses(case)


def private_step(model, x, y, G, clip, entry, known, epsilon):
    """One ``make_private`` fit of one step at rate 1 (every sample), with no
    noise and SGD(1.0): the update must be ``sum_i min(1, C/|g_i|) g_i / D``
    from the tape's ``G``, D what Keras's batch loss divides the samples'
    sum by (n for a mean, 1 for ``reduction="sum"``). Returns the model's
    privacy handle, the update and the expected one, or None when it refused
    clearly."""
    from jacutil.privacy import make_private
    from jacutil.privacy.keras_loss import LossCouplesSamples

    n = len(G)
    divisor = keras_batch_divisor(model, x, y, G)
    made = run(entry, lambda: make_private(
        model, epsilon=epsilon, delta=0.1 / n, l2_norm_clip=clip, batch_size=n,
        epochs=1, train_size=n, accountant="rdp", verbose=False), known)  # fmt: skip
    if made is None:
        return None
    assert made is model
    if divisor is None:  # Keras's batch loss is neither mean nor sum: refused
        with pytest.raises(LossCouplesSamples):
            model.fit(x, y, verbose=0)
        assert model.privacy.steps == 0
        event("make_private: a loss coupling the samples refused")
        return None
    # no noise in the step (traced after this), sigma still in the ledger
    model.privacy.dpsgd.switch_noise_off_unaccounted()
    before = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])
    if run(f"{entry}: model.fit", lambda: model.fit(x, y, verbose=0), known) is None:
        return None
    after = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])
    norms = np.linalg.norm(G, axis=1)
    weights = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
    expected = (weights[:, None] * G).sum(axis=0) / divisor
    return model.privacy, before - after, expected


def check_make_private(case, extras):
    """make_private on a head case's model as Keras compiles it (issue 54):
    its loss per head, drawn ``loss_weights``, a layer's ``add_loss`` on
    every output, mixed precision (float32 programs), and a second
    make_private after the first fit, each step against the per-sample
    tape of Keras's own loss (:func:`tests.generated.keras_loss_gradients`),
    and the second call's epsilon composed with the first's."""
    from jacutil.privacy.accounting import epsilon_of

    mixed = extras["mixed"] and case.dtype == "float32"
    if mixed:
        ju.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        ns = build(case)
    finally:
        ju.keras.mixed_precision.set_global_policy("float32")
    model, x, y, loss, known = ns["model"], ns["x"], ns["y"], ns["loss"], ns["known"]
    heads = len(ju.tf.nest.flatten(model.output))
    if extras["add_loss"]:  # the model inside one that adds a loss per output
        inputs = [ju.keras.Input(t.shape[1:], dtype=t.dtype) for t in model.inputs]
        inputs = inputs[0] if len(inputs) == 1 else inputs
        outputs = ju.keras.tree.map_structure(SampleLoss(), model(inputs))
        model = ju.keras.Model(inputs, outputs)
    weights = None
    if extras["weights"] is not None:
        weights = extras["weights"][:heads] if heads > 1 else extras["weights"][0]
        if isinstance(loss, dict):
            weights = dict(zip(sorted(loss), extras["weights"], strict=False))
    model.compile(ju.keras.optimizers.SGD(1.0), loss, loss_weights=weights)
    features_of = {"mixed precision" if mixed else "", "add_loss", "loss_weights"}
    known = known | {f for f in features_of if f}
    G = reference(case, ns, lambda: keras_loss_gradients(model, x, y))
    clip = float(np.median(np.linalg.norm(G, axis=1)))
    assume(clip > 0)
    # Keras's compiled loss computes in float32 even in a float64 model;
    # mixed precision's forward pass in float16
    dtype, slack = ("float32", 200.0) if mixed else ("float32", 1.0)
    scale = np.abs(G).max(initial=0) * slack
    entry = "make_private" + (" (mixed precision)" if mixed else "")
    found = private_step(model, x, y, G, clip, entry, known, 8.0)
    if found is None:
        return
    training, moved, expected = found
    way = "general" if training.loss.reads_forward else "fused"
    assert_close(f"{entry}: the step ({way})", moved, expected, dtype, scale)
    event(f"make_private checked ({way}{', mixed' if mixed else ''}"
          f"{', add_loss' if extras['add_loss'] else ''})")  # fmt: skip
    if not extras["again"]:
        return
    first = training.ledger.events
    G = reference(case, ns, lambda: keras_loss_gradients(model, x, y))
    found = private_step(model, x, y, G, clip, "make_private (again)", known, 16.0)
    if found is None:
        return
    training, moved, expected = found
    assert_close("make_private (again): the step", moved, expected, dtype, scale)
    events = training.ledger.events
    assert sum(events.values()) == 2 and all(k in events for k in first)
    composed = epsilon_of(None, events, training.delta, "rdp")
    assert training.epsilon() == composed  # both calls' steps
    event("make_private again: the ledger composed")


@budget("private")
@given(
    case=head_cases(),
    extras=st.fixed_dictionaries({
        "weights": st.none() | st.lists(st.sampled_from([0.5, 1.0, 2.0]),
                                        min_size=2, max_size=2),
        "add_loss": st.booleans(),
        "mixed": st.booleans(),
        "again": st.booleans(),
    }),
)  # fmt: skip
def test_make_private_on_kerass_own_loss(case, extras):
    check_make_private(case, extras)


# --- the instrument itself ----------------------------------------------------


def test_clear_refusal_tells_refusals_from_crashes():
    named = {"Conv2D", "groups", "group"}
    assert clear_refusal(JacobianError("a grouped convolution (groups=2)"), named)
    assert not clear_refusal(JacobianError("something went wrong"), named)
    with pytest.raises(ValueError) as raised:  # jacutil's own check
        ju.chunked_jacobian(lambda t: t, np.zeros((2, 2)), variables=[], chunk_size=1)
    assert clear_refusal(raised.value, {"variables"})
    assert not clear_refusal(KeyError("groups"), named)
    op_error = ju.tf.errors.InvalidArgumentError(None, None, "groups")
    assert not clear_refusal(op_error, named)
    with pytest.raises(Exception) as raised:  # noqa: B017 - raised inside TensorFlow
        ju.tf.reshape(ju.tf.zeros([3]), [2])
    assert not clear_refusal(raised.value, {"reshape", "Reshape"})


@pytest.mark.parametrize(
    "strategy", [chain_cases, graph_cases, loss_cases, wide_cases, head_cases]
)
def test_generated_programs_run_as_printed(strategy):
    """A case's printed program is a standalone reproduction."""

    @settings(PROFILE, max_examples=3, derandomize=True)
    @given(case=strategy())
    def runs(case):
        from tests import generated

        ns = {k: v for k, v in vars(generated).items() if k != "dtype"}
        exec(case.source, ns)  # noqa: S102
        ns["model"](ns["x"])

    runs()
