"""What the notebooks use to teach.

- ``check``     the exercises' checks (``check.exercise``), one module per notebook
- ``notebook``  showing source, progress bars, tables
- ``plots``     the figures
- ``models``    the notebooks' models and seeded data
- ``timing``    ``time_call``: medians of repeated calls
- ``memory_sweeps`` each size's peak memory, measured in a fresh process
"""

from . import check, memory_sweeps, models, notebook, plots, timing  # noqa: F401
