"""The Jacobian of a Dense layer's weights without a general Jacobian
(notebook 11-curvature-and-uncertainty).

A Dense layer computes ``z = phi W + b`` from its input phi (d features per
sample). With its kernel flattened row-major and then its bias (the order of
``flat_params``), the Jacobian of z by (W, b) is, per sample::

    dz_i / d(W, b) = phi_bar_i (x) I_l,        phi_bar_i = [phi_i, 1]

(``phi_bar = phi`` when the bias is not among the variables). Whatever
follows z on the way to the outputs f (the layer's activation, a Softmax
layer) enters as ``A_i = df_i / dz_i`` (l' x l), so
``J_i = A_i (phi_bar_i (x) I_l)`` and nothing of size m per output is ever
formed. From one forward pass to the layer's input (and A_i, where f is not
z itself):

* G, the Gauss-Newton matrix: ``sum_i (phi_bar_i phi_bar_i.T) (x) Lambda_i``
  with ``Lambda_i = A_i.T H_i A_i``;
* the predictive covariance ``J_i Sigma J_i.T`` for a full Sigma: Sigma
  reshaped to (d+1, l, d+1, l) and contracted with phi_bar_i twice; for a
  diagonal Sigma, ``phi_bar_i^2`` against Sigma's diagonal as (d+1, l); for
  KFAC's ``Sigma = (QA (x) QB) diag(1/p) (QA (x) QB).T``,
  ``QB diag(((phi_bar_i QA)^2) (1/p)) QB.T``,

each then taken through A_i. This is how laplace-torch's last-layer Laplace
treats a Linear last layer. :class:`jacutil.curvature.laplace.Laplace` uses
it whenever its variables are one Dense layer's kernel (and bias) inside a
functional or Sequential model, and a general Jacobian otherwise.
"""

import numpy as np
import scipy.linalg

from ..core import cache
from ..core._tf import keras, tf
from ..core.cache import PerSignature
from ..core.formulation import quiet_function

REPLAY_RTOL = 1e-5  # the replayed outputs against model(x), relative
# m n k up to which OpenBLAS multiplies on the calling thread (its
# SMP_THRESHOLD_MIN * GEMM_MULTITHREAD_THRESHOLD), and the fewest rows a block
# may have before one threaded product is the better choice
SERIAL_WORK, FEWEST_ROWS = 262_144, 16


