"""A one-run privacy audit of DP-SGD: proof that the noise is real
(notebook 09-matrix-free).

epsilon is a promise computed from sigma, the sampling rate and the steps; a
bug that skipped the noise or the clipping would leave the printed epsilon
unchanged. An audit measures instead. Steinke, Nasr and Jagielski ("Privacy
auditing with one (1) training run", NeurIPS 2023) need one training run:

1. m canaries, each put into the training with probability 1/2, by a coin
   the auditor keeps;
2. after training, a score per canary; the auditor guesses "in" for the k+
   highest scores and "out" for the k- lowest;
3. if training was (epsilon, delta)-DP, the number of right guesses cannot
   beat a binomial of success rate ``e^eps / (1 + e^eps)`` by much (their
   Theorem 5.2, delta's term included): the largest epsilon that the
   guesses rule out, at 95% confidence, is a *lower bound* on the true one.

A correct run's bound stays at or below the claimed epsilon; a run whose
noise or clipping is off has many more right guesses, and its bound exceeds
the claim. :class:`CanaryAudit` is the white-box version of their gradient
canaries: each canary is a per-sample gradient (a random direction, longer
than any clip norm) that joins each step's Poisson batch like a sample,
through the step's own clipping and noise; the auditor sees every step's
released gradient (plain SGD's update) and scores each canary by how much
of it the releases hold, less what the training data, public to the
auditor as the definition of DP allows, would put there on average.
"""

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from ..core._tf import keras, tf
from ..fitting.loss_gradients import per_sample_gradients

GUESSES = (0.02, 0.05, 0.1, 0.2, 0.5)  # k+ + k-, as fractions of the canaries


def p_value(canaries, guesses, correct, epsilon, delta):
    """How likely ``correct`` or more right guesses out of ``guesses`` are
    on ``canaries`` canaries (each in with probability 1/2) if training was
    (epsilon, delta)-DP: Steinke, Nasr and Jagielski's bound, the binomial
    tail at ``e^eps / (1 + e^eps)`` plus delta's term. Introduced in
    ``09-matrix-free``."""
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(
            f"correct={correct}, guesses={guesses}, canaries={canaries}: need "
            "0 <= correct <= guesses <= canaries."
        )
    rate = 1 / (1 + math.exp(-epsilon))
    tail = float(stats.binom.sf(correct - 1, guesses, rate))
    if delta == 0 or correct == 0:
        return min(tail, 1.0)
    below = stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, rate)
    alpha = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))
    return min(tail + 2 * canaries * delta * alpha, 1.0)


def epsilon_lower_bound(canaries, guesses, correct, delta, confidence=0.95):
    """The largest epsilon that ``correct`` right guesses out of
    ``guesses`` rule out at ``confidence``: training was not (eps, delta)-DP
    for any smaller eps, unless the 1 - confidence chance came up (0.0 when
    nothing is ruled out). Introduced in ``09-matrix-free``."""
    level = 1 - confidence
    if p_value(canaries, guesses, correct, 0.0, delta) >= level:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(canaries, guesses, correct, high, delta) < level:
        low, high = high, 2 * high
        if high > 64:
            return low
    for _ in range(40):
        middle = (low + high) / 2
        if p_value(canaries, guesses, correct, middle, delta) < level:
            low = middle
        else:
            high = middle
    return low


@dataclass
class AuditResult:
    """What :meth:`CanaryAudit.result` found. Introduced in ``09-matrix-free``.

    Attributes:
        epsilon_lower_bound: the measured lower bound on epsilon.
        claimed_epsilon: the epsilon the run's accountant claims.
        canaries, guesses, correct: the best of the guess counts tried (each
            tried at confidence 1 - (1 - confidence) / tries: Bonferroni).
        scores, included: each canary's score and coin (for a plot).
    """

    epsilon_lower_bound: float
    claimed_epsilon: float
    delta: float
    canaries: int
    guesses: int
    correct: int
    scores: np.ndarray
    included: np.ndarray

    @property
    def holds(self):
        """Whether the measured bound stays at or below the claim."""
        return self.epsilon_lower_bound <= self.claimed_epsilon

    def __str__(self):
        verdict = "at or below" if self.holds else "ABOVE"
        return (
            f"one-run audit: {self.correct} of {self.guesses} guesses right on "
            f"{self.canaries} canaries: epsilon >= {self.epsilon_lower_bound:.3f} "
            f"(95% confidence), {verdict} the claimed {self.claimed_epsilon:.3f}"
        )


