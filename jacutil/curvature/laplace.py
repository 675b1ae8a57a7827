"""Laplace uncertainty for a trained Keras model (notebook
11-curvature-and-uncertainty).

A trained model's weights ``theta*`` are the MAP estimate. The Laplace
approximation puts a Gaussian around them, ``N(theta*, Sigma)``, whose
precision is the curvature of the loss plus the prior's::

    P = G / sigma^2 + delta * I,        Sigma = P^-1,

with ``G = sum_i J_i.T H_i J_i`` the Gauss-Newton matrix of the summed loss
(``H_i`` from :class:`jacutil.curvature.losses.OutputLoss`), ``sigma^2`` the
noise variance of a regression (1 for a classification) and ``delta`` the
prior precision. Three structures of P, as in laplace-torch:

* ``"last_layer"``: the full G of the last layer that has weights; the other
  weights stay fixed at theta*. P is formed (m_LL x m_LL) and factored by
  Cholesky.
* ``"diagonal"``: every parameter, G replaced by its exact diagonal
  (:func:`jacutil.curvature.diagonal.ggn_diagonal`).
* ``"kfac"``: every parameter, G replaced by its Kronecker factors
  (:func:`jacutil.curvature.kfac.kfac`); ``(K / s + d I)^-1 = s (K + s d I)^-1``
  with ``s = sigma^2``.

The predictive of the linearized model at a test point x* is Gaussian over
the outputs: mean f(x*), covariance ``J* Sigma J*.T`` (l x l). For a
classification the probit approximation turns it into probabilities,
``softmax(f / sqrt(1 + pi/8 diag(var)))``, or Monte Carlo samples do.

The log marginal likelihood is laplace-torch's::

    log p(y | theta*) - 0.5 * (log det P - log det P0) - 0.5 * delta |theta*|^2

with ``P0 = delta I`` over the structure's parameters, and its maximum over
delta (and sigma for a regression) chooses the prior.
"""

import math

import numpy as np
import scipy.linalg
import scipy.optimize

from ..auto import jacobian
from ..core._tf import keras, tf
from ..core.batch import n_samples, take
from ..core.layout import flat_params
from ..core.outputs import as_rows
from .diagonal import ggn_diagonal
from .kfac import kfac
from .losses import output_loss

STRUCTURES = ("last_layer", "diagonal", "kfac")
DEFAULT_MEMORY_BUDGET = 2**28  # bytes for one chunk of J (256 MiB)


def laplace(
    model,
    x,
    y,
    loss="squared_error",
    structure="last_layer",
    *,
    prior_precision=1.0,
    sigma_noise=1.0,
    variables=None,
    memory_budget=None,
):
    """Fit a Laplace approximation around a trained model's weights.

    Introduced in ``11-curvature-and-uncertainty``.

    Args:
        model: a trained Keras model (its weights are theta*), or a callable
            ``f(x)`` with ``variables=``.
        x: the training inputs (n samples): an array, or a list or dict of
            arrays.
        y: the training targets: (n, l) values, or integer labels for
            ``"softmax_cross_entropy"``.
        loss: ``"squared_error"`` (a regression), ``"softmax_cross_entropy"``
            or ``"sigmoid_cross_entropy"`` (a classification; the model
            outputs logits), or an ``OutputLoss``.
        structure: ``"last_layer"``, ``"diagonal"`` or ``"kfac"``.
        prior_precision: delta, a positive scalar.
        sigma_noise: sigma, the noise standard deviation of a regression
            (it must stay 1 for a classification).
        variables: the variables the posterior covers (default: the last
            layer's for ``"last_layer"``, every trainable one otherwise).
        memory_budget: bytes for one chunk of J (default 256 MiB).

    Returns:
        A fitted :class:`Laplace`.

    Raises:
        ValueError: an unknown structure or loss, y of the wrong shape, a
            cross-entropy on a model that ends in a softmax or sigmoid, or a
            prior precision or noise that is not positive.
        TypeError: a plain callable without ``variables=``.
    """
    return Laplace(
        model,
        x,
        y,
        loss,
        structure,
        prior_precision=prior_precision,
        sigma_noise=sigma_noise,
        variables=variables,
        memory_budget=memory_budget,
    )


