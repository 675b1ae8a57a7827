"""The first call: what a notebook cell, a script or a user trying a library sees.

Each library's first call on a row runs in a Python process of its own,
after its imports and the model's build (timed apart), then three warm calls
(their median). Rows (:data:`ROWS`): the question's MLP (J), the bench's
CNN (norms), notebook 12's transformer (norms), KerasHub-shaped BERT (J) and
GPT-2 (per-sample gradients) built from Keras layers (KerasHub is not in
the lock), EfficientNetB0 and NASNetMobile (norms, ``weights=None``: nothing
downloads). Against JAX and PyTorch where they can run the model
(:mod:`.fair_tasks`), and against a per-sample tape loop (eager, one
``GradientTape`` per sample) everywhere. jacutil's first result is the
reference each other library's must match.

``python -m jacutil.bench.first_call`` prints the table with each ratio and
its aim (``make bench-peers``); ``--rows`` picks rows. Introduced in
``07-benchmark``.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..teaching.memory_sweeps import fresh_python
from .isolated import TORCH_FIRST
from .machine import machine_summary
from .skipping import format_seconds

MAIN = "from jacutil.bench.first_call import main\nmain()"


@dataclass(frozen=True)
class Row:
    """One row: ``what`` jacutil computes (``"jacobian"``, ``"gradients"``
    or ``"norms"``) on ``model`` at n; ``task`` the fair table's row where
    JAX and PyTorch can run it (None: the tape loop only); ``aim`` the most
    jacutil's first call may take, as a multiple of ``against``'s first call
    (``"peer"``: the fastest peer's; ``"tape"``: the tape loop's)."""

    what: str
    model: str
    n: int
    task: str | None
    aim: float
    against: str


ROWS = {
    "mlp": Row("jacobian", "mlp", 1000, "jacobian-mlp", 1.0, "peer"),
    "cnn": Row("norms", "cnn", 256, "norms-cnn", 1.0, "peer"),
    "transformer": Row("norms", "transformer", 32, None, 2.0, "tape"),
    "bert": Row("jacobian", "bert", 4, None, 2.0, "tape"),
    "gpt2": Row("gradients", "gpt2", 8, None, 2.0, "tape"),
    "efficientnet": Row("norms", "efficientnet", 8, None, 2.0, "tape"),
    "nasnet": Row("norms", "nasnet", 3, None, 2.0, "tape"),
}
DEFAULT_ROWS = ("mlp", "cnn", "transformer", "bert", "gpt2", "efficientnet")


# -- the models the fair table does not have ---------------------------------------


def tiny_bert(vocabulary=100, length=12, width=16, heads=2, n_layers=2, seed=0):
    """A text classifier of KerasHub's BERT shape from Keras's own layers:
    token, position and segment embeddings summed, a LayerNorm, ``n_layers``
    post-norm encoder blocks (MHA with the padding mask, a GELU MLP 4x
    wide), the first token's state through a tanh pooler, a 2-class head."""
    from ..core._tf import keras
    from ..teaching.transformer import PositionEmbedding

    layers = keras.layers
    init = iter(range(seed, seed + 100))

    def glorot():
        return keras.initializers.GlorotUniform(seed=next(init))

    ids = keras.Input((length,), dtype="int32", name="token_ids")
    segments = keras.Input((length,), dtype="int32", name="segment_ids")
    mask = keras.ops.expand_dims(keras.ops.not_equal(ids, 0), 1)
    h = layers.Embedding(vocabulary, width, name="token_embedding")(ids)
    h = PositionEmbedding(name="position_embedding")(h)
    segment = layers.Embedding(2, width, name="segment_embedding")(segments)
    h = layers.Add()([h, segment])
    h = layers.LayerNormalization(epsilon=1e-12, name="embeddings_norm")(h)
    for i in range(n_layers):
        attention = layers.MultiHeadAttention(
            heads, width // heads, kernel_initializer=glorot(), name=f"attention_{i}"
        )(h, h, attention_mask=mask)
        h = layers.LayerNormalization(epsilon=1e-12, name=f"attention_norm_{i}")(
            layers.Add()([h, attention])
        )
        f = layers.Dense(4 * width, activation="gelu", kernel_initializer=glorot(),
                         name=f"mlp_in_{i}")(h)  # fmt: skip
        f = layers.Dense(width, kernel_initializer=glorot(), name=f"mlp_out_{i}")(f)
        h = layers.LayerNormalization(epsilon=1e-12, name=f"mlp_norm_{i}")(
            layers.Add()([h, f])
        )
    first = layers.Lambda(lambda t: t[:, 0], name="first_token")(h)
    pooled = layers.Dense(width, activation="tanh", name="pooler")(first)
    logits = layers.Dense(2, kernel_initializer=glorot(), name="head")(pooled)
    return keras.Model([ids, segments], logits, name="tiny_bert")