class CanaryAudit(keras.callbacks.Callback):
    """Audit a private ``model.fit`` in the same run: a Keras callback.

    ``audit = CanaryAudit(model, x, y)`` on a model that ``make_private``
    made, compiled with plain ``keras.optimizers.SGD`` (its update is the
    released gradient, times the learning rate); then ``model.fit(x, y,
    callbacks=[audit])`` and ``audit.result()``. Introduced in
    ``09-matrix-free``.

    Args:
        model: the private model (``model.privacy``).
        x, y: the training data ``fit`` gets (the auditor knows it: what the
            training data adds on average is taken out of each release).
        canaries: how many gradient canaries (half, by coin, are in).
        canary_norm: each canary's norm (default ten times the clip norm:
            the clipping, and only it, bounds what a canary adds).
        seed: the coins' and directions' seed (None: fresh entropy).
        confidence: of the lower bound.
    """

    def __init__(self, model, x, y, canaries=1000, canary_norm=None, seed=None,
                 confidence=0.95):  # fmt: skip
        super().__init__()
        training = getattr(model, "privacy", None)
        if training is None:
            raise ValueError(
                "CanaryAudit audits a private model: call jacutil.make_private "
                "(model, ...) first."
            )
        optimizer = training.dpsgd.optimizer
        if type(optimizer) is not keras.optimizers.SGD or optimizer.momentum:
            raise ValueError(
                f"the model's optimizer is {type(optimizer).__name__}"
                f"{' with momentum' if type(optimizer) is keras.optimizers.SGD else ''}"
                ": the audit reads each released gradient from plain SGD's "
                "update (w -= learning_rate * gradient). Compile with "
                "keras.optimizers.SGD(learning_rate) without momentum to audit."
            )
        self.training = training
        self.dpsgd = dpsgd = training.dpsgd
        self.x, self.y = dpsgd.as_inputs(x, y)
        self.confidence = confidence
        rng = np.random.default_rng(seed)
        width = sum(int(np.prod(v.shape)) for v in dpsgd.variables)
        directions = rng.standard_normal((canaries, width))
        self.directions = directions / np.linalg.norm(directions, axis=1)[:, None]
        norm = 10 * dpsgd.l2_norm_clip if canary_norm is None else canary_norm
        self.vectors = norm * self.directions
        self.included = rng.random(canaries) < 0.5
        self.scores = np.zeros(canaries)
        self._before = None
        dpsgd.canaries = self

    def drawn(self, rate, sampler):
        """The canaries in this step's batch: each included one with
        probability ``rate``, by the step's own sampler. DPSGD calls it."""
        joins = sampler.random(len(self.vectors)) < rate
        return self.vectors[self.included & joins]

    def _flat(self, tensors):
        return np.concatenate(
            [
                np.zeros(int(np.prod(v.shape))) if t is None else np.ravel(t)
                for t, v in zip(tensors, self.dpsgd.variables, strict=True)
            ]
        )

    def on_train_batch_begin(self, batch, logs=None):
        dpsgd = self.dpsgd
        rate = self.training.sampling_rate
        G = per_sample_gradients(dpsgd.model, dpsgd.loss_fn, self.x, self.y,
                                 variables=dpsgd.variables)  # fmt: skip
        groups, _ = dpsgd._columns()
        norms = np.stack([np.linalg.norm(G[:, c], axis=1) for c in groups], 1)
        weights, _ = dpsgd.clip.weights(
            tf.constant(norms, tf.float64), tf.ones(len(G), tf.float64)
        )
        expected = np.zeros(G.shape[1])
        weights = weights.numpy()
        finite = np.isfinite(G).all(axis=1)
        if not finite.all():  # a sample of non-finite gradient adds nothing
            G, weights = G[finite], weights[finite]
        for g, c in enumerate(groups):
            expected[c] = rate * (weights[:, g] @ G[:, c])
        penalty = self._flat([None if p is None else p.numpy()
                              for p in dpsgd.penalty_gradients()])  # fmt: skip
        learning_rate = float(keras.ops.convert_to_numpy(
            dpsgd.optimizer.learning_rate))  # fmt: skip
        self._before = (self._flat([v.numpy() for v in dpsgd.variables]),
                        expected, penalty, learning_rate)  # fmt: skip

    def on_train_batch_end(self, batch, logs=None):
        before, expected, penalty, learning_rate = self._before
        after = self._flat([v.numpy() for v in self.dpsgd.variables])
        denominator = self.dpsgd.denominator(self.training.batch_size)
        released = ((before - after) / learning_rate - penalty) * denominator
        self.scores += self.directions @ (released - expected)

    def result(self):
        """The :class:`AuditResult` of the scores so far."""
        order = np.argsort(-self.scores)
        count = len(self.scores)
        tries = [max(2, int(round(f * count))) // 2 * 2 for f in GUESSES]
        level = 1 - (1 - self.confidence) / len(tries)  # Bonferroni
        delta = self.training.delta
        best = (0.0, tries[0], 0)
        for k in tries:
            top, bottom = order[: k // 2], order[count - k // 2 :]
            correct = int(self.included[top].sum() + (~self.included[bottom]).sum())
            bound = epsilon_lower_bound(count, k, correct, delta, level)
            if bound > best[0] or best[2] == 0:
                best = (bound, k, correct)
        return AuditResult(
            epsilon_lower_bound=best[0],
            claimed_epsilon=self.training.epsilon(),
            delta=delta,
            canaries=count,
            guesses=best[1],
            correct=best[2],
            scores=self.scores.copy(),
            included=self.included.copy(),
        )
