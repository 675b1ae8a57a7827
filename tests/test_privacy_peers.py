"""The Opacus peer row: same data as privacy_rows, and its JSON (issue 36)."""

import json
import os
import sys

import numpy as np
import pytest

from jacutil.bench import privacy_rows
from jacutil.peers import privacy_peers


def test_peer_draws_the_same_classifier_data_as_the_bench():
    for seed in (0, 1):
        x_peer, y_peer = privacy_peers._classifier_data(512, seed)
        x_bench, y_bench = privacy_rows._classifier_data(512, seed)
        np.testing.assert_array_equal(x_peer, x_bench)
        np.testing.assert_array_equal(y_peer, y_bench)


def test_main_refuses_an_unknown_peer():
    with pytest.raises(SystemExit, match="usage"):
        privacy_peers.main(["nobody"])


def test_opacus_row_prints_one_json_line(capsys):
    pytest.importorskip("opacus")
    privacy_peers.main(["opacus"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["private_s"] > 0 and 0.0 <= row["private_accuracy"] <= 1.0


def test_the_cnn_data_go_to_the_peer_in_a_file_removed_after(tmp_path, capsys):
    """privacy_rows --peer runs the peer in its own process with the CNN's
    images and teacher labels in a temporary .npz (here a stand-in peer that
    reads it and answers one JSON line), and removes the file afterwards."""
    peer = tmp_path / "peer"
    peer.write_text(
        f"#!{sys.executable}\n"
        "import json, sys, numpy as np\n"
        "path = sys.argv[-1]\n"
        "with np.load(path) as found:\n"
        "    shapes = {k: list(found[k].shape) for k in found.files}\n"
        "print('a line of the peer that is not JSON')\n"
        "import os\n"
        "print(json.dumps({'path': path, 'shapes': shapes, 'argv': sys.argv[1:-1],\n"
        "                  'backend': os.environ.get('KERAS_BACKEND')}))\n"
    )
    peer.chmod(0o755)
    _, _, _, n, _ = privacy_rows.MODELS["cnn"]
    (row,) = privacy_rows.peer_rows(str(peer))
    assert row["argv"] == ["-m", "jacutil.peers.privacy_peers", "opacus", "--cnn-data"]
    assert row["backend"] == os.environ.get("KERAS_BACKEND")  # unchanged
    assert row["shapes"] == {"x": [n, 12, 12, 1], "y": [n], "x_test": [2048, 12, 12, 1],
                             "y_test": [2048]}  # fmt: skip
    assert not os.path.exists(row["path"])
    (row,) = privacy_rows.peer_rows(str(peer), "jax_privacy")
    assert row["argv"][2] == "jax_privacy" and row["backend"] == "jax"


def test_a_failing_peer_raises_with_its_stderr(tmp_path):
    peer = tmp_path / "peer"
    peer.write_text(f"#!{sys.executable}\nimport sys\nsys.exit('no opacus here')\n")
    peer.chmod(0o755)
    with pytest.raises(RuntimeError, match="exit code 1:\n.*no opacus here"):
        privacy_rows.peer_rows(str(peer))


def test_the_peer_reads_the_cnn_data_channels_first(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"x": rng.normal(size=(5, 12, 12, 1)), "y": np.arange(5),
              "x_test": rng.normal(size=(3, 12, 12, 1)),
              "y_test": np.arange(3)}  # fmt: skip
    np.savez(tmp_path / "cnn.npz", **arrays)
    x, y, x_test, y_test = privacy_peers._data("cnn", 0, tmp_path / "cnn.npz")
    np.testing.assert_array_equal(x, np.transpose(arrays["x"], (0, 3, 1, 2)))
    np.testing.assert_array_equal(x_test[:, 0], arrays["x_test"][..., 0])
    np.testing.assert_array_equal(y_test, arrays["y_test"])
    with pytest.raises(SystemExit, match="privacy_rows --peer"):
        privacy_peers._data("cnn", 0, None)


def test_peer_trains_each_model_as_the_bench_does():
    for name, (words, n, rate) in privacy_peers.MODELS.items():
        bench_words, _, _, bench_n, bench_rate = privacy_rows.MODELS[name]
        assert (words, n, rate) == (bench_words, bench_n, bench_rate)


def test_main_without_a_peer_interpreter_says_how_to_add_one(monkeypatch, capsys):
    name, build, make_data, _, rate = privacy_rows.MODELS["classifier"]
    monkeypatch.setitem(privacy_rows.MODELS, "classifier",
                        (name, build, make_data, 512, rate))  # fmt: skip
    privacy_rows.main(["--models", "classifier", "--epochs", "2"])
    assert "--peer PYTHON" in capsys.readouterr().out


def test_jax_privacy_row_needs_the_jax_backend(monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    with pytest.raises(SystemExit, match="KERAS_BACKEND=jax"):
        privacy_peers.jax_privacy_row()
