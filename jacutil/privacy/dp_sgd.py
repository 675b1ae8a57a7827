"""DP-SGD for any Keras 3 model, by ghost clipping (notebook 09-matrix-free).

Differentially private SGD (Abadi et al., 2016) clips each sample's gradient
to norm at most C, sums, adds Gaussian noise N(0, sigma^2 C^2) to every
coordinate and divides by the batch size. Ghost clipping (Opacus' "fast
gradient clipping", Li et al., 2022) never forms the per-sample gradients:

1. the norms ``|g_i|`` from :func:`per_sample_gradient_norms`;
2. the weights ``w_i = min(1, C / |g_i|)``, so that ``w_i g_i`` is ``g_i``
   clipped to norm C;
3. one ordinary backward pass of ``sum_i w_i L_i``, whose gradient is
   ``sum_i w_i g_i``, the clipped sum, in a compiled ``tf.function`` - or,
   in the fused sampled step where every layer holding a variable is a
   Dense or a convolution, ``a.T @ (w * delta)`` (a convolution's filter
   gradient of ``w * delta``) from the signals the norms' pass already
   holds ("book-keeping", Bu et al., 2023: no second pass);
4. the noise from a seeded ``tf.random.Generator``, then
   ``optimizer.apply_gradients``.

:class:`DPSGD` is the step: the four steps around a model, a loss and a
Keras optimizer, each step counted in a ledger under the sigma it ran with.
It keeps no training loop: ``model.fit`` is the loop
(:func:`jacutil.privacy.make_private` makes each of its steps a
:meth:`DPSGD.sampled_step`), or a loop of one's own calls the steps.

Its parts live beside it: the sampling (:mod:`jacutil.privacy.sampling`),
the clipping (:mod:`jacutil.privacy.clip_groups`, and
:mod:`jacutil.privacy.adaptive_clip`), the noise (:mod:`jacutil.privacy.noise`)
and the accounting (:mod:`jacutil.privacy.accounting`: Google's
``dp-accounting``, not our own accountant, imported only when epsilon is
asked for; no release of it installs with ``requirements.lock`` by pip's
resolver, so it is an optional extra installed without its pins).
"""

import warnings
from functools import partial
from types import SimpleNamespace

import numpy as np

from ..core._tf import tf
from ..core.batch import n_samples, take
from ..core.graph_calls import SignatureCalls
from ..core.internals import layers_within
from ..fitting.loss_gradients import (
    gradients_for,
    loss_signal,
    losses_per_sample,
    per_sample_gradient_norms,
    per_sample_gradients,
    prepared,
)
from ..rules.walk import Weighing
from .accounting import dp_event
from .clip_groups import ClipGroups
from .config import DPConfig, check_noise_multiplier
from .ledger import PrivacyLedger
from .noise import random_sources, standard_normal
from .sampling import check_batch_size, padded_size, poisson_batch

FROZEN = frozenset(  # DPSGD's attributes fixed when built (its DPConfig)
    {"config", "clip", "l2_norm_clip", "adaptive_clip", "max_physical_batch_size",
     "secure_mode"}
)  # fmt: skip


def added(sums, found):
    """``found`` added to ``sums`` (None: nothing yet), variable by variable:
    the clipped sums of gradient accumulation's passes."""
    if sums is None:
        return list(found)
    return [a + b for a, b in zip(sums, found, strict=True)]


def _take(data, index):
    return tf.nest.map_structure(lambda a: tf.gather(a, index), data)


def refuse_activity_regularizers(model):
    """An activity regularizer's loss depends on the samples, so adding its
    gradient unclipped would break the privacy guarantee: refuse it where the
    loss reads the output alone (a loss function of ``(y, prediction)``;
    ``make_private``'s :class:`jacutil.privacy.keras_loss.KerasLoss` clips
    it with each sample's loss instead)."""
    for layer in layers_within(model, include_self=False):
        if getattr(layer, "activity_regularizer", None) is not None:
            raise ValueError(
                f"layer {layer.name!r} has an activity_regularizer: its loss "
                "depends on the samples and would reach the update unclipped, "
                "which breaks DP-SGD's guarantee. Remove it (weight "
                "regularizers such as kernel_regularizer are fine: they are "
                "added outside the clipping)."
            )