class DenseLastLayer:
    """One Dense layer's features and output Jacobian, compiled.

    Build it with :func:`dense_last_layer`. ``head(x)`` returns
    ``(phi_bar, f, A)``: the layer's inputs with a column of ones where the
    bias is a variable (n, d+1) float64, the model's outputs f (n, l')
    float64, and ``A = df/dz`` (n, l', l) float64, or None where f is z.
    Introduced in ``11-curvature-and-uncertainty``.
    """

    def __init__(self, layer, features, tail, with_bias):
        self.layer = layer
        self.jit_compile = True  # False once XLA failed on it
        self.with_bias = with_bias
        self.n_outputs = int(layer.units)  # l: z's width
        self._upper = np.triu_indices(self.n_outputs)  # the pairs k <= j
        self.n_features = int(layer.kernel.shape[0]) + int(with_bias)  # d + 1
        self._features, self._tail = features, tail
        self._identity = tail is None and layer.activation is keras.activations.linear
        self._functions = PerSignature()

    def _forward(self, x):
        """(phi, f, A or None) in the graph; phi without the column of ones."""
        phi = self._features(x, training=False)
        z = tf.matmul(phi, self.layer.kernel)
        if self.layer.use_bias:
            z = z + self.layer.bias
        if self._identity:
            return phi, z, None
        with tf.GradientTape() as tape:
            tape.watch(z)
            f = self.layer.activation(z)
            if self._tail is not None:
                f = self._tail(f, training=False)
        return phi, f, tape.batch_jacobian(f, z)

    def _head(self, x):
        """``(phi_bar, f[, A])`` as float64, the ones column appended."""
        phi, f, A = self._forward(x)
        phi = tf.cast(phi, tf.float64)
        if self.with_bias:
            phi = tf.concat([phi, tf.ones_like(phi[:, :1])], axis=1)
        out = (phi, tf.cast(f, tf.float64))
        return out if A is None else (*out, tf.cast(A, tf.float64))

    def _compiled(self, x, xla):
        """The concrete ``_head`` for x's per-sample shape and dtype, with XLA
        or without."""
        spec = tf.TensorSpec([None, *x.shape[1:]], x.dtype)
        return self._functions.get(
            (x.shape[1:], x.dtype.str, xla),
            lambda: quiet_function(self._head, jit_compile=xla).get_concrete_function(
                spec
            ),
        )

    def head(self, x):
        """``(phi_bar, f, A)`` of a batch x (an array), float64: phi_bar
        (n, d+1), f (n, l'), A (n, l', l), or None where f is z.

        By XLA (compiled once per batch shape, so the same call gives the
        same bits every time), or without it for good where XLA fails."""
        x = np.asarray(x)
        out = None
        if self.jit_compile:
            try:
                out = self._compiled(x, True)(tf.convert_to_tensor(x))
            except tf.errors.OpError:  # an op XLA cannot compile
                self.jit_compile = False
        if out is None:
            out = self._compiled(x, False)(tf.convert_to_tensor(x))
        out = [t.numpy() for t in out]
        return out[0], out[1], (out[2] if len(out) == 3 else None)

    # -- the predictive, from phi_bar and A ------------------------------------------

    def full_parts(self, covariance):
        """Sigma (m, m) as :meth:`variance` takes it: for each pair k <= j of
        outputs (``np.triu_indices(l)``, in that order) the block
        ``Sigma[(a, k), (b, j)]``, laid out ``S[a, (pair, b)]``,
        (d+1, pairs (d+1))."""
        d1, width = self.n_features, self.n_outputs
        k, j = self._upper
        blocks = covariance.reshape(d1, width, d1, width)[:, k, :, j]  # (pair, a, b)
        return np.ascontiguousarray(blocks.transpose(1, 0, 2)).reshape(d1, -1)

    def variance(self, x, form, parts):
        """``(J_i Sigma J_i.T (n, l', l'), f (n, l'))`` float64 of a batch x
        (an array), from one pass:
        ``form`` ``"full"`` with ``parts = (full_parts(Sigma),)``;
        ``"diagonal"`` with ``(Sigma's diagonal as (d+1, l),)``;
        ``"low_rank"`` with ``(rows, L, delta)`` for
        ``Sigma = (I - U.T (L L.T)^-1 U / delta) / delta``, U the
        :class:`FeatureRows` ``rows`` (:mod:`jacutil.curvature.laplace_low_rank`);
        ``"kronecker"`` with ``(QA, QB, 1 / p)`` for
        ``Sigma = (QA (x) QB) diag(1/p) (QA (x) QB).T``, p (d+1, l)."""
        phi, f, A = self.head(x)
        n, d1, width = len(phi), self.n_features, self.n_outputs
        if form == "full":  # sum_ab phi_a phi_b Sigma[(a, k), (b, j)], k <= j
            k, j = self._upper
            T = _by_rows(phi, parts[0]).reshape(n, len(k), d1)
            var = np.empty((n, width, width))
            var[:, k, j] = var[:, j, k] = np.einsum("npb,nb->np", T, phi)
        elif form == "diagonal":
            var = _by_rows(phi**2, parts[0])[:, :, None] * np.eye(width)
        elif form == "low_rank":
            var = _low_rank_variance(phi, *parts)
        else:  # QB diag(c_i) QB.T
            QA, QB, inverse = parts
            c = _by_rows(_by_rows(phi, QA) ** 2, inverse)
            scaled = (QB[None] * c[:, None, :]).reshape(-1, width)
            var = _by_rows(scaled, QB.T).reshape(n, width, width)
        if A is not None:
            var = np.matmul(np.matmul(A, var), A.transpose(0, 2, 1))
        return var, f

    # -- G from phi_bar and A -----------------------------------------------------

    def ggn(self, phi, A, H):
        """G of this chunk, (m, m): ``sum_i (phi_i phi_i.T) (x) A_i.T H_i A_i``."""
        Lam = H if A is None else np.einsum("nka,nkj,njb->nab", A, H, A)
        d1, width = self.n_features, self.n_outputs
        weighted = phi[:, :, None, None] * Lam[:, None, :, :]  # (n, d1, l, l)
        G = np.tensordot(phi, weighted, axes=(0, 0))  # (b, a, k, j)
        m = d1 * width
        return G.transpose(1, 2, 0, 3).reshape(m, m)

    def kronecker_sums(self, phi, A, H):
        """This chunk's sums for G's Kronecker factors:
        ``(sum_i phi_i phi_i.T (d+1, d+1), sum_i A_i.T H_i A_i (l, l))``."""
        Lam = H if A is None else np.einsum("nka,nkj,njb->nab", A, H, A)
        return phi.T @ phi, np.sum(Lam, axis=0)

    def ggn_diagonal(self, phi, A, H):
        """G's diagonal of this chunk, (m,)."""
        Lam = H if A is None else np.einsum("nka,nkj,njb->nab", A, H, A)
        return ((phi**2).T @ np.diagonal(Lam, 0, 1, 2)).reshape(-1)


