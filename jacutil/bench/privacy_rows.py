"""A private epoch against a plain Keras epoch (notebook 09-matrix-free).

``python -m jacutil.bench.privacy_rows`` trains each model below twice from
the same weights, on the same data, at batch size 256: with plain
``model.fit``, and with ``jacutil.privacy.make_private`` then ``model.fit``.
Each is timed twice: with ``fit`` called once per epoch, an epoch of each
in turn (so that a machine that slows down slows both), each call timed
whole; and on fresh models with ``fit`` called once for all the epochs, each
epoch timed by a callback. It leaves out the first (tracing) epoch of each
and prints a Markdown table: the median of the other epochs (5 by default)
of each, their ratios (the aim: at most 1.5; 2 for the GPT-2), the share of
the private epoch spent by the accountant on epsilon for the logs (about the
same on any model: on a small one it dominates), and the test accuracy of
each after the same epochs. The private epoch includes what
``model.fit`` does for a learner: sampling, the norms, the step, and epsilon
in the logs after the epoch. The models: notebook 09's classifier (10
features, Dense 32 tanh, 3 classes), ``jacutil.small_cnn`` on
``jacutil.image_data`` (4 classes from a fixed teacher network) and notebook
12's transformer with LoRA on its attention (``jacutil.teaching.transformer``)
at batch 32, where only the factors, their biases and the head train, and a
KerasHub-shaped GPT-2 (``tiny_gpt2``: 2 decoder blocks, its output head the
token embedding read transposed: a layer used twice, frozen under LoRA, so
on the layer rules a node per call) with LoRA rank 4 on query and value,
next-token prediction at batch 32.

With ``--peer PYTHON`` (an interpreter that has Opacus; ``make bench-peers``)
the same models and data train under Opacus with ghost clipping in that
interpreter's own process (``jacutil.peers.privacy_peers``; the CNN's data
go to it in a temporary ``.npz``), and a second table sets its private epoch
and accuracy beside ours.
Introduced in ``09-matrix-free``.
"""

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from ..core._tf import keras
from ..privacy import make_private
from ..teaching.models import image_data, small_cnn
from ..teaching.transformer import (
    enable_attention_lora,
    enable_gpt2_lora,
    next_token_data,
    tiny_gpt2,
    tiny_transformer,
    token_data,
)
from .machine import machine_summary

BATCH, EPSILON, CLIP = 256, 3.0, 1.0
AIM = 1.5
AIMS = {"gpt2-lora": 2.0}  # issue 63's aim for the GPT-2; AIM for the others


def _classifier(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((10,)),
                             keras.layers.Dense(32, activation="tanh"),
                             keras.layers.Dense(3)])  # fmt: skip


def _classifier_data(n, seed):
    rng = np.random.default_rng(seed)
    centers = 0.8 * np.random.default_rng(0).standard_normal((3, 10))
    labels = rng.integers(0, 3, n)
    x = (centers[labels] + rng.standard_normal((n, 10))).astype("float32")
    return x, labels


def _cnn_data(n, seed):
    x = image_data(n, seed=seed)
    teacher = small_cnn(seed=99)
    # one eager call: each new teacher's predict() would trace a function, and
    # TensorFlow warns about the retracing
    return x, np.argmax(np.asarray(teacher(x, training=False)), axis=1)


MODELS = {  # name: (in words, model, data, n, SGD's learning rate)
    "classifier": (
        "notebook 09's classifier",
        _classifier,
        _classifier_data,
        10240,
        0.5,
    ),
    # SGD at 0.2: both fits learn (at 0.05 the private CNN at epsilon 3 gave
    # every image the majority class, 74% of the labels; at 0.5 plain SGD
    # diverged)
    "cnn": ("small CNN", lambda seed: small_cnn(seed=seed), _cnn_data, 5120, 0.2),
    # notebook 12's: 2 attention blocks, LoRA rank 4 on query and value
    "lora-transformer": (
        "2-layer transformer, LoRA",
        lambda seed: _lora_transformer(seed),
        lambda n, seed: token_data(n, seed=seed, task=1),
        2048,
        0.5,
    ),
    # KerasHub's GPT-2 shape, tied embedding, LoRA rank 4 on query and value
    "gpt2-lora": (
        "GPT-2-shaped, tied embedding, LoRA",
        lambda seed: _gpt2_lora(seed),
        lambda n, seed: next_token_data(n, seed=seed),
        2048,
        0.5,
    ),
}
BATCHES = {"lora-transformer": 32, "gpt2-lora": 32}  # the issue's; others BATCH


def _lora_transformer(seed):
    model = tiny_transformer(seed=seed)
    enable_attention_lora(model, 4)
    return model


def _gpt2_lora(seed):
    model = tiny_gpt2(seed=seed)
    enable_gpt2_lora(model, 4)
    return model


