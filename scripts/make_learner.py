"""`make learner`: learner copies of the notebooks in build/learner/.

The stored notebooks are already the learner's (each solution a stub that
names its exercise and sets `answer = None`, tagged `exercise`: see
scripts/build_notebooks.py); the copy clears their outputs and execution
counts for a workshop. A solution cell still found (tagged `solution`, as in
notebooks/solutions/) is emptied to the same stub; everything else - prose,
code, the parameters cell - is kept as it is.
"""

import sys
from pathlib import Path

import nbformat
from build_notebooks import stub_for

OUT = Path("build/learner")


def learner_copy(nb, stem=""):
    number = 0
    for k, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        tags = cell.metadata.get("tags", [])
        if "solution" in tags or "exercise" in tags:
            number += 1
        if "solution" in tags:
            nb.cells[k] = cell = stub_for(cell, number, stem)
        cell.outputs = []
        cell.execution_count = None
    return nb, number


def main(paths):
    OUT.mkdir(parents=True, exist_ok=True)
    for path in map(Path, paths):
        nb, count = learner_copy(nbformat.read(path, as_version=4), path.stem)
        nbformat.write(nb, OUT / path.name)
        print(f"{OUT / path.name}: {count} exercise(s) emptied")


if __name__ == "__main__":
    main(sys.argv[1:])
