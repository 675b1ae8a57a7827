"""`make run`: execute every notebook with papermill and summarise what it found.

Writes build/executed/NN-name.ipynb, build/html/NN-name.html and every figure as
build/figures/NN-name-K.png, then prints one screen: each notebook's status,
time and figure count, and the lines it printed that start with "Finding:".
"""

import base64
import sys
import time
from pathlib import Path

import nbformat
import papermill
from course_minutes import stated
from local_kernel import LocalKernelManager
from nbconvert import HTMLExporter

BUILD = Path("build")


def outputs(nb):
    for cell in nb.cells:
        if cell.cell_type == "code":
            yield from cell.get("outputs", [])


def findings(nb):
    for out in outputs(nb):
        if out.get("output_type") == "stream" and out.get("name") == "stdout":
            for line in out.get("text", "").splitlines():
                if line.startswith("Finding:"):
                    yield line[len("Finding:") :].strip()


def save_figures(nb, stem):
    count = 0
    for out in outputs(nb):
        png = out.get("data", {}).get("image/png")
        if png:
            count += 1
            path = BUILD / "figures" / f"{stem}-{count}.png"
            path.write_bytes(base64.b64decode(png))
    return count


def run(notebook: Path):
    executed = BUILD / "executed" / notebook.name
    start = time.perf_counter()
    error = None
    try:
        papermill.execute_notebook(
            str(notebook),
            str(executed),
            kernel_name="python3",
            cwd=str(notebook.parent),
            progress_bar=False,
            kernel_manager_class=LocalKernelManager,  # no TCP warning
        )
    except papermill.PapermillExecutionError as err:
        error = f"{err.ename}: {err.evalue}"
    seconds = time.perf_counter() - start
    nb = nbformat.read(executed, as_version=4)
    html, _ = HTMLExporter().from_notebook_node(nb)
    (BUILD / "html" / f"{notebook.stem}.html").write_text(html, encoding="utf-8")
    return seconds, error, save_figures(nb, notebook.stem), list(findings(nb))


def main(paths):
    for folder in ("executed", "html", "figures"):
        (BUILD / folder).mkdir(parents=True, exist_ok=True)
    failed = 0
    minutes = 0
    lines = []
    for notebook in map(Path, paths):
        print(f"running {notebook} ...", flush=True)
        seconds, error, figures, found = run(notebook)
        minutes += sum(stated(nbformat.read(notebook, as_version=4)))
        status = "FAILED" if error else "ok"
        failed += bool(error)
        lines.append(
            f"{notebook.stem:<24} {status:<6} {seconds:6.1f} s  {figures} figure(s)"
        )
        lines += [f"    {error}"] if error else []
        lines += [f"    - {text}" for text in found]
    print("\n== make run: summary ==")
    print("\n".join(lines))
    print(
        f"\n{len(paths) - failed} of {len(paths)} notebooks ran; executed copies in "
        f"{BUILD}/executed, HTML in {BUILD}/html, figures in {BUILD}/figures"
    )
    print(f"Every notebook, every exercise: {minutes // 60} h {minutes % 60} min")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