class DPSGD:
    """Differentially private SGD for a Keras 3 model, by ghost clipping.

    Each step takes the four steps of this module's docstring, with noise of
    standard deviation ``noise_multiplier * l2_norm_clip``;
    :meth:`sampled_step` Poisson-samples its batch, as the accountant of
    :meth:`epsilon` assumes (``make_private``'s ``model.fit`` takes its steps
    there). Introduced in ``09-matrix-free``.

    The model runs in inference mode (``training=False``) in both passes:
    the norms and the backward pass are two forward passes, and a dropout
    mask drawn twice would make the norms those of other gradients. Neither
    random generator is cryptographically secure (as in Opacus without
    ``secure_mode``): this is for learning and research, not for a release.
    ``trace_count`` counts the traces of the compiled step (one per shape of
    the batch, whatever the data's values); ``steps`` the steps taken.
    ``last_weights`` holds the clip weights of the last step, one per row of
    its (padded) batch, and ``last_index`` which samples those rows were: what
    a test checks the clip invariant on, whichever way the step ran.
    ``bookkept`` says whether the fused step took its clipped sum by
    book-keeping (set ``bookkeeping = False`` before the first step for the
    second pass instead).

    Weight regularizers (``kernel_regularizer=...``) depend on no sample: the
    gradient of ``sum(model.losses)`` is added once to each update, outside
    the clipping and the noise, as Keras's ``fit`` adds it to the loss - so
    with no noise and a large C a step is Keras's own. An activity
    regularizer depends on the samples and would escape the clipping of a
    loss function of ``(y, prediction)``: such a model is refused (unless
    the loss reads the forward pass, as ``make_private``'s Keras loss does).
    A sample whose gradient is not finite (NaN or infinity) contributes
    nothing to its step; ``skipped`` counts them and a ``RuntimeWarning``
    says so (with ``quiet_skips``, as in ``make_private``, nothing is said:
    the count is a fact about the data that no noise covers, so do not
    release ``skipped``). NaN or infinity in ``x`` or ``y`` is refused.

    Args:
        model: a Keras 3 model (any model that ``per_sample_gradient_norms``
            takes); its trainable variables are trained.
        loss_fn: ``loss_fn(y, prediction)`` returning one loss per sample,
            shape (n,), e.g. ``keras.losses.sparse_categorical_crossentropy``.
        optimizer: a Keras 3 optimizer, e.g. ``keras.optimizers.SGD(0.1)``.
        l2_norm_clip: C, the largest norm a sample's gradient may keep (> 0);
            or ``{layer name: C_g}`` for per-layer clipping
            (:class:`jacutil.privacy.clip_groups.ClipGroups`), when
            ``l2_norm_clip`` the attribute is ``sqrt(sum C_g^2)``, the noise's
            scale.
        noise_multiplier: sigma, the noise's standard deviation in units of C
            (>= 0; 0 clips without noise and gives no privacy).
        seed: seeds the noise and the sampling: the same seed, model
            and data give the same steps - and anyone who knows the seed can
            replay the noise and subtract it, so a seeded run is for
            teaching and tests, never private. None (the default): a fresh
            state from the operating system's entropy each run.
        secure_mode: draw the sampling and the noise from the operating
            system's secure source (:class:`jacutil.privacy.noise.
            SecureRandom`) instead of seeded generators; slower (the noise
            leaves the graph for NumPy), and refuses a seed, since a seeded
            run can be replayed.
        max_physical_batch_size: the most rows a pass holds: a larger batch
            is taken in passes whose clipped sums are added before the noise
            (gradient accumulation, the same step in less memory). None:
            the whole batch in one pass.
        adaptive_clip: an :class:`jacutil.privacy.adaptive_clip.AdaptiveClip`
            (C follows a quantile of the norms), or None.
        ledger: the :class:`jacutil.privacy.ledger.PrivacyLedger` that counts
            each step under the sigma it ran with (``make_private`` gives the
            model's); None: a new one of this DPSGD's own.
        quiet_skips: say nothing of samples of non-finite gradient (private
            training: their count is not covered by the noise).
        on_step: ``on_step(losses, y, prediction, valid) -> logs``, traced
            into the fused step (``make_private``'s metrics), or None.

    Examples:
        >>> import numpy as np
        >>> from jacutil import keras
        >>> from jacutil.privacy.dp_sgd import DPSGD
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> dp = DPSGD(model, keras.losses.mean_squared_error,
        ...            keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
        ...            noise_multiplier=1.1, seed=0)
        >>> x = np.random.default_rng(0).normal(size=(8, 3))
        >>> losses = dp.step(x, np.zeros((8, 2)))  # one loss per sample
        >>> losses.shape, dp.steps, dp.trace_count
        ((8,), 1, 1)
    """

    def __init__(
        self,
        model,
        loss_fn,
        optimizer,
        *,
        l2_norm_clip,
        noise_multiplier,
        seed=None,
        secure_mode=False,
        max_physical_batch_size=None,
        adaptive_clip=None,
        ledger=None,
        quiet_skips=False,
        on_step=None,
    ):
        config = DPConfig(
            l2_norm_clip, noise_multiplier, adaptive_clip,
            max_physical_batch_size, seed, bool(secure_mode),
        )  # fmt: skip
        self._noise, self._sampler = random_sources(seed, secure_mode)
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.variables = list(model.trainable_variables)
        if not self.variables:
            raise ValueError("the model has no trainable variables to train.")
        self._config = config
        self._clip = ClipGroups(model, self.variables, l2_norm_clip)
        if adaptive_clip is not None:
            self._clip.adapt()
        # sigma (what the accountant composes) and the gradient's noise
        # multiplier (larger under adaptive clipping), read by the compiled
        # step each time it runs: a new sigma is the next step's, and the
        # ledger counts each step under the sigma it ran with
        self._sigma = tf.Variable(config.noise_multiplier, dtype=tf.float64,
                                  trainable=False)  # fmt: skip
        self._gradient_sigma = tf.Variable(0.0, dtype=tf.float64, trainable=False)
        self.noise_multiplier = config.noise_multiplier
        self.dtype = tf.as_dtype(self.variables[0].dtype)
        if not hasattr(loss_fn, "of_sample"):  # a loss of the output alone
            refuse_activity_regularizers(model)
        self.skipped = 0  # samples whose gradient was not finite
        if not optimizer.built:  # a compiled model's optimizer may be built already
            optimizer.build(self.variables)
        self.seeded = seed is not None
        self._checked_losses = False
        self.trace_count = 0
        self._compiled_sum = tf.function(self.clipped_sum, autograph=False)
        self._compiled_update = tf.function(self.noisy_update, autograph=False)
        self._fused = None  # (x, y, the compiled sampled steps or None)
        self.last_weights = None  # the clip weights of the last step, row by row
        self.last_index = None  # which samples of x its rows were (padding too)
        self._sampled = None  # how many rows of the step being taken are samples
        # the released noisy count of the last step under adaptive clipping
        self.last_released_count = None
        # the fused step's clipped sum from the norms' pass where the rules
        # can (book-keeping); False: always a second, weighted pass
        self.bookkeeping = True
        self.bookkept = False  # whether the last fused step was built so
        # traced into the fused one-pass step: on_step(losses, y, prediction,
        # valid) -> logs, kept in last_logs (make_private's metrics: one graph
        # call a step, not two); None elsewhere
        self.on_step = on_step
        self.last_logs = None
        # the one record of what ran: every step by its (sigma, rate)
        # (make_private gives the model's: jacutil.privacy.ledger)
        self.ledger = PrivacyLedger() if ledger is None else ledger
        self.quiet_skips = bool(quiet_skips)  # see _count_skipped
        # an audit's gradient canaries (jacutil.privacy.audit.CanaryAudit):
        # each step adds the clipped ones its Poisson draw took
        self.canaries = None

    # -- the configuration: frozen, but for sigma --------------------------------

    @property
    def config(self):
        """The :class:`jacutil.privacy.config.DPConfig` this was built with
        (its ``noise_multiplier`` is the first sigma)."""
        return self._config

    @property
    def clip(self):
        """The clip groups (:class:`ClipGroups`), fixed when built."""
        return self._clip

    @property
    def l2_norm_clip(self):
        """C (``sqrt(sum C_g^2)`` per layer) at the start: the noise's scale.
        Fixed when built: a new C is a new DPSGD (or ``make_private``)."""
        return self._clip.total

    @property
    def adaptive_clip(self):
        """The :class:`AdaptiveClip` settings, or None; fixed when built."""
        return self._config.adaptive_clip

    @property
    def max_physical_batch_size(self):
        """The most rows one pass holds (None: the whole batch); fixed."""
        return self._config.max_physical_batch_size

    @property
    def secure_mode(self):
        """Whether the noise and sampling come from ``os.urandom``; fixed."""
        return self._config.secure_mode

    def __setattr__(self, name, value):
        if name == "gradient_noise_multiplier":
            raise AttributeError(
                "DPSGD.gradient_noise_multiplier follows noise_multiplier (and "
                "the adaptive clipping's count): set noise_multiplier, which "
                "the ledger accounts step by step."
            )
        if name in FROZEN:
            raise AttributeError(
                f"DPSGD.{name} is fixed when the DPSGD is built (its DPConfig): "
                "the clipping and the accounting rest on it. Build a new DPSGD, "
                "or call make_private again; only noise_multiplier may change "
                "between steps (each step is accounted under the sigma it ran "
                "with)."
            )
        super().__setattr__(name, value)

    @property
    def noise_multiplier(self):
        """sigma (z), what the accountant composes for the next step. It may
        change between steps (a noise schedule): the compiled step reads it
        each time it runs, and the ledger counts each step under the sigma
        it ran with."""
        return float(self._sigma.numpy())

    @noise_multiplier.setter
    def noise_multiplier(self, value):
        value = check_noise_multiplier(value)
        adaptive = self.adaptive_clip
        # the gradient's noise multiplier: z, or under adaptive clipping the
        # larger z_grad that leaves the count's noise its share of z's privacy
        gradient = (
            value if adaptive is None else adaptive.gradient_noise_multiplier(value)
        )
        self._sigma.assign(value)
        self._gradient_sigma.assign(gradient)

    @property
    def gradient_noise_multiplier(self):
        """The gradient's noise in units of C: sigma, or under adaptive
        clipping the larger z_grad that pays for the count (read-only: it
        follows :attr:`noise_multiplier`)."""
        return float(self._gradient_sigma.numpy())

    def switch_noise_off_unaccounted(self):
        """A deliberate bug, for audits and teaching only: from the next
        step on the gradient gets no noise while the ledger still counts
        sigma - the failure a canary audit
        (:class:`jacutil.privacy.audit.CanaryAudit`) exists to catch.
        Never call it on a run whose epsilon you report."""
        self._gradient_sigma.assign(0.0)

    def rebuilt(self, loss_fn, optimizer):
        """A DPSGD for the same model with another loss and optimizer (the
        model compiled again), that carries on this one's noise multiplier,
        clip norms, random state (never a replayed draw), ledger and
        settings. Introduced in ``09-matrix-free``."""
        config = self._config
        other = DPSGD(
            self.model, loss_fn, optimizer,
            l2_norm_clip=config.l2_norm_clip, noise_multiplier=self.noise_multiplier,
            max_physical_batch_size=config.max_physical_batch_size,
            adaptive_clip=config.adaptive_clip, ledger=self.ledger,
            quiet_skips=self.quiet_skips, on_step=self.on_step,
        )  # fmt: skip
        other._config = config
        other._clip = self._clip  # C as it has adapted
        other.seeded = self.seeded
        other._noise, other._sampler = self._noise, self._sampler
        other.skipped = self.skipped
        other.bookkeeping = self.bookkeeping
        other._sigma, other._gradient_sigma = self._sigma, self._gradient_sigma
        other.canaries = self.canaries
        return other

    def denominator(self, size):
        """What the noisy sum is divided by for a batch of expected ``size``:
        the size, or 1 where the loss's batch value is the sum of its
        samples' (``loss_fn.aggregation == "sum"``: Keras's reduction="sum")."""
        return 1 if getattr(self.loss_fn, "aggregation", "mean") == "sum" else size

    @property
    def steps(self):
        """The steps in :attr:`ledger` (what the accountant composes)."""
        return self.ledger.steps

    @property
    def steps_at(self):
        """``{sampling rate: steps taken at it}`` over every sigma of the
        ledger, a copy."""
        found = {}
        for (_, rate), count in self.ledger.events.items():
            found[rate] = found.get(rate, 0) + count
        return found

    # -- one step ---------------------------------------------------------------

    def clipped_noisy_update(self, x, y, weights, denominator):
        """Compiled: the clipped sum by one backward pass, the noise, the update.

        ``weights`` are each sample's ``min(1, C / |g_i|)`` from the norms, so that
        one backward pass of the weighted loss gives the sum of the clipped
        gradients (:meth:`clipped_sum`); :meth:`noisy_update` adds the noise and
        applies it. Notebook 09 shows it."""
        sums, losses, prediction = self.clipped_sum(x, y, weights)
        self.noisy_update(sums, denominator)
        return losses, prediction

    def clipped_sum(self, x, y, weights):
        """``(sums, losses, prediction)``: ``sum_i w_i g_i`` per variable by one
        backward pass of ``sum_i w_i L_i``, and the losses and predictions of
        its forward pass. With per-layer clipping, ``weights`` has a column
        per group (``w_ig = min(1, C_g / |g_ig|)``) and each group's variables
        take the gradient of their own weighted sum, from the same forward
        pass. Gradient accumulation adds the sums of several batches."""
        self.trace_count += 1
        groups = self.clip.groups
        with tf.GradientTape(persistent=len(groups) > 1) as tape:
            prediction = self.model(x, training=False)
            losses = losses_per_sample(self.loss_fn, y, prediction, n_samples(x))
            weights = tf.reshape(tf.cast(weights, losses.dtype), [-1, len(groups)])
            weighted = [tf.reduce_sum(w * losses) for w in tf.unstack(weights, axis=1)]
        sums = [None] * len(self.variables)
        for total, (_, indices, _) in zip(weighted, groups, strict=True):
            found = tape.gradient(total, [self.variables[i] for i in indices])
            for i, gradient in zip(indices, found, strict=True):
                sums[i] = gradient
        sums = [  # None: the loss does not depend on this variable; an
            # embedding's IndexedSlices made dense (the noise is dense anyway)
            tf.zeros(v.shape, v.dtype) if s is None else tf.convert_to_tensor(s)
            for s, v in zip(sums, self.variables, strict=True)
        ]
        return sums, losses, prediction

    def noisy_update(self, sums, denominator):
        """The clipped ``sums`` plus Gaussian noise of standard deviation
        ``noise_multiplier * l2_norm_clip``, divided by ``denominator``, plus
        the weight penalties' gradient, applied by the optimizer. Sigma and
        C are read from their variables each time the step runs, so the
        noise is always the one the ledger counts."""
        penalties = self.penalty_gradients()  # no sample in it: not clipped
        std = tf.convert_to_tensor(self._gradient_sigma) * tf.cast(
            self.clip.current(), tf.float64
        )
        updates = []
        scale = self.optimizer.scale_loss(1.0)  # 1.0 but under loss scaling
        for total, penalty, variable in zip(
            sums, penalties, self.variables, strict=True
        ):
            dtype = tf.as_dtype(variable.dtype)
            noise = self._noise.normal(variable.shape, dtype=dtype)
            total = total + tf.cast(std, dtype) * noise
            update = total / tf.cast(denominator, dtype)
            update = update if penalty is None else update + penalty
            # in the loss's scale, as Keras's train_step hands them over: a
            # LossScaleOptimizer (mixed precision) divides by it again
            if not (isinstance(scale, float) and scale == 1.0):
                update = update * tf.cast(scale, dtype)
            updates.append(update)
        self.optimizer.apply_gradients(zip(updates, self.variables, strict=True))
        return tf.constant(True)

    def penalty_gradients(self):
        """The gradient of the weight regularizers (``v.regularizer(v)`` of
        each trainable weight, as Keras adds them to ``model.losses``), per
        variable (None where there is none): no sample enters it, so it is
        added to the update as it is, outside the clipping - unless the loss
        clips it with each sample's (``loss_fn.penalty_outside`` False: a
        model's own ``compute_loss``)."""
        if not getattr(self.loss_fn, "penalty_outside", True):
            return [None] * len(self.variables)
        with tf.GradientTape() as tape:
            penalties = [
                tf.cast(v.regularizer(v), self.dtype)
                for v in self.model.trainable_weights
                if getattr(v, "regularizer", None) is not None
            ]
            if not penalties:
                return [None] * len(self.variables)
            total = tf.add_n(penalties)
        return tape.gradient(total, self.variables)

    def as_inputs(self, x, y):
        """``x`` and ``y`` as tensors, floating ones in the model's dtype
        (already such tensors: unchanged, no copy)."""

        def cast(a):
            a = tf.convert_to_tensor(a)
            return tf.cast(a, self.dtype) if a.dtype.is_floating else a

        return tf.nest.map_structure(cast, x), tf.nest.map_structure(cast, y)

    def _check_losses(self, x, y):
        """Once: the loss gives one loss per sample (a cheap forward pass on
        two samples), before the norms would fail less clearly."""
        if self._checked_losses or getattr(self.loss_fn, "reads_forward", False):
            return  # a loss of the forward pass: KerasLoss.check proved it
        rows = min(2, n_samples(x))
        prediction = self.model(take(x, 0, rows), training=False)
        losses_per_sample(self.loss_fn, take(y, 0, rows), prediction, rows)
        self._checked_losses = True

    def clip_weights(self, x, y):
        """The clip weights ``min(1, C / |g_i|)`` of a batch ``x``, ``y``, from
        its norms: a float64 NumPy array of shape (n,), or (n, groups) with
        per-layer clipping (``min(1, C_g / |g_ig|)``). Introduced in
        ``09-matrix-free``."""
        x, y = self.as_inputs(x, y)
        weights, _ = self._weights(x, y, np.ones(n_samples(x)))
        return self.clip.as_shown(weights)

    def _weights(self, x, y, valid, rows=None):
        """``(weights (rows, groups), skipped (rows,))`` of a batch from its
        norms, one call of the norms per clip group (NumPy arrays). With
        ``rows``, the norms are taken in passes of that many rows, as
        :meth:`padded_step` takes its sums: one shape of batch, and so one
        compiled program, however large the Poisson batch."""
        self._check_losses(x, y)
        total = n_samples(x)
        rows = min(rows or total, total)
        parts = [
            (x, y) if rows == total else (take(x, s, s + rows), take(y, s, s + rows))
            for s in range(0, total, rows)
        ]
        norms = [
            np.concatenate([
                per_sample_gradient_norms(
                    self.model, self.loss_fn, part_x, part_y,
                    variables=None if self.clip.flat else group,
                )
                for part_x, part_y in parts
            ])  # fmt: skip
            for group in self.clip.variables_of(self.variables)
        ]
        weights, skipped = self.clip.weights(
            tf.constant(np.stack(norms, axis=1), tf.float64),
            tf.constant(np.asarray(valid), tf.float64),
        )
        return weights.numpy(), skipped.numpy()

    def padded_step(
        self, x, y, valid, *, denominator, sampling_rate, rows=None, expected=None
    ):
        """One DP-SGD step on a batch ``x``, ``y`` padded to a fixed size (tensors,
        cast as :meth:`step` casts them): the rows whose ``valid`` (shape
        (rows,)) is 0 are padding and weigh nothing. The noisy sum is divided
        by ``denominator``; ``sampling_rate`` is the Poisson rate that drew the
        batch (for the accountant). With ``rows``, the clipped sum is
        accumulated over slices of that many rows (gradient accumulation).
        :meth:`sampled_step` and :meth:`step` take their steps here, where
        the norms are off the layer rules. Introduced in ``09-matrix-free``.

        Returns:
            ``(losses, prediction)``: the per-sample losses before the step
            (NaN where a sample's gradient was not finite) and the model's
            predictions, tensors with one row per padded row.
        """
        total = n_samples(x)
        rows = rows or total
        expected = expected or float(np.sum(valid))  # the batch's size, by default
        if getattr(self.loss_fn, "reads_forward", False):
            return self._general_step(
                x, y, valid, denominator=denominator, sampling_rate=sampling_rate,
                rows=rows, expected=expected,
            )  # fmt: skip
        weights, skipped = self._weights(x, y, valid, rows)
        self.last_weights = self.clip.as_shown(weights)
        kept = (weights > 0).any(axis=1)
        self._count_skipped(skipped, any_kept=bool(kept.any()) or not skipped.any())
        index = np.where(skipped, np.argmax(kept), np.arange(total))
        sums, losses, predictions = self._canary_sum(sampling_rate), [], []
        for start in range(0, total, rows):
            part = index[start : start + rows]
            found, loss, prediction = self._compiled_sum(
                _take(x, part), _take(y, part),
                tf.constant(weights[start : start + rows], self.dtype),
            )  # fmt: skip
            sums = added(sums, found)
            losses.append(loss)
            predictions.append(prediction)
        self._compiled_update(sums, tf.constant(denominator, tf.float64))
        self._count_step(sampling_rate, expected)
        losses = tf.concat(losses, 0) if len(losses) > 1 else losses[0]
        prediction = tf.nest.map_structure(
            lambda *parts: tf.concat(parts, 0), *predictions
        )
        if skipped.any():
            losses = tf.where(skipped, tf.constant(np.nan, losses.dtype), losses)
        return losses, prediction

    def _general_step(
        self, x, y, valid, *, denominator, sampling_rate, rows, expected
    ):
        """:meth:`padded_step` where each sample's loss needs its own forward
        pass (``loss_fn.reads_forward``: a model that adds losses as it runs,
        or computes its loss itself): each pass of ``rows`` rows forms its
        per-sample gradients (autodiff, vectorized over samples), their norms
        per clip group, the weights and the clipped sum ``G.T w``; the noise
        and the update as everywhere. The general path that the layer rules'
        fast paths are proved equal to."""
        total = n_samples(x)
        group_columns, ends = self._columns()
        sums = np.zeros(int(ends[-1]))
        weights, skipped = [], []
        for start in range(0, total, rows):
            part_x, part_y = take(x, start, start + rows), take(y, start, start + rows)
            G = per_sample_gradients(
                self.model, self.loss_fn, part_x, part_y, variables=self.variables
            )
            norms = np.stack(
                [np.linalg.norm(G[:, c], axis=1) for c in group_columns], axis=1
            )
            part_valid = np.asarray(valid[start : start + rows], np.float64)
            w, skip = self.clip.weights(
                tf.constant(norms, tf.float64), tf.constant(part_valid)
            )  # a row of non-finite norm: weight 0, skipped
            w = w.numpy()
            finite = np.isfinite(G).all(axis=1)  # 0 * NaN is NaN: rows left out
            kept_G, kept_w = (G, w) if finite.all() else (G[finite], w[finite])
            for g, c in enumerate(group_columns):
                sums[c] += kept_w[:, g] @ kept_G[:, c]
            weights.append(w)
            skipped.append(skip.numpy())
        weights, skipped = np.concatenate(weights), np.concatenate(skipped)
        self.last_weights = self.clip.as_shown(weights)
        kept = (weights > 0).any(axis=1)
        self._count_skipped(skipped, any_kept=bool(kept.any()) or not skipped.any())
        found = added(self._canary_sum(sampling_rate), self._as_variables(sums))
        self._compiled_update(found, tf.constant(denominator, tf.float64))
        self._count_step(sampling_rate, expected)
        prediction = self.model(x, training=False)
        if getattr(self.loss_fn, "compiled", True) is not None:
            losses = losses_per_sample(self.loss_fn, y, prediction, total)
        else:  # a loss of model.losses alone: none to show per sample
            losses = tf.zeros([total], self.dtype)
        if skipped.any():
            losses = tf.where(skipped, tf.constant(np.nan, losses.dtype), losses)
        return losses, prediction

    def _columns(self):
        """Each clip group's columns of the flat gradient (``flat_params``
        order: a slice where they run on, so that indexing takes a view),
        and each variable's end column."""
        ends = np.cumsum([int(np.prod(v.shape)) for v in self.variables])
        spans = [np.arange(end - int(np.prod(v.shape)), end)
                 for v, end in zip(self.variables, ends, strict=True)]  # fmt: skip
        groups = []
        for _, indices, _ in self.clip.groups:
            columns = np.concatenate([spans[i] for i in indices])
            if np.array_equal(columns, np.arange(columns[0], columns[-1] + 1)):
                columns = slice(int(columns[0]), int(columns[-1]) + 1)
            groups.append(columns)
        return groups, ends

    def _as_variables(self, flat):
        """A flat (m,) vector as one tensor per variable."""
        _, ends = self._columns()
        return [
            tf.constant(np.reshape(part, v.shape), v.dtype)
            for part, v in zip(np.split(flat, ends[:-1]), self.variables, strict=True)
        ]

    def _canary_sum(self, rate):
        """The clipped sum of the audit's gradient canaries that this step's
        Poisson draw took (each included canary joins at ``rate``, as every
        sample does), clipped by the same weights as the samples', one
        tensor per variable; None without an audit."""
        if self.canaries is None:
            return None
        drawn = self.canaries.drawn(rate, self._sampler)  # (k, m)
        groups, ends = self._columns()
        total = np.zeros(int(ends[-1]))
        if len(drawn):
            norms = np.stack([np.linalg.norm(drawn[:, c], axis=1) for c in groups], 1)
            weights, _ = self.clip.weights(
                tf.constant(norms, tf.float64), tf.ones(len(drawn), tf.float64)
            )
            for g, c in enumerate(groups):
                total[c] = weights.numpy()[:, g] @ drawn[:, c]
        return self._as_variables(total)

    def _count_step(self, rate, expected):
        """One more step at sampling rate ``rate`` of expected batch size
        ``expected``, in :attr:`ledger` under the sigma it ran with; under
        adaptive clipping, C moves for the next step, by the noisy centred
        count of this step's unclipped samples (a weight of 1):
        :meth:`AdaptiveClip.released_count`, the mechanism its accounting
        assumes."""
        self.ledger.record(self.noise_multiplier, rate)
        adaptive = self.adaptive_clip
        if adaptive is not None:
            weights = np.asarray(self.last_weights)
            sampled = len(weights) if self._sampled is None else self._sampled
            unclipped = float(np.sum(weights == 1.0))
            draw = standard_normal(self._noise)
            released = adaptive.released_count(unclipped, sampled, draw)
            self.last_released_count = released
            clip = float(self.clip.current())
            self.clip.variable.assign([adaptive.next_clip(clip, released, expected)])

    def _count_skipped(self, skipped, any_kept):
        """Count and report the samples of non-finite gradient in a step; a
        FloatingPointError when no sample is left. With ``quiet_skips``
        (private training: how many of a batch's samples were skipped is a
        fact about them that no noise covers) nothing is reported: a skipped
        sample is a zero contribution, and a batch of them all a step of
        noise alone."""
        if self.quiet_skips:
            self.skipped += int(np.sum(skipped))
            return
        if not any_kept:
            raise FloatingPointError(
                "every sample of this batch has a non-finite gradient (NaN or "
                "infinity): training has diverged, or the loss takes log(0). "
                "Lower the learning rate, or check the loss on these samples."
            )
        if not skipped.any():
            return
        self.skipped += int(skipped.sum())
        warnings.warn(
            f"DP-SGD: {int(skipped.sum())} sample(s) of this batch have a "
            "non-finite gradient (NaN or infinity) and contribute nothing to "
            f"this step ({self.skipped} so far). Check the loss for log(0) or "
            "an overflow on them.",
            RuntimeWarning,
            stacklevel=5,
        )

    def largest_clipped_norm(self, x, y):
        """The largest ``|w_i g_i| / C`` over the batch (with per-layer
        clipping, over groups too: ``|w_ig g_ig| / C_g``): at most 1 (to
        rounding) is what DP-SGD's guarantee rests on.

        ``g_i`` from a tape per sample, independent of the step's norms: a
        check for a new model or loss (n backward passes), not for each step.
        Takes a batch ``x``, ``y``. Introduced in ``09-matrix-free``.
        """
        weights = np.reshape(self.clip_weights(x, y), (n_samples(x), -1))
        x, y = self.as_inputs(x, y)
        largest = 0.0
        for i in range(n_samples(x)):
            with tf.GradientTape() as tape:
                prediction = self.model(take(x, i, i + 1), training=False)
                loss = tf.reduce_sum(self.loss_fn(y[i : i + 1], prediction))
            grads = tape.gradient(loss, self.variables)
            for g, (_, indices, clip) in enumerate(self.clip.groups):
                squares = [
                    tf.reduce_sum(tf.square(grads[j]))
                    for j in indices
                    if grads[j] is not None
                ]
                norm = float(tf.sqrt(tf.add_n(squares))) if squares else 0.0
                largest = max(largest, weights[i, g] * norm / clip)
        return largest

    def step(self, x, y, *, sampling_rate=1.0, denominator=None):
        """One DP-SGD step on a batch the caller chose.

        The accountant records the step as one of a Poisson-sampled Gaussian
        mechanism at ``sampling_rate``: the probability with which each
        sample of the data set was put in this batch, independently. The
        default, 1.0, assumes no amplification by sampling: a correct but
        loose bound for a batch drawn any other way. Introduced in
        ``09-matrix-free``.

        Args:
            x, y: the batch's samples and their targets.
            sampling_rate: the Poisson sampling rate that drew the batch.
            denominator: what the noisy sum is divided by (default: the
                batch's size). The accountant takes it as public.

        Returns:
            The per-sample losses before the step, a NumPy array of shape (n,).
        """
        if not 0 < sampling_rate <= 1:
            raise ValueError(f"sampling_rate is {sampling_rate!r}; it is in (0, 1].")
        x, y = self.as_inputs(x, y)
        n = n_samples(x)
        self.last_index = np.arange(n)
        self._sampled = n
        losses, _ = self.padded_step(
            x,
            y,
            np.ones(n),
            denominator=self.denominator(n) if denominator is None else denominator,
            sampling_rate=sampling_rate,
            rows=self.max_physical_batch_size,
        )
        return losses.numpy()

    # -- training ---------------------------------------------------------------

    def sampled_step(self, x, y, batch_size, physical_batch_size=None):
        """One step on a Poisson-sampled batch of the whole data set.

        Each of the n samples joins the batch independently with probability
        ``q = batch_size / n``; the noisy sum is divided by ``batch_size``
        (the expected size, as Opacus does), and the accountant records one
        step at rate q: exactly the mechanism it accounts for. The batch is
        padded with weight-0 rows to ``physical_batch_size``, or to a multiple
        of it when larger, taken in passes of ``physical_batch_size`` rows
        (gradient accumulation: the same step), so the compiled step traces
        once, not once per batch size. ``jacutil.privacy.make_private``'s
        ``model.fit`` takes its steps here. ``x``, ``y`` are all n training
        samples and targets; ``batch_size`` the expected batch size, at most
        n; ``physical_batch_size`` the padded batch's size (default: the
        expected size plus two standard deviations of the Poisson batch
        size, exceeded in about 2% of the steps). Introduced in
        ``09-matrix-free``.

        Returns:
            ``(losses, y, prediction, valid)``, one row per row of the padded
            batch: the losses before the step (NaN where a gradient was not
            finite), the targets, the model's predictions, and 1.0 for a
            sampled row, 0.0 for padding (a metric's ``sample_weight``; the
            padding's rows are some sample's, and mean nothing).
        """
        fused, x, y = self._fused_step(x, y)
        n = n_samples(x)
        check_batch_size(batch_size, n)
        rate = batch_size / n
        physical = padded_size(
            batch_size, rate, physical_batch_size, self.max_physical_batch_size
        )
        index, valid = poisson_batch(self._sampler, n, rate, physical)
        self._sampled = int(np.sum(valid))
        self.last_logs = None
        if fused is None:
            batch_y = _take(y, index)
            losses, prediction = self.padded_step(
                _take(x, index), batch_y, valid,
                denominator=self.denominator(batch_size),
                sampling_rate=rate, rows=physical, expected=batch_size,
            )  # fmt: skip
        else:
            losses, prediction, batch_y = self._run_fused(
                fused, x, y, index, valid, self.denominator(batch_size), physical,
                rate,
            )
            self._count_step(rate, batch_size)
        self.last_index = index
        return losses, batch_y, prediction, tf.constant(valid, losses.dtype)

    def _run_fused(self, fused, x, y, index, valid, denominator, rows, rate):
        """The compiled sampled step, one call per pass of ``rows`` rows: each
        pass adds its clipped sum to the passes' before it, and the last one
        adds the noise and applies the update (one call when the batch is
        one pass; gradient accumulation, the same step, in less memory,
        when it is larger). Every pass is the same graph, so a Poisson batch
        larger than the padded size traces nothing new."""
        denominator = tf.constant(denominator, tf.float64)
        sums, kept, skipped = fused.nothing
        sums = self._canary_sum(rate) or sums
        parts = []
        for start in range(0, len(index), rows):
            last = fused.last[start + rows >= len(index)]
            *part, batch_y, logs, sums, kept, skipped = fused.step(
                x, y, tf.constant(index[start : start + rows]),
                tf.constant(valid[start : start + rows], tf.float64),
                denominator, sums, kept, skipped, last,
            )  # fmt: skip
            parts.append((*part, batch_y))
        losses, prediction, skipped_rows, weights, batch_y = (
            parts[0] if len(parts) == 1 else tf.nest.map_structure(
                lambda *p: tf.concat(p, 0), *parts
            )
        )  # fmt: skip
        self.last_weights = self.clip.as_shown(weights.numpy())
        self._count_skipped(
            skipped_rows.numpy(), any_kept=bool(kept) or not bool(skipped)
        )
        self.last_logs = logs if self.on_step is not None else None
        return losses, prediction, batch_y

    def _fused_step(self, x, y):
        """``(steps, x, y)``: the compiled sampled step on ``(x, y)`` (rows,
        norms, weights, the clipped sum and, on a batch's last pass, the
        noisy update, no NumPy between: ``steps.step``, with ``steps.nothing``
        the sums and flags a batch's first pass starts from and
        ``steps.last[is_last]`` its ``last`` argument), or None where
        the norms are off the layer rules (then :meth:`padded_step`); ``x``,
        ``y`` as tensors. Kept for the same arrays; the compiled step takes
        the data as an argument, so new arrays (another ``model.fit`` call)
        cost no new trace."""
        leaves = [id(a) for a in tf.nest.flatten((x, y))]
        key = (self.on_step, self.bookkeeping)
        if self._fused is not None and self._fused[5] == key:
            if self._fused[0] == leaves:
                return self._fused[2:5]
            compiled, job = self._fused[6]
        else:
            compiled, job = self._compiled_steps(x, y)
        source = (x, y)  # held, so that the ids above stay theirs
        x, y = self.as_inputs(x, y)
        steps = None
        if compiled is not None:
            data = prepared(job, x, y)
            steps = SimpleNamespace(
                step=partial(compiled.step, data),
                nothing=compiled.nothing,
                last=compiled.last,
            )
        self._fused = (leaves, source, steps, x, y, key, (compiled, job))
        return steps, x, y

    def _compiled_steps(self, x, y):
        """``(steps, job)``: :meth:`_fused_step`'s compiled ``step``, taking
        the prepared data first, and ``nothing`` (None where a group's norms
        are off the layer rules), and the last group's :func:`gradients_for`
        job; sets :attr:`bookkept`."""
        x, y = self.as_inputs(x, y)
        rows = min(2, n_samples(x))
        graphs = []
        for group in self.clip.variables_of(self.variables):
            variables = None if self.clip.flat else group
            job = gradients_for(self.model, self.loss_fn, variables, False, x)
            few = prepared(job, take(x, 0, rows), take(y, 0, rows))
            job(*few, "norms")  # an eager call chooses the mode for this signature
            graphs.append(job.norms_graph(*few))
        self.bookkept = False
        if not all(graph is not None for graph in graphs):
            return None, job
        plan = job.jac.plan
        on_step = self.on_step
        quiet = tf.constant(self.quiet_skips)
        bookkept = self.clip.flat and plan.weighs_sums() and self.bookkeeping

        def step(data, x, y, index, valid, denominator, before, kept, skipped, last):
            """One pass of a step: its rows' clipped sum added to ``before``
            (the batch's earlier passes'), ``kept``/``skipped`` whether any
            sample so far was kept/skipped; on the ``last`` pass the noise and
            the update. The metrics (``on_step``) record every pass's rows."""
            if bookkept:
                found = self._bookkept_rows(plan, data, x, y, index, valid)
            else:
                found = self._clipped_rows(graphs, data, x, y, index, valid)
            sums, losses, prediction, skipped_rows, any_kept, weights = found
            sums = [a + b for a, b in zip(before, sums, strict=True)]
            kept = kept | any_kept
            skipped = skipped | tf.reduce_any(skipped_rows)
            # nothing to apply only when samples were skipped and none is
            # kept (an empty Poisson batch still takes its step: the noise)
            applied = kept | tf.logical_not(skipped) | quiet
            tf.cond(
                last & applied,
                lambda: self.noisy_update(sums, denominator),
                lambda: tf.constant(False),
            )
            batch_y = _take(y, index)
            logs = {}
            if on_step is not None:
                logs = on_step(losses, batch_y, prediction,
                               tf.cast(valid, losses.dtype))  # fmt: skip
            return (losses, prediction, skipped_rows, weights, batch_y, logs,
                    sums, kept, skipped)  # fmt: skip

        self.bookkept = bookkept
        steps = SimpleNamespace(
            # static shapes (a graph of unknown batch size is slower: 1.0 ms
            # against 0.7 ms a step of notebook 09's classifier): one trace
            # per pass's size, and per size of the data
            step=SignatureCalls(tf.function(step, autograph=False)),
            nothing=(
                [tf.zeros(v.shape, v.dtype) for v in self.variables],
                tf.constant(False),
                tf.constant(False),
            ),
            last=(tf.constant(False), tf.constant(True)),  # by a pass's lastness
        )
        return steps, job

    def _bookkept_rows(self, plan, data, x_all, y_all, index, valid):
        """What :meth:`_clipped_rows` returns, from one forward and one
        backward pass: where every layer's rule writes weighted sums
        (:meth:`jacutil.rules.plan.Plan.weighted_sums`, Dense's
        ``a.T @ (w * delta)``, a convolution's filter gradient), the clipped
        sum comes from the signals the norms' pass already holds
        ("book-keeping", Bu et al., 2023) instead of a second forward and
        backward pass of the weighted loss. Flat clipping only; the weights
        are :meth:`ClipGroups.weights` of the same norms, so the step is the
        two-pass one, to rounding."""
        self.trace_count += 1
        batch, targets = (_take(part, index) for part in data)
        y = _take(y_all, index)
        seen = {}
        signal_of = loss_signal(self.loss_fn, targets)

        def signal(prediction):
            seen["prediction"] = prediction
            return signal_of(prediction)

        def weigh(squared):
            norms = tf.cast(tf.sqrt(squared), tf.float64)[:, None]
            seen["weights"], seen["skipped"] = self.clip.weights(norms, valid)
            return tf.cast(seen["weights"][:, 0], squared.dtype)

        found = plan.weighted_sums(batch, Weighing(signal, weigh))
        by_id = dict(zip(map(id, plan.variables), found, strict=True))
        sums = [
            tf.zeros(v.shape, v.dtype) if by_id.get(id(v)) is None else by_id[id(v)]
            for v in self.variables
        ]
        prediction, weights, skipped = (
            seen["prediction"],
            seen["weights"],
            seen["skipped"],
        )
        losses = losses_per_sample(self.loss_fn, y, prediction, n_samples(y))
        losses = tf.where(skipped, tf.constant(np.nan, losses.dtype), losses)
        any_kept = tf.reduce_any(weights > 0)
        return sums, losses, prediction, skipped, any_kept, weights

    def _clipped_rows(self, norms_of, data, x_all, y_all, index, valid):
        """Compiled (in :meth:`_fused_step`): the rows ``index`` of the data,
        their norms (one graph per clip group), weights
        (:meth:`ClipGroups.weights`, float64) and :meth:`clipped_sum`. A sample
        of non-finite gradient weighs 0 and its rows are replaced by a kept
        sample's, so that its NaN never reaches the backward pass; with no
        kept sample the sums are zeros. Returns ``(sums, losses, prediction,
        skipped, any_kept, weights)``."""
        batch, targets = (_take(part, index) for part in data)
        norms = tf.stack(
            [tf.cast(group(batch, targets), tf.float64) for group in norms_of], axis=1
        )
        weights, skipped = self.clip.weights(norms, valid)
        kept = tf.reduce_any(weights > 0, axis=1)
        any_kept = tf.reduce_any(kept)
        first_kept = tf.gather(index, tf.argmax(tf.cast(kept, tf.int32)))
        index = tf.where(skipped, first_kept, index)
        x, y = _take(x_all, index), _take(y_all, index)

        def clipped():
            return self.clipped_sum(x, y, weights)

        def nothing():  # every sampled row skipped: no sum
            prediction = self.model(x, training=False)
            losses = losses_per_sample(self.loss_fn, y, prediction, n_samples(x))
            return (
                [tf.zeros(v.shape, v.dtype) for v in self.variables],
                losses,
                (prediction),
            )

        sums, losses, prediction = tf.cond(any_kept, clipped, nothing)
        losses = tf.where(skipped, tf.constant(np.nan, losses.dtype), losses)
        return sums, losses, prediction, skipped, any_kept, weights

    # -- privacy ----------------------------------------------------------------

    def dp_event(self):
        """The steps of :attr:`ledger` as a ``dp_accounting.DpEvent``
        (:func:`dp_event` of each (sigma, rate) and its steps). Introduced in
        ``09-matrix-free``."""
        return dp_event(None, self.ledger.events)

    def epsilon(self, delta, accountant="rdp"):
        """The epsilon spent so far at ``delta``: the ledger's, every step
        under the sigma it ran with (:func:`jacutil.privacy.accounting.
        epsilon_of`). Introduced in ``09-matrix-free``."""
        return self.ledger.epsilon(delta, accountant)


