"""How long a notebook takes a learner, measured the way a course author would.

    python scripts/course_minutes.py notebooks/[0-9]*.ipynb   # a table per notebook
    python scripts/course_minutes.py --write notebooks/[0-9]*.ipynb   # make minutes

`--write` puts the figures where a reader plans with them: README's plan (the
core path and going further) and INSTRUCTORS.md's heading and section minutes
of each notebook; tests/test_teaching_plan.py checks that they are current.

A learner reads the prose, reads the code shown, waits for each cell to run,
looks at each printed table and figure, and then tries every exercise from its
stub (the copy `make learner` gives): reads the question, writes the lines the
solution has, runs it and its check, and reads a hint once. The rates below
are a careful reader's on technical text, not a skimmer's:

- prose: 150 words a minute (technical English, read to be understood);
- code shown: 15 lines a minute;
- printed output: 200 words a minute; a figure: half a minute;
- running a cell: its run time, stored by `make notebooks` in the cell's
  metadata (`run_seconds`);
- an exercise: 3 minutes to read, plan and run the check, 1 minute per
  line of code the solution writes (comments and blank lines not counted),
  and its cells' run time twice (a first try and a second).

These are a newcomer's rates, the ones a fresh reader measured the course
with (issue 57): at the earlier 150, 15 and 1.0 the stated minutes were a
faster reader's. `python scripts/course_minutes.py --newcomer` prints the
core path and the whole course at these rates; the core must stay within
CORE_LIMIT. The minutes are a plan for a reader at these rates, not a
promise: INSTRUCTORS.md says how they are counted.

The stored notebook is the learner's (its solutions are stubs): a solution's
lines and run time are read from notebooks/solutions/ (solutions_of).

A section starts at each `## ` heading; the exercises are counted apart. A
`## Going further ...` heading starts a notebook's optional part (to the next
`## Keypoints`): its sections and exercises count as going further. The
notebook's "*Teaching: T min · Exercises: E min · Going further: G min*" line
states these sums, whole minutes rounded up (tests/test_teaching_plan.py).
"""

import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

PROSE_WPM = 120
CODE_LINES_PER_MIN = 10
OUTPUT_WPM = 200
FIGURE_MIN = 0.5
EXERCISE_BASE_MIN = 3.0
SOLUTION_LINE_MIN = 1.5
TRIES = 2


LINE = re.compile(
    r"Teaching: (\d+) min · Exercises: (\d+) min(?: · Going further: (\d+) min)?"
)


@dataclass
class Section:
    title: str
    minutes: float = 0.0
    further: bool = False  # under a "## Going further" heading


@dataclass
class Minutes:
    sections: list = field(default_factory=list)  # [Section]
    exercises: list = field(default_factory=list)  # [(minutes, further)]

    @property
    def teaching(self) -> int:
        return math.ceil(sum(s.minutes for s in self.sections if not s.further))

    @property
    def doing(self) -> int:
        return math.ceil(sum(m for m, further in self.exercises if not further))

    @property
    def further(self) -> int:
        """Going further: its sections and the exercises in them."""
        return math.ceil(
            sum(s.minutes for s in self.sections if s.further)
            + sum(m for m, further in self.exercises if further)
        )


def _words(text: str) -> int:
    return len(re.findall(r"\S+", text))


def _code_lines(source: str) -> int:
    lines = (line.strip() for line in source.splitlines())
    return sum(1 for line in lines if line and not line.startswith("#"))


def _output_minutes(cell) -> float:
    minutes = 0.0
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream" and out.get("name") == "stdout":
            minutes += _words(out.get("text", "")) / OUTPUT_WPM
        data = out.get("data", {})
        if "image/png" in data or "image/svg+xml" in data:
            minutes += FIGURE_MIN
        elif "text/markdown" in data:
            minutes += _markdown_minutes(data["text/markdown"])
        elif "text/html" in data or "text/plain" in data:
            text = data.get("text/plain", "")
            text = text if isinstance(text, str) else "".join(text)
            minutes += _words(text) / OUTPUT_WPM
    return minutes


FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.DOTALL)


def _markdown_minutes(text) -> float:
    """Displayed markdown: its code blocks (library source that show_source
    displays) read as code, the rest as prose."""
    text = text if isinstance(text, str) else "".join(text)
    code = sum(_code_lines(block) for block in FENCE.findall(text))
    return _words(FENCE.sub("", text)) / PROSE_WPM + code / CODE_LINES_PER_MIN


def _run_minutes(cell) -> float:
    return cell.metadata.get("run_seconds", 0.0) / 60


