"""A package's attributes, imported on first use (PEP 562): ``import
jacutil`` loads no TensorFlow until a name that needs it is used."""

import importlib
import sys


def lazy_modules(package, names):
    """A module ``__getattr__`` that imports what ``names`` name on first use.

    ``jacutil.stages.chunked`` works without the package importing every
    module at once (no import cycles), and the first use of a name keeps it
    in the package's namespace.

    Args:
        package: the package's ``__name__``.
        names: the module names to import on first use, or a dict: name ->
            the module (relative to ``package``) that defines it; a name
            that is its module's own name is that module.

    Returns:
        A function ``__getattr__(name)`` for the package's namespace.
    """
    table = names if isinstance(names, dict) else {name: name for name in names}

    def __getattr__(name):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.{table[name]}")
        value = module if table[name] == name else getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
