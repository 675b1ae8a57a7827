"""nbval compares every output of a notebook except standard error.

TensorFlow writes warnings and progress bars to stderr; their text changes from
run to run and is not what a notebook teaches. nbval has no switch for this, so
its stream comparison drops stderr on both sides (the stored notebook and the
fresh run); stdout, results and errors are still compared in strict mode.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

try:
    import nbval.plugin as _nbval
except ImportError:  # nbval is only needed to test the notebooks
    _nbval = None


def _is_stderr(output):
    return output.get("output_type") == "stream" and output.get("name") == "stderr"


if _nbval is not None:
    _compare_streams = _nbval.transform_streams_for_comparison

    def _without_stderr(outputs):
        return _compare_streams([o for o in outputs if not _is_stderr(o)])

    _nbval.transform_streams_for_comparison = _without_stderr