def solutions_of(path) -> "nbformat.NotebookNode":
    """notebooks/solutions/NN-name.ipynb of notebooks/NN-name.ipynb."""
    path = Path(path)
    return nbformat.read(path.parent / "solutions" / path.name, as_version=4)


def measure(nb, solutions=None) -> Minutes:
    """Minutes per section and per exercise of one notebook (see the module).

    A `## Going further...` heading starts the notebook's going-further part,
    which runs to the next `## Keypoints` (or the end). Every cell tagged
    `solution` is one exercise: its question is the prose since the last code
    cell, and the code cell after it is its check. ``nb`` is the stored
    (learner) notebook, whose outputs are read; ``solutions``, its solutions
    notebook (the same cells, solutions in), gives each exercise's solution
    lines and the run times of the solution and its check."""
    result = Minutes(sections=[Section("Introduction")])
    further = False
    prompt = 0.0  # minutes of prose since the last code cell
    skip_check = False
    solved = solutions.cells if solutions is not None else nb.cells
    for shown, cell in zip(nb.cells, solved, strict=True):
        if "solution" not in cell.metadata.get("tags", []) and not skip_check:
            cell = shown  # outside the exercises: what the reader sees
        tags = cell.metadata.get("tags", [])
        if cell.cell_type == "markdown":
            heading = re.match(r"## (.+)", cell.source)
            if heading:
                title = heading[1].strip()
                if title.lower().startswith("going further"):
                    further = True
                elif title.lower().startswith("keypoints"):
                    further = False
                result.sections.append(Section(title, further=further))
                prompt = 0.0
            # the minutes line itself is not read as prose: the figures it
            # states must not change the count they come from
            minutes = _words(LINE.sub("", cell.source)) / PROSE_WPM
            result.sections[-1].minutes += minutes
            prompt += minutes
            continue
        if "solution" in tags:
            result.sections[-1].minutes -= prompt  # the question is the exercise's
            result.exercises.append(
                [
                    prompt
                    + EXERCISE_BASE_MIN
                    + SOLUTION_LINE_MIN * _code_lines(cell.source)
                    + TRIES * _run_minutes(cell),
                    further,
                ]
            )
            prompt, skip_check = 0.0, True
            continue
        prompt = 0.0
        if skip_check:  # the check cell: part of its exercise
            result.exercises[-1][0] += TRIES * _run_minutes(cell)
            skip_check = False
            continue
        result.sections[-1].minutes += (
            _code_lines(cell.source) / CODE_LINES_PER_MIN
            + _output_minutes(cell)
            + _run_minutes(cell)
        )
    return result


def stated(nb) -> tuple:
    """(teaching, exercises, going further) minutes from the notebook's
    "*Teaching: T min · Exercises: E min · Going further: G min*" line (the
    last part only where the notebook has one)."""
    for cell in nb.cells:
        found = LINE.search(cell.source)
        if cell.cell_type == "markdown" and found:
            return int(found[1]), int(found[2]), int(found[3] or 0)
    raise ValueError("no '*Teaching: T min · Exercises: E min*' line")


def round_up(minutes: float, step: int = 5) -> int:
    return step * math.ceil(minutes / step)


ROOT = Path(__file__).resolve().parent.parent
CORE = ("00", "01", "02", "03", "04", "05")  # the question answered, in order
CORE_LIMIT = 180  # minutes, exercises included
PLAN = re.compile(r"<!-- plan: .*?<!-- /plan -->", re.DOTALL)
MARK = "<!-- plan: made by `make minutes` (scripts/course_minutes.py); do not edit -->"


def hours(minutes: int) -> str:
    return f"{minutes // 60} h {minutes % 60} min"


def title(nb) -> str:
    """The notebook's title without its number: "The nested loop, ..."."""
    first = nb.cells[0].source.splitlines()[0]
    return re.sub(r"^#\s*\d+\s*·\s*", "", first).strip()


