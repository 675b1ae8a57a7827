"""nbval compares every output of a notebook except standard error.

TensorFlow writes warnings and progress bars to stderr; their text changes from
run to run and is not what a notebook teaches. nbval has no switch for this, so
its stream comparison drops stderr on both sides (the stored notebook and the
fresh run); stdout, results and errors are still compared in strict mode.
"""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# the rules' kept verdicts (jacutil.rules.verdicts): a folder of the test
# run's own, so that each run checks every layer once and leaves nothing
if "JACUTIL_CHECK_CACHE" not in os.environ:
    _verdicts = tempfile.mkdtemp(prefix="jacutil-verdicts-")
    os.environ["JACUTIL_CHECK_CACHE"] = _verdicts
    atexit.register(shutil.rmtree, _verdicts, ignore_errors=True)

# notebooks/solutions/ holds each notebook with its solutions in and no stored
# outputs: papermill runs them (tests/test_notebooks.py), nbval runs the stored
# learner copies in notebooks/ (scripts/build_notebooks.py says why).
collect_ignore_glob = ["notebooks/solutions/*"]

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


def _version(package):
    from importlib.metadata import version

    return tuple(int(part) for part in version(package).split(".")[:2])


class NotebookGroups:
    """nbval runs a notebook's cells in one kernel, in order: in `make test`'s
    one pytest run (``--dist loadgroup``) each notebook's cells are one xdist
    group, so that one worker takes them all, in order."""

    @pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which names groups
    def pytest_collection_modifyitems(self, config, items):
        for item in items:
            path, _, cell = item.nodeid.partition("::")
            if path.endswith(".ipynb") and cell.startswith("Cell "):
                name = f"nbval:{path.rsplit('/', 1)[-1]}"
                item.add_marker(pytest.mark.xdist_group(name))


def pytest_configure(config):
    """Group each notebook's nbval cells (:class:`NotebookGroups`); refuse,
    before any test, the versions whose --dist loadgroup does not group (see
    pytest_collection_modifyitems below)."""
    config.pluginmanager.register(NotebookGroups(), "jacutil-notebook-groups")
    if getattr(config.option, "dist", None) != "loadgroup":
        return
    if _version("pytest") >= (9, 2) and _version("pytest-xdist") <= (3, 8):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist 3.8 or older ignores "
            "xdist_group marks under --dist loadgroup (pytest-xdist issue 1386), "
            "and tests that must run one at a time (Dask clusters, LocalWorkers) "
            "would run at once. Install the locked versions: make setup "
            "(requirements.lock pins pytest 9.1.1)."
        )


@pytest.hookimpl(trylast=True)  # after pytest-xdist's, which names the groups
def pytest_collection_modifyitems(config, items):
    """Refuse a run where ``--dist loadgroup`` does not group.

    Tests marked ``xdist_group`` (LocalWorkers, Dask clusters, the stages'
    compiled caches) must run one at a time in one worker. pytest 9.2 with
    pytest-xdist 3.8 ignores the marks without a word (pytest-xdist issue
    1386): the groups then ran at once on both workers, two Dask clusters on
    two cores, and CI of 2026-12-04 hung. xdist names a grouped test
    ``<nodeid>@<group>`` in the worker; a marked test without it is an error
    (shown by xdist as an INTERNALERROR: versions not yet known to break).
    """
    if not getattr(config.option, "loadgroup", False):
        return
    ungrouped = [
        item.nodeid
        for item in items
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid
    ]
    if ungrouped:
        raise pytest.UsageError(
            f"--dist loadgroup does not group {len(ungrouped)} tests marked "
            f"xdist_group (e.g. {ungrouped[0]}) with pytest {pytest.__version__}: "
            "pytest 9.2 breaks pytest-xdist's groups (issue 1386). Install the "
            "locked versions (make setup: requirements.lock pins pytest 9.1.1)."
        )
