"""``python -m jacutil.testing``: check every registered rule on its settings.

One line per rule and setting, then a summary; exit status 1 on any
failure or on a registered layer type without a setting.
"""

import sys
import time

from ..core._tf import tf
from ..rules import RULES
from .rule_check import check_rule
from .settings import SETTINGS


def main():
    # Keras retraces its grouped convolution per setting: its warning is not ours
    tf.get_logger().setLevel("ERROR")
    start = time.perf_counter()
    failed = 0
    for setting in SETTINGS:
        report = check_rule(
            setting.make(),
            input_shape=setting.input_shape,
            input_dtype=setting.input_dtype,
            raise_on_failure=False,
        )
        report.layer = setting.label
        print(report.line(), flush=True)
        failed += not report.passed
    covered = {s.layer_type for s in SETTINGS}
    unchecked = sorted(t.__name__ for t in RULES if t not in covered)
    for name in unchecked:
        print(f"FAIL {name}: registered, but no setting checks its rule")
    seconds = time.perf_counter() - start
    print(
        f"{len(SETTINGS) - failed} of {len(SETTINGS)} settings passed, "
        f"{len(covered & set(RULES))} of {len(RULES)} registered layer types "
        f"checked, in {seconds:.1f} s"
    )
    return 1 if failed or unchecked else 0


if __name__ == "__main__":
    sys.exit(main())
