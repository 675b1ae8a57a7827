"""List jacutil's public functions, classes and methods whose docstring lacks
``Args:`` (when they take arguments besides self/cls) or ``Returns:`` (when
they return a value). Skips jacutil.peers, __main__ modules and the
exercise checks (jacutil.teaching.check.notebook_NN: one contract, written
once in ``checks``).

    PYTHONPATH=. python scripts/audit_docstrings.py [-v]
"""

import ast
import importlib
import inspect
import pkgutil
import sys
import textwrap

import jacutil

SKIP = ("jacutil.peers", "jacutil.bench.__main__", "jacutil.teaching.check.notebook_")


def modules():
    names = ["jacutil"]
    for info in pkgutil.walk_packages(jacutil.__path__, "jacutil."):
        if not info.name.startswith(SKIP) and not info.name.endswith("__main__"):
            names.append(info.name)
    return sorted(names)


def returns_value(func):
    """Whether the function's own body has ``return <value>`` or ``yield``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):
        return False
    top = tree.body[0]

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                  ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(child, (ast.Yield, ast.YieldFrom)):
                return True
            if isinstance(child, ast.Return) and child.value is not None:
                if not (isinstance(child.value, ast.Constant)
                        and child.value.value is None):
                    return True
            if walk(child):
                return True
        return False

    return walk(top)


def takes_args(func):
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    return any(p not in ("self", "cls") for p in params)


def check_function(name, func, problems, what="function"):
    doc = inspect.getdoc(func) or ""
    missing = []
    if takes_args(func) and "Args:" not in doc:
        missing.append("Args")
    if returns_value(func) and "Returns:" not in doc and "Yields:" not in doc:
        missing.append("Returns")
    if missing:
        problems.append((name, what, missing))


def main():
    problems, seen = [], set()
    for modname in modules():
        module = importlib.import_module(modname)
        for attr, obj in vars(module).items():
            if attr.startswith("_") or getattr(obj, "__module__", None) != modname:
                continue
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            qual = f"{modname}.{attr}"
            if inspect.isclass(obj):
                doc = inspect.getdoc(obj) or ""
                init = obj.__dict__.get("__init__")
                fields = getattr(obj, "__dataclass_fields__", None) or getattr(
                    obj, "_fields", None)
                needs = (init is not None and takes_args(init)) or bool(fields)
                if needs and "Args:" not in doc and "Attributes:" not in doc:
                    problems.append((qual, "class", ["Args"]))
                for mname, member in obj.__dict__.items():
                    if mname.startswith("_") and mname not in ("__call__",):
                        continue
                    mq = f"{qual}.{mname}"
                    if isinstance(member, property):
                        if member.fget and not (inspect.getdoc(member) or ""):
                            problems.append((mq, "property", ["docstring"]))
                        continue
                    if isinstance(member, (staticmethod, classmethod)):
                        member = member.__func__
                    if inspect.isfunction(member):
                        check_function(mq, member, problems, "method")
            elif inspect.isfunction(obj):
                check_function(qual, obj, problems)
    for name, what, missing in problems:
        print(f"{name}  [{what}] lacks {', '.join(missing)}")
    print(f"{len(problems)} object(s) lack Args/Returns", file=sys.stderr)
    return problems


if __name__ == "__main__":
    main()
