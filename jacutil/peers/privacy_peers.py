"""The peers' private epochs on the models of the privacy bench (peer rows).

``python -m jacutil.peers.privacy_peers opacus [--cnn-data FILE]`` trains
the models of ``jacutil.bench.privacy_rows`` under Opacus
``make_private_with_epsilon`` with ghost clipping (batch 256, epsilon 3,
C = 1, delta 1/(10 n), the same learning rates) and prints one JSON line per
model: median epoch after the first of a plain fit (the same loop without
privacy) and of the private one, test accuracy, torch threads.
``KERAS_BACKEND=jax python -m jacutil.peers.privacy_peers jax_privacy ...``
does the same with jax_privacy's Keras API (``make_private`` and
``model.fit`` with Poisson sampling, on the JAX backend).
Notebook 09's classifier draws its own data (the same draw as the bench);
the small CNN's images and a Keras teacher's labels come from ``FILE``, an
``.npz`` that ``privacy_rows --peer`` writes (Opacus's process imports no
TensorFlow). Each peer runs in an interpreter of its own, beside the lock. Weights are
torch's own initialisation, not copied from Keras.
Introduced in ``09-matrix-free``.
"""

import json
import os
import sys
import time

import numpy as np

BATCH, EPSILON, CLIP, EPOCHS = 256, 3.0, 1.0, 4
# name: (in words, samples, SGD's learning rate), as privacy_rows.MODELS
MODELS = {
    "classifier": ("notebook 09's classifier", 10240, 0.5),
    "cnn": ("small CNN", 5120, 0.2),
}


def _classifier_data(n, seed):  # the same draw as privacy_rows._classifier_data
    rng = np.random.default_rng(seed)
    centers = 0.8 * np.random.default_rng(0).standard_normal((3, 10))
    labels = rng.integers(0, 3, n)
    x = (centers[labels] + rng.standard_normal((n, 10))).astype("float32")
    return x, labels


def _torch_model(name):
    import torch

    if name == "classifier":
        return torch.nn.Sequential(
            torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)
        )
    # jacutil.small_cnn: 12 x 12 x 1 images, two 3x3 convolutions of 8
    # channels (ReLU, tanh), then Dense to 4 classes
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3), torch.nn.Tanh(),
        torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 4),
    )  # fmt: skip


def _data(name, seed, cnn_data):
    """``(x, y, x_test, y_test)`` as NumPy arrays, images channels first."""
    if name == "classifier":
        return (*_classifier_data(MODELS[name][1], seed),
                *_classifier_data(2048, seed + 1))  # fmt: skip
    if cnn_data is None:
        raise SystemExit(
            "the CNN's data come from a Keras teacher: run it through "
            "python -m jacutil.bench.privacy_rows --peer PYTHON, which writes them"
        )
    with np.load(cnn_data) as found:
        arrays = [found[k] for k in ("x", "y", "x_test", "y_test")]
    arrays[0], arrays[2] = (np.transpose(a, (0, 3, 1, 2)) for a in arrays[::2])
    return tuple(arrays)


def opacus_row(name="classifier", seed=0, cnn_data=None):
    """Train one model under Opacus with ghost clipping; a dict for the table."""
    import torch
    from opacus import PrivacyEngine

    words, n, rate = MODELS[name]
    x, y, x_test, y_test = _data(name, seed, cnn_data)
    assert len(x) == n, (len(x), n)
    data = torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    criterion = torch.nn.CrossEntropyLoss()

    def epochs(model, optimizer, loader, criterion):
        seconds = []
        for _ in range(EPOCHS):
            start = time.perf_counter()
            for xb, yb in loader:
                optimizer.zero_grad()
                criterion(model(xb), yb).backward()
                optimizer.step()
            seconds.append(time.perf_counter() - start)
        return float(np.median(seconds[1:]))

    torch.manual_seed(seed)
    model = _torch_model(name)  # a plain epoch first, the same loop
    plain = epochs(model, torch.optim.SGD(model.parameters(), lr=rate), loader,
                   criterion)  # fmt: skip
    torch.manual_seed(seed)
    model = _torch_model(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=rate)
    model, optimizer, criterion, loader = PrivacyEngine().make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, criterion=criterion,
        target_epsilon=EPSILON, target_delta=1 / (10 * n), epochs=EPOCHS,
        max_grad_norm=CLIP, grad_sample_mode="ghost",
    )  # fmt: skip
    private = epochs(model, optimizer, loader, criterion)
    with torch.no_grad():
        logits = model(torch.tensor(x_test))
    accuracy = float((logits.argmax(1).numpy() == y_test).mean())
    return {
        "peer": "Opacus (ghost clipping)",
        "model": words,
        "plain_s": plain,
        "private_s": private,
        "private_accuracy": accuracy,
        "torch_threads": torch.get_num_threads(),
    }


