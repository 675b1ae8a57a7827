"""The cheap check (issue 64): each layer's rule proved once per
configuration, its verdict kept in the process and in a cache folder keyed
by the versions; a wrong rule still caught on first use.

References: the float64 per-sample tape (``ju.per_sample_jacobian``) and
the rules' own whole-model check."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jacutil as ju
from jacutil import keras, rules
from jacutil.engine.compiled import compiled_for
from jacutil.rules import verdicts

layers = keras.layers
F64 = "float64"


def cnn(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6, 6, 2), dtype=F64),
            layers.Conv2D(3, 3, activation="tanh", dtype=F64),
            layers.MaxPooling2D(2, dtype=F64),
            layers.Flatten(dtype=F64),
            layers.Dense(5, activation="tanh", dtype=F64),
            layers.Dense(2, dtype=F64),
        ]
    )


def inputs(n=5, seed=1):
    return np.random.default_rng(seed).standard_normal((n, 6, 6, 2))


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A cache folder of the test's own, and no verdicts in the process."""
    monkeypatch.setenv(verdicts.CACHE_ENV, str(tmp_path))
    verdicts.forget_in_process()
    yield tmp_path
    verdicts.forget_in_process()


def report_of(model, x):
    jac = compiled_for(model, None, False, False, "rules", x)
    J = jac(x)
    return jac, J


def test_a_layer_is_proved_once_and_its_verdict_kept(folder):
    model, x = cnn(), inputs()
    jac, J = report_of(model, x)
    report = jac.plan.report
    assert not report.whole_model and report.layers == 5 and report.known == 0
    np.testing.assert_allclose(J, ju.per_sample_jacobian(model, x), rtol=1e-10)
    kept = [p for p in folder.rglob("*") if p.is_file()]
    assert len(kept) == 5 and not [p for p in kept if p.name.startswith(".")]
    assert kept[0].parent.name == verdicts.versions()
    # another model of the same layers (new weights): nothing to prove again
    other = cnn(seed=3)
    jac, J = report_of(other, inputs(seed=4))
    assert jac.plan.report.layers == 0 and jac.plan.report.known == 5
    np.testing.assert_allclose(
        J, ju.per_sample_jacobian(other, inputs(seed=4)), rtol=1e-10
    )


def test_the_folder_keeps_verdicts_across_processes_and_versions(folder):
    script = textwrap.dedent(
        """
        import json, numpy as np
        from tests.test_rule_verdicts import cnn, inputs, report_of
        jac, J = report_of(cnn(), inputs())
        r = jac.plan.report
        print(json.dumps([r.layers, r.known, r.whole_model]))
        """
    )
    env = dict(os.environ, **{verdicts.CACHE_ENV: str(folder)})

    def run():
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True,
            env=env, check=True, cwd=os.path.dirname(os.path.dirname(__file__)),
        )  # fmt: skip
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert run() == [5, 0, False]
    assert run() == [0, 5, False]  # a new process: the folder's verdicts
    # another version of TensorFlow, Keras, jacutil or the rules: proved again
    (versions,) = [p for p in folder.iterdir() if p.is_dir()]
    versions.rename(folder / "tf-0.0_keras-0.0_jacutil-0.0_000000000000")
    assert run() == [5, 0, False]


def test_a_version_change_proves_again(folder, monkeypatch):
    report_of(cnn(), inputs())
    verdicts.forget_in_process()
    monkeypatch.setattr(verdicts, "versions", lambda: "tf-9.9_keras-9.9_jacutil-9.9")
    jac, _ = report_of(cnn(seed=2), inputs())
    assert jac.plan.report.layers == 5


def test_switched_off_the_folder_stays_empty(folder, monkeypatch):
    monkeypatch.setenv(verdicts.CACHE_ENV, "0")
    jac, _ = report_of(cnn(), inputs())
    assert jac.plan.report.layers == 5 and not list(folder.iterdir())
    assert verdicts.cache_folder() is None


def test_a_half_written_verdict_counts_for_nothing(folder):
    model, x = cnn(), inputs()
    jac = compiled_for(model, None, False, False, "rules", x)
    step = jac.plan.steps[-1]  # the last Dense
    a = np.zeros((2, 5))
    key, on_disk = verdicts.verdict_key(
        step, jac.plan.nodes[-1], [a], jac.plan.wanted[-1], [True]
    )
    assert on_disk
    where = verdicts.cache_folder()
    where.mkdir(parents=True)
    (where / f".{key}.123.partial").write_text("pass")  # a run killed mid-write
    assert not verdicts.is_known(key, on_disk)
    verdicts.remember(key, on_disk)
    verdicts.forget_in_process()
    assert verdicts.is_known(key, on_disk)


def test_a_wrong_rule_is_caught_on_first_use_beside_kept_verdicts(folder):
    """The right Dense rule's verdicts are kept; a lying rule registered for
    Dense is another rule: proved on first use, it fails, and the whole
    model's check names the difference; the per-sample stage runs."""
    report_of(cnn(), inputs())

    class Lying(rules.dense.DenseRule):
        def __init__(self, layer):
            super().__init__(layer)
            self.activation = rules.activations.Activation(None)

    model, x = cnn(seed=5), inputs()
    with rules.registered(layers.Dense, Lying):
        jac, J = report_of(model, x)
    assert jac.plan is None and "differ from autodiff" in jac.fallback
    np.testing.assert_allclose(J, ju.per_sample_jacobian(model, x), rtol=1e-10)


def test_a_layer_whose_call_was_replaced_is_never_kept(folder):
    model, x = cnn(), inputs()
    dense = model.layers[-2]
    plain = dense.call
    dense.call = lambda h, *args, **kwargs: keras.ops.clip(plain(h), -0.1, 0.1)
    jac, J = report_of(model, x)
    assert jac.plan is None and "differ from autodiff" in jac.fallback
    np.testing.assert_allclose(J, ju.per_sample_jacobian(model, x), rtol=1e-10)


def test_explain_says_what_the_first_call_spent(folder):
    model, x = cnn(), inputs()
    _, first = ju.jacobian(model, x, explain=True)
    _, second = ju.jacobian(model, x, explain=True)
    _, warm = ju.jacobian(model, x, explain=True)
    assert not first.traced and first.spent["checking the rules"] > 0
    assert first.spent["running eagerly (a first call: no trace)"] > 0
    assert "tracing and compiling" not in first.spent
    assert "checked layer by layer" in str(first) and "5 layer rules" in str(first)
    assert "ran eagerly" in str(first) and "this call took" in str(first)
    assert second.traced and second.spent["tracing and compiling"] > 0
    assert "tracing and compiling" in str(second) and not second.check
    assert not warm.traced and set(warm.spent) <= {"running", "total"}
    total = sum(v for k, v in first.spent.items() if k != "total")
    assert total <= first.spent["total"] + 1e-6
