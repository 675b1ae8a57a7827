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
    """Peak bytes of each size's first call, sizes increasing (in this process).

    Args:
        name: a path in ``PATHS``.
        sizes: the numbers of samples.
        seed: the model's and the inputs' seed.
        model: a name in ``MODELS``.

    Returns:
        A list of ints, one per size in increasing order.
    """
    network = MODELS[model].build(seed)
    jac = PATHS[name].build(network)
    x = MODELS[model].inputs(max(sizes), seed)
    start = memory.anonymous_rss()
    return [memory.peak_memory(jac, x[:n], baseline=start).peak for n in sorted(sizes)]


def measure_in_fresh_process(name, sizes, seed=0, model="mlp"):
    """Peak bytes of path ``name`` at each size, in a new Python process.

    Args as in :func:`measure_memory`.

    Returns:
        A list of ints, one per size in increasing order (empty without sizes).

    Raises:
        RuntimeError: the process failed (its stderr's end is in the message).
    """
    if not sizes:
        return []
    arguments = ["-m", "jacutil.bench", "--measure-memory", name, "--seed", str(seed)]
    arguments += ["--model", model, "--sizes", *map(str, sizes)]
    return fresh_python(arguments, f"measuring {name} failed")
