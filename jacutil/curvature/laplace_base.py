"""What every Laplace posterior shares (11-curvature-and-uncertainty): the
weights it covers, the prior per layer, the pass over the data, the
predictive and the marginal likelihood. Each structure is a subclass in its
own module; :mod:`jacutil.curvature.laplace` gathers them."""

import math
from collections.abc import Mapping

import numpy as np
import scipy.optimize

from ..core._tf import keras, tf
from ..core.arguments import check_memory_budget, refuse_non_finite
from ..core.batch import n_samples, take
from ..core.data import inputs_of, read_data
from ..core.layout import flat_params
from ..core.outputs import as_rows
from ..core.planner import plan_chunks, sum_chunks
from ..core.target import resolve_target, variable_list
from ..engine.jacobian import best_jacobian
from .dense_last_layer import dense_last_layer
from .losses import output_loss

STRUCTURES = ("last_layer", "diagonal", "kfac")
PRIOR_STRUCTURES = ("scalar", "layerwise")

# -- which layer is last ----------------------------------------------------------


def _layers_inside(model, variables=None):
    """Every Keras layer inside ``model`` (``Target.layers``), the model last."""
    return [*resolve_target(model, variables).layers, model]


def _owners(model, variables):
    """For each variable, the innermost layer of ``model`` that holds it
    (the one with the fewest weights), or None."""
    is_keras = isinstance(model, keras.Layer)
    layers = _layers_inside(model, variables) if is_keras else []
    holders = [(layer, {id(w) for w in layer.weights}) for layer in layers]
    owners = []
    for v in variables:
        holding = [(len(ids), k) for k, (_, ids) in enumerate(holders) if id(v) in ids]
        owners.append(holders[min(holding)[1]][0] if holding else None)
    return owners


def _tracing_inputs(model, x):
    """One sample of x as tensors, or the model's declared inputs as specs."""
    if x is not None:
        return tf.nest.map_structure(
            lambda a: tf.convert_to_tensor(np.asarray(a)), take(x, 0, 1)
        )
    declared = resolve_target(model).declared
    if declared is None:
        raise ValueError(
            f"model {model.name!r} declares no inputs (a subclassed model), so "
            "its forward pass cannot be traced without data: pass x, e.g. "
            "last_layer_variables(model, x)."
        )
    return tf.nest.map_structure(
        lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), declared
    )


def _last_layers_per_output(model, x):
    """``(layers, last)``: the weighted layers (innermost owners of the
    trainable variables, in their order) and, per output leaf, the set of
    their indices that no other weighted layer follows on the way to it.

    The forward pass is traced once; each tensor records the weighted layers
    it depends on, and an op that reads a layer's variables (directly, or
    through a loop or call that takes the variable's handle) records that
    the layers its data came through precede that layer.
    """
    variables = list(model.trainable_variables)
    owners = _owners(model, variables)
    layers, index, of_handle = [], {}, {}
    for v, owner in zip(variables, owners, strict=True):
        owner = model if owner is None else owner
        if id(owner) not in index:
            index[id(owner)] = len(layers)
            layers.append(owner)
        of_handle[id(v.handle)] = index[id(owner)]

    traced = tf.function(lambda inputs: model(inputs, training=False))
    concrete = traced.get_concrete_function(_tracing_inputs(model, x))
    graph = concrete.graph
    depends, data = {}, set()  # tensor -> layer indices; tensors that carry x
    for external, internal in graph.captures:
        k = of_handle.get(id(external))
        depends[internal.ref()] = frozenset() if k is None else frozenset({k})
    for t in graph.inputs:
        if t.ref() not in depends:
            depends[t.ref()] = frozenset()
            data.add(t.ref())
    precedes = [set() for _ in layers]  # precedes[k]: layers whose output reaches k
    for op in graph.get_operations():
        flowing, applied, carries = set(), set(), False
        for t in op.inputs:
            d = depends.get(t.ref(), frozenset())
            if t.ref() in data:
                flowing |= d
                carries = True
            else:
                applied |= d
        for k in applied:
            precedes[k] |= flowing - {k}
        for out in op.outputs:
            if out.ref() not in depends:
                depends[out.ref()] = frozenset(flowing | applied)
                if carries:
                    data.add(out.ref())
    last = []
    for out in tf.nest.flatten(concrete.structured_outputs):
        reached = depends.get(out.ref(), frozenset())
        last.append(
            {k for k in reached if not any(k in precedes[j] for j in reached - {k})}
        )
    return layers, last


