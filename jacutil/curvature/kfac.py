"""Kronecker-factored curvature (KFAC) of the layers whose rule says
``kronecker_factors`` - Dense, and Conv2D with one group
(notebook 11-curvature-and-uncertainty).

A Dense layer's per-sample gradient for signal c is the outer product
``a_bar (x) delta_c``: its input with a 1 for the bias (``a_bar``, length
d_in + 1) and the signal at its pre-activation output (``delta_c``, d_out),
the backward pass started from column c of ``S_i`` (``H_i = S_i S_i.T``).
G's block for the layer, ``sum_i sum_c (a_bar a_bar.T) (x) (delta delta.T)``,
is approximated by a Kronecker product of two small matrices::

    A = (1 / (n R)) sum a_bar a_bar.T      (d_in + 1) x (d_in + 1)
    B = sum delta delta.T                   d_out x d_out

(sums over samples, signals c and the R output positions of a convolution,
whose ``a_bar`` are its input patches: "KFAC-expand"). With one sample and
one position it is exact. ``(A (x) B) vec(V) = vec(A V B)`` for the layer's
parameters laid out as V = [kernel; bias], (d_in + 1) x d_out, so a product
costs two small matrix products, and the damped inverse
``(A (x) B + lambda I)^-1`` is exact through the eigendecompositions of A and
B. Parameters outside Dense and Conv2D layers get G's exact diagonal.

The layers are replayed one by one, so the model must be a
``keras.Sequential`` (any layers). What a layer's factors are made of - its
inputs as rows and its output before the activation - its rule says
(:class:`jacutil.rules.dense.KernelRule`).
"""

from dataclasses import dataclass, field

import numpy as np

from ..core._shared import sizes_of
from ..core._tf import keras, tf
from ..core.cache import PerSignature
from ..core.data import read_data
from ..core.formulation import quiet_function
from ..core.planner import plan_chunks, sum_chunks
from ..core.target import resolve_target, variable_list
from ..rules.registry import rule_for
from .compiled import curvature_for, curvature_inputs
from .diagonal import ggn_diagonal


@dataclass
class LayerFactors:
    """The Kronecker factors of one layer.

    Args:
        name: the layer's name.
        A: the input covariance with the bias column, (d_in + 1) x (d_in + 1)
            (d_in x d_in for a layer without bias).
        B: the output-signal covariance, d_out x d_out.
        kernel: the kernel's slice of the flat parameters.
        bias: the bias's slice, or None.
    """

    name: str
    A: np.ndarray
    B: np.ndarray
    kernel: slice
    bias: slice | None
    _eig: tuple | None = field(default=None, repr=False)

    def as_matrix(self, v):
        """The layer's part of flat vectors ``v`` (m, k): V, (d_in+1, d_out, k)."""
        d_out = self.B.shape[0]
        K = v[self.kernel].reshape(-1, d_out, v.shape[1])
        if self.bias is None:
            return K
        return np.concatenate([K, v[self.bias][None]], axis=0)

    def put(self, out, V):
        """Write V (d_in+1, d_out, k) back into the flat vectors ``out`` (m, k)."""
        rows = V.shape[0] - (self.bias is not None)
        out[self.kernel] = V[:rows].reshape(-1, V.shape[2])
        if self.bias is not None:
            out[self.bias] = V[rows]

    def eig(self):
        """``(eA, QA, eB, QB)``, computed once."""
        if self._eig is None:
            eA, QA = np.linalg.eigh(self.A)
            eB, QB = np.linalg.eigh(self.B)
            self._eig = (np.clip(eA, 0, None), QA, np.clip(eB, 0, None), QB)
        return self._eig


