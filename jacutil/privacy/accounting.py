"""The noise multiplier sigma for a target epsilon (notebook 09-matrix-free).

DP-SGD's privacy comes from sigma, the noise's standard deviation in units of
the clip norm C. A Keras user thinks in epsilon: :func:`noise_multiplier_for`
finds the smallest sigma whose epsilon, after all the planned steps, is at
most the target, by Google's ``dp-accounting`` (its
``calibrate_dp_mechanism``, with the same events and accountants that
``DPSGD.epsilon`` uses: :func:`jacutil.fitting.dp_sgd.dp_event`).
"""

from ..fitting.dp_sgd import (
    as_events,
    check_accounting,
    dp_accounting_module,
    dp_event,
    epsilon_of,
    new_accountant,
    quiet_absl,
)

TOLERANCE = 1e-4  # sigma is found to within this; epsilon never exceeds the target
# the PLD grid of the search: 10x coarser than the accountant's (1e-4) and
# about 10x faster; its sigma is at most 0.05% above the fine grid's (notebook
# 09's budgets, epsilon 0.5 to 8: 2.4570 against 2.4558 at 0.5)
SEARCH_GRID = 1e-3


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
        delta, accountant: as :func:`jacutil.fitting.dp_sgd.epsilon_of` takes
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
