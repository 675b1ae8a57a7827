"""The empirical neural tangent kernel ``Theta(x, x') = J(x) J(x').T``
(notebook 11-curvature-and-uncertainty).

Row ``i * l + k`` of Theta is sample i's output k (sample-major, the order in
which ``jacutil.jacobian`` flattens the outputs), and so are the columns for
the samples of ``x'``. Theta is an (n l, n' l) matrix of inner products of
Jacobian rows: it never needs more than a chunk of J at a time. The work
runs in *block-rows* (one chunk of ``x`` against every chunk of ``x'``), the
unit of the memory budget and of a resumable run into a ``.npy`` file, whose
rows are on disk before the ledger records them (:func:`empirical_ntk`).
"""

from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..core._shared import ceil_div, is_path
from ..core._tf import tf
from ..core.arguments import check_chunk_size
from ..core.batch import as_batch, n_samples, take
from ..core.data import inputs_of, read_data
from ..core.outputs import output_layout
from ..core.planner import (
    Plan,
    bytes_per_sample,
    memory_budget_for,
    resumable_chunks,
    run_chunks,
    sum_chunks,
)
from ..core.resume import (
    LEDGER_SUFFIX,
    ResumeMismatch,
    check_key,
    check_out,
    fingerprint,
)
from ..core.target import variable_list
from ..engine.compiled import compiled_for
from ..engine.jacobian import best_jacobian


class _Setup:
    """What every function here needs to know about ``model`` at ``x``."""

    def __init__(self, model, x, variables):
        self.variables = None if variables is None else variable_list(variables)
        jac = compiled_for(model, self.variables, False, False, "rules", x)
        self.model = model
        self.target = jac.target
        self.batch = as_batch(x, self.target)
        self.n = int(n_samples(self.batch))
        self.l = output_layout(self.target, self.batch).n_outputs
        self.m = self.target.n_params
        self.dtype = np.dtype(self.target.dtype)
        self.itemsize = self.dtype.itemsize
        activations = jac.activation_elements(self.batch)
        # working memory of one sample's J rows while jacutil.jacobian runs
        self.per_sample = bytes_per_sample(self.l, self.m, self.itemsize, activations)
        self.row_bytes = self.l * self.m * self.itemsize  # one sample's J rows


def _jacobian_rows(model, x, variables, budget):
    """J of the samples ``x`` (one chunk), shape (c, l, m), by the fastest path.

    One function, so that the tests can count how often J is formed."""
    J = best_jacobian(model, x, variables=variables, memory_budget=budget)
    return np.asarray(J)


def _check_x2(setup, x2):
    """The batch of ``x2`` for ``setup``'s model; ValueError when its samples
    are shaped differently from those of x."""
    shapes = [tuple(t.shape[1:]) for t in tf.nest.flatten(setup.batch)]
    shapes2 = [tuple(np.shape(t)[1:]) for t in tf.nest.flatten(x2)]
    if len(shapes2) == len(shapes) and shapes != shapes2:  # before as_batch,
        _shape_error(shapes, shapes2)  # which would speak of x, not x2
    batch2 = as_batch(x2, setup.target)
    shapes2 = [tuple(t.shape[1:]) for t in tf.nest.flatten(batch2)]
    if shapes != shapes2:
        _shape_error(shapes, shapes2)
    return batch2


def _shape_error(shapes, shapes2):
    raise ValueError(
        f"x2's samples have shape {_shapes_text(shapes2)}, x's "
        f"{_shapes_text(shapes)}: Theta(x, x2) compares the same outputs of "
        "the same kind of sample. Give x2 the per-sample shape of x (only "
        "the number of samples, the first axis, may differ)."
    )


def _shapes_text(shapes):
    return str(shapes[0]) if len(shapes) == 1 else str(shapes)


