"""Build notebooks/NN-name.ipynb from notebooks/src/NN-name.py and store outputs.

The sources are jupytext "percent" scripts: easy to review and diff. Each is
turned into a notebook and executed once, top to bottom, with its default
parameters, so the stored outputs a reader sees on GitHub are real. Run it with
`make notebooks` (or `make notebooks ONLY=notebooks/src/01-nested-loop.py`).

Answers stay out of what a learner reads (issue 57). The stored notebook is
the learner's: each solution cell (tagged `solution` in the source) is a stub,
`answer = None`, tagged `exercise`, and its check prints "no answer yet". The
solutions go to notebooks/solutions/NN-name.ipynb: the same cells with the
solutions in, outputs left out (no "✓" to read before trying), each cell's
run time kept for the course's minutes. One kernel runs both: each stub and
its check, then the solution and its check (which must print "✓"), so the
stored outputs after an exercise come from a run that had the solution; nbval
then proves that the learner copy, without it, reproduces them.
"""

import copy
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
SOLUTIONS = "solutions"  # notebooks/solutions/NN-name.ipynb
STUB = (
    "# Exercise {number}: your solution here. Put what the exercise asks for\n"
    "# in `answer`; the next cell checks it. A solution: {solutions}\n"
    "answer = None\n"
)


def stub_for(cell, number, stem):
    """The learner's cell in place of a solution cell."""
    stub = nbformat.v4.new_code_cell(
        STUB.format(number=number, solutions=f"{SOLUTIONS}/{stem}.ipynb")
    )
    tags = [t for t in cell.metadata.get("tags", []) if t != "solution"]
    stub.metadata["tags"] = [*tags, "exercise"]
    stub.id = cell.id
    return stub


def learner_cells(cells, stem):
    """The source's cells with every solution cell a stub."""
    out, number = [], 0
    for cell in cells:
        if "solution" in cell.metadata.get("tags", []):
            number += 1
            out.append(stub_for(cell, number, stem))
        else:
            out.append(cell)
    return out


def _interleaved(cells, stem):
    """[(cell, role)]: role "both", or, at each exercise, the stub and its
    check ("learner") followed by the solution and its check ("solution")."""
    out, number, k = [], 0, 0
    while k < len(cells):
        cell = cells[k]
        if "solution" in cell.metadata.get("tags", []):
            number += 1
            checked = cells[k + 1]
            out += [
                (stub_for(cell, number, stem), "learner"),
                (copy.deepcopy(checked), "learner"),
                (cell, "solution"),
                (checked, "solution"),
            ]
            k += 2
        else:
            out.append((cell, "both"))
            k += 1
    return out


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
            cell.metadata.setdefault("jupyter", {})["outputs_hidden"] = True
    roles = _interleaved(nb.cells, source.stem)
    ids = [c.id for c, _ in roles]
    for k, (cell, _) in enumerate(roles):
        cell.id = f"run-{k:03d}"  # unique within the run
    run = nbformat.v4.new_notebook(metadata=nb.metadata, cells=[c for c, _ in roles])
    execute(run, target)
    for (cell, _), stable in zip(roles, ids, strict=True):
        cell.id = stable
    learner = [c for c, role in roles if role != "solution"]
    solved = [c for c, role in roles if role != "learner"]
    for number, cell in enumerate(
        (c for c in learner if c.cell_type == "code"), start=1
    ):
        cell.execution_count = number  # as a top-to-bottom run of this copy
        for out in cell.get("outputs", []):
            if "execution_count" in out:
                out["execution_count"] = number
    for cell, role in roles:
        if role == "solution" and "check.exercise(" in cell.source:
            said = "".join(o.get("text", "") for o in cell.outputs)
            if not said.startswith("✓"):
                raise AssertionError(f"{source}: a solution fails its check: {said}")
    nb.cells = learner
    state_minutes(nb, source, solved)
    solutions = nbformat.v4.new_notebook(
        metadata=nb.metadata, cells=copy.deepcopy(solved)
    )
    for cell in solutions.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbformat.write(nb, target)
    (target.parent / SOLUTIONS).mkdir(exist_ok=True)
    nbformat.write(solutions, target.parent / SOLUTIONS / target.name)
    return target


def execute(nb, target: Path) -> None:
    """Run ``nb`` top to bottom in a local kernel; keep each cell's run time."""
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


def state_minutes(nb, source: Path, solved) -> None:
    """Write the measured minutes (scripts/course_minutes.py) into the
    notebook's "*Teaching: ... min*" line, in the notebook and in its source.
    ``solved``: the solutions' cells, whose lines and run times count."""
    m = measure(nb, solutions=nbformat.v4.new_notebook(cells=solved))
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
