"""The benchmark runs on a tiny size list and writes its files (no timing asserted)."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest

import jacutil as ju
from jacutil import bench


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
    for path in ("floor", "floor_new", "loop", "compiled_batch", "compiled", "dense"):
        assert {(path, 3), (path, 6)} <= paths
    ran = [r for r in stored["results"] if r["median"] is not None]
    assert all(len(r["times"]) == 1 and r["first"] > 0 for r in ran)
    table = (tmp_path / "results.md").read_text()
    assert "hand-derived, tf.function" in table and "**n = 6**" in table
    assert "fills a preallocated" in table and "np.full" in table
    assert (tmp_path / "scaling.png").stat().st_size > 10_000
    ratios = bench.ratios(results, 6)
    fastest = min(r.fastest for r in ratios.values())
    assert fastest == pytest.approx(1.0)
    assert ratios["dense"][1] == ratios["dense"].fastest  # still a tuple
    assert "profile" in results  # the hand-derived path, piece by piece


def test_bench_has_cnn_and_lstm_rows(tmp_path):
    every = bench.main(
        [
            "--sizes", "3", "6", "--repeats", "1", "--memory", "inline",
            "--paths", "loop", "compiled", "chunked",
            "--out", str(tmp_path), "--model", "cnn", "lstm",
        ]
    )  # fmt: skip
    cnn, lstm = every
    assert lstm["model"] == "lstm" and lstm["shape"] == [2, 1378]
    assert cnn["model"] == "cnn" and cnn["shape"] == [4, 2716]
    stored = json.loads((tmp_path / "results-lstm.json").read_text())
    ran = {(r["path"], r["n"]) for r in stored["results"] if r["median"]}
    assert ("compiled", 6) in ran and ("chunked", 6) in ran
    table = (tmp_path / "results-lstm.md").read_text()
    assert "LSTM(16)" in table and "6 x 2 x 1,378" in table
    assert "6 x 4 x 2,716" in (tmp_path / "results-cnn.md").read_text()


def test_each_model_has_its_sizes_and_the_paths_that_apply():
    assert bench.MODELS["mlp"].sizes == (100, 1000, 10_000)
    assert bench.MODELS["cnn"].sizes == bench.MODELS["lstm"].sizes == (100, 2000)
    mlp = bench.default_paths("mlp", ju.question_mlp())
    cnn = bench.default_paths("cnn", ju.small_cnn())
    assert mlp == list(bench.PATHS)
    assert "dense" not in cnn and {"compiled", "jax", "torch"} <= set(cnn)


def test_a_slow_path_is_skipped_with_its_prediction(tmp_path, monkeypatch):
    # A path is skipped at n = 2000 when 1000 x its time at n = 2, times
    # (repeats + 1) calls, passes max_seconds: here above 25 ms at n = 2. The
    # slow path sleeps 50 ms a call, so it is over that on any machine; the
    # compiled path takes about 1 ms, 25x below it. (With the loop's 28 ms
    # the limit had to be 5 ms, and a busy machine once pushed compiled over.)
    def slow(model):
        jac = bench.PATHS["compiled"].build(model)

        def asleep(x):
            time.sleep(0.05)
            return jac(x)

        return asleep

    monkeypatch.setitem(bench.PATHS, "slow", bench.Path_("50 ms asleep", slow))
    results = bench.run_bench(
        [2, 2000],
        repeats=3,
        max_seconds=100,
        memory_mode="inline",
        paths=["slow", "compiled"],
        log=lambda *a: None,
    )
    skipped = [r for r in results["results"] if r["path"] == "slow"]
    assert skipped[0]["median"] >= 0.05
    assert skipped[1]["median"] is None and "predicted" in skipped[1]["skipped"]
    assert skipped[1]["predicted"] > skipped[0]["median"]
    ran = {(r["path"], r["n"]) for r in results["results"] if r["median"]}
    floors = {(f, n) for f in ("floor", "floor_new") for n in (2, 2000)}
    assert ran == floors | {("slow", 2), ("compiled", 2), ("compiled", 2000)}
    assert "skipped" in bench.markdown(results)


def test_a_new_path_is_one_entry_and_checked_before_it_is_timed(monkeypatch):
    calls = []

    def wrong(model):
        def jac(x):
            calls.append(len(x))
            return np.zeros((len(x), 2, 2850), np.float32)

        return jac

    monkeypatch.setitem(bench.PATHS, "wrong", bench.Path_("a wrong path", wrong))
    assert "wrong" in bench.default_paths("mlp", ju.question_mlp())
    with pytest.raises(AssertionError, match="wrong disagrees with compiled"):
        bench.run_bench(
            [3], repeats=4, memory_mode="inline", paths=["wrong"],
            log=lambda *a: None,
        )  # fmt: skip
    assert calls == [3]  # the first call only: no timed calls


def test_a_quadratic_path_is_skipped_by_its_predicted_memory():
    results = bench.run_bench(
        [4, 5000],
        repeats=1,
        memory_mode="fresh",  # the quadratic path still watches its memory
        paths=["compiled_batch"],
        model="cnn",
        log=lambda *a: None,
    )
    at = {(r["path"], r["n"]): r for r in results["results"]}
    assert at[("compiled_batch", 4)]["median"] is not None
    assert "out of memory" in at[("compiled_batch", 5000)]["skipped"]


def test_the_floors_write_every_element():
    floor = bench.write_floor((2, 3, 4))
    assert floor.shape == (2, 3, 4) and floor.dtype == np.float32
    assert np.all(floor == 1.0)
    out = bench.preallocated((2, 3, 4))
    assert bench.fill_floor(out) is out and np.all(out == 1.0)


def _fake_results():
    """Medians in seconds at one n: two jacutil paths, two peers, both floors."""
    medians = {
        "compiled": 4.0, "dense": 2.0, "jax": 1.0, "torch": 8.0,
        "floor": 0.5, "floor_new": 1.0, "loop": None,
    }  # fmt: skip
    results = [
        {"path": p, "n": 10, "median": t, "predicted": 400.0 if t is None else None}
        for p, t in medians.items()
    ]
    labels = {p: p.upper() for p in medians}
    return {"sizes": [10], "results": results, "labels": labels}


def test_ratios_to_the_floor_and_the_fastest_peer():
    share = bench.ratios(_fake_results(), 10)
    assert share["dense"] == (200.0, 2.0, 4.0, 2.0)
    assert share["jax"].peer == 1.0 and share["torch"].peer == 8.0
    assert "floor" not in share and "floor_new" not in share
    (row,) = bench.summary(_fake_results())
    assert row["best"] == "dense" and row["per_peer"] == 2.0
    assert row["per_floor"] == 4.0 and row["torch"] == 8.0


def test_without_peers_the_peer_ratio_is_empty():
    results = _fake_results()
    results["results"] = [
        r for r in results["results"] if r["path"] not in ("jax", "torch")
    ]
    assert bench.ratios(results, 10)["dense"].peer is None
    assert bench.summary(results)[0]["per_peer"] is None


@pytest.mark.parametrize("name", ["jax", "torch"])
def test_the_bench_checks_a_peer_against_jacutil(name):
    pytest.importorskip(name)
    results = bench.run_bench(
        [3], repeats=1, memory_mode="inline", paths=[name], model="cnn",
        log=lambda *a: None,
    )  # fmt: skip
    share = bench.ratios(results, 3)
    assert share[name].peer == 1.0 and share["compiled"].peer > 0
    (peer,) = [r for r in results["results"] if r["path"] == name]
    assert 0 <= peer["max_abs_diff"] < 1e-5
    assert "Proof at n = 3" in bench.markdown(results)


def test_python_dash_m_runs_the_cli():
    done = subprocess.run(
        [sys.executable, "-m", "jacutil.bench", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--model" in done.stdout and "cnn" in done.stdout


def _results_at_sizes(sizes, skipped_after=None):
    """Power-law medians for three paths and both floors at ``sizes``."""
    slopes = {"compiled": 1.0, "dense": 0.5, "loop": 1.0, "floor": 1.0,
              "floor_new": 1.0}  # fmt: skip
    results = [
        {"path": p, "n": n,
         "median": None if p == "loop" and skipped_after and n > skipped_after
         else 1e-3 * n**s}
        for p, s in slopes.items() for n in sizes
    ]  # fmt: skip
    labels = {p: p.upper() for p in slopes}
    labels |= {"floor": "write floor (fill)", "floor_new": "write floor, new array"}
    return {"sizes": sizes, "results": results, "labels": labels}


def test_the_plot_fits_slopes_only_over_three_sizes_or_more():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = bench.plot(_results_at_sizes([10, 100, 1000], skipped_after=100))
    labels = [line.get_label() for line in ax.get_lines()]
    assert "DENSE (slope 0.50)" in labels and "COMPILED (slope 1.00)" in labels
    assert "LOOP" in labels  # two sizes: no slope
    legend = ax.get_legend()
    assert "3+ sizes" in legend.get_title().get_text()
    assert min(t.get_fontsize() for t in legend.get_texts()) >= 9
    lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("write")]
    assert len({(ln.get_marker(), str(ln.get_linestyle())) for ln in lines}) == 3
    plt.close(ax.figure)
    ax = bench.plot(_results_at_sizes([10, 100]))
    assert not any("slope" in line.get_label() for line in ax.get_lines())
    assert "fewer than 3" in ax.get_legend().get_title().get_text()
    plt.close(ax.figure)


def test_loglog_scaling_fits_slopes_only_over_three_sizes_or_more():
    import matplotlib

    matplotlib.use("Agg")
    from jacutil.teaching.plots import loglog_scaling

    ax = loglog_scaling(
        [10, 100, 1000], {"three": [1.0, 10.0, 100.0], "two": [1.0, 4.0, None]}
    )
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["three (slope 1.00)", "two"]


def test_the_peer_rows_appear_in_the_report(tmp_path):
    bench.main(
        [
            "--sizes", "3", "--repeats", "1", "--memory", "inline",
            "--paths", "compiled", "--no-profile", "--model", "mlp",
            "--out", str(tmp_path), "--peer-rows", "gradients-mlp",
            "norms-mlp", "jacobian-mlp", "jacobian-residual", "jacobian-two_head",
        ]
    )  # fmt: skip
    stored = json.loads((tmp_path / "peers.json").read_text())
    rows = {(r["task"], r["n"]): r for r in stored["rows"]}
    assert set(rows) == {
        (task, 3)
        for task in ("gradients-mlp", "norms-mlp", "jacobian-mlp",
                     "jacobian-residual", "jacobian-two_head")
    }  # fmt: skip
    for row in rows.values():
        assert len(row["jacutil"]["times"]) == 1 and row["jacutil"]["first"] > 0
        for timing in row["peers"].values():  # where JAX or PyTorch is installed
            assert timing["max_abs_diff"] < 1e-5 and len(timing["times"]) == 1
    table = (tmp_path / "peers.md").read_text()
    for words in (
        "per-sample gradients (squared error) | question's MLP | 3 |",
        "per-sample gradient norms (squared error) | question's MLP | 3 |",
        "per-sample Jacobian | residual MLP | 3 |",
        "per-sample Jacobian | two-head | 3 |",
        "**Proof**",
        "- gradients, question's MLP, n = 3:",
        "Add skip",
    ):
        assert words in table


def test_every_task_names_a_kind_and_a_model():
    assert set(bench.TASKS) >= {
        f"{kind}-{model}"
        for kind in ("gradients", "norms")
        for model in ("mlp", "cnn", "lstm")
    } | {"jacobian-mlp", "jacobian-residual", "jacobian-two_head"}
    for task in bench.TASKS.values():
        assert task.kind in bench.KINDS and task.model in bench.MODELS
    assert bench.TASKS["gradients-mlp"].sizes == (1000, 10_000)
    assert bench.TASKS["jacobian-residual"].sizes == (2000,)
    assert bench.TASKS["jacobian-mlp"].sizes == (100,)


def test_the_residual_and_two_head_models():
    residual, two_head = bench.residual_mlp(), bench.two_head()
    assert 9_000 <= residual.count_params() <= 13_000
    x = bench.flat_data(4, 10)
    assert bench.jacobian_shape(two_head, x, 4) == (4, 3, 2883)
    assert [tuple(y.shape) for y in two_head(x)] == [(4, 2), (4, 1)]
    assert sum(isinstance(layer, ju.keras.layers.Add) for layer in residual.layers) == 3


def test_a_peer_row_checks_each_peer_before_timing_it(monkeypatch):
    calls = []

    def wrong(model):
        def grads(x, y):
            calls.append(len(x))
            return np.zeros((len(x), 2850), np.float32)

        return grads

    kind = bench.KINDS["gradients"]
    monkeypatch.setattr(kind, "peers", {"jax": ("a wrong peer", wrong)})
    with pytest.raises(AssertionError, match="jax disagrees with jacutil"):
        bench.run_task("gradients-mlp", [3], repeats=4, log=lambda *a: None)
    assert calls == [3]  # the first call only: no timed calls


def _fake_rows():
    timing = {"first": 1.0, "times": [0.02], "median": 0.02}
    peers = {
        "jax": {"first": 2.0, "times": [0.01], "median": 0.01, "max_abs_diff": 2e-7},
        "torch": {"first": 0.1, "times": [0.04], "median": 0.04, "max_abs_diff": 0.0},
    }
    rows = [
        {"task": "gradients-cnn", "kind": "gradients", "model": "cnn", "n": 1000,
         "jacutil": timing, "peers": peers},
        {"task": "norms-lstm", "kind": "norms", "model": "lstm", "n": 10_000,
         "jacutil": timing, "peers": {}},
    ]  # fmt: skip
    kinds = {"gradients": {"label": "GRADS", "jax": "jit(vmap(grad))"},
             "norms": {"label": "NORMS"}}  # fmt: skip
    machine = {"date": "today", "cpu_count": 2, "load_average": [1.0],
               "versions": {"tensorflow": "2.21.0"}}  # fmt: skip
    models = {"cnn": "the CNN", "lstm": "the LSTM"}
    return {"machine": machine, "repeats": 1, "models": models, "kinds": kinds,
            "rows": rows}  # fmt: skip


def test_a_peer_row_gives_the_ratio_to_the_fastest_peer_and_its_proof():
    results = _fake_rows()
    assert bench.peer_ratio(results["rows"][0]) == pytest.approx(2.0)
    assert bench.peer_ratio(results["rows"][1]) is None
    table = bench.peer_rows_markdown(results)
    row = "| GRADS | CNN | 1,000 | 20.0 ms | 1.00 s | 10.0 ms | 40.0 ms | 2.00 |"
    assert row in table
    assert "| NORMS | LSTM | 10,000 | 20.0 ms | 1.00 s | - | - | - |" in table
    assert "JAX jit(vmap(grad)): max |peer - jacutil| = 2.0e-07" in table
    assert "PyTorch: max |peer - jacutil| = 0.0e+00" in table
    assert "- norms, LSTM, n = 10,000: no peer ran." in table
    assert "rtol 1e-5, atol 1e-6" in table and "- the CNN" in table


def test_the_jacobian_tables_print_each_peers_difference():
    results = _fake_results()
    for r in results["results"]:
        r["max_abs_diff"] = {"jax": 3e-7, "torch": 1e-7}.get(r["path"])
    proof = bench.peer_proof(results, 10)
    assert "JAX max |J_peer - J| = 3.0e-07" in proof and "PyTorch" in proof
    for r in results["results"]:
        r["max_abs_diff"] = None
    assert bench.peer_proof(results, 10) == ""
