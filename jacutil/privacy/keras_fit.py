"""Private training the Keras way (notebook 09-matrix-free): ``make_private``
on a compiled model, then plain ``model.fit``, whose History, callbacks,
compiled metrics, progress bar and ``validation_data`` stay Keras's while each
step becomes one step of :class:`jacutil.privacy.dp_sgd.DPSGD`.
"""

import warnings

import numpy as np

from ..core._tf import keras, tf
from ..core.batch import take
from ..core.internals import compile_loss, keras_train_step, loss_tracker
from .accounting import epsilon_of, noise_multiplier_for
from .adaptive_clip import AdaptiveClip
from .config import DPConfig
from .dp_sgd import DPSGD
from .keras_loss import KerasLoss
from .ledger import ledger_of
from .sampling import steps_per_epoch
from .validator import validate_private

REFUSED = {  # model.fit's arguments that would break the accounting
    "sample_weight": "a sample weight scales one sample's loss, and so its "
    "influence, in ways the clip norm does not see",
    "class_weight": "a class weight scales some samples' losses, and so their "
    "influence, in ways the clip norm does not see",
    "validation_split": "it would hold out rows from the train_size the noise "
    "was calibrated for: pass validation_data instead",
    "steps_per_epoch": "each epoch takes round(train_size / batch_size) "
    "Poisson-sampled steps, the number the noise was calibrated for",
}


def per_sample_loss(loss):
    """The loss ``model.compile`` took, as a function with one loss per sample.

    A Keras ``Loss`` object (``keras.losses.SparseCategoricalCrossentropy(
    from_logits=True)``) gives its unreduced ``call``, with its options; a name
    gives the Keras function of that name; a function is taken as it is.
    Returns ``loss_fn(y, prediction)`` for ``model.loss`` of a compiled model;
    the same object for the same ``loss`` is not promised, so keep the one
    returned. Introduced in ``09-matrix-free``.
    """
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        return loss.call  # unreduced, with the object's options
    if callable(loss):
        return loss
    raise ValueError(
        f"the model was compiled with loss={loss!r}; make_private needs one "
        "loss for the whole output (a Keras loss, its name, or a function of "
        "(y, prediction)): DP-SGD clips each sample's gradient of that loss. "
        "For several outputs, write one function of the structure of targets "
        "and predictions."
    )


