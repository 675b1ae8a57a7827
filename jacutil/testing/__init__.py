"""Independent references for tests: finite differences, and the rule check.

- :func:`finite_difference_jacobian`: (n, l, m) by central differences,
  sharing no code with the autodiff stages.
- :func:`check_rule`: one layer's rule alone against autodiff in random
  directions (VJP, JVP, the signal below, the column placement).
- ``SETTINGS``: the layer settings every registered rule is checked on;
  ``python -m jacutil.testing`` checks them all and exits 1 on a failure.
"""

from .finite_differences import finite_difference_jacobian
from .rule_check import RuleReport, check_rule
from .settings import SETTINGS, Setting

__all__ = [
    "SETTINGS",
    "RuleReport",
    "Setting",
    "check_rule",
    "finite_difference_jacobian",
]
