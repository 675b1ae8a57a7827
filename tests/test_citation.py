"""CITATION.cff: valid Citation File Format 1.2.0, and in step with pyproject.toml.

Validated with the locked ``jsonschema`` against the CFF 1.2.0 JSON schema,
vendored as tests/cff-schema-1.2.0.json (no network at test time). It is the
schema of https://citation-file-format.github.io/1.2.0/schema.json, as
cffconvert 2.0.0 ships it (cffconvert/schemas/1.2.0/schema.json, sha256
0b8d2214...). cffconvert itself (``cffconvert --validate``) is not used: its
only release for CFF 1.2.0, 2.0.0, requires jsonschema<4, and the lock holds
jsonschema 4.26.0.
"""

import json
import tomllib
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = Path(__file__).with_name("cff-schema-1.2.0.json")


class _StringDates(yaml.SafeLoader):
    """YAML as CFF means it: a date stays a string, as the schema wants (the
    safe loader would make ``2026-12-02`` a datetime.date)."""


_StringDates.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in found if tag != "tag:yaml.org,2002:timestamp"]
    for first, found in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def citation():
    return yaml.load((ROOT / "CITATION.cff").read_text(), Loader=_StringDates)


def project():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def test_citation_is_valid_cff_1_2_0():
    schema = json.loads(SCHEMA.read_text())
    assert schema["$id"] == "https://citation-file-format.github.io/1.2.0/schema.json"
    cff = citation()
    assert cff["cff-version"] == "1.2.0"
    validator = jsonschema.Draft7Validator(
        schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER
    )
    errors = [
        f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
        for e in validator.iter_errors(cff)
    ]
    assert not errors, errors


def test_the_schema_catches_a_broken_citation():
    """The validation is not vacuous: a missing title or a bad date fails."""
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    broken = {k: v for k, v in citation().items() if k != "title"}
    assert not validator.is_valid(broken)
    assert not validator.is_valid({**citation(), "date-released": "2 December 2026"})


def test_citation_matches_pyproject():
    cff, meta = citation(), project()
    assert str(cff["version"]) == meta["version"], (
        "CITATION.cff's version is not pyproject.toml's"
    )
    assert cff["license"] == meta["license"]
    assert cff["repository-code"] == meta["urls"]["Repository"]
    authors = [a["name"] for a in meta.get("authors", []) if "name" in a]
    if authors:  # pyproject names its authors: the same people, in order
        cited = [
            a.get("name") or f"{a.get('given-names', '')} {a.get('family-names', '')}"
            for a in cff["authors"]
        ]
        assert [c.strip() for c in cited] == authors
    assert str(cff["date-released"]) == "2026-12-02"


def test_licence_covers_code_and_notebooks():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert "Permission is hereby granted, free of charge" in text
    assert "CC BY 4.0" in text
    assert "https://creativecommons.org/licenses/by/4.0/" in text
