"""Small helpers that several modules need (internal)."""

import importlib


def lazy_modules(package, names):
    """A module ``__getattr__`` that imports ``package.<name>`` on first use,
    for each name in ``names`` (PEP 562): ``jacutil.stages.chunked`` works
    without the package importing every module at once (no import cycles)."""

    def __getattr__(name):
        if name in names:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
