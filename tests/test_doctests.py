"""The examples in jacutil's docstrings run, and say what they show.

Every module of the package is searched except the benchmark's peers, whose
imports need optional packages (JAX, PyTorch), and ``__main__`` modules. The
examples build tiny float64 models, so the whole file takes seconds.
"""

import doctest
import importlib
import pkgutil

import pytest

import jacutil

SKIP = ("jacutil.peers.", "jacutil.bench.__main__")
# 95 examples when this was written (entry points, _shared): a count below
# this means the search missed modules or examples were dropped.
AT_LEAST = 90


def _module_names():
    names = ["jacutil"]
    for info in pkgutil.walk_packages(jacutil.__path__, "jacutil."):
        if not info.name.startswith(SKIP) and not info.name.endswith("__main__"):
            names.append(info.name)
    return sorted(names)


MODULES = _module_names()
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _tests(name):
    module = importlib.import_module(name)
    # the finder keeps the module's own objects: a re-export is tested once
    return doctest.DocTestFinder(exclude_empty=True).find(module)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in _tests(name):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert not results.failed, f"{results.failed} example(s) failed in {name}"


def test_examples_are_found():
    """The search finds the examples (so the test above cannot pass on none)."""
    count = sum(len(t.examples) for name in MODULES for t in _tests(name))
    assert count >= AT_LEAST, f"only {count} docstring examples found"
