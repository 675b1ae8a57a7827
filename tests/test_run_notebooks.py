"""`make run` (scripts/run_notebooks.py) prints no kernel error line.

Issue 57: after notebook 07, `make run` printed ipykernel's "[IPKernelApp]
ERROR | KeyboardInterrupt caught in kernel." No cell was interrupted: the run
had ended, papermill had its last reply (to a kernel_info request), and
jupyter_client's shutdown began, as always, with an interrupt (SIGINT). Now and
then that signal lands in the kernel's handler of the last request after its
reply went out, before ipykernel sets SIGINT back to "ignore" - a window of
microseconds that a loaded machine, or the kernel's own busy threads, widens.
scripts/local_kernel.py's LocalKernelManager shuts its kernels down without
that interrupt (a kernel that does not exit is still ended: SIGTERM, SIGKILL).

The test widens the window on purpose, so that the race is not left to chance:
a cell makes the kernel's handler sleep 2 s after it sends its kernel_info
reply (a filter on the kernel's log, whose debug line follows the send). With
jupyter_client's shutdown the line appears; with make run's kernel manager it
does not.
"""

import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import run_notebooks  # noqa: E402
from local_kernel import LocalKernelManager  # noqa: E402

pytestmark = pytest.mark.notebook

LINGER_AFTER_KERNEL_INFO_REPLY = '''\
import logging, time

class Linger(logging.Filter):
    """Sleep 2 s after the kernel sends a kernel_info reply; drop debug lines."""
    def filter(self, record):
        if record.levelno == logging.DEBUG and "kernel_info_reply" in str(record.args):
            time.sleep(2)
        return record.levelno > logging.DEBUG

log = get_ipython().kernel.log
log.addFilter(Linger())
log.setLevel(logging.DEBUG)
print(6 * 7)
'''


class InterruptingManager(LocalKernelManager):
    """make run's kernel manager with jupyter_client's shutdown as it is:
    interrupt first."""

    async def _async_interrupt_kernel(self):
        from jupyter_client.manager import KernelManager

        await KernelManager._async_interrupt_kernel(self)


def run_as_make_run(tmp_path, monkeypatch, capfd, manager):
    """Run a one-cell notebook as `make run` does; what the kernel printed."""
    tmp_path.mkdir()
    book = tmp_path / "linger.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(LINGER_AFTER_KERNEL_INFO_REPLY)]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, book)
    monkeypatch.setattr(run_notebooks, "BUILD", tmp_path / "build")
    monkeypatch.setattr(run_notebooks, "LocalKernelManager", manager)
    for folder in ("executed", "html", "figures"):
        (tmp_path / "build" / folder).mkdir(parents=True, exist_ok=True)
    capfd.readouterr()
    _, error, _, _ = run_notebooks.run(book)
    assert error is None
    ran = nbformat.read(tmp_path / "build" / "executed" / book.name, as_version=4)
    assert ran.cells[0].outputs[0]["text"] == "42\n"
    said = capfd.readouterr()
    return said.err + said.out


def test_make_run_shuts_its_kernels_down_without_an_interrupt(
    tmp_path, monkeypatch, capfd
):
    interrupted = run_as_make_run(
        tmp_path / "interrupt", monkeypatch, capfd, InterruptingManager
    )
    assert "KeyboardInterrupt caught in kernel" in interrupted, interrupted
    said = run_as_make_run(tmp_path / "local", monkeypatch, capfd, LocalKernelManager)
    assert "KeyboardInterrupt" not in said, said
    assert "ERROR" not in said, said
