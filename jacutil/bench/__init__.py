"""The benchmark: every path on each model, in one run (``make bench``)::

    python -m jacutil.bench                        # mlp, cnn, lstm
    python -m jacutil.bench --model mlp --sizes 100 1000 --repeats 5 --memory inline

Each path runs at each n: the first call (trace, compile) is timed apart,
then ``repeats`` more calls give the median. A path is skipped where its
predicted time for all those calls exceeds ``--max-seconds``, or, for the
quadratic ``tape.jacobian`` paths, where its predicted memory does not fit.
Every result is checked against the compiled per-sample stage before it is
timed. Peak memory is the resident memory a path's first call at each n
needs above the level before, measured in a fresh process per path
(``--memory fresh``), or in this one (``inline``: quicker, but memory that
an earlier path left pooled is not counted again).

The *floor* is filling a preallocated array of the Jacobian's shape: any
function that computes J writes its n * l * m numbers at least once. Beside
it, a fresh array (``np.full``), which any function that returns a new J
must also allocate. Every table gives each path's ratio to the floor and,
when JAX and PyTorch are installed (``make bench-peers``), to the faster of
the two, with each peer's largest difference from jacutil's J.

The *peer rows* (``--peer-rows``, on in ``make bench-peers``) time jacutil
against both peers beyond the Jacobian tables: per-sample gradients of a
squared-error loss and their norms on the MLP, the CNN and the LSTM, and the
Jacobian of the MLP at n = 100, of a residual MLP and of a two-head model
(``models.py`` builds those two), each row with its proof that the peers'
numbers equal jacutil's.

The modules, in reading order: ``paths`` (the ``PATHS`` and ``MODELS``
registries), ``floor``, ``runner`` (``run_bench``), ``skipping``,
``fresh`` (memory in a fresh process), ``report`` (ratios and tables),
``plots``, ``profile`` (the hand-derived path piece by piece),
``models`` (the residual and two-head models), ``peer_rows``, ``cli``.
Introduced in ``07-benchmark``.
"""

from .cli import main
from .floor import FLOOR, FLOOR_NEW, fill_floor, preallocated, write_floor
from .fresh import measure_in_fresh_process
from .machine import machine_summary
from .models import flat_data, residual_mlp, targets, two_head
from .paths import (
    MODELS,
    PATHS,
    PEERS,
    REFERENCE,
    SIZES,
    BenchModel,
    Path_,
    count_outputs,
    default_paths,
    jacobian_shape,
)
from .peer_rows import (
    KINDS,
    TASKS,
    peer_ratio,
    peer_rows_markdown,
    peer_rows_table,
    proof_line,
    run_peer_rows,
    run_task,
)
from .plots import plot, save
from .profile import profile_dense
from .report import (
    Ratios,
    markdown,
    peer_proof,
    profile_table,
    ratios,
    series,
    slopes,
    summary,
    summary_table,
    table_at,
)
from .runner import Result, build_paths, max_abs_diff, run_bench
from .skipping import format_seconds

__all__ = [
    "FLOOR",
    "FLOOR_NEW",
    "KINDS",
    "MODELS",
    "PATHS",
    "PEERS",
    "REFERENCE",
    "SIZES",
    "TASKS",
    "BenchModel",
    "Path_",
    "Ratios",
    "Result",
    "build_paths",
    "count_outputs",
    "default_paths",
    "fill_floor",
    "format_seconds",
    "flat_data",
    "jacobian_shape",
    "machine_summary",
    "main",
    "markdown",
    "max_abs_diff",
    "measure_in_fresh_process",
    "peer_proof",
    "peer_ratio",
    "peer_rows_markdown",
    "peer_rows_table",
    "plot",
    "preallocated",
    "profile_dense",
    "profile_table",
    "proof_line",
    "ratios",
    "residual_mlp",
    "run_bench",
    "run_peer_rows",
    "run_task",
    "save",
    "series",
    "slopes",
    "summary",
    "summary_table",
    "table_at",
    "targets",
    "two_head",
    "write_floor",
]
