"""The peer rows in separate processes (jacutil.bench.isolated): the
plumbing, the check before timing, the children's end and the report. No
timing is asserted: speed lives in the bench."""

import json

import numpy as np
import pytest

from jacutil.bench import fair_tasks, isolated


def test_a_row_in_separate_processes_gives_rounds_and_medians():
    row = isolated.run_separately(
        "jacobian-mlp", 4, rounds=2, repeats=1, log=lambda _: None
    )
    timing = row["jacutil"]
    assert len(timing["times"]) == 2 and timing["median"] == np.median(timing["times"])
    assert {"tf_intra_op", "tf_inter_op"} <= set(timing["threads"])
    for peer, their in row["peers"].items():  # where a peer is installed
        assert len(their["times"]) == 2 and their["max_abs_diff"] <= 1e-5, peer


def test_a_result_unlike_the_reference_is_refused_before_timing(tmp_path, capsys):
    reference = tmp_path / "reference.npy"
    options = dict(repeats=1, seed=0)
    isolated.child(
        "jacobian-mlp", 3, "jacutil", reference, commands=["go\n"], **options
    )
    said = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert said[0]["max_abs_diff"] == 0.0 and len(said[1]["times"]) == 1
    np.save(reference, np.load(reference) + 1e-3)  # another library's answer
    with pytest.raises(AssertionError, match="differs from jacutil.s"):
        isolated.child(
            "jacobian-mlp", 3, "jacutil", reference, commands=["go\n"], **options
        )
    assert "times" not in capsys.readouterr().out


def test_a_child_that_dies_is_an_error_with_its_stderr(tmp_path):
    with isolated.Child("no-such-task", 3, "jacutil", tmp_path / "r.npy", tmp_path,
                        1, 0) as child:  # fmt: skip
        with pytest.raises(RuntimeError, match="KeyError.*'no-such-task': no such row"):
            child.answer()


def test_a_child_ends_when_its_stdin_closes(tmp_path):
    with isolated.Child("jacobian-mlp", 3, "jacutil", tmp_path / "r.npy", tmp_path,
                        1, 0) as child:  # fmt: skip
        child.answer()
        assert len(child.round()) == 1
    assert child.process.returncode == 0  # it left by itself: not killed


def _row(task, n, ours, fastest):
    return {"task": task, "kind": task.split("-")[0], "model": task.split("-")[1],
            "n": n, "jacutil": {"median": ours},
            "peers": {"jax": {"median": fastest, "max_abs_diff": 0.0},
                      "torch": {"median": 2 * fastest, "max_abs_diff": 0}}}  # fmt: skip


def test_the_table_gives_both_ratios_and_says_where_the_aim_holds_in_both():
    results = {"machine": {}, "rounds": 2, "repeats": 1, "rows": [
        {"one_process": _row("norms-mlp", 1000, 0.4, 1.0),
         "separate": _row("norms-mlp", 1000, 0.45, 1.0)},
        {"one_process": _row("jacobian-mlp", 100, 0.9, 1.0),
         "separate": _row("jacobian-mlp", 100, 2.0, 1.0)},
    ]}  # fmt: skip
    lines = isolated.fair_table(results).splitlines()[2:]
    assert lines[0].split("|")[5:10] == [" 0.40 ", " 450.0 ms ", " 0.45 ", " <= 0.5 ",
                                         " yes "]  # fmt: skip
    assert lines[1].split("|")[-3:-1] == [" <= 1 ", " no "]  # 2.0x apart


def test_the_one_process_row_runs_in_a_new_process():
    row = isolated.one_process("jacobian-mlp", 4, 2, 0)
    assert row["task"] == "jacobian-mlp" and len(row["jacutil"]["times"]) == 2


def test_an_unknown_row_is_a_key_error_that_lists_the_rows():
    with pytest.raises(KeyError, match="no such row.*floor-cnn.*laplace-mlp"):
        fair_tasks.libraries("floor-mlp")


def test_the_floor_row_fills_an_array_of_the_jacobians_shape():
    ours = fair_tasks.prepare("floor-lstm", 3, "jacutil", 0)
    floor = fair_tasks.prepare("floor-lstm", 3, "floor", 0)
    J = np.asarray(ours.function(*ours.args))
    [out] = floor.args
    assert out.shape == J.shape and out.dtype == J.dtype
    assert floor.function(*floor.args) is out and np.all(out == 1.0)
    assert floor.check(out, J) is None  # the floor computes nothing to compare


def test_the_floor_row_in_one_process_times_both_and_compares_nothing():
    row = isolated.in_one_process("floor-cnn", 2, repeats=2, seed=0)
    assert fair_tasks.libraries("floor-cnn") == ["jacutil", "floor"]
    floor = row["peers"]["floor"]
    assert len(row["jacutil"]["times"]) == 2 and len(floor["times"]) == 2
    assert floor["max_abs_diff"] is None
    assert "(computes nothing: not compared)" in isolated._checked(floor)


def test_the_laplace_row_is_the_curvature_tables_and_refuses_a_wrong_covariance():
    prepared = fair_tasks.prepare("laplace-mlp", 5, "jacutil", 0)
    value = np.asarray(prepared.function(*prepared.args), np.float64)
    assert value.shape[0] == 5  # the predictive covariance of 5 test inputs
    assert prepared.check(value + 5e-5, value) == pytest.approx(5e-5)
    with pytest.raises(AssertionError, match="laplace-torch FullLLLaplace disagrees"):
        prepared.check(value + 2e-4, value)  # beyond LAPLACE_ATOL, 1e-4


def test_the_table_names_the_new_rows_and_their_aims():
    def row(task, ours, theirs, peer):
        n = 2000 if task == "floor-cnn" else 1000
        return {"task": task, "model": "-", "n": n, "jacutil": {"median": ours},
                "peers": {peer: {"median": theirs, "max_abs_diff": None}}}  # fmt: skip

    results = {"rows": [
        {"one_process": row("floor-cnn", 3.0, 1.0, "floor"),
         "separate": row("floor-cnn", 5.0, 1.0, "floor")},
        {"one_process": row("laplace-mlp", 0.9, 1.0, "laplace"),
         "separate": row("laplace-mlp", 0.8, 1.0, "laplace")},
    ]}  # fmt: skip
    floor, laplace = isolated.fair_table(results).splitlines()[2:]
    assert "per-sample Jacobian, x the write floor | CNN" in floor
    assert floor.split("|")[-3:-1] == [" <= 4 ", " no "]  # 5.0x in one of the two
    assert "last-layer Laplace predictive" in laplace
    assert laplace.split("|")[-3:-1] == [" <= 1 ", " yes "]