class PrivateTraining:
    """A model's private training: ``model.privacy`` after :func:`make_private`.

    It holds the configuration the noise was calibrated for and the
    :class:`DPSGD` that takes the steps; ``model.fit`` calls :meth:`fit`.
    The privacy spent is the model's :class:`~jacutil.privacy.ledger.
    PrivacyLedger`'s, which counts every step of every ``make_private`` on
    the model (and survives ``model.save`` with
    :func:`jacutil.privacy.load_model`). Introduced in ``09-matrix-free``.

    Attributes:
        dpsgd: the :class:`DPSGD` (its ``noise_multiplier``, ``last_weights``).
        loss: the :class:`~jacutil.privacy.keras_loss.KerasLoss` it clips.
        ledger: the model's ledger.
        calibrated_noise_multiplier: sigma as ``make_private`` calibrated it
            to ``target_epsilon`` (``noise_multiplier`` is the next step's).
        budget_steps: the steps sigma was calibrated for (``epochs`` epochs
            of ``steps_per_epoch``).
    """

    def __init__(
        self,
        model,
        config,
        *,
        ledger,
        target_epsilon,
        delta,
        accountant,
        batch_size,
        train_size,
        epochs,
        report_training,
    ):
        self.model = model
        self.ledger = ledger
        self.report_training = report_training
        # the steps: each sample's gradient of Keras's own loss, the model's
        # ledger counting them, the logs recorded inside the step (one graph
        # call a step), a sample of non-finite gradient skipped unreported
        self.dpsgd = DPSGD(
            model, KerasLoss(model), model.optimizer,
            l2_norm_clip=config.l2_norm_clip,
            noise_multiplier=config.noise_multiplier, seed=config.seed,
            secure_mode=config.secure_mode,
            max_physical_batch_size=config.max_physical_batch_size,
            adaptive_clip=config.adaptive_clip,
            ledger=ledger, quiet_skips=True, on_step=self.record,
        )  # fmt: skip
        dpsgd = self.dpsgd
        self.target_epsilon = target_epsilon
        self.delta = delta
        self.accountant = accountant
        self.batch_size = batch_size
        self.train_size = train_size
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch(train_size, batch_size)
        self.budget_steps = epochs * self.steps_per_epoch
        self.sampling_rate = batch_size / train_size
        self._before = ledger.events  # spent by earlier make_private calls
        self._start = ledger.steps
        self._keras_fit = type(model).fit  # Keras's own, bound at each call
        self._data = None
        self._record = None  # the compiled record(), made at the first step
        self._spent = {}  # the ledger's events (sorted items) -> epsilon
        self._checked = set()  # the data signatures fit's early checks passed
        self.calibrated_noise_multiplier = dpsgd.noise_multiplier

    @property
    def loss(self):
        return self.dpsgd.loss_fn

    @property
    def noise_multiplier(self):
        """sigma for the next step. Setting it (a noise schedule, e.g. from
        a callback) takes effect at the next step, and the ledger counts
        each step under the sigma it ran with, so ``epsilon()`` and the logs
        stay what ran; ``fit`` warns before a run whose planned steps
        at the current sigma would spend more than ``target_epsilon``."""
        return self.dpsgd.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value):
        self.dpsgd.noise_multiplier = value

    @property
    def steps(self):
        """The DP-SGD steps taken since this ``make_private``."""
        return self.ledger.steps - self._start

    def epsilon(self):
        """The epsilon spent on the model so far at ``delta``, by the
        accountant that calibrated sigma: every step of its ledger, earlier
        ``make_private`` calls' included (0.0 before the first). Evaluation
        (``validation_data``, ``model.evaluate``) is not private and spends
        nothing: it releases its own results. The accountant's answer for
        each ledger is kept: asked again, it costs nothing."""
        key = tuple(sorted(self.ledger.events.items()))
        if key not in self._spent:
            self._spent[key] = epsilon_of(
                None, self.ledger.events, self.delta, self.accountant
            )
        return self._spent[key]

    def account_epochs(self):
        """Ask the accountant, once and before training, for the epsilon
        after each of the budgeted epochs (the steps before this
        ``make_private`` composed with them): it depends on sigma, the rate
        and the steps, not on the data, so ``fit`` shows epsilon per epoch
        without paying the accountant inside an epoch. The same call as
        :meth:`epsilon`, so the same values; with PLD each sampled step's
        distribution is built once (about 0.5 s) and each epoch's count
        composes it (about 0.1 s:
        ``jacutil.privacy.accounting.sampled_gaussian_pld``)."""
        for epoch in range(1, self.epochs + 1):
            events = dict(self._before)
            key = (float(self.noise_multiplier), float(self.sampling_rate))
            events[key] = events.get(key, 0) + epoch * self.steps_per_epoch
            self._spent[tuple(sorted(events.items()))] = epsilon_of(
                None, events, self.delta, self.accountant
            )

    # -- model.fit --------------------------------------------------------------

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        callbacks=None,
        initial_epoch=0,
        **options,
    ):
        """``model.fit`` of a private model: Keras's own loop, DP-SGD steps.

        Takes ``model.fit``'s arguments; refuses, before the first step, those
        that would break the accounting (a dataset or generator, a size or
        batch size other than the calibrated ones, more steps than budgeted,
        sample or class weights, ``validation_split``, ``steps_per_epoch``)
        and a loss that couples samples. ``shuffle`` is ignored: each step
        Poisson-samples its batch. A model compiled again since (another
        loss, ``loss_weights`` or optimizer) trains on what it was compiled
        with last.
        """
        for name, why in REFUSED.items():
            value = options.get(name)
            if value is not None and not (isinstance(value, float | int) and not value):
                raise ValueError(
                    f"model.fit({name}=...) is refused on a private model: {why}."
                )
        options = {k: v for k, v in options.items() if k not in REFUSED}
        options.pop("shuffle", None)
        # Keras evaluates validation_data at fit's batch size unless told:
        # here that is 1 (one token a step), so say the calibrated one
        if options.get("validation_batch_size") is None:
            options["validation_batch_size"] = self.batch_size
        self._check_data(x, y)
        if batch_size not in (None, self.batch_size):
            raise ValueError(
                f"model.fit(batch_size={batch_size}) disagrees with make_private("
                f"batch_size={self.batch_size}), which the noise was calibrated "
                "for: leave batch_size out, or call make_private again with it."
            )
        self._follow_compile()
        self._check_budget(epochs - initial_epoch)
        self._check_early(x, y)
        self._data = self.dpsgd.as_inputs(x, y)  # once: each step gathers rows
        tokens = np.zeros((self.steps_per_epoch, 1), np.float32)  # one per step
        # first, so that every callback's on_epoch_end reads the ledger's
        # epsilon, an epoch stopped early by a callback included
        callbacks = [_LedgerEpsilon(self), *(callbacks or [])]
        try:
            return self._keras_fit(
                self.model,
                tokens,
                None,
                batch_size=1,
                epochs=epochs,
                callbacks=callbacks,
                initial_epoch=initial_epoch,
                shuffle=False,
                **options,
            )
        finally:
            self._data = None

    def _check_early(self, x, y):
        """Refuse, before the first step, a loss that couples samples or
        norms that cannot be taken: once per signature of the data (its
        dtypes and per-sample shapes) and compiled loss, so a fit per epoch
        pays for them once. Without logs of the training, Keras's compiled
        metrics are built here, unchanged (``fit`` reads their results)."""
        few_x, few_y = take(x, 0, 3), take(y, 0, 3)
        few_x, few_y = self.dpsgd.as_inputs(few_x, few_y)
        key = (
            id(self.loss),
            tuple((a.dtype, tuple(a.shape[1:])) for a in tf.nest.flatten((x, y))),
        )
        if key in self._checked:
            return
        if not self.loss.checked:
            self.loss.check(few_x, few_y)
        self.dpsgd.clip_weights(few_x, few_y)  # refuse early, clearly
        if not self.report_training:
            self.model.compute_metrics(
                few_x, few_y, self.model(few_x, training=False), sample_weight=None
            )
            self.model.reset_metrics()
        self._checked.add(key)

    def _follow_compile(self):
        """After ``model.compile`` again (with the same optimizer or
        another), the steps use what it set: a new :class:`KerasLoss` and
        the model's optimizer; sigma, the clip norms, the random state and
        the ledger carry over."""
        if (
            self.model.optimizer is self.dpsgd.optimizer
            and compile_loss(self.model) is self.loss.compiled
        ):
            return
        refuse_own_train_step(self.model)
        self.dpsgd = self.dpsgd.rebuilt(
            KerasLoss(self.model, general=self.loss.general), self.model.optimizer
        )
        self.model.train_function = None
        self._record = None

    def _check_data(self, x, y):
        leaves = tf.nest.flatten(x) if x is not None else []
        if (
            not leaves
            or not all(hasattr(a, "shape") for a in leaves)
            or isinstance(x, (tf.data.Dataset, keras.utils.PyDataset))
        ):
            raise ValueError(
                f"model.fit got x of type {type(x).__name__}; a private model "
                "samples each batch itself (Poisson sampling, what the accountant "
                f"assumes), so it needs all train_size={self.train_size} samples "
                "as arrays: model.fit(x, y) with NumPy arrays or tensors. A "
                "dataset's or generator's size and order cannot be checked."
            )
        if y is None:
            raise ValueError("model.fit needs y, the targets, on a private model.")
        rows = {int(np.shape(a)[0]) for a in leaves + tf.nest.flatten(y)}
        if rows != {self.train_size}:
            raise ValueError(
                f"model.fit got {sorted(rows)} rows, and make_private was told "
                f"train_size={self.train_size}: the sampling rate, and so the "
                "noise, depend on it. Pass the whole training set, or call "
                "make_private again with its size."
            )

    def _check_budget(self, epochs):
        if int(epochs) != epochs or epochs < 1:
            raise ValueError(f"epochs - initial_epoch is {epochs!r}; at least 1.")
        planned = epochs * self.steps_per_epoch
        if self.noise_multiplier != self.calibrated_noise_multiplier:
            self._check_planned_epsilon(planned)
        if self.steps + planned > self.budget_steps:
            left = (self.budget_steps - self.steps) // self.steps_per_epoch
            raise ValueError(
                f"this fit would take {planned} steps ({epochs} "
                f"epoch{'s' * (epochs != 1)} of {self.steps_per_epoch}) after "
                f"the {self.steps} taken: more than the {self.budget_steps} "
                f"steps (epochs={self.epochs}) whose noise make_private "
                f"calibrated so that the model's epsilon stays within "
                f"{self.target_epsilon:g}. Fit at most {left} more epoch(s). "
                "Every step taken stays in the model's ledger: a new "
                "make_private on this model composes them, and can only "
                "calibrate what is left of the same epsilon."
            )

    def _check_planned_epsilon(self, planned):
        """Warn, before the first step, when the ``planned`` steps at the
        current sigma (set since ``make_private`` calibrated it) would take
        the model's epsilon past the target: the steps are then accounted as
        they run (the ledger), but the target no longer bounds them."""
        events = self.ledger.events
        key = (float(self.noise_multiplier), float(self.sampling_rate))
        events[key] = events.get(key, 0) + planned
        found = epsilon_of(None, events, self.delta, self.accountant)
        if found > self.target_epsilon:
            warnings.warn(
                f"noise_multiplier is now {self.noise_multiplier:.4g} (make_private "
                f"calibrated {self.calibrated_noise_multiplier:.4g}): this fit's "
                f"{planned} steps will take the model's epsilon to {found:.4g}, "
                f"past the target {self.target_epsilon:g}. The logs and "
                "epsilon() report what is spent; to stay within the target, "
                "raise noise_multiplier or fit fewer epochs.",
                RuntimeWarning,
                stacklevel=3,
            )

    def record(self, losses, y, prediction, valid):
        """Compiled: the step's mean loss into Keras's loss tracker and its
        predictions into the compiled metrics, padding and samples of
        non-finite loss weighing nothing (an empty Poisson batch changes
        nothing); Keras's logs. With ``report_training=False``, nothing:
        the logs hold epsilon (and validation) only."""
        if not self.report_training:
            return {}
        finite = tf.math.is_finite(losses) & (valid > 0)
        count = tf.reduce_sum(tf.cast(finite, losses.dtype))
        total = tf.reduce_sum(tf.where(finite, losses, tf.zeros_like(losses)))
        mean = total / tf.maximum(count, tf.ones_like(count))
        loss_tracker(self.model).update_state(mean, sample_weight=count)
        compiled = compile_loss(self.model)
        if compiled is not None and compiled.metrics:  # each output's loss
            # Keras's own per-output trackers, over the sampled rows: each
            # row weighs rows / sampled (a sum over batch size: their mean)
            rows = tf.cast(tf.shape(valid)[0], valid.dtype)
            weight = valid * rows / tf.maximum(tf.reduce_sum(valid), 1.0)
            compiled(y, prediction, sample_weight=weight)
        return self.model.compute_metrics(None, y, prediction, sample_weight=valid)

    def make_train_function(self, force=False):
        """Keras's hook: the private step is the model's train function."""
        self.model.train_function = self.train_function
        return self.train_function

    def train_function(self, iterator):
        """One ``model.fit`` step: a DP-SGD step on a Poisson-sampled batch,
        the loss and compiled metrics updated on the sampled rows. Epsilon
        enters the logs at each epoch's end (:class:`_LedgerEpsilon`), read
        from the ledger: the accountant is not asked at every step."""
        if self._data is None:  # train_on_batch, or a loop of one's own
            raise TypeError(
                "a private model trains only through model.fit(x, y), whose steps "
                "Poisson-sample the training set as the accountant assumes; "
                "model.train_on_batch would train on a batch it does not know. "
                "Use model.fit, or jacutil.DPSGD.step for a step of your own."
            )
        iterator.get_next()  # the step's token: Keras counts the steps
        x, y = self._data
        step = self.dpsgd.sampled_step(x, y, self.batch_size)
        logs = self.dpsgd.last_logs  # recorded inside the fused step
        if logs is None:  # the step ran off the layer rules (padded_step)
            if self._record is None:
                self._record = tf.function(self.record, autograph=False)
            logs = self._record(*step) if self.report_training else {}
        logs = dict(logs)
        if self.dpsgd.adaptive_clip is not None:  # C, released by its noisy count
            logs["l2_norm_clip"] = float(self.dpsgd.clip.current())
        return logs