def last_layer_variables(model, x=None):
    """The trainable variables of the last weighted layer of the forward pass.

    Found from what the forward pass computes (traced once), not from the
    order of ``model.layers``: the layer with trainable weights that no
    other weighted layer follows on the way to the outputs (laplace-torch
    finds its last layer with a forward pass too). Subclassed, nested and
    functional models all work; the answer is a layer, not a nested model.
    ``x``, a batch of inputs (one sample is used), is needed when the model
    declares no inputs (a subclassed model). Returns a list of tf.Variables
    in ``model.trainable_variables`` order. Introduced in
    ``11-curvature-and-uncertainty``.

    Raises:
        TypeError: ``model`` is not a Keras model.
        ValueError: no layer has trainable weights; a subclassed model without
            ``x``; or the outputs end in different weighted layers (several
            heads), or one output in several: then name the layers with
            ``laplace(..., last_layer=[...])`` or pass ``variables=``.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"the last layer is looked up in a Keras model; got "
            f"{type(model).__name__}. For a plain callable pass "
            "variables=[...], the variables of its last layer."
        )
    if not model.trainable_variables:
        raise ValueError(
            f"model {model.name!r} has no layer with trainable weights: build it "
            "(give it an Input) and check that its layers are not all frozen."
        )
    layers, last = _last_layers_per_output(model, x)
    ends = {frozenset(k) for k in last}
    if len(ends) == 1 and len(next(iter(ends))) == 1:
        (k,) = next(iter(ends))
        held = {id(v) for v in layers[k].weights}
        return [v for v in model.trainable_variables if id(v) in held]
    described = "; ".join(
        f"output {j}: {', '.join(repr(layers[k].name) for k in sorted(ks)) or 'none'}"
        for j, ks in enumerate(last)
    )
    names = sorted({layers[k].name for ks in last for k in ks})
    raise ValueError(
        f"model {model.name!r} has no single last layer: its outputs end in "
        f"different weighted layers ({described}). A posterior over one of "
        "them would give the other outputs zero variance. Name the layers: "
        f"laplace(..., last_layer={names!r}) (layer objects work too), or pass "
        "variables=[...]."
    )


def named_layer_variables(model, last_layer):
    """The trainable variables of the layers named by ``last_layer``."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            "last_layer= names layers of a Keras model; for a plain callable "
            "pass variables=[...]."
        )
    items = list(last_layer) if isinstance(last_layer, (list, tuple)) else [last_layer]
    if not items:
        raise ValueError("last_layer= is empty: name at least one layer.")
    inside = _layers_inside(model)[:-1]
    chosen = []
    for item in items:
        if isinstance(item, str):
            found = [layer for layer in inside if layer.name == item]
            if len(found) != 1:
                known = ", ".join(
                    repr(layer.name) for layer in inside if layer.trainable_variables
                )
                raise ValueError(
                    f"last_layer={item!r}: {'no' if not found else len(found)} "
                    f"layer(s) of model {model.name!r} have that name. Layers with "
                    f"trainable weights: {known}. Pass a name from those, or the "
                    "layer object."
                )
            item = found[0]
        elif not isinstance(item, keras.Layer) or not any(item is i for i in inside):
            raise ValueError(
                f"last_layer= holds {item!r}, which is not a layer of model "
                f"{model.name!r}: pass layer names or layer objects of this model."
            )
        if not item.trainable_variables:
            raise ValueError(
                f"last_layer: layer {item.name!r} has no trainable weights; name "
                "layers that have some."
            )
        chosen.append(item)
    held = {id(v) for layer in chosen for v in layer.trainable_variables}
    return [v for v in model.trainable_variables if id(v) in held]


