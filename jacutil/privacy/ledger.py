"""The privacy a model has spent, kept with the model (notebook 09-matrix-free).

Each DP-SGD step is a Poisson-sampled Gaussian mechanism: its noise
multiplier sigma and its sampling rate q are all the accountant needs. A
:class:`PrivacyLedger` counts the steps of each ``(sigma, q)`` a model has
taken, over every ``make_private`` call, so that epsilon always composes
everything spent on the model's weights, never only the last call's.

It lives on the model (``model._privacy_ledger``) as a Keras saveable: Keras's
own ``model.save`` and ``model.save_weights`` walk to it and write its counts
into the file beside the weights, and ``model.load_weights`` reads them back
into a private model. ``keras.models.load_model`` builds a plain model from
the file's config and leaves the ledger's entries unread (Keras has no hook
by which a loaded model could grow an attribute): :func:`load_model` loads
the model and its ledger, and ``make_private`` on it composes what it spent.
"""

import numpy as np

from ..core._tf import keras
from ..core.internals import keras_saveable
from .accounting import ACCOUNTANTS, as_events, epsilon_of

ATTRIBUTE = "_privacy_ledger"  # the model's attribute, and its path in the file


class PrivacyLedger(keras_saveable()):
    """Steps taken per ``(sigma, rate)``, with the delta and the accountant
    of the last ``make_private``: what epsilon composes. Introduced in
    ``09-matrix-free``.

    ``record(sigma, rate)`` counts a step; ``events`` is ``{(sigma, rate):
    steps}``; ``epsilon(delta, accountant)`` the epsilon of them all.
    """

    def __init__(self):
        self.counts = {}  # (sigma, rate) -> steps
        self.delta = None
        self.accountant = None

    def _obj_type(self):
        return "Operation"  # what Keras walks past: no sublayers, no variables

    @property
    def steps(self):
        """Every step recorded."""
        return sum(self.counts.values())

    @property
    def events(self):
        """``{(sigma, rate): steps}``, a copy."""
        return dict(self.counts)

    def record(self, sigma, rate, steps=1):
        """Count ``steps`` more steps of noise multiplier ``sigma`` at rate
        ``rate``."""
        key = (float(sigma), float(rate))
        self.counts[key] = self.counts.get(key, 0) + int(steps)

    def epsilon(self, delta=None, accountant=None):
        """The epsilon of every recorded step at ``delta`` (default: the last
        ``make_private``'s), by ``accountant`` (default: its too)."""
        delta = self.delta if delta is None else delta
        accountant = accountant or self.accountant or "pld"
        return epsilon_of(None, self.counts, delta, accountant)

    # -- Keras's saving walks here ----------------------------------------------

    def save_own_variables(self, store):
        keys = sorted(self.counts)
        store["sigma"] = np.array([s for s, _ in keys], np.float64)
        store["rate"] = np.array([q for _, q in keys], np.float64)
        store["steps"] = np.array([self.counts[k] for k in keys], np.int64)
        store["delta"] = np.array([np.nan if self.delta is None else self.delta])
        code = -1 if self.accountant is None else ACCOUNTANTS.index(self.accountant)
        store["accountant"] = np.array([code], np.int64)

    def load_own_variables(self, store):
        """The file's counts replace these; a file without a ledger (a model
        saved before it was private) leaves them as they are: no spending is
        ever forgotten on load."""
        if "steps" not in store.keys():
            return
        sigma, rate, steps = (np.asarray(store[k]) for k in ("sigma", "rate", "steps"))
        runs = zip(zip(sigma, rate, strict=True), steps, strict=True)
        self.counts = as_events(None, dict(runs))
        delta = float(np.asarray(store["delta"])[0])
        self.delta = None if np.isnan(delta) else delta
        code = int(np.asarray(store["accountant"])[0])
        self.accountant = None if code < 0 else ACCOUNTANTS[code]


def ledger_of(model, create=False):
    """The model's :class:`PrivacyLedger` (with ``create``, a new empty one
    attached when it has none; else None)."""
    found = getattr(model, ATTRIBUTE, None)
    if found is None and create:
        found = PrivacyLedger()
        setattr(model, ATTRIBUTE, found)
    return found


def load_model(filepath, **options):
    """``keras.models.load_model`` and the privacy the model spent.

    The model comes back as Keras loads it, with its
    :class:`PrivacyLedger` read from the same file, so that ``make_private``
    and ``epsilon()`` compose the steps it took before it was saved.
    ``options`` are ``keras.models.load_model``'s. Introduced in
    ``09-matrix-free``.
    """
    model = keras.models.load_model(filepath, **options)
    ledger_of(model, create=True)
    model.load_weights(filepath)  # Keras's walk reads the ledger's entries too
    return model