class _EpochClock(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self.start)

    def __init__(self):
        super().__init__()
        self.seconds = []


def _prepared(name, private, epochs, seed):
    """A model of row ``name``, compiled (and made private), its data, and
    the accountant's timings list: what :func:`run_row` fits epoch by epoch."""
    _, build, data, n, learning_rate = MODELS[name]
    batch = BATCHES.get(name, BATCH)
    x, y = data(n, seed)
    model = build(seed)
    model.compile(
        keras.optimizers.SGD(learning_rate),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    accounting = []
    if private:
        # the noise and sampling from fresh entropy, as users run it
        training = make_private(model, epsilon=EPSILON, delta=1 / (10 * n),
                                l2_norm_clip=CLIP, batch_size=batch, epochs=epochs,
                                train_size=n, verbose=False).privacy  # fmt: skip
        epsilon = training.epsilon

        def timed_epsilon():  # the accountant's share of each epoch
            start = time.perf_counter()
            value = epsilon()
            accounting.append(time.perf_counter() - start)
            return value

        training.epsilon = timed_epsilon
    return model, x, y, accounting


def run_row(name, epochs=6, seed=0):
    """Time one model's plain and private epochs; a dict for the table.

    First with ``fit`` called once per epoch: the two fits alternate, an
    epoch of each in turn, so that both meet the machine in the same state
    (a machine that slows down mid-run slows both), each call timed whole
    (what a call costs besides its epoch included). Then, on fresh models
    from the same weights, with ``fit`` called once for all the epochs, each
    epoch timed by a callback. The first epoch of each (traces) is left out;
    the medians of the others are compared."""
    batch = BATCHES.get(name, BATCH)
    plain, x, y, _ = _prepared(name, False, epochs, seed)
    private, _, _, accounting = _prepared(name, True, epochs, seed)
    calls = {"plain": [], "private": []}
    for _ in range(epochs):
        for kind, model, options in (
            ("plain", plain, {"batch_size": batch}),
            ("private", private, {}),
        ):
            start = time.perf_counter()
            model.fit(x, y, epochs=1, verbose=0, **options)
            calls[kind].append(time.perf_counter() - start)
    clocks = {}
    for kind in ("plain", "private"):
        model, *_ = _prepared(name, kind == "private", epochs, seed)
        clocks[kind] = _EpochClock()
        options = {"batch_size": batch} if kind == "plain" else {}
        model.fit(x, y, epochs=epochs, verbose=0, callbacks=[clocks[kind]],
                  **options)  # fmt: skip
    x_test, y_test = MODELS[name][2](2048, seed + 1)

    def accuracy(model):
        found = model.evaluate(x_test, y_test, verbose=0, return_dict=True)
        return found["accuracy"]

    def median(seconds):
        return float(np.median(seconds[1:]))

    plain_s, private_s = median(calls["plain"]), median(calls["private"])
    plain_all_s, private_all_s = (median(c.seconds) for c in clocks.values())
    accounting_s = float(np.median(accounting[1:])) if accounting else 0.0
    return {
        "model": MODELS[name][0],
        "n": MODELS[name][3],
        "batch_note": f" (batch {BATCHES[name]})" if name in BATCHES else "",
        "aim": AIMS.get(name, AIM),
        "plain_s": plain_s,
        "private_s": private_s,
        "accounting_s": accounting_s,
        "ratio": private_s / plain_s,
        "steps_ratio": (private_s - accounting_s) / plain_s,
        "plain_all_s": plain_all_s,
        "private_all_s": private_all_s,
        "ratio_all": private_all_s / plain_all_s,
        "plain_accuracy": accuracy(plain),
        "private_accuracy": accuracy(private),
        "noise_multiplier": private.privacy.noise_multiplier,
    }


PEERS = ("opacus", "jax_privacy")  # jacutil.peers.privacy_peers.ROWS


def peer_rows(python, peer="opacus", seed=0, timeout=1200):
    """One peer's rows, from ``python -m jacutil.peers.privacy_peers PEER`` in
    its own process (jax_privacy's with ``KERAS_BACKEND=jax``): a list of
    dicts (its JSON lines). The CNN's images and teacher labels are drawn
    here, as :func:`_prepared` draws them, and passed in a temporary ``.npz``
    that is removed however the run ends; a failed or timed-out peer raises
    RuntimeError with the end of its stderr."""
    _, _, data, n, _ = MODELS["cnn"]
    x, y = data(n, seed)
    x_test, y_test = data(2048, seed + 1)
    command = [python, "-m", "jacutil.peers.privacy_peers", peer, "--cnn-data"]
    jax = peer == "jax_privacy"
    environment = {**os.environ, "KERAS_BACKEND": "jax"} if jax else None
    with tempfile.TemporaryDirectory(prefix="privacy-peer-") as folder:
        path = os.path.join(folder, "cnn.npz")
        np.savez(path, x=x, y=y, x_test=x_test, y_test=y_test)
        try:
            done = subprocess.run(
                [*command, path],
                cwd=Path(__file__).resolve().parents[2],  # jacutil importable
                env=environment,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(
                f"the peer ({python}, {peer}) ran past {timeout} s and was stopped"
            ) from error
    if done.returncode != 0:
        raise RuntimeError(
            f"the peer ({' '.join(command)} ...) failed with exit code "
            f"{done.returncode}:\n{done.stderr[-2000:]}"
        )
    return [json.loads(line) for line in done.stdout.splitlines() if line[:1] == "{"]


def _threads_or_sigma(peer):
    if "torch_threads" in peer:
        return f"{peer['torch_threads']} torch threads"
    return f"sigma {peer['noise_multiplier']:.3f}"


def _print_peer_table(rows, peers):
    ours = {r["model"]: r for r in rows}
    print(
        "\n| model | peer | its plain epoch | its private epoch | its private / "
        "plain | our private / plain | our private epoch / its | accuracy: its "
        "/ ours | threads or sigma |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|---|")
    for p in peers:
        mine = ours.get(p["model"])
        if mine is None:
            continue
        print(f"| {p['model']} | {p['peer']} | {p['plain_s']:.3f} s | "
              f"{p['private_s']:.3f} s | {p['private_s'] / p['plain_s']:.2f} | "
              f"{mine['private_s'] / mine['plain_s']:.2f} | "
              f"{mine['private_s'] / p['private_s']:.2f} | "
              f"{p['private_accuracy']:.3f} / {mine['private_accuracy']:.3f} | "
              f"{_threads_or_sigma(p)} |")  # fmt: skip


def main(argv=None):
    """``python -m jacutil.bench.privacy_rows``: run the rows, print the table.

    Introduced in ``09-matrix-free``.
    """
    parser = argparse.ArgumentParser(
        prog="python -m jacutil.bench.privacy_rows",
        description="Time a make_private model.fit epoch against a plain one.",
    )
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS),
                        default=sorted(MODELS))  # fmt: skip
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--peer", metavar="PYTHON",
                        help="a Python with Opacus: its rows beside ours")  # fmt: skip
    args = parser.parse_args(argv)
    rows = [run_row(name, args.epochs) for name in args.models]
    peers, missing = [], []
    for peer in PEERS if args.peer else ():
        try:
            peers += peer_rows(args.peer, peer)
        except RuntimeError as error:  # one peer missing: the others still run
            missing.append(f"{peer}: {str(error).strip().splitlines()[-1]}")
    m = machine_summary()
    print(f"\n{m['date']}, {m['cpu_count']} CPUs, load average {m['load_average']}. "
          f"Batch {BATCH} (else as the row says), epsilon {EPSILON:g}, "
          f"C = {CLIP:g}; median epoch of "
          f"{args.epochs - 1} after the first, fit called once per epoch "
          "(each call timed whole) and once for all epochs (fresh models, "
          "each epoch timed).\n")  # fmt: skip
    print(
        "| model | n | plain epoch | private epoch | of which epsilon (PLD) | "
        "private / plain | without epsilon | one fit: plain epoch | one fit: "
        "private epoch | one fit: private / plain | aim | accuracy plain "
        "| accuracy private |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']}{r['batch_note']} | {r['n']:,} | {r['plain_s']:.3f} s | "
              f"{r['private_s']:.3f} s | {r['accounting_s']:.3f} s | "
              f"{r['ratio']:.2f} | {r['steps_ratio']:.2f} | "
              f"{r['plain_all_s']:.3f} s | {r['private_all_s']:.3f} s | "
              f"{r['ratio_all']:.2f} | <= {r['aim']:g} | "
              f"{r['plain_accuracy']:.3f} | {r['private_accuracy']:.3f} |")  # fmt: skip
    if args.peer:
        _print_peer_table(rows, peers)
        print(
            "\nEach peer ran in its own process, after ours, on the same data "
            "and SGD rates, with its own initial weights and its own accountant "
            f"for epsilon {EPSILON:g} (jax_privacy's sigma beside it; make_private's: "
            + ", ".join(f"{r['model']} {r['noise_multiplier']:.3f}" for r in rows)
            + ")."
        )
        for line in missing:
            print(f"- not run: {line}")
    else:
        print(
            "\nOpacus (PyTorch) and jax_privacy's Keras API (JAX backend) are not "
            "in this table: run with --peer PYTHON, an interpreter that has "
            "Opacus (make bench-peers)."
        )
    return rows


if __name__ == "__main__":
    main()