def _application(name, shape, classes):
    from ..core._tf import keras

    build = getattr(keras.applications, name)
    keras.utils.set_random_seed(0)
    return build(weights=None, input_shape=shape, classes=classes)


def row_model(row, seed=0):
    """``(model, x, y, loss)`` of a row without a fair-table task, seeded."""
    from ..core._tf import keras
    from ..teaching import transformer

    keras.utils.set_random_seed(seed)  # every initializer, in every process
    rng = np.random.default_rng(seed)
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None
    )
    if row.model == "transformer":
        x, y = transformer.token_data(row.n, seed=seed)
        return transformer.tiny_transformer(seed=seed), x, y, cross_entropy
    if row.model == "gpt2":
        x, y = transformer.next_token_data(row.n, seed=seed)
        return transformer.tiny_gpt2(seed=seed), x, y, cross_entropy
    if row.model == "bert":
        ids = rng.integers(1, 100, (row.n, 12)).astype("int32")
        ids[:, 9:] = 0  # padding
        segments = (np.arange(12) >= 6).astype("int32")[None].repeat(row.n, 0)
        return tiny_bert(seed=seed), [ids, segments], None, None
    if row.model == "efficientnet":
        model = _application("EfficientNetB0", (64, 64, 3), 10)
        x = rng.standard_normal((row.n, 64, 64, 3)).astype("float32")
    else:
        model = _application("NASNetMobile", (224, 224, 3), 10)
        x = rng.standard_normal((row.n, 224, 224, 3)).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(reduction=None)  # softmax out
    return model, x, rng.integers(0, 10, row.n), loss


def _jacutil_function(row, model, loss):
    import jacutil as ju

    if row.what == "jacobian":
        return lambda x, y: ju.jacobian(model, x)
    if row.what == "gradients":
        return lambda x, y: ju.per_sample_gradients(model, loss, x, y)
    return lambda x, y: ju.per_sample_gradient_norms(model, loss, x, y)


def _tape_function(row, model, loss):
    """One eager ``GradientTape`` per sample: what a user writes first."""
    from ..core._tf import tf

    variables = model.trainable_variables

    def one(x, i):
        return tf.nest.map_structure(lambda t: t[i : i + 1], x)

    def loop(x, y):
        rows = []
        for i in range(len(y) if y is not None else len(tf.nest.flatten(x)[0])):
            with tf.GradientTape(persistent=row.what == "jacobian") as tape:
                out = model(one(x, i), training=False)
                if row.what != "jacobian":
                    per_token = loss(y[i : i + 1], out)
                    out = tf.reduce_mean(tf.reshape(per_token, [1, -1]), axis=1)
            if row.what == "jacobian":
                parts = tape.jacobian(out, variables, experimental_use_pfor=False)
                flat = [tf.reshape(p, [-1, int(np.prod(v.shape))])
                        for p, v in zip(parts, variables, strict=True)]  # fmt: skip
                rows.append(tf.concat(flat, axis=1).numpy())
            else:
                grads = tape.gradient(out, variables)
                dense = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices
                flat = np.concatenate([np.ravel(g) for g in dense])
                rows.append(np.linalg.norm(flat) if row.what == "norms" else flat)
        return np.asarray(rows)

    return loop


def prepared(name, library, seed=0):
    """``(function, args, check)`` of one library on row ``name``, its
    model built; ``check(value, expected)`` raises where they differ."""
    row = ROWS[name]
    if row.task is not None and library != "tape":
        from .fair_tasks import prepare

        done = prepare(row.task, row.n, library, seed)
        return done.function, done.args, done.check
    if row.task is not None:  # the tape loop on a fair-table model
        from .fair_tasks import prepare

        done = prepare(row.task, row.n, "jacutil", seed)
        from .paths import MODELS

        model = MODELS[ROWS[name].model].build(seed)
        from ..core._tf import keras

        loss = keras.losses.mean_squared_error
        return _tape_function(row, model, loss), done.args, _close
    model, x, y, loss = row_model(row, seed)
    build = _jacutil_function if library == "jacutil" else _tape_function
    return build(row, model, loss), (x, y), _close


