"""Every notebook's learner copy run in JupyterLab, in headless Chromium, as a
workshop participant runs it.

Starts `jupyter lab` on a free loopback port with a token, over learner copies of
the notebooks (solutions emptied to stubs, small parameters injected; nothing in
the repository is saved over), opens each in Chromium driven by Playwright,
clears the outputs, runs all cells from the Run menu, waits until every cell has
run, and checks what a person would see: no error output (but in cells tagged
`raises-exception`), no red stderr box, every figure rendered as an image, the
progress bars drawn, and each exercise's check saying "no answer yet".
A screenshot of each notebook lands in build/screenshots/.

Needs Debian's Chromium (`apt-get install -y chromium`) and the `playwright`
package; `.ci/run` installs both. Elsewhere the test is skipped.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from tests.chromium import CHROMIUM, CHROMIUM_FLAGS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from make_learner import learner_copy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
TOKEN = "jacutil-browser-test"
# What runs here is each notebook's learner copy (scripts/make_learner.py:
# solutions emptied to stubs), with its small parameters (tests/small_parameters/)
# injected: what a workshop participant opens. nbval runs every full notebook at
# its defaults and papermill at its small parameters; what the browser adds -
# the page as a learner sees it, no error or stderr box, the checks saying "no
# answer yet" - does not depend on the sizes. (At the defaults these were the
# slowest tests of make test; notebook 10 also starts workers and writes
# gigabytes.)
SMALL = ROOT / "tests" / "small_parameters"
SCREENSHOTS = ROOT / "build" / "screenshots"
RUN_TIMEOUT_S = 240

playwright_api = pytest.importorskip(
    "playwright.sync_api",
    reason="needs playwright: pip install playwright (`make test` installs it)",
)
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(),
        reason="needs Debian's Chromium at /usr/bin/chromium: run "
        "`apt-get install -y chromium` as root (.ci/run does)",
    ),
]

# JupyterLab settings for the test: render every cell (no virtual scrolling, so
# every output is in the page) and no news pop-up over the notebook.
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none"
    },
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def learner_copy_with_small_parameters(book, target):
    """The learner copy of ``book`` with its small parameters in a cell after
    its parameters cell, as papermill injects them."""
    nb, _ = learner_copy(nbformat.read(book, as_version=4))
    values = json.loads((SMALL / f"{book.stem}.json").read_text())
    at = next(
        i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])
    )
    cell = nbformat.v4.new_code_cell(
        "\n".join(f"{name} = {value!r}" for name, value in values.items())
    )
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(at + 1, cell)
    nbformat.write(nb, target)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A running JupyterLab over a copy of notebooks/; yields its base URL."""
    work = tmp_path_factory.mktemp("lab")
    for book in BOOKS:
        learner_copy_with_small_parameters(book, work / book.name)
    settings = work / ".settings"
    for name, values in SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port = free_port()
    env = dict(
        os.environ,
        JUPYTERLAB_SETTINGS_DIR=str(settings),
        JUPYTERLAB_WORKSPACES_DIR=str(work / ".workspaces"),
        JUPYTER_PREFER_ENV_PATH="1",
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={TOKEN}",
            f"--ServerApp.root_dir={work}",
            "--allow-root",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail("jupyter lab did not start within 60 s")
            time.sleep(0.5)
    yield url
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


def expected(book):
    """What the stored run of a notebook shows outside its solutions (which
    the learner copy empties): figures, progress bars, errors, checks."""
    nb = nbformat.read(book, as_version=4)
    kept = [
        c
        for c in nb.cells
        if c.cell_type == "code" and "solution" not in c.metadata.get("tags", [])
    ]
    outputs = [o for c in kept for o in c.outputs]
    raising = [
        c
        for c in nb.cells
        if c.cell_type == "code" and "raises-exception" in c.metadata.get("tags", [])
    ]
    return {
        "code_cells": sum(c.cell_type == "code" for c in nb.cells),
        "figures": sum("image/png" in o.get("data", {}) for o in outputs),
        "widgets": sum(
            "application/vnd.jupyter.widget-view+json" in o.get("data", {})
            for o in outputs
        ),
        "raising": len(raising),
        "checks": sum("check.exercise(" in c.source for c in kept),
    }


def shut_down_kernels(url):
    """Stop every kernel, so that eight TensorFlow kernels do not pile up."""
    headers = {"Authorization": f"token {TOKEN}"}
    request = urllib.request.Request(f"{url}/api/kernels", headers=headers)
    for kernel in json.load(urllib.request.urlopen(request, timeout=10)):
        urllib.request.urlopen(
            urllib.request.Request(
                f"{url}/api/kernels/{kernel['id']}", headers=headers, method="DELETE"
            ),
            timeout=30,
        )


MENU_TIMEOUT_S = 120


def menu(page, top, item):
    """Click a command in JupyterLab's menu bar, as a learner would - once
    JupyterLab enables it.

    A notebook's commands stay disabled until its panel is the current
    widget and its session is set up; on a loaded machine that comes after
    the page looks ready, and a click on a disabled entry does nothing (the
    run that then "never started": every prompt still ``[ ]:``). So the menu
    is opened until the entry is enabled, then clicked.
    """
    deadline = time.monotonic() + MENU_TIMEOUT_S
    while True:
        page.locator(".lm-MenuBar-itemLabel", has_text=top).first.click()
        enabled = page.locator(".lm-Menu-item:not(.lm-mod-disabled)")
        entry = enabled.locator(".lm-Menu-itemLabel").get_by_text(item, exact=True)
        if entry.count():
            entry.first.click()
            return
        page.keyboard.press("Escape")
        if time.monotonic() > deadline:
            pytest.fail(f"{top} > {item} stayed disabled for {MENU_TIMEOUT_S} s")
        time.sleep(0.5)


def wait_until_run(page, panel):
    """Wait until every shown prompt has an execution count and the kernel is idle.

    (A solution cell whose source is hidden shows no prompt.)
    """
    deadline = time.monotonic() + RUN_TIMEOUT_S
    prompts = panel.locator(".jp-CodeCell .jp-InputArea-prompt")
    while time.monotonic() < deadline:
        texts = [t.strip() for t in prompts.all_inner_texts()]
        ran = [re.fullmatch(r"\[\d+\]:", t) is not None for t in texts]
        busy = page.locator('.jp-Notebook-ExecutionIndicator[data-status="busy"]')
        if texts and all(ran) and not busy.count():
            return
        time.sleep(1)
    pytest.fail(f"not every cell ran within {RUN_TIMEOUT_S} s: prompts {texts}")


@pytest.mark.parametrize("book", BOOKS, ids=[b.stem for b in BOOKS])
def test_notebook_runs_cleanly_in_jupyterlab(lab, browser, book):
    want = expected(book)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(f"{lab}/lab/tree/{book.name}?token={TOKEN}&reset")
        panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
        panel.locator(".jp-Notebook").wait_for(timeout=60_000)
        page.locator('.jp-Notebook-ExecutionIndicator[data-status="idle"]').wait_for(
            timeout=60_000
        )
        panel.locator(".jp-Notebook").click()
        menu(page, "Edit", "Clear Outputs of All Cells")
        page.wait_for_function(
            "document.querySelectorAll('.jp-RenderedImage').length === 0"
        )
        menu(page, "Run", "Run All Cells")
        wait_until_run(page, panel)
        page.wait_for_timeout(1500)  # let the last outputs render

        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{book.stem}.png"))
        figures = panel.locator(".jp-RenderedImage img")
        if figures.count():
            figures.first.scroll_into_view_if_needed()
            page.screenshot(path=str(SCREENSHOTS / f"{book.stem}-figure.png"))

        errors = panel.locator('[data-mime-type="application/vnd.jupyter.error"]')
        stderr = panel.locator('[data-mime-type="application/vnd.jupyter.stderr"]')
        assert errors.count() == want["raising"], errors.all_inner_texts()
        assert stderr.count() == 0, stderr.all_inner_texts()
        assert figures.count() == want["figures"]
        progress = panel.locator(".jp-OutputArea-output .widget-hprogress")
        assert progress.count() >= min(want["widgets"], 1)
        assert not panel.get_by_text("Error displaying widget").count()
        checks = panel.locator(".jp-CodeCell").filter(has_text="check.exercise(")
        said = [
            cell.locator(".jp-OutputArea").inner_text() for cell in checks.all()
        ]
        assert len(said) == want["checks"] > 0, said
        assert all("no answer yet" in text for text in said), said
    finally:
        page.close()
        shut_down_kernels(lab)
