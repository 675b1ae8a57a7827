"""What the notebooks use to teach.

- ``check``     the exercises' checks (``check.exercise``), one module per notebook
- ``claims``    ``claim``: a sentence about the run, asserted by the run
- ``notebook``  showing source, progress bars, tables
- ``plots``     the figures
- ``models``    the notebooks' models and seeded data
- ``transformer`` notebook 12's transformer classifier and token data
- ``timing``    ``time_call``: medians of repeated calls
- ``memory_sweeps`` each size's peak memory, measured in a fresh process
- ``wide_fit``  notebook 09's fit of a wide network, in a fresh process
- ``drills``    fault drills: a run killed part way (notebook 10)
"""

from ..core.lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(
    __name__,
    modules="check claims drills memory_sweeps models notebook plots timing "
    "transformer wide_fit",
)
