"""python -m jacutil.scale.credentials: the guide's first command (issue 37)."""

import subprocess
import sys


def test_a_second_run_says_one_line_and_keeps_the_files(tmp_path):
    command = [sys.executable, "-m", "jacutil.scale.credentials", str(tmp_path / "c")]
    first = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    key = (tmp_path / "c" / "key.pem").read_bytes()
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 1
    assert "Traceback" not in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert "never overwritten" in again.stderr
    assert (tmp_path / "c" / "key.pem").read_bytes() == key
