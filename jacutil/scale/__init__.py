"""Beyond one process (10-beyond-one-machine).

- ``resume``       the file and ledger that let a killed run resume
- ``credentials``  TLS credentials for workers on a cluster
- ``workers``      ``LocalWorkers``: worker processes on this machine
- ``distributed``  ``distributed_jacobian`` and ``DistributedLeastSquares``
"""

from ..core._shared import lazy_modules

__getattr__ = lazy_modules(
    __name__,
    {
        "credentials",
        "distributed",
        "resume",
        "workers",
    },
)