def _close(value, expected):
    value, expected = np.asarray(value), np.asarray(expected)
    value = value.reshape(expected.shape)
    scale = max(1.0, float(np.abs(expected).max()))
    difference = float(np.abs(value - expected).max())
    if difference > 1e-3 * scale:
        raise AssertionError(f"differs from jacutil's by {difference:.3g}")
    return difference


def libraries(name):
    """The row's libraries: jacutil, then JAX and PyTorch where they run
    the model and are installed, then the tape loop."""
    from .fair_tasks import libraries as fair_libraries

    row = ROWS[name]
    peers = [p for p in fair_libraries(row.task) if p != "jacutil"] if row.task else []
    return ["jacutil", *peers, "tape"]


def child(name, library, reference, seed=0):
    """In a fresh process: build, call once (timed), check against the
    reference (jacutil's, saved by its own process), three warm calls."""
    start = time.perf_counter()
    function, args, check = prepared(name, library, seed)
    built = time.perf_counter() - start
    start = time.perf_counter()
    value = function(*args)
    first = time.perf_counter() - start
    value = value[0] if isinstance(value, tuple) else value
    if library == "jacutil":
        np.save(reference, np.asarray(value))
        difference = 0.0
    else:
        difference = check(np.asarray(value), np.load(reference))
    warm = []
    for _ in range(3):
        start = time.perf_counter()
        function(*args)
        warm.append(time.perf_counter() - start)
    return {"import_and_build": built, "first": first,
            "warm": float(np.median(warm)), "max_abs_diff": difference}  # fmt: skip


def run_row(name, seed=0, log=print):
    """Each library's first call on row ``name``, each in a fresh process."""
    row = ROWS[name]
    results = {}
    with tempfile.TemporaryDirectory(prefix="jacutil-first-") as folder:
        reference = str(Path(folder) / "reference.npy")
        for library in libraries(name):
            code = (TORCH_FIRST if library == "torch" else "") + MAIN
            results[library] = fresh_python(
                ["-c", code, "--child", name, library, reference, "--seed", str(seed)],
                f"the first call of {library} on {name} failed",
            )  # fmt: skip
            log(f"{name} n = {row.n}: {library} first call "
                f"{format_seconds(results[library]['first'])}")  # fmt: skip
    return {"row": name, "what": row.what, "model": row.model, "n": row.n,
            "aim": row.aim, "against": row.against, "libraries": results}  # fmt: skip


def ratio(result):
    """jacutil's first call over the reference's (the fastest peer's, or the
    tape loop's), or None where that reference did not run."""
    times = result["libraries"]
    if result["against"] == "peer":
        peers = [
            t["first"] for lib, t in times.items() if lib not in ("jacutil", "tape")
        ]
        if not peers:
            return None
        return times["jacutil"]["first"] / min(peers)
    return times["jacutil"]["first"] / times["tape"]["first"]


def table(results):
    """Markdown: each row's first and warm calls per library, the ratio and aim."""
    lines = [
        "| row | n | jacutil first / warm | JAX first | PyTorch first | tape loop "
        "first | ratio | aim | met |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for result in results:
        times = result["libraries"]
        first = {lib: format_seconds(t["first"]) for lib, t in times.items()}
        ours = times["jacutil"]
        r = ratio(result)
        against = "fastest peer" if result["against"] == "peer" else "tape loop"
        met = "-" if r is None else ("yes" if r <= result["aim"] else "no")
        lines.append(
            f"| {result['what']}, {result['model']} | {result['n']:,} | "
            f"{format_seconds(ours['first'])} / {format_seconds(ours['warm'])} | "
            f"{first.get('jax', '-')} | {first.get('torch', '-')} | "
            f"{first.get('tape', '-')} | "
            f"{'-' if r is None else f'{r:.2f}'} | <= {result['aim']:g}x {against} "
            f"| {met} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=3, metavar=("ROW", "LIBRARY", "REFERENCE"))
    parser.add_argument("--rows", nargs="*", default=list(DEFAULT_ROWS),
                        choices=sorted(ROWS))  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="build/bench/first_call.json")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, seed=args.seed)))
        return
    load = os.getloadavg()[0]
    results = [run_row(name, seed=args.seed) for name in args.rows]
    summary = {"machine": machine_summary(), "load_before": load,
               "load_after": os.getloadavg()[0], "rows": results}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(table(results))
    print(f"load average (1 min) {load:.1f} before, "
          f"{summary['load_after']:.1f} after; written to {args.out}")  # fmt: skip


if __name__ == "__main__" and len(sys.argv) > 1:
    main()
