"""DP-SGD's privacy accounting: epsilon of the steps taken, and the noise
multiplier sigma for a target epsilon (notebook 09-matrix-free).

DP-SGD's privacy comes from sigma, the noise's standard deviation in units of
the clip norm C. A Keras user thinks in epsilon: :func:`noise_multiplier_for`
finds the smallest sigma whose epsilon, after all the planned steps, is at
most the target, by Google's ``dp-accounting`` (its
``calibrate_dp_mechanism``, with the same events and accountants that
``DPSGD.epsilon`` uses: :func:`dp_event`).
"""

import logging
import math
from contextlib import contextmanager
from functools import lru_cache

TOLERANCE = 1e-4  # sigma is found to within this; epsilon never exceeds the target
# the PLD grid of the search: 10x coarser than the accountant's (1e-4) and
# about 10x faster; its sigma is at most 0.05% above the fine grid's (notebook
# 09's budgets, epsilon 0.5 to 8: 2.4570 against 2.4558 at 0.5)
SEARCH_GRID = 1e-3


INSTALL_COMMAND = "pip install --no-deps dp-accounting==0.6.0"
INSTALL_HINT = (
    "DPSGD.epsilon needs Google's dp-accounting, which is not installed. No "
    "release of it installs next to requirements.lock with pip's resolver: "
    "0.5.0-0.6.0 pin attrs<24 (the lock has attrs 26.1.0), 0.1.0-0.5.1 pin "
    "absl-py<2 (the lock has 2.5.1), and 0.0.1-0.0.2 (2021) have no "
    "subsampled Gaussian. Its code runs with the locked versions (it imports "
    "only absl-py, attrs, numpy and scipy), so install it without its pins:\n"
    f"    {INSTALL_COMMAND}"
)

ACCOUNTANTS = ("rdp", "pld")
PLD_GRID = 1e-4  # the PLD accountant's grid of privacy losses (its default)


def dp_accounting_module():
    """The ``dp_accounting`` module, or an ImportError that says how to install it."""
    try:
        import dp_accounting
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return dp_accounting


