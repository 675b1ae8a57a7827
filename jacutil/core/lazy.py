"""A package's attributes, imported on first use (PEP 562): ``import
jacutil`` loads no TensorFlow until a name that needs it is used."""

import importlib
import sys


def lazy_face(package, names=(), modules="", hidden=()):
    """A package's ``__all__``, ``__getattr__`` and ``__dir__``, in one call.

    ``names`` maps each name the package shows to the module (relative to
    ``package``) that defines it; a name that is its module's own name is
    that module. ``modules`` (space-separated) are submodules importable as
    attributes but not in ``__all__``, and so are the ``hidden`` names.
    Nothing is imported until first use (no import cycles), which then keeps
    the value in the package's namespace.
    """
    table = dict(names) | {module: module for module in modules.split()}

    def __getattr__(name):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.{table[name]}")
        value = module if table[name] == name else getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted({*vars(sys.modules[package]), *table})

    return [name for name in names if name not in hidden], __getattr__, __dir__
