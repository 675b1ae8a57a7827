"""Independent references for tests: finite differences, and the rule check.

- :func:`finite_difference_jacobian`: (n, l, m) by central differences,
  sharing no code with the autodiff stages.
- :func:`check_rule`: one layer's rule alone against autodiff in random
  directions (VJP, JVP, the signal below, the column placement).
- ``SETTINGS``: the layer settings every registered rule is checked on;
  ``python -m jacutil.testing`` checks them all and exits 1 on a failure.
"""

from ..core.lazy import lazy_face

_NAMES = {
    "SETTINGS": "settings",
    "RuleReport": "rule_check",
    "Setting": "settings",
    "check_rule": "rule_check",
    "finite_difference_jacobian": "finite_differences",
}
__all__, __getattr__, __dir__ = lazy_face(
    __name__, _NAMES, modules="finite_differences rule_check settings"
)
