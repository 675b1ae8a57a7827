"""Build notebooks/NN-name.ipynb from notebooks/src/NN-name.py and store outputs.

The sources are jupytext "percent" scripts: easy to review and diff. Each is
turned into a notebook and executed once, top to bottom, with its default
parameters, so the stored outputs a reader sees on GitHub are real. Run it with
`make notebooks` (or `make notebooks ONLY=notebooks/src/01-nested-loop.py`).
"""

import sys
import time
from datetime import datetime
from pathlib import Path

import jupytext
import nbformat
from course_minutes import LINE, measure
from local_kernel import LocalKernelManager
from nbclient import NotebookClient

KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def build(source: Path) -> Path:
    target = source.parent.parent / f"{source.stem}.ipynb"
    nb = jupytext.read(source)
    nb.metadata = {
        "kernelspec": KERNELSPEC,
        "language_info": {"name": "python"},
    }
    for i, cell in enumerate(nb.cells):
        cell.id = f"{source.stem[:2]}-{i:02d}"  # stable ids keep diffs small
        if "solution" in cell.metadata.get("tags", []):
            # A solution's outputs give it away: hidden with its code.
            cell.metadata.setdefault("jupyter", {})["outputs_hidden"] = True
    NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        kernel_manager_class=LocalKernelManager,  # no TCP warning
        resources={"metadata": {"path": str(target.parent)}},
    ).execute()
    for cell in nb.cells:
        ran = cell.metadata.pop("execution", {})
        if "iopub.execute_input" in ran and "shell.execute_reply" in ran:
            # The run time of the cell, kept for the course's minutes
            # (scripts/course_minutes.py); timestamps would make every diff noisy.
            seconds = _seconds(ran["shell.execute_reply"]) - _seconds(
                ran["iopub.execute_input"]
            )
            cell.metadata["run_seconds"] = round(max(seconds, 0.0), 1)
    state_minutes(nb, source)
    nbformat.write(nb, target)
    return target


def state_minutes(nb, source: Path) -> None:
    """Write the measured minutes (scripts/course_minutes.py) into the
    notebook's "*Teaching: ... min*" line, in the notebook and in its source."""
    m = measure(nb)
    line = f"Teaching: {m.teaching} min · Exercises: {m.doing} min" + (
        f" · Going further: {m.further} min" if m.further else ""
    )
    for cell in nb.cells:
        if cell.cell_type == "markdown" and LINE.search(cell.source):
            cell.source = LINE.sub(line, cell.source, count=1)
            break
    else:
        raise ValueError(f"{source}: no '*Teaching: T min · Exercises: E min*' line")
    text = source.read_text()
    source.write_text(LINE.sub(line, text, count=1))


def main(paths):
    for path in map(Path, paths):
        start = time.perf_counter()
        target = build(path)
        print(f"{target}: executed in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