class _LedgerEpsilon(keras.callbacks.Callback):
    """Puts the ledger's epsilon into each epoch's logs, before any other
    callback reads them (History, a CSV logger, early stopping), so an
    epoch that a callback stopped mid-way reports the steps it took; and
    into History's last entry when training ends, whatever ended it."""

    def __init__(self, training):
        super().__init__()
        self.training = training

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["epsilon"] = self.training.epsilon()

    def on_train_end(self, logs=None):
        history = getattr(self.model, "history", None)
        spent = getattr(history, "history", {}).get("epsilon")
        if spent:
            spent[-1] = self.training.epsilon()


def refuse_own_train_step(model):
    """A model whose class defines its own ``train_step`` runs code of its
    own in each step, which DP-SGD's step would bypass without a word:
    refuse it, saying what to do."""
    if type(model).train_step is not keras_train_step():
        raise ValueError(
            f"{type(model).__name__} defines its own train_step: make_private "
            "replaces the training step with DP-SGD's, which would skip that "
            "code. Put what the step computes into the model's call() or "
            "compute_loss() (make_private clips each sample's gradient of "
            "compute_loss), or write the loop with jacutil.DPSGD's step."
        )


def refuse_forgotten_steps(model, new_count):
    """A ValueError when the model's optimizer has taken steps that no
    ledger records, unless ``new_count``: they may have spent privacy that
    a fresh count would forget."""
    ledger = ledger_of(model)
    taken = int(model.optimizer.iterations.numpy())
    if new_count or not taken or (ledger is not None and ledger.steps):
        return
    raise ValueError(
        f"the model's optimizer has taken {taken} steps, but the model carries "
        "no privacy ledger: if they were private steps (a model saved after "
        "make_private and loaded with keras.models.load_model, which drops "
        "the ledger), a new count would forget what they spent. Load it with "
        "jacutil.privacy.load_model(path), which reads the ledger too; or, if "
        "those steps used no private data (public pretraining), say so: "
        "make_private(..., new_count=True)."
    )