def readme_plan(books) -> str:
    """README's plan: the core path with start times, then going further."""
    core = [(p, m, t) for p, m, t in books if p.stem[:2] in CORE]
    more = [(p, m, t) for p, m, t in books if p.stem[:2] not in CORE]
    core_total = sum(m.teaching + m.doing for _, m, _ in core)
    lines = [
        MARK,
        f"**The core path** ({hours(core_total)}): the question answered, from the "
        "loop to a Keras model fitted by SciPy. Teaching and one exercise a "
        "notebook; each notebook's optional part is going further.",
        "",
        "| start | notebook | teaching | exercises | minutes |",
        "|---|---|---|---|---|",
    ]
    start = 0
    for path, m, name in core:
        minutes = m.teaching + m.doing
        lines.append(
            f"| {start // 60}:{start % 60:02d} | `{path.stem}` — {name} "
            f"| {m.teaching} | {m.doing} | {minutes} |"
        )
        start += minutes
    further = [(f"`{p.stem}` — its going-further part", m.further) for p, m, _ in core]
    further += [(f"`{p.stem}` — {name}", m.teaching + m.doing) for p, m, name in more]
    further = [(what, minutes) for what, minutes in further if minutes]
    further_total = sum(minutes for _, minutes in further)
    lines += [
        "",
        f"**Going further** ({hours(further_total)}), in any order after the core:",
        "",
        "| notebook | minutes |",
        "|---|---|",
        *(f"| {what} | {minutes} |" for what, minutes in further),
        "",
        f"Everything, every exercise included: {hours(core_total + further_total)}.",
        "<!-- /plan -->",
    ]
    return "\n".join(lines)


def instructors_notes(text: str, books) -> str:
    """INSTRUCTORS.md: each notebook's heading states its minutes, and the line
    after it the minutes of each section and exercise."""
    for path, m, _ in books:
        heading = f"## {path.stem} ({m.teaching} + {m.doing} min" + (
            f"; going further {m.further} min)" if m.further else ")"
        )
        sections = ", ".join(
            f"{s.title} {math.ceil(s.minutes)}" for s in m.sections if s.minutes >= 0.5
        )
        exercises = ", ".join(
            f"{math.ceil(e)}{' (going further)' * f}" for e, f in m.exercises
        )
        detail = f"- Minutes measured per section: {sections}; exercises: {exercises}."
        pattern = re.compile(
            rf"^## {re.escape(path.stem)} \(.*\)\n"
            r"(- Minutes measured per section:.*\n)?",
            re.MULTILINE,
        )
        replacement = heading + "\n" + detail + "\n"
        text, found = pattern.subn(lambda _, r=replacement: r, text)
        if not found:
            raise ValueError(f"INSTRUCTORS.md has no '## {path.stem} (...)' heading")
    return text


def books_of(paths):
    out = []
    for path in map(Path, paths):
        nb = nbformat.read(path, as_version=4)
        out.append((path, measure(nb, solutions_of(path)), title(nb)))
    return out


def write(paths) -> None:
    books = books_of(paths)
    readme = ROOT / "README.md"
    text = readme.read_text()
    if not PLAN.search(text):
        raise ValueError("README.md has no '<!-- plan: ... <!-- /plan -->' block")
    readme.write_text(PLAN.sub(lambda _: readme_plan(books), text))
    notes = ROOT / "INSTRUCTORS.md"
    notes.write_text(instructors_notes(notes.read_text(), books))


def newcomer(paths) -> None:
    """The core and the whole course, at the rates above."""
    books = books_of(paths)
    core = sum(m.teaching + m.doing for p, m, _ in books if p.stem[:2] in CORE)
    whole = sum(m.teaching + m.doing + m.further for _, m, _ in books)
    print(
        f"At a newcomer's rates ({PROSE_WPM} words a minute, {CODE_LINES_PER_MIN} "
        f"lines of code a minute, shown library source included, "
        f"{SOLUTION_LINE_MIN} min a solution line):"
    )
    print(f"core (notebooks {CORE[0]} to {CORE[-1]}, exercises included): "
          f"{core} min ({hours(core)}); limit {CORE_LIMIT} min")
    print(f"everything, every exercise included: {whole} min ({hours(whole)})")


def main(paths):
    if paths and paths[0] == "--write":
        write(paths[1:])
        return
    if paths and paths[0] == "--newcomer":
        books = (ROOT / "notebooks").glob("[0-9]*.ipynb")
        newcomer(paths[1:] or sorted(map(str, books)))
        return
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        m = measure(nb, solutions_of(path))
        teach, ex, further = stated(nb)
        print(
            f"{path}: measured teaching {m.teaching} min, exercises {m.doing} min, "
            f"going further {m.further} min; stated {teach} + {ex} + {further}"
        )
        for s in m.sections:
            print(f"    {s.minutes:5.1f}  {s.title}{'  (going further)' * s.further}")
        for k, (e, f) in enumerate(m.exercises, 1):
            print(f"    {e:5.1f}  exercise {k}{'  (going further)' * f}")


if __name__ == "__main__":
    main(sys.argv[1:])