def _positive(value, name):
    value = float(value)
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number; got {value!r}.")
    return value


def _per_sample_shapes(x):
    return tf.nest.map_structure(lambda a: tuple(np.shape(a)[1:]), x)


class Laplace:
    """A Laplace posterior ``N(theta*, (G / sigma^2 + diag(delta))^-1)``.

    ``Laplace(...)`` (or :func:`laplace`, same arguments) builds the class of
    its ``structure``: :class:`LastLayerLaplace`, :class:`DiagonalLaplace`
    or :class:`KFACLaplace`. It keeps the curvature of the training data, so
    a new prior precision or noise costs no new pass over the data.
    Introduced in ``11-curvature-and-uncertainty``.

    Attributes:
        structure: ``"last_layer"``, ``"diagonal"`` or ``"kfac"``.
        loss, variables: the ``OutputLoss``; the variables it covers.
        mean: theta* (m,), in ``flat_params`` order of ``variables``.
        n_params, n_data, n_outputs: m; n, the training samples; l.
        layer_names: the layers of the posterior in the order of their
            variables (a variable outside any layer: its path), the order of
            a per-layer ``prior_precision``.
        prior_precision: delta: a float, or an array with one per layer.
        sigma_noise: sigma (1 for a classification).
        ggn: the structure's curvature: G (m, m) for ``"last_layer"``, its
            diagonal (m,) for ``"diagonal"``, the ``KFAC`` for ``"kfac"``.
        jacobian_form: ``"dense"`` where J is used as ``A (phi (x) I)`` from
            one Dense layer's inputs phi, never formed
            (:mod:`jacutil.curvature.dense_last_layer`), else ``"general"``.
        dense: the ``DenseLastLayer`` of the ``"dense"`` form, or None.
    """

    structure = None  # each subclass's own

    def __new__(cls, *args, **options):
        # Laplace(...) builds the structure's class; a subclass is its own only
        allowed = STRUCTURES if cls is Laplace else (cls.structure,)
        structure = options.get("structure", allowed[0])
        structure = args[4] if len(args) > 4 else structure
        if structure not in allowed:
            raise ValueError(
                f"structure must be one of {', '.join(map(repr, allowed))}; "
                f"got {structure!r}."
            )
        if cls is Laplace:
            cls = {kind.structure: kind for kind in cls.__subclasses__()}[structure]
        return super().__new__(cls)

    def __init__(
        self, model, x, y=None, loss="squared_error", structure=None, *,
        prior_precision=1.0, sigma_noise=1.0, variables=None, last_layer=None,
        memory_budget=None,
    ):  # fmt: skip
        if variables is not None:
            variables = variable_list(variables)  # a generator is read once, here
        if last_layer is not None:
            self._check_last_layer(variables)
        memory_budget = check_memory_budget(memory_budget)
        x, y, weights = read_data(x, y)
        if weights is not None:
            raise ValueError(
                "the dataset's batches carry sample weights; laplace takes none: "
                "give batches of (x, y)."
            )
        if y is None:
            raise ValueError("y is missing: pass the targets, or a dataset of (x, y).")
        refuse_non_finite(x, "x")
        refuse_non_finite(y, "y")
        self.model = model
        # a likelihood is a sum over the data: Keras's reduction (a mean) is
        # for training, not for the posterior (as laplace-torch sums)
        self.loss = output_loss(loss, model, x).summed()
        self.regression = self.loss.name == "squared_error"
        self.sigma_noise = self._sigma(sigma_noise)
        self.memory_budget = memory_budget  # None: the planner's policy
        if variables is None:
            variables = self._default_variables(model, x, last_layer)
        self.variables = variables
        self.mean = flat_params(model, variables=variables)
        self.n_params = self.mean.size
        self._group_parameters()
        self.prior_precision = self._prior(prior_precision)
        self._inputs = _per_sample_shapes(x)
        self.n_data = int(n_samples(x))
        self.f_train = self._outputs(x)
        self.n_outputs = self.f_train.shape[1]
        self.y_train = self.loss.targets(y, self.f_train)  # checks y's shape
        several = len(getattr(self.loss, "heads", ())) > 1  # y: one per head
        self._y = tf.nest.map_structure(np.asarray, y) if several else np.asarray(y)
        self._summed_loss = None
        self.dense = self._dense_structure(x)
        self.jacobian_form = "general" if self.dense is None else "dense"
        self._fit(x)

    def __repr__(self):
        shown = ", ".join(f"{d:.4g}" for d in np.atleast_1d(self.prior_precision))
        shown = shown if np.ndim(self.prior_precision) == 0 else f"[{shown}]"
        return (
            f"Laplace({self.structure!r}, {self.loss.name!r}, m={self.n_params}, "
            f"prior_precision={shown}, sigma_noise={self.sigma_noise:.4g}, "
            f"jacobian={self.jacobian_form!r})"
        )

    # -- what each structure fills in ---------------------------------------------
    # _fit(x) sets ggn; at delta and sigma^2 (_values): _precision, _log_det,
    # _covariance_diagonal, _covariance_times (or _jacobian_variance), _dense_parts

    def _check_last_layer(self, variables):
        """Refuse ``last_layer=`` (given), which only the last layer takes."""
        raise ValueError(
            f"last_layer= chooses the layers of the 'last_layer' structure; "
            f"for {self.structure!r} pass variables=[...] instead."
        )

    def _default_variables(self, model, x, last_layer):
        """The variables without ``variables=``: None, every trainable one."""
        return None

    def _jacobian_variance(self):
        """At the stored values, J (c, l, m) -> J Sigma J.T (c, l, l)."""
        delta, s2 = self._values(None, None)

        def variance(J):
            c, width = J.shape[:2]
            SJ = self._covariance_times(J.reshape(c * width, -1).T, delta, s2)
            return np.einsum("ckp,pcj->ckj", J, SJ.reshape(-1, c, width))

        return variance

    # -- the prior, per layer ---------------------------------------------------

    def _group_parameters(self):
        """``layer_names``, per parameter the index of its layer, and per
        variable the layer that holds it (``_holders``)."""
        variables = self.variables
        if variables is None:
            variables = self.model.trainable_variables
        self._holders = owners = _owners(self.model, variables)
        names, index, group = [], {}, []
        for v, owner in zip(variables, owners, strict=True):
            key = id(owner) if owner is not None else ("variable", id(v))
            if key not in index:  # a variable outside any layer: named by its path
                index[key] = len(names)
                path = str(getattr(v, "path", None) or v.name)
                names.append(owner.name if owner is not None else path)
            group.append(np.full(int(np.prod(v.shape)), index[key]))
        self.layer_names = names
        self._group = np.concatenate(group) if group else np.zeros(0, int)
        self._group_sizes = np.bincount(self._group, minlength=len(names))

    def _prior(self, prior_precision):
        """delta as a float, or as an array with one value per layer."""
        if isinstance(prior_precision, Mapping):
            if len(set(self.layer_names)) != len(self.layer_names):
                raise ValueError(
                    f"the posterior's layers {self.layer_names} share names, so a "
                    "dict cannot tell them apart: pass prior_precision as a "
                    "sequence in the order of .layer_names."
                )
            unknown = sorted(set(map(str, prior_precision)) - set(self.layer_names))
            missing = [n for n in self.layer_names if n not in prior_precision]
            if unknown or missing:
                raise ValueError(
                    f"prior_precision as a dict needs one value for each layer of "
                    f"the posterior, {self.layer_names}; "
                    + (f"unknown: {unknown}" if unknown else "")
                    + ("; " if unknown and missing else "")
                    + (f"missing: {missing}" if missing else "")
                    + ". Or pass one number for every layer."
                )
            prior_precision = [prior_precision[n] for n in self.layer_names]
        if np.ndim(prior_precision) == 0:
            return _positive(prior_precision, "prior_precision")
        values = np.asarray(prior_precision, dtype=np.float64)
        if values.shape != (len(self.layer_names),):
            raise ValueError(
                f"prior_precision per layer needs one value for each of the "
                f"{len(self.layer_names)} layers of the posterior "
                f"({self.layer_names}); got shape {values.shape}. Pass a "
                "number, a dict {layer name: value}, or a sequence in that order."
            )
        if not np.all(np.isfinite(values) & (values > 0)):
            raise ValueError(
                f"prior_precision must be positive numbers; got {values.tolist()}."
            )
        return values

    @property
    def prior_precision_by_layer(self):
        """delta of each layer, ``{layer name: delta}`` (a scalar repeated).
        Introduced in ``11-curvature-and-uncertainty``."""
        values = np.broadcast_to(self.prior_precision, (len(self.layer_names),))
        return dict(zip(self.layer_names, map(float, values), strict=True))

    # -- the pieces -----------------------------------------------------------

    def _outputs(self, x):
        """f(x) as (n, l) float64 rows."""
        if isinstance(self.model, keras.Model):
            out = self.model(x, training=False)
        else:
            out = self.model(x)
        return np.asarray(as_rows(out, int(n_samples(x))), dtype=np.float64)

    def _chunks(self, x):
        """The plan of x's chunks whose J fits in the memory budget."""
        row_bytes = 8 * max(1, self.n_outputs) * self.n_params
        return plan_chunks(
            int(n_samples(x)), per_sample=row_bytes, memory_budget=self.memory_budget
        )

    def _summed(self, x, rule):
        """The float64 sum over x's chunks of ``rule(phi, A, H)`` from the
        Dense layer's inputs, or of ``rule(J, H)`` without the Dense form."""

        def chunk(start, stop):
            part, y = take(x, start, stop), take(self._y, start, stop)
            H = self.loss.hessian(self.f_train[start:stop], y)
            if self.dense is None:
                return rule(self._jacobian(part), H)
            phi, _, A = self.dense.head(part)
            return rule(phi, A, H)

        return sum_chunks(self._chunks(x), chunk)

    def _jacobian(self, x):
        """J of the structure's variables, (n, l, m) float64."""
        J = best_jacobian(self.model, x, variables=self.variables)  # one chunk
        return np.asarray(J, dtype=np.float64)

    def _dense_structure(self, x):
        """The ``DenseLastLayer`` of the variables, or None (the general J)."""
        owners, few = self._holders, min(self.n_data, 8)
        one = bool(owners) and all(o is owners[0] for o in owners)
        if not (one and isinstance(self.model, keras.Model)):
            return None
        variables = self.variables or self.model.trainable_variables
        return dense_last_layer(
            self.model, variables, owners[0], take(x, 0, few), self.f_train[:few]
        )

    # -- the posterior --------------------------------------------------------

    def _sigma(self, sigma_noise):
        """sigma as a float: positive, and 1 for a classification."""
        sigma = _positive(sigma_noise, "sigma_noise")
        if not self.regression and sigma != 1.0:
            raise ValueError(
                f"sigma_noise={sigma_noise!r} is for a regression; a "
                f"classification ({self.loss.name}) has no observation noise. "
                "Leave sigma_noise at 1."
            )
        return sigma

    def _values(self, prior_precision, sigma_noise):
        """(delta: a float, or per-layer values repeated to one per parameter
        (m,); sigma^2)."""
        delta = self._prior(
            self.prior_precision if prior_precision is None else prior_precision
        )
        if np.ndim(delta) != 0:
            delta = delta[self._group]
        sigma = self.sigma_noise if sigma_noise is None else sigma_noise
        return delta, self._sigma(sigma) ** 2

    def posterior_precision(self):
        """P = G / sigma^2 + diag(delta), a NumPy array: (m, m) for
        ``"last_layer"``, its diagonal (m,) for ``"diagonal"``; ValueError for
        ``"kfac"``, whose P is never formed (use :meth:`predictive_variance`
        or the ``KFAC`` in ``ggn``). Introduced in
        ``11-curvature-and-uncertainty``."""
        return self._precision(*self._values(None, None))

    def posterior_covariance(self):
        """Sigma = P^-1, a NumPy array: (m, m) for ``"last_layer"`` (by
        Cholesky solves, so small last layers only), its diagonal (m,) for
        ``"diagonal"``; ValueError for ``"kfac"`` (use ``ggn.inverse_matvec``).
        Introduced in ``11-curvature-and-uncertainty``."""
        return self._inverse(self.posterior_precision())

    def log_det_posterior_precision(self, prior_precision=None, sigma_noise=None):
        """log det P, a float, at the stored (or the given) delta (one or per
        layer) and sigma. Introduced in ``11-curvature-and-uncertainty``."""
        return self._log_det(*self._values(prior_precision, sigma_noise))

    def predictive_variance(self, x_test):
        """The linearized predictive covariance ``J* Sigma J*.T`` per point.

        ``x_test``: test inputs shaped like the training inputs. Returns an
        array (n_test, l, l), without observation noise. J* is taken in
        chunks that fit the memory budget; for ``"diagonal"`` and ``"kfac"``
        no m x m matrix is formed, and over one Dense layer
        (``jacobian_form == "dense"``) J* is never formed. Introduced in
        ``11-curvature-and-uncertainty``.

        Raises:
            ValueError: x_test's per-sample shape differs from the training
                inputs', or x_test holds NaN or infinity.
        """
        return self._variance_and_outputs(x_test)[0]

    def _variance_and_outputs(self, x_test):
        """(J* Sigma J*.T (n, l, l), f(x_test) (n, l) from the same pass
        with the Dense form, or None)."""
        x_test = read_data(x_test, inputs=inputs_of(self.model))[0]
        self._check_inputs(x_test)
        refuse_non_finite(x_test, "x_test")
        n, width = int(n_samples(x_test)), self.n_outputs
        var, f = np.empty((n, width, width)), None
        form = self._dense_form()
        if form is not None:  # J = A (phi (x) I): never formed
            f = np.empty((n, width))
            for start, stop in self._chunks(x_test):
                var[start:stop], f[start:stop] = self.dense.variance(
                    take(x_test, start, stop), *form
                )
        else:
            variance = self._jacobian_variance()
            for start, stop in self._chunks(x_test):
                var[start:stop] = variance(self._jacobian(take(x_test, start, stop)))
        return 0.5 * (var + np.transpose(var, (0, 2, 1))), f

    def _dense_form(self):
        """``(form, parts)`` of Sigma for ``DenseLastLayer.variance`` at the
        stored delta and sigma, or None (the general J)."""
        if self.dense is None:
            return None
        return self._dense_parts(*self._values(None, None))

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
            samples, seed: a classification: the number of Monte Carlo
                draws (None: the probit approximation) and their seed.

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
        var, f = self._variance_and_outputs(x_test)
        if f is None:
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
        """log p(y | theta*), a float: minus the summed cross-entropy, or the
        Gaussian log likelihood of a regression with noise sigma (default:
        the stored one). Introduced in ``11-curvature-and-uncertainty``."""
        _, s2 = self._values(None, sigma_noise)
        if self._summed_loss is None:  # the data are fixed: summed once
            losses = self.loss.value(self.f_train, self.y_train)
            self._summed_loss = float(np.sum(losses))
        if not self.regression:
            return -self._summed_loss
        count = self.n_data * self.n_outputs
        return -self._summed_loss / s2 - 0.5 * count * math.log(2 * math.pi * s2)

    def log_marginal_likelihood(self, prior_precision=None, sigma_noise=None):
        """laplace-torch's Laplace log marginal likelihood, a float.

        ``log p(y|theta*) - 0.5 (log det P - log det P0) - 0.5 theta*.T P0
        theta*`` with ``P0 = diag(delta)`` over the structure's m
        parameters, at ``prior_precision`` (delta, one or per layer) and
        ``sigma_noise`` (sigma, a regression only), each by default the
        stored one. Unlike laplace-torch it does not store the values it is
        given. Introduced in ``11-curvature-and-uncertainty``.

        Raises:
            ValueError: a value that is not positive, or sigma_noise for a
                classification.
        """
        delta, _ = self._values(prior_precision, sigma_noise)
        log_det = self.log_det_posterior_precision(prior_precision, sigma_noise)
        if np.ndim(delta) == 0:
            log_det_ratio = log_det - self.n_params * math.log(delta)
            scatter = delta * float(self.mean @ self.mean)
        else:
            log_det_ratio = log_det - float(np.sum(np.log(delta)))
            scatter = float(np.sum(delta * self.mean**2))
        return self.log_likelihood(sigma_noise) - 0.5 * (log_det_ratio + scatter)

    def _layerwise_gradient(self, values, sigma):
        """d log marginal likelihood / d log delta_g, per layer g:
        ``0.5 m_g - 0.5 delta_g (tr Sigma_gg + |theta*_g|^2)``."""
        delta, s2 = self._values(values, sigma)
        per_parameter = self._covariance_diagonal(delta, s2) + self.mean**2
        traces = np.bincount(self._group, per_parameter, len(self.layer_names))
        return 0.5 * self._group_sizes - 0.5 * np.asarray(values) * traces

    def optimize_prior_precision(
        self, method="marglik", *, sigma_noise=None, prior_structure=None,
        bounds=(1e-4, 1e4), sigma_bounds=(1e-3, 1e3),
    ):  # fmt: skip
        """Choose delta (and sigma) that maximize the marginal likelihood.

        One delta: log delta is optimized by bounded Brent search. One delta
        per layer (laplace-torch's ``prior_structure="layerwise"``): from
        the best single delta, L-BFGS-B on the log deltas with the exact
        gradient ``0.5 m_g - 0.5 delta_g (tr Sigma_gg + |theta*_g|^2)``.
        With ``sigma_noise="fit"`` (a regression) log sigma is searched
        outside it, each sigma with its best delta. The values are stored.
        Introduced in ``11-curvature-and-uncertainty``.

        Args:
            method: ``"marglik"``, the only one.
            sigma_noise: ``"fit"`` to choose sigma as well, or None to keep it.
            prior_structure: ``"scalar"`` (one delta), ``"layerwise"`` (one
                per entry of :attr:`layer_names`), or None: the shape of the
                stored ``prior_precision``.
            bounds, sigma_bounds: the ranges of delta and sigma.

        Returns:
            ``(prior_precision, sigma_noise)``, the values now stored (delta a
            float, or an array per layer).

        Raises:
            ValueError: another method or prior structure, ``"fit"`` for a
                classification, or bounds that are not positive and
                increasing.
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
        if prior_structure is None:  # the stored prior's shape
            stored = np.ndim(self._prior(self.prior_precision))
            prior_structure = "layerwise" if stored else "scalar"
        if prior_structure not in PRIOR_STRUCTURES:
            raise ValueError(
                "prior_structure must be 'scalar', 'layerwise' or None (the "
                f"stored prior's shape); got {prior_structure!r}."
            )
        low, high = (_positive(b, "bounds") for b in bounds)
        if not low < high:
            raise ValueError(
                f"bounds must be (low, high) with low < high; got {bounds}."
            )
        log_bounds = (math.log(low), math.log(high))

        def best_scalar(sigma):
            result = scipy.optimize.minimize_scalar(
                lambda t: -self.log_marginal_likelihood(math.exp(t), sigma),
                bounds=log_bounds,
                method="bounded",
                options={"xatol": 1e-8},
            )
            return math.exp(result.x), -result.fun

        def best_delta(sigma):
            delta, value = best_scalar(sigma)
            if prior_structure == "scalar":
                return delta, value
            groups = len(self.layer_names)

            def objective(t):
                values = np.exp(t)
                value = -self.log_marginal_likelihood(values, sigma)
                return value, -self._layerwise_gradient(values, sigma)

            result = scipy.optimize.minimize(
                objective,
                np.full(groups, math.log(delta)),
                jac=True,
                method="L-BFGS-B",
                bounds=[log_bounds] * groups,
                options={"ftol": 1e-14, "gtol": 1e-9, "maxiter": 500},
            )
            return np.exp(result.x), -float(result.fun)

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