def _samples_per_chunk(budget, fixed, per_chunk_sample, quadratic, what):
    """The largest c with ``fixed + c * per_chunk_sample + c**2 * quadratic``
    bytes within ``budget``; ValueError naming the smallest budget otherwise."""
    smallest = fixed + per_chunk_sample + quadratic
    if budget < smallest:
        raise ValueError(
            f"memory_budget={budget:,} bytes is too small for even one sample "
            f"of {what}: that needs {smallest:,} bytes. Pass memory_budget="
            f"{smallest:,} or more (a larger budget means fewer, larger chunks "
            "and a faster run)."
        )
    room = budget - fixed
    if quadratic == 0:
        return int(room // per_chunk_sample)
    b, a = per_chunk_sample, quadratic
    c = int((-b + np.sqrt(b * b + 4.0 * a * room)) / (2.0 * a))
    while c > 1 and c * b + c * c * a > room:  # rounding
        c -= 1
    return max(c, 1)


class _Plan:
    """Chunk size and J(x') chunks kept, for a budget; see ``empirical_ntk``."""

    def __init__(self, setup, n2, budget, chunk_size, to_file, symmetric):
        n_out, itemsize = setup.l, setup.itemsize
        # per sample of a chunk: its J rows held (x side), a J(x') chunk being
        # computed, and (for a file) its block-row of Theta before it is written;
        # per pair of samples: one block, before it is copied in
        per_sample = setup.row_bytes + setup.per_sample
        if to_file:
            per_sample += n_out * n2 * n_out * itemsize
        quadratic = n_out * n_out * itemsize
        all_x2 = n2 * setup.row_bytes  # the whole J(x'), to keep it
        fixed = 0
        if all_x2 + per_sample + quadratic <= budget:
            fixed = all_x2  # keep all of J(x'): each chunk formed once
        what = f"Theta with {n_out} outputs x {setup.m:,} parameters"
        if chunk_size is None:
            chunk_size = _samples_per_chunk(budget, fixed, per_sample, quadratic, what)
        self.chunk_size = max(1, min(int(chunk_size), max(setup.n, n2)))
        c = self.chunk_size
        used = fixed + c * per_sample + c * c * quadratic
        chunk_bytes = c * setup.row_bytes
        n_chunks2 = ceil_div(n2, c)
        if fixed:
            self.keep = n_chunks2
        else:
            self.keep = min(n_chunks2, max(0, budget - used) // chunk_bytes)


class _Chunks:
    """The J rows of the chunks of one batch, the first ``keep`` of them kept."""

    def __init__(self, setup, batch, chunk_size, keep, budget):
        self.setup, self.batch = setup, batch
        self.chunk_size, self.keep, self.budget = chunk_size, keep, budget
        self.n = int(n_samples(batch))
        self.kept = {}

    def rows(self, j):
        """J of chunk j as (c * l, m)."""
        if j in self.kept:
            return self.kept[j]
        start = j * self.chunk_size
        stop = min(start + self.chunk_size, self.n)
        s = self.setup
        J = _jacobian_rows(
            s.model, take(self.batch, start, stop), s.variables, self.budget
        )
        J = J.reshape(-1, s.m)
        if len(self.kept) < self.keep:
            self.kept[j] = J
        return J


def empirical_ntk(
    model,
    x,
    x2=None,
    *,
    variables=None,
    out=None,
    memory_budget=None,
    chunk_size=None,
    progress=False,
    key=None,
):
    """The empirical neural tangent kernel ``Theta(x, x2) = J(x) J(x2).T``.

    Rows are sample-major: row ``i * l + k`` is sample i of ``x``, output k;
    columns likewise for ``x2``. ``x2=None`` means ``x2 = x``: only the
    blocks on and above the diagonal are multiplied and the others are their
    mirror images, so the result is exactly symmetric (an ``x2`` holding the
    same values as ``x`` takes this path too).

    The run goes block-row by block-row: chunk i of ``x`` (its J rows formed
    once, by ``jacutil.jacobian``) times every chunk j of ``x2``. Each J
    chunk of ``x`` is computed once. The J chunks of ``x2`` are kept when all
    of J(x2) fits in ``memory_budget`` beside one sample's working memory
    (the chunks are then as large as the rest of the budget allows): each is
    computed once. Otherwise the first chunks that fit in what the budget
    leaves are kept and the others are computed again for every block-row,
    ``n_chunks(x)`` times each. With ``x2=None`` the J chunks of ``x`` serve
    as rows and columns: each is computed once when all of J(x) fits, and
    chunk j at most ``j + 1`` times otherwise.
    Introduced in ``11-curvature-and-uncertainty``.

    Args:
        model: a Keras model, or a callable ``f(x)`` with ``variables=``.
        x: the n samples (an array, or a list or dict of arrays, or a dataset
            of ``model.fit``'s batches, read as ``jacutil.jacobian`` reads it).
        x2: the n2 samples of the columns, shaped per sample like ``x``; None
            for ``x`` itself.
        variables: the variables to differentiate (default: the model's
            trainable variables).
        out: None (a new array), a NumPy array or ``np.memmap`` of shape
            (n l, n2 l) in the model's dtype, or the path of a ``.npy`` file:
            a resumable run that skips the block-rows an earlier run of the
            same model, weights, ``x`` and ``x2`` finished, and refuses a file
            of anything else (``jacutil.core.resume``).
        memory_budget: bytes of working memory (default: as
            ``jacutil.jacobian``, half the memory free now when the work is
            large). The output itself is not counted, except one block-row
            before it is written to a ``.npy`` path.
        chunk_size: samples per chunk (default: the largest that fits
            ``memory_budget``). A resumed file keeps the chunk size it was
            started with.
        progress: show a progress bar over block-rows.
        key: with ``out=path`` and a plain callable: a name you choose for
            what it computes (no fingerprint can see inside a function).

    Returns:
        Theta, shape (n l, n2 l), in the model's dtype: ``out`` when given,
        the ``.npy`` opened read-only for a path.

    Raises:
        ValueError: ``x2``'s samples are shaped differently from ``x``'s;
            ``out`` has the wrong shape or dtype; ``memory_budget`` is too
            small for one sample (the message names the smallest that works).
        jacutil.core.resume.ResumeMismatch: the ``.npy`` at ``out`` was
            started by another computation.
        jacutil.core.resume.FileBusy: another run is writing that file.
    """
    x = read_data(x, inputs=inputs_of(model))[0]  # a dataset: its x, in order
    if x2 is not None:
        x2 = read_data(x2, inputs=inputs_of(model))[0]
    setup = _Setup(model, x, variables)
    chunk_size = check_chunk_size(chunk_size)
    symmetric = x2 is None or x2 is x
    batch2 = setup.batch
    if not symmetric:
        batch2 = _check_x2(setup, x2)
        symmetric = _same_values(setup.batch, batch2)
        if symmetric:
            batch2 = setup.batch
    n2 = int(n_samples(batch2))
    shape = (setup.n * setup.l, n2 * setup.l)
    to_file = is_path(out)
    check_key(key, setup.model, out, "theta.npy")
    working = (setup.row_bytes + setup.per_sample) * (setup.n + n2)
    working += shape[0] * shape[1] * setup.itemsize  # Theta in one block
    budget = memory_budget_for(memory_budget, working)
    plan = _Plan(setup, n2, budget, chunk_size, to_file, symmetric)
    if to_file:
        record = _record(setup, batch2, symmetric, key)
        return _into_file(setup, batch2, out, shape, plan, budget, record,
                          chunk_size is not None, symmetric, progress)  # fmt: skip
    if out is None:
        out = np.empty(shape, setup.dtype)
    else:
        out = check_out(
            out, shape, setup.dtype, what="Theta",
            layout=" (n * l rows, n2 * l columns, sample-major)",
        )  # fmt: skip
    c = plan.chunk_size
    columns = _Chunks(setup, batch2, c, plan.keep, budget)
    for i in tqdm(range(ceil_div(setup.n, c)), disable=not progress, unit="block-row"):
        _block_row(setup, i, c, columns, out, 0, symmetric, budget, out)
    return out


def _same_values(batch, batch2):
    """Whether two batches hold the same samples (then Theta is symmetric)."""
    leaves, leaves2 = tf.nest.flatten(batch), tf.nest.flatten(batch2)
    return all(
        a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(leaves, leaves2, strict=True)
    )


def _block_row(setup, i, c, columns, rows_out, row0, symmetric, budget, theta):
    """Block-row i of Theta into ``rows_out`` (rows ``row0..`` of Theta).

    With ``symmetric``, blocks left of the diagonal are read back (transposed)
    from ``theta``, where their block-rows were written before."""
    n_out = setup.l
    start = i * c * n_out
    stop = min(start + c * n_out, setup.n * n_out)
    rows = columns if symmetric else _Chunks(setup, setup.batch, c, 0, budget)
    Ji = rows.rows(i)
    n_columns = columns.n * n_out
    for j in range(ceil_div(columns.n, c)):
        c0, c1 = j * c * n_out, min((j + 1) * c * n_out, n_columns)
        dest = rows_out[start - row0 : stop - row0, c0:c1]
        if symmetric and j < i:
            dest[...] = np.asarray(theta[c0:c1, start:stop]).T
        else:
            _product(Ji, Ji if symmetric and j == i else columns.rows(j), dest)


def _product(A, B, dest):
    """``dest[...] = A @ B.T``, straight into ``dest`` when it is one
    contiguous piece (a block-row of one block: no second copy of it)."""
    if dest.flags.c_contiguous and dest.dtype == A.dtype:
        np.matmul(A, B.T, out=dest)
    else:
        dest[...] = A @ B.T


def _record(setup, batch2, symmetric, key):
    """What identifies a resumable Theta: model, weights, variables, x, x2."""
    inputs = [setup.batch] if symmetric else [setup.batch, batch2]
    digest = fingerprint(
        setup.model, setup.target.variables, inputs, what="empirical_ntk",
        symmetric=symmetric,
    )  # fmt: skip
    return {"fingerprint": digest, "key": key}


def _into_file(setup, batch2, path, shape, plan, budget, record, explicit,
               symmetric, progress):  # fmt: skip
    """Block-rows into the ``.npy`` at ``path``, skipping those already there
    (the planner's resumable writer: :func:`jacutil.core.planner.resumable_chunks`)."""
    n_out = setup.l

    def block_rows(rows_plan):  # a resumed file keeps its chunk size
        c = rows_plan.chunk_size // n_out
        if explicit and c != plan.chunk_size:
            name = Path(path).name
            raise ResumeMismatch(
                f"{name} was started with chunk_size={c} samples; this run asks "
                f"for {plan.chunk_size}. Pass chunk_size={c} (or leave it out) "
                f"to resume it, or delete {name} and {name}{LEDGER_SUFFIX} to start "
                "afresh."
            )
        keep = plan.keep  # with another chunk size, the J chunks kept are counted again
        if c != plan.chunk_size:
            keep = _Plan(setup, shape[1] // n_out, budget, c, True, symmetric).keep
        columns = _Chunks(setup, batch2, c, keep, budget)

        def compute(start, stop):
            rows = np.empty((stop - start, shape[1]), setup.dtype)
            theta = np.load(path, mmap_mode="r") if symmetric else None
            i = start // (c * n_out)
            _block_row(setup, i, c, columns, rows, start, symmetric, budget, theta)
            return rows  # theta's mapping goes: its pages leave this process

        return compute

    rows_plan = Plan(shape[0], plan.chunk_size * n_out)
    return resumable_chunks(
        path, rows_plan, block_rows, shape, setup.dtype, record, progress, for_plan=True
    )


def _row_chunks(model, setup, memory_budget, held_per_sample):
    """``(plan, rows)``: the chunks of x sized for a pass that also holds
    ``held_per_sample``, and ``rows(start, stop)``, J of a chunk (c, l, m)."""
    what = f"J with {setup.l} outputs x {setup.m:,} parameters"
    per_sample = setup.row_bytes + setup.per_sample + held_per_sample
    budget = memory_budget_for(memory_budget, per_sample * setup.n)
    c = min(_samples_per_chunk(budget, 0, per_sample, 0, what), setup.n)

    def rows(start, stop):
        chunk = take(setup.batch, start, stop)
        return _jacobian_rows(model, chunk, setup.variables, budget)

    return Plan(setup.n, c), rows


def ntk_trace(model, x, *, variables=None, memory_budget=None, progress=False):
    """The trace of Theta(x, x): the sum of the squared entries of J(x).

    No (n l, n l) matrix is formed: J is computed chunk by chunk within
    ``memory_budget`` and each chunk's squares are added (in the model's
    dtype per chunk, the chunks' sums in float64).
    Arguments as :func:`empirical_ntk` (``progress``: a bar over chunks).
    Introduced in ``11-curvature-and-uncertainty``.

    Returns:
        The trace, a Python ``float``.

    Raises:
        ValueError: ``memory_budget`` is too small for one sample.
    """
    setup = _Setup(model, x, variables)
    plan, rows = _row_chunks(model, setup, memory_budget, 0)

    def squares(start, stop):  # in the model's dtype per chunk
        J = rows(start, stop).reshape(-1)
        return np.dot(J, J)

    return float(sum_chunks(plan, squares, progress=progress))


def ntk_diagonal(model, x, *, variables=None, memory_budget=None, progress=False):
    """The per-sample diagonal blocks of Theta(x, x): ``J_i J_i.T`` for each i.

    Block i is the (l, l) kernel of sample i's outputs with themselves; the
    diagonal of Theta is ``np.einsum("ikk->ik", blocks).reshape(-1)`` and its
    trace the sum of that. Computed chunk by chunk within ``memory_budget``;
    arguments as :func:`ntk_trace`. Introduced in
    ``11-curvature-and-uncertainty``.

    Returns:
        The blocks, shape (n, l, l), in the model's dtype.

    Raises:
        ValueError: ``memory_budget`` is too small for one sample.
    """
    setup = _Setup(model, x, variables)
    n_out = setup.l
    plan, rows = _row_chunks(model, setup, memory_budget, n_out**2 * setup.itemsize)

    def blocks(start, stop):
        J = rows(start, stop)
        return np.matmul(J, J.transpose(0, 2, 1))

    shape = (setup.n, n_out, n_out)
    return run_chunks(plan, blocks, shape=shape, dtype=setup.dtype, progress=progress)
