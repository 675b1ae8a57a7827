"""Build notebooks/NN-name.ipynb from notebooks/src/NN-name.py and store outputs.

The sources are jupytext "percent" scripts: easy to review and diff. Each is
turned into a notebook and executed once, top to bottom, with its default
parameters, so the stored outputs a reader sees on GitHub are real. Run it with
`make notebooks` (or `make notebooks ONLY=notebooks/src/01-nested-loop.py`).
"""

import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


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
        resources={"metadata": {"path": str(target.parent)}},
    ).execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nbformat.write(nb, target)
    return target


def main(paths):
    for path in map(Path, paths):
        start = time.perf_counter()
        target = build(path)
        print(f"{target}: executed in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