class KFAC:
    """KFAC of G: Kronecker blocks for Dense and Conv2D layers, G's exact
    diagonal for every other parameter. See :func:`kfac`.

    Args:
        factors: one :class:`LayerFactors` per factored layer.
        rest: the flat indices of the other parameters.
        rest_diagonal: G's diagonal on them.
        n_params: m.
    """

    def __init__(self, factors, rest, rest_diagonal, n_params):
        self.factors = factors
        self.rest = np.asarray(rest, dtype=np.int64)
        self.rest_diagonal = np.asarray(rest_diagonal, dtype=np.float64)
        self.n_params = n_params

    def _columns(self, v):
        v = np.asarray(v, dtype=np.float64)
        if v.shape[0] != self.n_params or v.ndim > 2:
            raise ValueError(
                f"v has shape {v.shape}; it must be (m,) or (m, k) with m = "
                f"{self.n_params:,} (one number per parameter)."
            )
        return v.reshape(self.n_params, -1), v.ndim == 1

    def matvec(self, v):
        """``KFAC @ v``, of v's shape, for flat parameter vectors v
        (``flat_params`` order) of shape (m,) or (m, k)."""
        v, flat = self._columns(v)
        out = np.zeros_like(v)
        for f in self.factors:
            V = f.as_matrix(v)
            f.put(out, np.einsum("ab,bdk,de->aek", f.A, V, f.B, optimize=True))
        out[self.rest] = self.rest_diagonal[:, None] * v[self.rest]
        return out[:, 0] if flat else out

    def inverse_matvec(self, v, damping):
        """``(KFAC + damping * I)^-1 @ v``, exact for this KFAC, of v's shape
        (as :meth:`matvec`); ``damping`` a positive number."""
        if not damping > 0:
            raise ValueError(f"damping must be positive; got {damping}.")
        v, flat = self._columns(v)
        out = np.zeros_like(v)
        for f in self.factors:
            eA, QA, eB, QB = f.eig()
            V = np.einsum("ba,bdk,de->aek", QA, f.as_matrix(v), QB, optimize=True)
            V /= (eA[:, None] * eB[None, :] + damping)[:, :, None]
            f.put(out, np.einsum("ab,bdk,ed->aek", QA, V, QB, optimize=True))
        out[self.rest] = v[self.rest] / (self.rest_diagonal[:, None] + damping)
        return out[:, 0] if flat else out

    def logdet(self, damping):
        """``log det(KFAC + damping * I)``, a float; ``damping`` positive."""
        total = float(np.sum(np.log(self.rest_diagonal + damping)))
        for f in self.factors:
            eA, _, eB, _ = f.eig()
            total += float(np.sum(np.log(np.outer(eA, eB) + damping)))
        return total

    def to_dense(self):
        """The m x m matrix (small models only: plots and tests)."""
        return self.matvec(np.eye(self.n_params))

    def as_operator(self):
        """A symmetric ``scipy.sparse.linalg.LinearOperator`` (m, m)."""
        from scipy.sparse.linalg import LinearOperator

        m = self.n_params
        return LinearOperator(
            (m, m), matvec=self.matvec, rmatvec=self.matvec, matmat=self.matvec,
            dtype=np.float64,
        )  # fmt: skip


def _refuse(model):
    if not isinstance(model, keras.Sequential):
        raise ValueError(
            f"kfac() replays a keras.Sequential layer by layer; {type(model).__name__} "
            "is not one. Use ggn_diagonal() or ggn_operator() for this model."
        )


class _Replay:
    """The compiled sums of one chunk: per factored layer, ``a_bar.T a_bar``,
    the number of rows, and ``sum_c delta_c.T delta_c``."""

    def __init__(self, model, rules, loss):
        self.model, self.rules, self.loss = model, rules, loss
        self._factored = {id(rule.layer): rule for rule in rules}
        self._functions = PerSignature()
        self.trace_count = 0

    def forward(self, x):
        h, inputs, pre = x, [], []
        for layer in self.model.layers:
            rule = self._factored.get(id(layer))
            if rule is not None:
                inputs.append(h)
                pre.append(rule.pre_activation(h))
                h = layer.activation(pre[-1])
            else:
                h = layer(h, training=False)
        return tf.reshape(h, [-1, int(np.prod(h.shape[1:]))]), inputs, pre

    def sums(self, x, w, t=None):
        self.trace_count += 1  # Python side effect: runs once per trace
        with tf.GradientTape(persistent=True) as tape:
            f, inputs, pre = self.forward(x)
        S = tf.sqrt(w)[:, :, None] * self.loss.sqrt_hessian_tf(tf.stop_gradient(f), t)
        out = []
        for rule, a in zip(self.rules, inputs, strict=True):
            rows = rule.input_rows(a)
            out += [tf.matmul(rows, rows, transpose_a=True), tf.shape(rows)[0]]
        B = [0.0] * len(self.rules)
        for c in range(f.shape[1]):
            deltas = tape.gradient(f, pre, output_gradients=S[:, :, c])
            for j, delta in enumerate(deltas):
                delta = tf.reshape(delta, [-1, delta.shape[-1]])
                B[j] = B[j] + tf.matmul(delta, delta, transpose_a=True)
        return out, B, f

    def __call__(self, x, w, t=None):
        widths = None if t is None else tuple(a.shape[1] for a in t)
        specs = [
            tf.TensorSpec([None, *x.shape[1:]], x.dtype),
            tf.TensorSpec([None, w.shape[1]], x.dtype),
        ]
        args = [x, tf.constant(w)]
        if t is not None:
            specs.append([tf.TensorSpec([None, k], x.dtype) for k in widths])
            args.append([tf.constant(a) for a in t])
        function = self._functions.get(
            (tuple(x.shape[1:]), x.dtype.name, w.shape[1], widths),
            lambda: quiet_function(self.sums, input_signature=specs),
        )
        return function(*args)


