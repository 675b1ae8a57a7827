"""A ``dask.array`` x, read where it lies (notebook 10-beyond-one-machine):
what :func:`jacutil.distributed_jacobian` and
:func:`jacutil.scale.dask_arrays.lazy_jacobian` need to take samples from
Dask without bringing them to the driver."""

import operator

import numpy as np


def is_dask_input(x):
    """Whether ``x`` is a ``dask.array``, a Dask future, or a list of futures."""
    try:
        import dask.array as da
        from distributed import Future
    except ImportError:  # pragma: no cover - distributed is a dependency
        return False
    if isinstance(x, da.Array | Future):
        return True
    return (
        isinstance(x, list | tuple)
        and bool(x)
        and all(isinstance(f, Future) for f in x)
    )


def as_dask_array(x, client):
    """``x`` (a ``dask.array``, a Dask future of an array, or a list of
    futures of blocks of samples, held by ``client``) as a ``dask.array``
    whose data stays where it is; ``ValueError`` when its number of samples is
    unknown (``nan`` chunks)."""
    import dask.array as da
    from distributed import Future

    if isinstance(x, Future):
        x = [x]
    if isinstance(x, list | tuple):
        metas = client.gather(
            [client.submit(operator.attrgetter("shape", "dtype"), f) for f in x]
        )
        x = da.concatenate(
            [
                da.from_delayed(f, shape=shape, dtype=dtype)
                for f, (shape, dtype) in zip(x, metas, strict=True)
            ]
        )
    if any(np.isnan(size) for size in x.shape):
        raise ValueError(
            f"x is a dask.array of unknown shape {x.shape}: call "
            "x.compute_chunk_sizes() (or give its shape) first."
        )
    return x


def first_sample(x, client):
    """Sample 0 of a ``dask.array``, computed on the workers."""
    return np.asarray(client.compute(x[:1]).result())


def blocks_by_samples(x, chunk_size):
    """``x`` cut into blocks of ``chunk_size`` samples: a list of ``dask.delayed``."""
    rest = {axis: -1 for axis in range(1, x.ndim)}
    return list(x.rechunk({0: chunk_size, **rest}).to_delayed().ravel())
