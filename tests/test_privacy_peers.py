"""The Opacus peer row: same data as privacy_rows, and its JSON (issue 36)."""

import json

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