def kfac(
    model, x, loss="squared_error", *, y=None, sample_weight=None, chunk_size=256,
    variables=None,
):  # fmt: skip
    """KFAC of G = sum_i w_i J_i.T H_i J_i for a ``keras.Sequential`` model.

    Introduced in ``11-curvature-and-uncertainty``. Layers whose rule says
    ``kronecker_factors`` (Dense; Conv2D with one group) and whose kernel
    (and bias) are among the variables get Kronecker factors;
    every other variable G's exact diagonal (:func:`ggn_diagonal`).

    Arguments as :func:`jacutil.curvature.ggn.ggn_operator`, except: the
    model must be a ``keras.Sequential`` and ``x`` one array;
    ``sample_weight`` weights each sample's signals (B) while the input
    covariance A stays unweighted; ``chunk_size`` is samples per pass.

    Returns:
        A :class:`KFAC`.

    Raises:
        ValueError: not a Sequential, an unknown loss, a cross-entropy on
            probabilities, a bad chunk_size, an empty x, NaN in x or y.
    """
    x, y, sample_weight = read_data(x, y, sample_weight)  # y, weights used below
    variables = None if variables is None else variable_list(variables)  # once
    target = resolve_target(model, variables, False)
    given = curvature_inputs(model, target, x, loss, y, sample_weight)
    loss, w = given.loss, given.weights
    t = given.targets if loss.needs_targets else None
    columns = target.variables
    index = {id(v): j for j, v in enumerate(columns)}
    starts = np.concatenate([[0], np.cumsum(sizes_of(columns))])
    where = lambda v: slice(int(starts[index[id(v)]]), int(starts[index[id(v)] + 1]))  # noqa: E731

    def factored(layer):  # its rule, where KFAC factors it over the variables
        rule = rule_for(layer)[0]
        if rule is None or not rule.kronecker_factors:
            return None
        asked = [v for v in rule.variables if id(v) in index]
        return rule if len(asked) == len(rule.variables) else None

    _refuse(model)
    rules = [rule for rule in map(factored, model.layers) if rule is not None]
    layers = [rule.layer for rule in rules]
    x = given.batch
    if not tf.is_tensor(x):
        raise ValueError("kfac() takes x as one array: a Sequential has one input.")
    replay = curvature_for(  # compiled once per model, loss and variables
        model, variables, ("kfac", loss.key),
        lambda _: _Replay(model, rules, loss),
    )  # fmt: skip
    n = int(x.shape[0])

    def sums(start, stop):  # each layer's (A's sum, its rows, B's sum) on a chunk
        chunk = x[start:stop]
        parts, B, f = replay(
            chunk, w[start:stop], None if t is None else [a[start:stop] for a in t]
        )
        if start == 0:
            _check_replay(model, chunk, f)
        return [(parts[2 * j], parts[2 * j + 1], B[j]) for j in range(len(layers))]

    plan = plan_chunks(n, chunk_size=256 if chunk_size is None else chunk_size)
    factors = [
        LayerFactors(
            layer.name, AA / count, BB, where(layer.kernel),  # count: n R rows
            where(layer.bias) if layer.use_bias else None,
        )
        for layer, (AA, count, BB) in zip(layers, sum_chunks(plan, sums), strict=True)
    ]  # fmt: skip
    covered = {id(layer.kernel) for layer in layers} | {
        id(layer.bias) for layer in layers if layer.use_bias
    }
    others = [v for v in columns if id(v) not in covered]
    rest = np.concatenate(
        [np.arange(where(v).start, where(v).stop) for v in others] or [np.zeros(0, int)]
    )
    diagonal = []
    if others:
        diagonal = ggn_diagonal(
            model, x.numpy(), loss, y=y, sample_weight=sample_weight, variables=others
        )
    return KFAC(factors, rest, diagonal, target.n_params)


def _check_replay(model, x, f):
    expected = tf.reshape(model(x, training=False), [tf.shape(x)[0], -1])
    scale = float(tf.reduce_max(tf.abs(expected))) + 1.0
    if float(tf.reduce_max(tf.abs(expected - f))) > 1e-4 * scale:
        raise ValueError(
            "kfac() replayed the model's layers one by one and got other outputs "
            "than model(x): a layer's call must depend on its input alone. Use "
            "ggn_diagonal() or ggn_operator() for this model."
        )
