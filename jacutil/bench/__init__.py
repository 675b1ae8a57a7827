"""The benchmark: every path on each model, in one run (``make bench``).

``cli`` says how to run it and what it writes; each module says its part.
The modules, in reading order: ``paths`` (the ``PATHS`` and ``MODELS``
registries), ``floor`` (the write floor every ratio is to), ``runner``
(``run_bench``), ``skipping``, ``fresh`` (memory in a fresh process),
``report`` (ratios and tables, against the faster of JAX and PyTorch when
installed: ``make bench-peers``), ``plots``, ``profile`` (the hand-derived
path piece by piece), ``models`` (the residual and two-head models),
``peer_rows`` (jacutil against the peers beyond the Jacobian), ``cli``.
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
