"""Data that stays on the workers: dask.arrays (notebook 10-beyond-one-machine).

``x`` may be a ``dask.array`` (or a Dask future of an array, or a list of
futures of blocks of samples): :func:`jacutil.distributed_jacobian` computes
its blocks on the workers and hands each to the chunk that needs it; only
one sample comes to the driver, to check the model. J itself can stay there
too: :func:`lazy_jacobian` and :func:`jacobian_futures`.

Tasks reach the scheduler as ``pickle.loads`` and ``operator.call`` with
bytes (as in :mod:`jacutil.scale.executors`): it needs nothing of ours.
"""

import functools
import operator
import pickle

from ..core.arguments import check_chunk_size
from ..core.planner import Plan
from .dask_blocks import blocks_by_samples, is_dask_input
from .distributed import model_spec, prepare, rows_task
from .workers import client_of


def lazy_jacobian(
    model,
    x,
    *,
    chunk_size,
    training=False,
    jit_compile=False,
    method="rules",
    client=None,
):
    """The per-sample Jacobian as a lazy ``dask.array``, chunked by samples.

    Nothing runs until it is computed (``J.compute()``), persisted on the
    workers (``client.persist(J)``) or stored (``J.to_zarr(...)``,
    ``da.store``); each block is a chunk of :func:`jacutil.chunked_jacobian`
    rows, equal to it bit for bit with the same ``chunk_size``. Introduced
    in ``10-beyond-one-machine``.

    Arguments as :func:`jacutil.distributed_jacobian` (``chunk_size``: samples
    per block, required); ``client``, the ``dask.distributed.Client`` that
    computes a ``dask.array`` x's first sample (None: the current client).
    Returns a ``dask.array`` of shape (n, l, m).
    """
    import dask
    import dask.array as da

    chunk_size = check_chunk_size(chunk_size)  # the stages' check and words
    if chunk_size is None:
        raise TypeError("lazy_jacobian needs chunk_size: the samples per block.")
    if client is None and is_dask_input(x):
        client = client_of(None)  # the current one, as Dask's own functions do
    run = prepare(model, x, client, training, jit_compile, method)
    loads = dask.delayed(pickle.loads, pure=True)
    options = {"training": training, "jit_compile": jit_compile, "method": method}
    task = loads(pickle.dumps(functools.partial(rows_task, options=options)))
    spec = loads(pickle.dumps(model_spec(model, run.probe)))
    plan = Plan(run.n_rows, chunk_size)
    if run.dask_x is not None:
        blocks = blocks_by_samples(run.dask_x, chunk_size)
    else:
        blocks = [loads(pickle.dumps(run.chunk(*bounds))) for bounds in plan]
    call = dask.delayed(operator.call, pure=True)
    parts = [
        da.from_delayed(
            call(task, spec, block, start),
            shape=(stop - start, *run.shape[1:]),
            dtype=run.dtype,
        )
        for block, (start, stop) in zip(blocks, plan, strict=True)
    ]
    return da.concatenate(parts)


def jacobian_futures(model, x, workers=None, *, chunk_size, **options):
    """Start every chunk on the workers now; one future per chunk.

    For asynchronous use: the driver goes on while the workers compute;
    ``future.result()`` (or ``distributed.as_completed``) gives each chunk's
    rows, shape (c, l, m), in sample order of the list: chunk k holds rows
    ``k * chunk_size ...``. Arguments as :func:`lazy_jacobian`, with
    ``workers`` a :class:`jacutil.LocalWorkers` or ``dask.distributed.Client``
    (None: the current client). Introduced in ``10-beyond-one-machine``.
    """
    client = client_of(workers)
    J = lazy_jacobian(model, x, chunk_size=chunk_size, client=client, **options)
    return client.compute(list(J.to_delayed().ravel()))
