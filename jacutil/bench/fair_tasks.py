"""The rows of the fair table (``isolated.py``): what each library computes.

A row is a task at one n. The peer rows' tasks (:data:`~.peer_rows.TASKS`:
per-sample gradients, their norms, the Jacobian) use each library's builder
there. Issue 38's table holds two more kinds of row:

- ``laplace-mlp``: the covariance J* Sigma J*.T of a last-layer Laplace
  posterior (:mod:`.curvature_rows`'s row; the posterior is built outside
  the clock) against laplace-torch, checked as that table checks it;
- ``floor-cnn`` and ``floor-lstm``: jacutil's ``jacobian(model, x)`` against
  the write floor, filling a preallocated array of J's shape (n, l, m)
  (:func:`~.floor.fill_floor`). The floor computes nothing, so its result
  is not checked; its "ratio" is how many floors jacutil's J costs.

:func:`prepare` builds one library's function of one row, ready to call,
with the check its result must pass. Introduced in ``07-benchmark``.
"""

import dataclasses
import importlib.util
from dataclasses import dataclass

from .. import peers
from . import curvature_rows
from .floor import fill_floor, preallocated
from .paths import MODELS, PEER_NAMES, jacobian_shape
from .peer_rows import KINDS, SHORT_MODELS, TASKS, inputs_for
from .runner import agree

CURVATURE = {"laplace-mlp": next(r for r in curvature_rows.ROWS if r.kind == "laplace")}
FLOOR_MODELS = {"floor-cnn": "cnn", "floor-lstm": "lstm"}
NAMES = PEER_NAMES | {"laplace": "laplace-torch", "floor": "the write floor"}


@dataclass
class Prepared:
    """One library's function of one row: ``function(*args)`` is timed, and
    ``check(value, expected)`` returns the largest absolute difference of
    its result from jacutil's (None where nothing is compared), raising
    AssertionError beyond the row's tolerance."""

    function: object
    args: tuple
    check: object


def _known(task_name):
    if task_name not in TASKS and task_name not in CURVATURE | FLOOR_MODELS:
        known = sorted([*TASKS, *CURVATURE, *FLOOR_MODELS])
        raise KeyError(f"{task_name!r}: no such row; the rows are {known}")


def libraries(task_name):
    """The row's libraries, jacutil first, then each installed peer."""
    _known(task_name)
    if task_name in FLOOR_MODELS:
        return ["jacutil", "floor"]
    if task_name in CURVATURE:
        needed = ("torch", CURVATURE[task_name].library)
        have = all(importlib.util.find_spec(name) for name in needed)
        return ["jacutil"] + (["laplace"] if have else [])
    kind = KINDS[TASKS[task_name].kind]
    return ["jacutil"] + [p for p in kind.peers if peers.available(p)]


def describe(task_name):
    """(what, model) in words, for the table."""
    _known(task_name)
    if task_name in FLOOR_MODELS:
        return "per-sample Jacobian, x the write floor", SHORT_MODELS[
            FLOOR_MODELS[task_name]
        ]
    if task_name in CURVATURE:
        row = CURVATURE[task_name]
        return curvature_rows.LABELS[row.kind], SHORT_MODELS[row.model]
    task = TASKS[task_name]
    return KINDS[task.kind].label, SHORT_MODELS[task.model]


def model_name(task_name):
    """The row's model, a key of :data:`~.paths.MODELS`."""
    _known(task_name)
    if task_name in FLOOR_MODELS:
        return FLOOR_MODELS[task_name]
    if task_name in CURVATURE:
        return CURVATURE[task_name].model
    return TASKS[task_name].model


def prepare(task_name, n, library, seed):
    """One library's :class:`Prepared` function of the row ``task_name`` at n
    (the model, data and any setup from ``seed``); KeyError for an unknown
    row."""
    _known(task_name)
    if task_name in CURVATURE:
        row = dataclasses.replace(CURVATURE[task_name], n=n)
        network = MODELS[row.model].build(seed)
        x, y = curvature_rows.row_inputs(row.model, n, seed)
        build = curvature_rows.jacutil_function
        if library != "jacutil":
            build = curvature_rows.peer_function
        function = build(row, network, x, y, seed)
        return Prepared(function, (), lambda v, e: curvature_rows.check_row(row, v, e))
    if task_name in FLOOR_MODELS:
        from ..auto import jacobian

        network = MODELS[FLOOR_MODELS[task_name]].build(seed)
        x = MODELS[FLOOR_MODELS[task_name]].inputs(n, seed)
        if library == "floor":
            out = preallocated(jacobian_shape(network, x, n))
            return Prepared(fill_floor, (out,), lambda v, e: None)
        return Prepared(jacobian, (network, x), lambda v, e: 0.0)
    task = TASKS[task_name]
    kind = KINDS[task.kind]
    network = MODELS[task.model].build(seed)
    if library == "jacutil":
        function = kind.ours(network)
    else:
        function = kind.peers[library][1](network)

    def check(value, expected):
        message = f"{library}'s result differs from jacutil's on {task_name} at n = {n}"
        return agree(value, expected, message)

    return Prepared(function, inputs_for(task, network, n, seed), check)
