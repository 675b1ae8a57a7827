"""Beyond one process (10-beyond-one-machine).

- ``executors``    where chunks run: Dask (default) or a process pool
- ``chunk_files``  a Jacobian as a folder of files, one per chunk
- ``dask_blocks``  a dask.array x read where it lies (its blocks, one sample)
- ``dask_arrays``  a lazy J as a dask.array, and futures of its chunks
- ``credentials``  TLS credentials for workers on a cluster
- ``workers``      ``LocalWorkers``: worker processes on this machine
- ``distributed``  ``distributed_jacobian`` and ``DistributedLeastSquares``
"""

from ..core.lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(
    __name__,
    modules="chunk_files credentials dask_arrays dask_blocks distributed executors "
    "workers",
)
