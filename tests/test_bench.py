"""The benchmark runs on a tiny size list and writes its files (no timing asserted)."""

import json

import numpy as np
import pytest

from jacutil import bench, peers
from jacutil.models import question_mlp, regression_data


def test_bench_writes_results_table_and_plot(tmp_path):
    results = bench.main(
        [
            "--sizes", "3", "6",
            "--repeats", "1",
            "--memory", "inline",
            "--paths", "loop", "compiled_batch", "compiled", "dense",
            "--out", str(tmp_path), "--model", "mlp",
        ]
    )  # fmt: skip
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["sizes"] == [3, 6]
    paths = {(r["path"], r["n"]) for r in stored["results"]}
    for path in ("floor", "loop", "compiled_batch", "compiled", "dense"):
        assert {(path, 3), (path, 6)} <= paths
    ran = [r for r in stored["results"] if r["median"] is not None]
    assert all(len(r["times"]) == 1 and r["first"] > 0 for r in ran)
    table = (tmp_path / "results.md").read_text()
    assert "hand-derived, tf.function" in table and "**n = 6**" in table
    assert (tmp_path / "scaling.png").stat().st_size > 10_000
    ratios = bench.ratios(results, 6)
    fastest = min(r[1] for r in ratios.values())
    assert fastest == pytest.approx(1.0)


def test_bench_has_an_lstm_row(tmp_path):
    results = bench.main(
        [
            "--sizes", "3", "6", "--repeats", "1", "--memory", "inline",
            "--paths", "loop", "compiled", "chunked",
            "--out", str(tmp_path), "--model", "lstm",
        ]
    )  # fmt: skip
    assert results["model"] == "lstm" and results["shape"] == [2, 1378]
    stored = json.loads((tmp_path / "results-lstm.json").read_text())
    ran = {(r["path"], r["n"]) for r in stored["results"] if r["median"]}
    assert ("compiled", 6) in ran and ("chunked", 6) in ran
    table = (tmp_path / "results-lstm.md").read_text()
    assert "LSTM(16)" in table and "6 x 2 x 1,378" in table


def test_a_slow_path_is_skipped_with_its_prediction(tmp_path):
    results = bench.run_bench(
        [2, 2000],
        repeats=1,
        max_seconds=10,
        memory_mode="inline",
        paths=["loop", "compiled"],
        log=lambda *a: None,
    )
    loop = [r for r in results["results"] if r["path"] == "loop"]
    assert loop[0]["median"] is not None
    assert loop[1]["median"] is None and "predicted" in loop[1]["skipped"]
    assert loop[1]["predicted"] > loop[0]["median"]
    ran = {(r["path"], r["n"]) for r in results["results"] if r["median"]}
    expected = {("floor", 2), ("loop", 2), ("compiled", 2)}
    assert ran == expected | {("floor", 2000), ("compiled", 2000)}
    assert "skipped" in bench.markdown(results)


def test_the_floor_writes_every_element():
    floor = bench.write_floor((2, 3, 4))
    assert floor.shape == (2, 3, 4) and floor.dtype == np.float32
    assert np.all(floor == 1.0)


@pytest.mark.parametrize("name", ["jax", "torch"])
def test_peer_equals_jacutil_when_installed(name):
    if not peers.available(name):
        pytest.skip(f"{name} is not installed (pip install -e '.[peers]')")
    model = question_mlp()
    x, _ = regression_data(5)
    jac = bench.PATHS[name].build(model)
    np.testing.assert_allclose(
        jac(x), bench.PATHS["compiled"].build(model)(x), rtol=1e-5, atol=1e-6
    )


def test_peers_are_none_when_not_installed(monkeypatch):
    monkeypatch.setattr(peers, "available", lambda name: False)
    model = question_mlp()
    assert peers.jax_jacobian(model) is None and peers.torch_jacobian(model) is None
