"""The fallback ladder (jacutil.core.formulation.Ladder), with stand-in
functions that fail as TensorFlow does: no model, no trace."""

import pytest

from jacutil import tf
from jacutil.core.formulation import (
    Ladder,
    NeedsXla,
    PforFailed,
    SlowPathWarning,
)


class NotOnRules(Exception):
    pass


def ladder_of(fails, plan=True, pfor=True):
    """A ladder whose function in (mode, xla) raises ``fails[mode, xla]``,
    else returns (mode, xla); ``built`` lists what it built."""
    built = []

    def build(key, mode, xla, x):
        built.append((key, mode, xla))

        def run(x):
            if (mode, xla) in fails:
                raise fails[mode, xla]
            return mode, xla

        return run

    checked_plan = lambda x: "plan" if plan else None  # noqa: E731
    ladder = Ladder(build, checked_plan, pfor=pfor, not_on_rules=NotOnRules)
    return ladder, built


def pfor_when_run():
    return tf.errors.InvalidArgumentError(None, None, "at node loop_body/pfor/Gather")


def xla_cannot():
    return tf.errors.InvalidArgumentError(
        None, None, "TensorListReserve on XLA_CPU_JIT"
    )


def test_each_signature_keeps_the_first_mode_that_works():
    ladder, built = ladder_of({})
    assert ladder("a", (0,)) == ((Ladder.RULES, False), Ladder.RULES, False)
    ladder("a", (1,))
    assert built == [("a", Ladder.RULES, False)]
    ladder, built = ladder_of({}, plan=False)
    assert ladder("a", (0,))[1] == Ladder.VECTORIZED
    ladder, built = ladder_of({}, plan=False, pfor=False)  # a loop that is kept
    assert ladder("a", (0,))[1] == Ladder.MAP_FN


def test_down_every_rung_warned_once_and_later_signatures_start_below_pfor():
    fails = {
        (Ladder.RULES, False): NotOnRules(),
        (Ladder.VECTORIZED, False): NeedsXla(),
        (Ladder.UNDER_XLA, True): PforFailed("no converter for Foo"),
    }
    ladder, built = ladder_of(fails)
    with pytest.warns(SlowPathWarning, match="no converter for Foo") as record:
        assert ladder("a", (0,))[1] == Ladder.MAP_FN
        assert ladder("b", (0,))[1] == Ladder.MAP_FN
    assert len(record) == 1
    assert ladder.pfor_failed == "no converter for Foo"
    modes = [mode for _, mode, _ in built]
    assert modes == [
        Ladder.RULES,
        Ladder.VECTORIZED,
        Ladder.UNDER_XLA,
        Ladder.MAP_FN,
        Ladder.RULES,
        Ladder.MAP_FN,
    ]


@pytest.mark.parametrize(
    "fails",
    [
        {(Ladder.VECTORIZED, False): pfor_when_run()},
        {
            (Ladder.VECTORIZED, False): NeedsXla(),
            (Ladder.UNDER_XLA, True): xla_cannot(),
        },
        {(Ladder.VECTORIZED, False): xla_cannot()},  # moved under XLA by vectorize
    ],
    ids=["pfor-when-run", "under-xla", "moved-under-xla"],
)
def test_pfor_failing_when_run_or_under_onednns_xla_runs_sample_by_sample(fails):
    ladder, _ = ladder_of(fails, plan=False)
    with pytest.warns(SlowPathWarning):
        assert ladder("a", (0,))[1] == Ladder.MAP_FN


def test_what_xla_cannot_compile_runs_in_the_same_mode_without_xla():
    ladder, built = ladder_of({(Ladder.RULES, True): xla_cannot()})
    assert ladder("a", (0,), xla=(Ladder.RULES,))[1:] == (Ladder.RULES, False)
    ladder("a", (0,), xla=(Ladder.RULES,))
    assert built == [("a", Ladder.RULES, True), ("a", Ladder.RULES, False)]


def test_other_errors_are_raised_as_they_are():
    error = ValueError("the user's own bug")
    for fails, plan in [
        ({(Ladder.RULES, False): error}, True),
        ({(Ladder.MAP_FN, False): error}, False),
    ]:
        ladder, _ = ladder_of(fails, plan=plan, pfor=False)
        with pytest.raises(ValueError) as caught:
            ladder("a", (0,))
        assert caught.value is error
    ladder, _ = ladder_of(
        {(Ladder.MAP_FN, False): pfor_when_run()}, plan=False, pfor=False
    )
    with pytest.raises(tf.errors.InvalidArgumentError):  # no rung below tf.map_fn
        ladder("a", (0,))


def test_a_dropped_plan_starts_again():
    ladder, built = ladder_of({})
    ladder("a", (0,))
    ladder.restart()
    ladder.checked_plan = lambda x: None
    assert ladder("a", (0,))[1] == Ladder.VECTORIZED