class FeatureRows:
    """U, the rows ``S_i.T J_i`` of ``G = U.T U``, from a Dense layer's
    features, never formed: row (i, c) of U is ``phi_i (x) R_i[:, c]``, with
    ``R_i = A_i.T S_i`` (l, r) and ``H_i = S_i S_i.T``, so
    ``(U U.T)[(i, c), (j, e)] = (phi_i . phi_j) (R_i[:, c] . R_j[:, e])``.
    The products :class:`jacutil.curvature.laplace_low_rank.LowRankGGN`
    takes; k = n r rows, m = (d+1) l parameters.

    Args:
        phi: phi_bar (n, d+1).
        R: (n, l, r).
    """

    def __init__(self, phi, R):
        self.phi, self.R = phi, R
        n, self.width, r = R.shape
        self.n_rows, self.n_params = n * r, phi.shape[1] * self.width

    def gram(self, inverse_delta=None):
        """``U diag(inverse_delta) U.T`` (k, k); ``U U.T`` without it."""
        phi, R = self.phi, self.R
        if inverse_delta is None:
            K = (phi @ phi.T)[:, None, :, None] * np.einsum("iac,jae->icje", R, R)
            return K.reshape(self.n_rows, self.n_rows)
        scales = np.reshape(inverse_delta, (phi.shape[1], self.width))
        K = 0.0
        for b in range(self.width):  # sum_b (phi D_b phi.T)_ij R_i[b, c] R_j[b, e]
            outer = (phi * scales[:, b]) @ phi.T
            K = K + np.einsum("ij,ic,je->icje", outer, R[:, b], R[:, b])
        return K.reshape(self.n_rows, self.n_rows)

    def times(self, V):
        """``U V``: V (m, c) -> (k, c)."""
        c = V.shape[1]
        T = (self.phi @ V.reshape(-1, self.width * c)).reshape(-1, self.width, c)
        return np.einsum("ibe,ibx->iex", self.R, T).reshape(self.n_rows, c)

    def transposed_times(self, Y):
        """``U.T Y``: Y (k, c) -> (m, c)."""
        c, r = Y.shape[1], self.R.shape[2]
        T = np.einsum("ibe,iex->ibx", self.R, Y.reshape(-1, r, c))
        return (self.phi.T @ T.reshape(len(T), -1)).reshape(self.n_params, c)

    def to_dense(self):
        """G (m, m): ``sum_i (phi_i phi_i.T) (x) R_i R_i.T``."""
        G = np.einsum("ia,ib,ijc,ikc->ajbk", self.phi, self.phi, self.R, self.R)
        return G.reshape(self.n_params, self.n_params)