def make_private(
    model,
    *,
    epsilon,
    delta,
    l2_norm_clip,
    batch_size,
    epochs,
    train_size,
    accountant="pld",
    seed=None,
    secure_mode=False,
    max_physical_batch_size=None,
    target_quantile=None,
    clip_learning_rate=0.2,
    report_training=True,
    new_count=False,
    verbose=True,
):
    """Make ``model.fit`` train by DP-SGD with at most ``epsilon`` spent.

    On a compiled model: the model is checked
    (:func:`jacutil.privacy.validator.validate_private`), sigma is calibrated
    so that ``epochs`` epochs of ``round(train_size / batch_size)``
    Poisson-sampled steps, composed with every step the model took before
    (its :class:`~jacutil.privacy.ledger.PrivacyLedger`), spend at most
    ``epsilon`` at ``delta``, and printed once. Then ``model.fit(x, y,
    epochs=..., validation_data=..., callbacks=[...])`` trains privately:
    each step clips each sample's gradient of Keras's own loss (what
    ``model.compile`` set: every output, ``loss_weights``, ``model.losses``;
    the loss scale of mixed precision: :class:`~jacutil.privacy.keras_loss.
    KerasLoss`), adds the noise and applies the compiled optimizer. The logs
    hold ``epsilon``, spent after each epoch.

    What the logs' training loss and metrics leak: they are computed on each
    step's sampled rows without noise, so they are *not* covered by epsilon
    (``report_training=False`` leaves them out; validation and
    ``model.evaluate`` release their own data's results and spend nothing).
    The number of samples whose gradient was not finite is not reported
    during the fit either: each contributes nothing, and a batch of them all
    takes a step of noise alone.

    The noise and the sampling come from the operating system's entropy
    (``secure_mode``: ``os.urandom`` itself, drawn in float64); a ``seed``
    makes them repeatable, for teaching and tests: such a run is not private
    against anyone who knows the seed, and says so. The steps run the model
    in inference mode (dropout off; see :class:`DPSGD`). A model whose class
    defines its own ``train_step`` is refused; one whose loss couples the
    samples of a batch is refused at ``fit``, before the first step.
    Introduced in ``09-matrix-free``.

    Args:
        model: a compiled, built Keras 3 model.
        epsilon: the target epsilon, > 0: of the whole model, steps taken
            before (its ledger) included.
        delta: the delta of the guarantee, in (0, 1); below 1 / train_size.
        l2_norm_clip: C, the largest norm a sample's gradient keeps; or a
            dict ``{layer name: C_g}`` (a key may be a tuple of names) for
            per-layer clipping: each sample's gradient on each group's
            variables keeps at most C_g, every trainable variable in one
            group, and the noise scales with ``sqrt(sum C_g^2)``
            (:class:`jacutil.privacy.clip_groups.ClipGroups`).
        batch_size: the expected batch size.
        epochs: the epochs the budget covers; ``fit`` refuses more.
        train_size: the number of training samples ``fit`` will get.
        accountant: "pld" (tight; the default) or "rdp".
        seed: seeds the sampling and the noise, for a repeatable run that is
            not private against whoever knows it (None: fresh entropy).
        secure_mode: draw the sampling and the noise from ``os.urandom``
            (:class:`jacutil.privacy.noise.SecureRandom`: Box-Muller in
            float64, each noise value the sum of two draws / sqrt(2), as
            Opacus's secure mode); a seed is refused with it. It costs a trip
            out of the compiled step for the noise each step.
        max_physical_batch_size: the most rows one pass holds (Opacus's
            name). A Poisson batch larger than it is split into passes whose
            clipped sums are added up before the noise (gradient
            accumulation): the same step in less memory, for logical batches
            that do not fit. None: one pass per step.
        target_quantile: None (the clip norm stays ``l2_norm_clip``), or
            gamma in (0, 1): adaptive clipping (Andrew et al., 2021;
            :class:`jacutil.privacy.adaptive_clip.AdaptiveClip`) - C starts at
            ``l2_norm_clip`` and follows the gamma quantile of the per-sample
            norms, by a count with noise of ``batch_size / 20`` samples. The
            accountant's sigma is unchanged; the gradient's noise multiplier
            grows to pay for the count (printed). The logs hold C.
        clip_learning_rate: eta, C's geometric step under adaptive clipping.
        report_training: keep the training loss and compiled metrics in the
            logs (computed without noise; see above).
        new_count: a model whose optimizer has taken steps but that carries
            no ledger (loaded by plain ``keras.models.load_model``, or
            trained before without ``make_private``) is refused unless this
            is True: say so only when those steps spent no privacy of this
            data (pretraining on public data). A privately trained model
            saved with ``model.save`` loads with its ledger by
            :func:`jacutil.privacy.load_model`.
        verbose: print the calibrated sigma once.

    Returns:
        The model, whose ``fit`` now trains privately; ``model.privacy`` is
        its :class:`PrivateTraining` (``epsilon()``, ``noise_multiplier``,
        ``steps``, ``ledger``).
    """
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise ValueError(
            "the model is not compiled: call model.compile(optimizer=..., "
            "loss=..., metrics=[...]) first; make_private uses its optimizer and "
            "loss."
        )
    if getattr(model, "steps_per_execution", 1) != 1:
        raise ValueError(
            "the model was compiled with steps_per_execution="
            f"{model.steps_per_execution}; a private model takes one step per "
            "execution: compile with steps_per_execution=1."
        )
    if int(train_size) != train_size or train_size < 1:
        raise ValueError(f"train_size is {train_size!r}; a whole number >= 1.")
    if not 0 < delta < 1 / train_size:
        raise ValueError(
            f"delta is {delta!r}; it must be in (0, 1 / train_size = "
            f"{1 / train_size:.3g}): a larger delta allows leaking one sample "
            "outright. A common choice: 1 / (10 * train_size)."
        )
    if int(epochs) != epochs or epochs < 1:
        raise ValueError(f"epochs is {epochs!r}; a whole number >= 1.")
    validate_private(model)
    refuse_own_train_step(model)
    refuse_forgotten_steps(model, new_count)
    ledger = ledger_of(model, create=True)
    steps = epochs * steps_per_epoch(train_size, batch_size)
    rate = batch_size / train_size
    sigma = noise_multiplier_for(
        epsilon, delta, rate, steps, accountant, spent=ledger.events
    )
    ledger.delta, ledger.accountant = delta, accountant
    adaptive = None
    if target_quantile is not None:
        adaptive = AdaptiveClip(target_quantile, clip_learning_rate, batch_size / 20)
    config = DPConfig(l2_norm_clip, sigma, adaptive, max_physical_batch_size, seed,
                      bool(secure_mode))  # fmt: skip
    training = PrivateTraining(
        model,
        config,
        ledger=ledger,
        target_epsilon=epsilon,
        delta=delta,
        accountant=accountant,
        batch_size=batch_size,
        train_size=train_size,
        epochs=epochs,
        report_training=report_training,
    )
    training.account_epochs()
    dpsgd = training.dpsgd
    before = (
        f", after the {ledger.steps} steps the model took before "
        f"(epsilon {training.epsilon():.3g})"
        if ledger.steps
        else ""
    )
    seeded = (
        f" seed={seed}: the noise and the sampling repeat for anyone who knows "
        "the seed, so this run is NOT private against them (for teaching and "
        "tests only)."
        if seed is not None
        else ""
    )
    adapting = (
        f" Adaptive clipping: C starts at {dpsgd.l2_norm_clip:g} and follows "
        f"the {target_quantile:g} quantile of the norms by a count with noise "
        f"{adaptive.count_noise:g}; to pay for it the gradient's noise "
        f"multiplier is {dpsgd.gradient_noise_multiplier:.4f}."
        if adaptive is not None
        else ""
    )
    if verbose:
        print(
            f"make_private: noise multiplier {sigma:.4f} (in units of "
            f"{dpsgd.clip.describe()}), so that {steps} steps ({epochs} "
            f"epochs of {training.steps_per_epoch}), each batch Poisson-sampled "
            f"at rate {rate:.4g}{before}, spend epsilon <= {epsilon:g} at "
            f"delta = {delta:g} ({accountant.upper()} accountant)."
            + adapting
            + (
                " The training loss and metrics in the logs are computed "
                "without noise: not covered by epsilon."
                if report_training
                else ""
            )
            + seeded
        )
    elif seeded:
        warnings.warn(seeded.strip(), UserWarning, stacklevel=2)
    model.privacy = training
    model.fit = training.fit  # this model only: nothing is patched elsewhere
    model.make_train_function = training.make_train_function
    model.train_function = None
    return model
