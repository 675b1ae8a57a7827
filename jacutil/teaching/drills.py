"""Fault drills: a run killed part way, as a lost machine would end it
(notebook 10-beyond-one-machine; the resume tests use it too)."""

import os
import signal
import subprocess
import sys
import time


def kill_part_way(script, progress, at_least=1, timeout=120.0):
    """A drill: run ``script`` in a fresh Python and ``SIGKILL`` it - no
    clean-up, as a lost machine - once ``progress()`` (chunks finished) reaches
    ``at_least``, waiting ``timeout`` seconds at the most. Returns
    ``progress()`` after the kill (int).
    """
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    try:
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            if progress() >= at_least:
                process.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    return progress()
