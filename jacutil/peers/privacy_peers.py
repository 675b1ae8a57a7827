"""Opacus's private epoch on notebook 09's classifier (a peer row).

``/tmp/pv/bin/python -m jacutil.peers.privacy_peers opacus`` trains the
classifier of ``jacutil.bench.privacy_rows`` (10 features, Dense 32 tanh,
3 classes; the same data, batch 256, epsilon 3, C = 1, delta 1/(10 n)) under
Opacus ``make_private_with_epsilon`` with ghost clipping and prints one JSON
line: median epoch after the first, test accuracy, torch threads. Runs in a
separate interpreter beside the lock; imports no TensorFlow. Weights are
torch's own initialisation, not copied from Keras.
Introduced in ``09-matrix-free``.
"""

import json
import sys
import time

import numpy as np

BATCH, EPSILON, CLIP, N, EPOCHS, RATE = 256, 3.0, 1.0, 10240, 4, 0.5


def _classifier_data(n, seed):  # the same draw as privacy_rows._classifier_data
    rng = np.random.default_rng(seed)
    centers = 0.8 * np.random.default_rng(0).standard_normal((3, 10))
    labels = rng.integers(0, 3, n)
    x = (centers[labels] + rng.standard_normal((n, 10))).astype("float32")
    return x, labels


def opacus_row(seed=0):
    """Train under Opacus with ghost clipping; a dict for the table."""
    import torch
    from opacus import PrivacyEngine

    torch.manual_seed(seed)
    x, y = _classifier_data(N, seed)
    x_test, y_test = _classifier_data(2048, seed + 1)
    data = torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    model = torch.nn.Sequential(
        torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=RATE)
    criterion = torch.nn.CrossEntropyLoss()
    model, optimizer, criterion, loader = PrivacyEngine().make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, criterion=criterion,
        target_epsilon=EPSILON, target_delta=1 / (10 * N), epochs=EPOCHS,
        max_grad_norm=CLIP, grad_sample_mode="ghost",
    )  # fmt: skip
    seconds = []
    for _ in range(EPOCHS):
        start = time.perf_counter()
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = criterion(model(xb), yb)
            loss.backward()
            optimizer.step()
        seconds.append(time.perf_counter() - start)
    with torch.no_grad():
        logits = model(torch.tensor(x_test))
    accuracy = float((logits.argmax(1).numpy() == y_test).mean())
    return {
        "peer": "Opacus (ghost clipping)",
        "model": "notebook 09's classifier",
        "private_s": float(np.median(seconds[1:])),
        "private_accuracy": accuracy,
        "torch_threads": torch.get_num_threads(),
    }


def main(argv=None):
    """Print the named peer's row as one JSON line."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["opacus"]:
        raise SystemExit("usage: python -m jacutil.peers.privacy_peers opacus")
    print(json.dumps(opacus_row()))


if __name__ == "__main__":
    main()
