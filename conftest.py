"""nbval compares every output of a notebook except standard error.

TensorFlow writes warnings and progress bars to stderr; their text changes from
run to run and is not what a notebook teaches. nbval has no switch for this, so
its stream comparison drops stderr on both sides (the stored notebook and the
fresh run); stdout, results and errors are still compared in strict mode.
"""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

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


def pytest_configure(config):
    """Refuse, before any test, the versions whose --dist loadgroup does not
    group (see pytest_collection_modifyitems below)."""
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
