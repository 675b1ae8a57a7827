"""environment.yml (conda, Binder) installs what pyproject.toml declares."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


# The extras that `make setup` installs; others (such as benchmark peers) are
# optional and installed by their own make targets.
INSTALLED_EXTRAS = ("notebooks", "test", "site")


def name_of(requirement):
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower()


def test_environment_yml_agrees_with_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {name_of(r) for r in project["dependencies"]}
    for extra in INSTALLED_EXTRAS:
        declared |= {name_of(r) for r in project["optional-dependencies"][extra]}

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert any(d.startswith("python=3.11") for d in conda)
    assert "pip" in conda
    listed = {name_of(r) for r in pip if not r.startswith("-e")}
    assert listed == declared
    assert "-e ." in pip  # the package itself, from the repository


def test_lock_file_pins_every_declared_package():
    locked = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            locked[name.lower().replace("_", "-")] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {name_of(r) for r in project["dependencies"]}
    for extra in INSTALLED_EXTRAS:
        names |= {name_of(r) for r in project["optional-dependencies"][extra]}
    missing = {n for n in names if n.replace("_", "-") not in locked}
    assert not missing, f"not pinned in requirements.lock: {missing}"
