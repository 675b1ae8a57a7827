"""`make learner`: learner copies of the notebooks in build/learner/.

Outputs cleared, execution counts reset, and every solution cell (tagged
`solution`) emptied to a stub that names its exercise and sets `answer = None` (the
check cell after it then says "no answer yet"); everything else - prose,
code, the parameters cell - is kept as it is. Solutions are shown (not hidden)
so that a learner sees where to type.
"""

import sys
from pathlib import Path

import nbformat

OUT = Path("build/learner")
STUB = (
    "# Exercise {number}: your solution here. Put what the exercise asks for\n"
    "# in `answer`; the next cell checks it.\n"
    "answer = None\n"
)


def learner_copy(nb):
    number = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs = []
        cell.execution_count = None
        tags = cell.metadata.get("tags", [])
        if "solution" in tags:
            number += 1
            cell.source = STUB.format(number=number)
            cell.metadata.pop("jupyter", None)  # code and outputs shown
            cell.metadata["tags"] = [t for t in tags if t != "solution"] + ["exercise"]
    return nb, number


def main(paths):
    OUT.mkdir(parents=True, exist_ok=True)
    for path in map(Path, paths):
        nb, count = learner_copy(nbformat.read(path, as_version=4))
        nbformat.write(nb, OUT / path.name)
        print(f"{OUT / path.name}: {count} exercise(s) emptied")


if __name__ == "__main__":
    main(sys.argv[1:])