def _keras_model(name):
    """The bench's model in Keras (on whatever backend is loaded): the same
    layers as ``jacutil.bench.privacy_rows``'s, built here so that this
    process imports no TensorFlow."""
    import keras

    if name == "classifier":
        layers = [keras.Input((10,)), keras.layers.Dense(32, activation="tanh"),
                  keras.layers.Dense(3)]  # fmt: skip
    else:  # jacutil.small_cnn
        layers = [keras.Input((12, 12, 1)),
                  keras.layers.Conv2D(8, 3, activation="relu"),
                  keras.layers.Conv2D(8, 3, activation="tanh"),
                  keras.layers.Flatten(), keras.layers.Dense(4)]  # fmt: skip
    return keras.Sequential(layers)


def jax_privacy_row(name="classifier", seed=0, cnn_data=None):
    """Train one model with jax_privacy's Keras API (``make_private``, then
    ``model.fit`` with its own Poisson sampling) on the JAX backend; a dict
    for the table. Its clipping is vmap's per-example gradients, not ghost
    clipping; ``rescale_to_unit_norm`` is off, so the SGD rate is ours."""
    if os.environ.get("KERAS_BACKEND") != "jax":
        raise SystemExit("jax_privacy's Keras API needs KERAS_BACKEND=jax")
    import keras
    from jax_privacy import keras_api

    words, n, rate = MODELS[name]
    x, y, x_test, y_test = _data(name, seed, cnn_data)
    if x.ndim == 4:  # back to channels last, as Keras takes images
        x, x_test = (np.transpose(a, (0, 2, 3, 1)) for a in (x, x_test))
    seconds = []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(time.perf_counter() - self.start)

    def compiled():
        keras.utils.set_random_seed(seed)
        model = _keras_model(name)
        model.compile(
            keras.optimizers.SGD(rate),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    compiled().fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0,
                   callbacks=[Clock()])  # fmt: skip
    plain, seconds = float(np.median(seconds[1:])), []
    model = compiled()
    config = keras_api.DPKerasConfig(
        epsilon=EPSILON, delta=1 / (10 * n), clipping_norm=CLIP, batch_size=BATCH,
        gradient_accumulation_steps=1, train_steps=EPOCHS * (n // BATCH),
        train_size=n, poisson_sampling_in_fit=True, rescale_to_unit_norm=False,
        seed=seed,
    )  # fmt: skip
    model = keras_api.make_private(model, config)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=[Clock()])
    logits = np.asarray(model.predict(x_test, batch_size=1024, verbose=0))
    return {
        "peer": "jax_privacy Keras API (JAX backend)",
        "model": words,
        "plain_s": plain,
        "private_s": float(np.median(seconds[1:])),
        "private_accuracy": float((logits.argmax(1) == y_test).mean()),
        "noise_multiplier": float(model.get_noise_multiplier()),
    }


ROWS = {"opacus": opacus_row, "jax_privacy": jax_privacy_row}


def main(argv=None):
    """Print each model's row as one JSON line (the CNN's with ``--cnn-data``)."""
    argv = sys.argv[1:] if argv is None else argv
    known = len(argv) in (1, 3) and argv[0] in ROWS
    if not known or argv[1:2] not in ([], ["--cnn-data"]):
        raise SystemExit(
            "usage: python -m jacutil.peers.privacy_peers "
            f"{{{','.join(ROWS)}}} [--cnn-data FILE]"
        )
    cnn_data = argv[2] if len(argv) == 3 else None
    for name in ["classifier"] + ["cnn"] * (cnn_data is not None):
        print(json.dumps(ROWS[argv[0]](name, cnn_data=cnn_data)), flush=True)


if __name__ == "__main__":
    main()