def last_layer_variables(model):
    """The trainable variables of the last layer that has any.

    Nested models are searched inside: the answer is a layer, not a model.
    Introduced in ``11-curvature-and-uncertainty``.

    Args:
        model: a Keras model.

    Returns:
        A list of tf.Variables, in ``flat_params`` order.

    Raises:
        TypeError: ``model`` is not a Keras model.
        ValueError: no layer has trainable weights.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"the last layer is looked up in a Keras model; got "
            f"{type(model).__name__}. For a plain callable pass "
            "variables=[...], the variables of its last layer."
        )
    for layer in reversed(model.layers):
        if isinstance(layer, keras.Model):
            try:
                return last_layer_variables(layer)
            except ValueError:
                continue
        if layer.trainable_variables:
            return list(layer.trainable_variables)
    raise ValueError(
        f"model {model.name!r} has no layer with trainable weights: build it "
        "(give it an Input) and check that its layers are not all frozen."
    )


def _positive(value, name):
    value = float(value)
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number; got {value!r}.")
    return value


def _per_sample_shapes(x):
    return tf.nest.map_structure(lambda a: tuple(np.shape(a)[1:]), x)


class Laplace:
    """A Laplace posterior ``N(theta*, (G / sigma^2 + delta I)^-1)``.

    Build it with :func:`laplace` (same arguments). It keeps the curvature
    of the training data, so that changing the prior precision or the noise
    costs no new pass over the data.

    Introduced in ``11-curvature-and-uncertainty``.

    Attributes:
        structure: ``"last_layer"``, ``"diagonal"`` or ``"kfac"``.
        loss: the ``OutputLoss``.
        variables: the variables the posterior covers.
        mean: theta*, shape (m,), in ``flat_params`` order of ``variables``.
        n_params: m.
        n_data: n, the training samples.
        n_outputs: l, the outputs per sample.
        prior_precision: delta.
        sigma_noise: sigma (1 for a classification).
        ggn: the structure's curvature: G (m, m) for ``"last_layer"``, its
            diagonal (m,) for ``"diagonal"``, the ``KFAC`` for ``"kfac"``.
    """

    def __init__(
        self,
        model,
        x,
        y,
        loss="squared_error",
        structure="last_layer",
        *,
        prior_precision=1.0,
        sigma_noise=1.0,
        variables=None,
        memory_budget=None,
    ):
        if structure not in STRUCTURES:
            raise ValueError(
                f"structure must be one of {', '.join(map(repr, STRUCTURES))}; "
                f"got {structure!r}."
            )
        self.model = model
        self.structure = structure
        self.loss = output_loss(loss, model)
        self.regression = self.loss.name == "squared_error"
        self.prior_precision = _positive(prior_precision, "prior_precision")
        self.sigma_noise = _positive(sigma_noise, "sigma_noise")
        if not self.regression and self.sigma_noise != 1.0:
            raise ValueError(
                f"sigma_noise={sigma_noise!r} is for a regression; a "
                f"classification ({self.loss.name}) has no observation noise. "
                "Leave sigma_noise at 1."
            )
        self.memory_budget = int(memory_budget or DEFAULT_MEMORY_BUDGET)
        if structure == "last_layer" and variables is None:
            variables = last_layer_variables(model)
        self.variables = variables
        self.mean = flat_params(model, variables=variables)
        self.n_params = self.mean.size
        self._inputs = _per_sample_shapes(x)
        self.n_data = int(n_samples(x))
        self.f_train = self._outputs(x)
        self.n_outputs = self.f_train.shape[1]
        self.y_train = self.loss.targets(y, self.f_train)  # checks y's shape
        self._fit(x)

    def __repr__(self):
        return (
            f"Laplace({self.structure!r}, {self.loss.name!r}, m={self.n_params}, "
            f"prior_precision={self.prior_precision:.4g}, "
            f"sigma_noise={self.sigma_noise:.4g})"
        )

    # -- the pieces -----------------------------------------------------------

    def _outputs(self, x):
        """f(x) as (n, l) float64 rows."""
        if isinstance(self.model, keras.Model):
            out = self.model(x, training=False)
        else:
            out = self.model(x)
        return np.asarray(as_rows(out, int(n_samples(x))), dtype=np.float64)

    def _chunks(self, x):
        """(start, stop) pieces of x whose J fits in the memory budget."""
        n = int(n_samples(x))
        row_bytes = 8 * max(1, self.n_outputs) * self.n_params
        size = max(1, self.memory_budget // row_bytes)
        return [(s, min(s + size, n)) for s in range(0, n, size)]

    def _jacobian(self, x):
        """J of the structure's variables, (n, l, m) float64."""
        J = jacobian(self.model, x, variables=self.variables)  # x is one chunk
        return np.asarray(J, dtype=np.float64)

    def _fit(self, x):
        if self.structure == "last_layer":
            G = np.zeros((self.n_params, self.n_params))
            for start, stop in self._chunks(x):
                J = self._jacobian(take(x, start, stop))
                H = self.loss.hessian(self.f_train[start:stop])
                G += np.einsum("nkp,nkj,njq->pq", J, H, J, optimize=True)
            self.ggn = 0.5 * (G + G.T)
            self._eigenvalues = np.linalg.eigvalsh(self.ggn)
        elif self.structure == "diagonal":
            self.ggn = np.asarray(
                ggn_diagonal(
                    self.model,
                    x,
                    self.loss,
                    variables=self.variables,
                    memory_budget=self.memory_budget,
                ),
                dtype=np.float64,
            )
        else:
            self.ggn = kfac(self.model, x, self.loss, variables=self.variables)

    # -- the posterior --------------------------------------------------------

    def _values(self, prior_precision, sigma_noise):
        delta = self.prior_precision if prior_precision is None else prior_precision
        sigma = self.sigma_noise if sigma_noise is None else sigma_noise
        delta = _positive(delta, "prior_precision")
        sigma = _positive(sigma, "sigma_noise")
        if not self.regression and sigma != 1.0:
            raise ValueError(
                "sigma_noise is for a regression; a classification has none."
            )
        return delta, sigma**2

    def posterior_precision(self):
        """P = G / sigma^2 + delta I: (m, m) for ``"last_layer"``, its
        diagonal (m,) for ``"diagonal"``.

        Introduced in ``11-curvature-and-uncertainty``.

        Returns:
            A NumPy array.

        Raises:
            ValueError: for ``"kfac"``, whose P is never formed (use
                :meth:`predictive_variance` or the ``KFAC`` in ``ggn``).
        """
        delta, s2 = self._values(None, None)
        if self.structure == "last_layer":
            return self.ggn / s2 + delta * np.eye(self.n_params)
        if self.structure == "diagonal":
            return self.ggn / s2 + delta
        raise ValueError(
            "a KFAC posterior precision is never formed as a matrix (it is "
            "m x m); use predictive_variance, or the KFAC object in .ggn."
        )

    def posterior_covariance(self):
        """Sigma = P^-1: (m, m) for ``"last_layer"`` (by Cholesky solves, so
        small last layers only), its diagonal (m,) for ``"diagonal"``.

        Introduced in ``11-curvature-and-uncertainty``.

        Returns:
            A NumPy array.

        Raises:
            ValueError: for ``"kfac"`` (use ``ggn.inverse_matvec``).
        """
        P = self.posterior_precision()
        if self.structure == "diagonal":
            return 1.0 / P
        factor = scipy.linalg.cho_factor(P, lower=True)
        return scipy.linalg.cho_solve(factor, np.eye(self.n_params))

    def log_det_posterior_precision(self, prior_precision=None, sigma_noise=None):
        """log det P at the stored (or the given) delta and sigma.

        Introduced in ``11-curvature-and-uncertainty``.

        Args:
            prior_precision: delta (default: the stored one).
            sigma_noise: sigma (default: the stored one).

        Returns:
            A float.
        """
        delta, s2 = self._values(prior_precision, sigma_noise)
        if self.structure == "last_layer":
            return float(np.sum(np.log(self._eigenvalues / s2 + delta)))
        if self.structure == "diagonal":
            return float(np.sum(np.log(self.ggn / s2 + delta)))
        # log det(K / s + d I) = log det(K + s d I) - m log s
        return float(self.ggn.logdet(s2 * delta)) - self.n_params * math.log(s2)

    def _covariance_times(self, V):
        """Sigma @ V for V (m, r) for diagonal and KFAC: no m x m matrix."""
        delta, s2 = self._values(None, None)
        if self.structure == "diagonal":
            return V / (self.ggn / s2 + delta)[:, None]
        return s2 * np.asarray(self.ggn.inverse_matvec(V, s2 * delta), np.float64)

    def predictive_variance(self, x_test):
        """The linearized predictive covariance ``J* Sigma J*.T`` per point.

        J* is taken in chunks that fit the memory budget; for ``"diagonal"``
        and ``"kfac"`` no m x m matrix is formed. Introduced in
        ``11-curvature-and-uncertainty``.

        Args:
            x_test: test inputs shaped like the training inputs.

        Returns:
            An array of shape (n_test, l, l) (without observation noise).

        Raises:
            ValueError: x_test's per-sample shape differs from the training
                inputs'.
        """
        self._check_inputs(x_test)
        n, width = int(n_samples(x_test)), self.n_outputs
        var = np.empty((n, width, width))
        if self.structure == "last_layer":  # P = L L.T: J Sigma J.T = |L^-1 J.T|^2
            L = np.linalg.cholesky(self.posterior_precision())
        for start, stop in self._chunks(x_test):
            J = self._jacobian(take(x_test, start, stop))
            c = stop - start
            if self.structure == "last_layer":
                Z = scipy.linalg.solve_triangular(
                    L, J.reshape(c * width, -1).T, lower=True
                ).reshape(-1, c, width)
                var[start:stop] = np.einsum("pck,pcj->ckj", Z, Z)
            else:
                SJ = self._covariance_times(J.reshape(c * width, -1).T)
                var[start:stop] = np.einsum("ckp,pcj->ckj", J, SJ.reshape(-1, c, width))
        return 0.5 * (var + np.transpose(var, (0, 2, 1)))

    def _check_inputs(self, x_test):
        shapes = _per_sample_shapes(x_test)
        try:
            tf.nest.assert_same_structure(shapes, self._inputs)
            same = tf.nest.flatten(shapes) == tf.nest.flatten(self._inputs)
        except (ValueError, TypeError):
            same = False
        if not same:
            raise ValueError(
                f"x_test has per-sample shape {shapes}; the model was fitted on "
                f"inputs of per-sample shape {self._inputs}. Pass test inputs "
                "shaped like the training inputs, samples first."
            )

    def predict(self, x_test, *, observation_noise=True, samples=None, seed=0):
        """The predictive distribution at ``x_test``.

        A regression returns the Gaussian ``(mean, covariance)``. A
        classification returns probabilities: by the probit approximation
        (laplace-torch's ``link_approx="probit"``), ``softmax(f * kappa)``
        with ``kappa = 1 / sqrt(1 + pi/8 diag(var))`` (the sigmoid likewise),
        or, with ``samples=``, the mean of the softmax over seeded draws of
        ``f ~ N(f(x*), var)``. Introduced in ``11-curvature-and-uncertainty``.

        Args:
            x_test: test inputs shaped like the training inputs.
            observation_noise: a regression adds ``sigma^2 I`` to the
                covariance (the predictive of a new y, not of f).
            samples: a classification: the number of Monte Carlo draws
                (None: the probit approximation).
            seed: the seed of the draws.

        Returns:
            A regression: ``(mean (n, l), covariance (n, l, l))``. A
            classification: probabilities (n, l).

        Raises:
            ValueError: ``samples=`` for a regression, or x_test shaped
                unlike the training inputs.
        """
        if self.regression and samples is not None:
            raise ValueError(
                "samples= draws class probabilities for a classification; a "
                "regression's predictive is Gaussian already: (mean, covariance)."
            )
        var = self.predictive_variance(x_test)
        f = self._outputs(x_test)
        if self.regression:
            if observation_noise:
                var = var + self.sigma_noise**2 * np.eye(self.n_outputs)
            return f, var
        if samples is None:
            kappa = 1.0 / np.sqrt(1.0 + math.pi / 8.0 * np.diagonal(var, 0, 1, 2))
            return self.loss.mean(f * kappa)
        samples = int(samples)
        if samples < 1:
            raise ValueError(f"samples must be a positive integer; got {samples}.")
        values, vectors = np.linalg.eigh(var)
        root = vectors * np.sqrt(np.clip(values, 0.0, None))[:, None, :]
        rng = np.random.default_rng(seed)
        draws = rng.standard_normal((samples, *f.shape))
        fs = f + np.einsum("nkj,snj->snk", root, draws)
        return np.mean([self.loss.mean(one) for one in fs], axis=0)

    # -- the marginal likelihood ----------------------------------------------

    def log_likelihood(self, sigma_noise=None):
        """log p(y | theta*): minus the summed cross-entropy, or the Gaussian
        log likelihood of a regression with noise sigma.

        Introduced in ``11-curvature-and-uncertainty``.

        Args:
            sigma_noise: sigma (default: the stored one).

        Returns:
            A float.
        """
        _, s2 = self._values(None, sigma_noise)
        losses = self.loss.value(self.f_train, self.y_train)
        if not self.regression:
            return -float(np.sum(losses))
        count = self.n_data * self.n_outputs
        return -float(np.sum(losses)) / s2 - 0.5 * count * math.log(2 * math.pi * s2)

    def log_marginal_likelihood(self, prior_precision=None, sigma_noise=None):
        """laplace-torch's Laplace log marginal likelihood.

        ``log p(y|theta*) - 0.5 (log det P - log det P0) - 0.5 delta
        |theta*|^2`` with ``P0 = delta I`` over the structure's m
        parameters. Unlike laplace-torch it does not store the values it is
        given. Introduced in ``11-curvature-and-uncertainty``.

        Args:
            prior_precision: delta (default: the stored one).
            sigma_noise: sigma, a regression only (default: the stored one).

        Returns:
            A float.

        Raises:
            ValueError: a value that is not positive, or sigma_noise for a
                classification.
        """
        delta, _ = self._values(prior_precision, sigma_noise)
        log_det_ratio = self.log_det_posterior_precision(
            delta, sigma_noise
        ) - self.n_params * math.log(delta)
        scatter = delta * float(self.mean @ self.mean)
        return self.log_likelihood(sigma_noise) - 0.5 * (log_det_ratio + scatter)

    def optimize_prior_precision(
        self,
        method="marglik",
        *,
        sigma_noise=None,
        bounds=(1e-4, 1e4),
        sigma_bounds=(1e-3, 1e3),
    ):
        """Choose delta (and sigma) that maximize the marginal likelihood.

        log delta is optimized by bounded Brent search; with
        ``sigma_noise="fit"`` (a regression) log sigma is searched outside
        it, each sigma with its best delta. The values are stored.
        Introduced in ``11-curvature-and-uncertainty``.

        Args:
            method: ``"marglik"``, the only one.
            sigma_noise: ``"fit"`` to choose sigma as well, or None to keep it.
            bounds: the range of delta.
            sigma_bounds: the range of sigma.

        Returns:
            ``(prior_precision, sigma_noise)``, the values now stored.

        Raises:
            ValueError: another method, ``"fit"`` for a classification, or
                bounds that are not positive and increasing.
        """
        if method != "marglik":
            raise ValueError(
                f"method must be 'marglik' (the marginal likelihood); got {method!r}."
            )
        if sigma_noise not in (None, "fit"):
            raise ValueError(
                f"sigma_noise must be None (keep it) or 'fit'; got {sigma_noise!r}. "
                "To set a value, pass it to laplace(...) or assign .sigma_noise."
            )
        if sigma_noise == "fit" and not self.regression:
            raise ValueError("sigma_noise='fit' is for a regression only.")
        low, high = (_positive(b, "bounds") for b in bounds)
        if not low < high:
            raise ValueError(
                f"bounds must be (low, high) with low < high; got {bounds}."
            )

        def best_delta(sigma):
            result = scipy.optimize.minimize_scalar(
                lambda t: -self.log_marginal_likelihood(math.exp(t), sigma),
                bounds=(math.log(low), math.log(high)),
                method="bounded",
                options={"xatol": 1e-8},
            )
            return math.exp(result.x), -result.fun

        sigma = self.sigma_noise
        if sigma_noise == "fit":
            s_low, s_high = (_positive(b, "sigma_bounds") for b in sigma_bounds)
            result = scipy.optimize.minimize_scalar(
                lambda t: -best_delta(math.exp(t))[1],
                bounds=(math.log(s_low), math.log(s_high)),
                method="bounded",
                options={"xatol": 1e-8},
            )
            sigma = math.exp(result.x)
        self.prior_precision, _ = best_delta(sigma)
        self.sigma_noise = sigma
        return self.prior_precision, self.sigma_noise