@contextmanager
def quiet_absl():
    """dp-accounting's RDP accountant logs a WARNING for each order whose
    series does not converge ("Excluding this order from the epsilon
    computation"): the epsilon it returns is still a valid bound, taken over
    the other orders, so the warning tells a learner nothing to act on."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def dp_event(noise_multiplier, steps_at):
    """DP-SGD's steps as a ``dp_accounting.DpEvent``.

    Each step is a Gaussian mechanism of noise multiplier sigma (on a sum of
    sensitivity C), Poisson-sampled at its rate; any accountant of
    ``dp-accounting`` takes it. Introduced in ``09-matrix-free``.

    ``noise_multiplier`` is sigma, ``steps_at`` ``{sampling rate: steps
    taken at it}`` (rate 1: no sampling); or ``noise_multiplier`` None and
    ``steps_at`` ``{(sigma, rate): steps}``, the steps of several sigmas (a
    model's ledger: :class:`jacutil.privacy.ledger.PrivacyLedger`). Returns a
    ``dp_accounting.ComposedDpEvent``; an ImportError that says how to install
    dp-accounting when it is not.
    """
    dpa = dp_accounting_module()
    events = []
    for (sigma, q), count in sorted(as_events(noise_multiplier, steps_at).items()):
        gaussian = dpa.GaussianDpEvent(sigma)
        step = gaussian if q == 1 else dpa.PoissonSampledDpEvent(q, gaussian)
        events.append(dpa.SelfComposedDpEvent(step, count))
    return dpa.ComposedDpEvent(events)


def as_events(noise_multiplier, steps_at):
    """``{(sigma, rate): steps}`` from :func:`dp_event`'s arguments: one
    sigma and ``{rate: steps}``, or None and already ``{(sigma, rate):
    steps}``; runs of no step left out."""
    if noise_multiplier is not None:
        steps_at = {(float(noise_multiplier), q): c for q, c in steps_at.items()}
    return {
        (float(sigma), float(q)): int(c) for (sigma, q), c in steps_at.items() if c
    }


def check_accounting(delta, accountant):
    """Refuse a ``delta`` outside (0, 1) (None: not checked) or an accountant
    that is neither "rdp" nor "pld", saying which values are allowed."""
    if delta is not None and not 0 < delta < 1:
        raise ValueError(f"delta is {delta!r}; it must be in (0, 1).")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant is {accountant!r}; one of {ACCOUNTANTS}.")


def new_accountant(accountant):
    """A fresh ``dp-accounting`` accountant: "rdp" or "pld"."""
    check_accounting(None, accountant)
    dpa = dp_accounting_module()
    if accountant == "rdp":
        return dpa.rdp.RdpAccountant()
    return dpa.pld.PLDAccountant(value_discretization_interval=PLD_GRID)


@lru_cache(maxsize=16)
def sampled_gaussian_pld(noise_multiplier, sampling_rate):
    """One Poisson-sampled Gaussian step's privacy loss distribution, built
    as dp-accounting's ``PLDAccountant`` builds it (its grid, one sample
    added or removed), once per (sigma, q).

    Building it is the slow part of a PLD epsilon (about 0.5 s on the grid of
    1e-4); composing it k times is about 10x faster. So epsilon after each
    epoch of one training (``make_private``), after a calibration's check,
    or after one more step, builds it once. The result is immutable: every
    composition returns a new distribution.
    """
    dpa = dp_accounting_module()
    return dpa.pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier,
        value_discretization_interval=PLD_GRID,
        sampling_prob=sampling_rate,
        neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
    )


def epsilon_of(noise_multiplier, steps_at, delta, accountant="rdp"):
    """The epsilon of DP-SGD's steps at ``delta``, from Google's dp-accounting.

    Adjacent data sets differ by one sample added or removed. Introduced in
    ``09-matrix-free``.

    Args:
        noise_multiplier: sigma; or None when ``steps_at`` names each run's
            sigma (:func:`as_events`).
        steps_at: ``{sampling rate: steps taken at it}``, or with
            ``noise_multiplier`` None ``{(sigma, rate): steps}``: runs of
            steps at several noise multipliers, composed.
        delta: the delta of the (epsilon, delta) guarantee, in (0, 1);
            usually below 1 / n.
        accountant: "rdp" (Renyi DP, as TensorFlow Privacy reports) or "pld"
            (privacy loss distributions: tighter, slower).

    Returns:
        Epsilon, a float (``inf`` with no noise; 0.0 before any step).

    Raises:
        ImportError: dp-accounting is not installed (the message says how).
    """
    check_accounting(delta, accountant)
    dpa = dp_accounting_module()
    events = as_events(noise_multiplier, steps_at)
    if not events:
        return 0.0
    if any(sigma == 0 for sigma, _ in events):
        return math.inf
    with quiet_absl():
        if accountant == "pld" and all(0 < q < 1 for _, q in events):
            # what the PLD accountant composes for dp_event's events, in
            # their order, from its identity, each step's distribution built
            # once (the tests compare with the accountant itself)
            pld = dpa.pld.privacy_loss_distribution.identity(PLD_GRID)
            for (sigma, q), count in sorted(events.items()):
                step = sampled_gaussian_pld(sigma, q)
                pld = pld.compose(step.self_compose(count))
            return float(pld.get_epsilon_for_delta(delta))
        ledger = new_accountant(accountant)
        ledger.compose(dp_event(None, events))
        return float(ledger.get_epsilon(delta))


def noise_multiplier_for(
    epsilon, delta, sampling_rate, steps, accountant="pld", spent=None
):
    """The smallest noise multiplier whose epsilon is at most ``epsilon``.

    The steps are Poisson-sampled Gaussian mechanisms at ``sampling_rate``
    (what ``DPSGD.sampled_step`` and ``make_private``'s ``model.fit`` do);
    adjacent data sets differ by one sample added or removed. The sigma
    returned gives, by the same accountant, an epsilon at most the target (the
    tests call dp-accounting directly to check it). Introduced in
    ``09-matrix-free``.

    Args:
        epsilon: the target epsilon, > 0.
        delta, accountant: as :func:`epsilon_of` takes
            them (but "pld" is the default here).
        sampling_rate: q, each sample's probability of joining a batch, in
            (0, 1].
        steps: how many steps the training takes, >= 1.
        spent: steps already taken, ``{(sigma, rate): steps}`` (a model's
            :class:`jacutil.privacy.ledger.PrivacyLedger`): the epsilon
            bounded is that of those and the new steps, composed. A
            ValueError when they alone spend ``epsilon`` or more.

    With PLD the search runs on a 10x coarser grid of privacy losses
    (``SEARCH_GRID``; a PLD accountant's epsilon is an upper bound at any
    grid), about 10x faster, and one call of the accountant itself then
    checks that sigma keeps epsilon under the target (else the search runs
    again on its grid). The sigma found so is at most about 0.05% above the
    smallest on the accountant's own grid.

    Returns:
        sigma, a float; an ImportError says how to install dp-accounting.
    """
    if not epsilon > 0:
        raise ValueError(
            f"epsilon is {epsilon!r}; the target must be > 0 (common choices: "
            "1 to 8; smaller is more private and costs accuracy)."
        )
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate is {sampling_rate!r}; it is in (0, 1].")
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps is {steps!r}; a whole number >= 1.")
    check_accounting(delta, accountant)
    dpa = dp_accounting_module()
    spent = as_events(None, spent or {})

    def planned(sigma):
        events = dict(spent)
        key = (float(sigma), float(sampling_rate))
        events[key] = events.get(key, 0) + int(steps)
        return events

    already = epsilon_of(None, spent, delta, accountant) if spent else 0.0
    if already >= epsilon:
        raise ValueError(
            f"the steps already taken ({sum(spent.values())} in the model's "
            f"ledger) spend epsilon = {already:.4g} at delta = {delta:g}: the "
            f"target epsilon = {epsilon:g} leaves nothing for more steps. This "
            "model's budget on its data is spent: more training on that data "
            "would spend more than the target, whatever the noise."
        )

    def event(sigma):
        return dp_event(None, planned(sigma))

    def search(make_accountant):
        with quiet_absl():
            return float(
                dpa.calibrate_dp_mechanism(
                    make_accountant,
                    event,
                    epsilon,
                    delta,
                    dpa.LowerEndpointAndGuess(0.0, 1.0),
                    tol=TOLERANCE,
                )
            )

    if accountant == "pld":
        sigma = search(
            lambda: dpa.pld.PLDAccountant(value_discretization_interval=SEARCH_GRID)
        )
        if epsilon_of(None, planned(sigma), delta, "pld") <= epsilon:
            return sigma
    return search(lambda: new_accountant(accountant))
