"""Peak memory of a path measured in a fresh Python process (``--memory fresh``).

TensorFlow keeps memory it grew in a pool, so a path measured after others
would not count what they left. ``measure_in_fresh_process`` runs
``python -m jacutil.bench --measure-memory PATH`` instead: one new process
per path, its sizes in increasing order, each first call's peak above the
level before the first. Introduced in ``07-benchmark``.
"""

from ..core import memory
from ..teaching.memory_sweeps import fresh_python
from .paths import MODELS, PATHS


def measure_memory(name, sizes, seed, model="mlp"):
    """Peak bytes of path ``name``'s first call at each of ``sizes``, a list of
    ints in increasing order of size (in this process); ``seed`` is the
    model's and the inputs', ``model`` a name in ``MODELS``."""
    network = MODELS[model].build(seed)
    jac = PATHS[name].build(network)
    x = MODELS[model].inputs(max(sizes), seed)
    start = memory.anonymous_rss()
    return [memory.peak_memory(jac, x[:n], baseline=start).peak for n in sorted(sizes)]


def measure_in_fresh_process(name, sizes, seed=0, model="mlp"):
    """:func:`measure_memory` in a new Python process (an empty list without
    sizes); RuntimeError, with the end of its stderr, where the process fails.
    """

    if not sizes:
        return []
    arguments = ["-m", "jacutil.bench", "--measure-memory", name, "--seed", str(seed)]
    arguments += ["--model", model, "--sizes", *map(str, sizes)]
    return fresh_python(arguments, f"measuring {name} failed")