def _low_rank_variance(phi_test, rows, lower, delta):
    """``J_z Sigma J_z.T`` (n, l, l) at the layer's output z, for
    ``Sigma = (I - U.T (L L.T)^-1 U / delta) / delta``: ``J_z J_z.T`` is
    ``|phi|^2 I`` and ``(U J_z.T)[(i, c), j] = (phi_i . phi) R_i[j, c]``."""
    n, width = len(phi_test), rows.width
    C = phi_test @ rows.phi.T  # (n, n_train)
    W = C[:, :, None, None] * rows.R.transpose(0, 2, 1)[None]  # (n, i, c, j)
    W = W.reshape(n, rows.n_rows, width).transpose(1, 0, 2).reshape(rows.n_rows, -1)
    Y = scipy.linalg.solve_triangular(lower, W, lower=True).reshape(-1, n, width)
    spanned = np.einsum("ank,anj->nkj", Y, Y)
    norms = np.sum(phi_test**2, axis=1)
    return (norms[:, None, None] * np.eye(width) - spanned / delta) / delta


def _by_rows(a, b):
    """``a @ b`` in blocks of rows small enough for BLAS to multiply on the
    calling thread. Waking BLAS's worker threads next to TensorFlow's
    spinning ones cost about 8 ms a product on a busy 2-core machine
    (measured), ten times the whole predictive."""
    n, width = a.shape[0], b.shape[1]
    rows = SERIAL_WORK // max(1, a.shape[1] * width)
    if rows >= n or rows < FEWEST_ROWS:
        return a @ b
    out = np.empty((n, width))
    for start in range(0, n, rows):
        np.matmul(a[start : start + rows], b, out=out[start : start + rows])
    return out


def _single(structure):
    leaves = tf.nest.flatten(structure)
    return leaves[0] if len(leaves) == 1 else None


def dense_last_layer(model, variables, owner, x, f):
    """A :class:`DenseLastLayer` when ``variables`` are exactly the kernel
    (and the bias) of ``owner``, a Dense layer of a functional or Sequential
    ``model`` called once, on (n, d) inputs, and the replay reproduces
    ``f = model(x)`` (n, l') on ``x``, a few samples; otherwise None (the
    general Jacobian applies). Built once per model and variables, and kept
    (:mod:`jacutil.core.cache`) while the model lives. Introduced in
    ``11-curvature-and-uncertainty``.
    """
    if not isinstance(x, np.ndarray | tf.Tensor):
        return None  # one input array: several inputs take the general J
    variables = list(variables)
    dense = cache.kept(
        "dense_last_layer",
        model,
        tuple(map(id, variables)),
        lambda: _built(model, variables, owner),
    )
    if dense is None:
        return None
    try:
        _, replayed, _ = dense.head(x)
    except (ValueError, TypeError, tf.errors.OpError):
        return None
    f = np.asarray(f, dtype=np.float64)
    if replayed.shape != f.shape:
        return None
    scale = float(np.max(np.abs(f), initial=0.0)) + 1.0
    if float(np.max(np.abs(replayed - f), initial=0.0)) > REPLAY_RTOL * scale:
        return None
    return dense


def _built(model, variables, owner):
    """The :class:`DenseLastLayer` of ``owner`` in ``model``, or None where
    the variables or the graph do not fit (see :func:`dense_last_layer`)."""
    if not isinstance(model, keras.Model) or not isinstance(owner, keras.layers.Dense):
        return None
    with_bias = len(variables) == 2
    expected = [owner.kernel, owner.bias] if with_bias else [owner.kernel]
    if len(variables) not in (1, 2) or any(
        v is not w for v, w in zip(variables, expected, strict=True)
    ):
        return None
    if len(owner.kernel.shape) != 2:
        return None
    try:
        inputs, output = list(model.inputs), _single(model.outputs)
        layer_input, layer_output = owner.input, owner.output
        if output is None or len(inputs) != 1 or len(layer_input.shape) != 2:
            return None
        features = keras.Model(inputs[0], layer_input)
        tail = None if output is layer_output else keras.Model(layer_output, output)
    except (AttributeError, ValueError, TypeError, KeyError, IndexError):
        return None  # subclassed, nested, shared or multi-output: the general J
    return DenseLastLayer(owner, features, tail, with_bias)
