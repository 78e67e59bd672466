"""Spec validation: a corpus of broken specs with the diagnostics each must produce, the shipped specs
(which must validate clean), and the JSON Schema's freshness.

Each file in tests/broken_specs/ starts with comment lines:
    # expect: CODE LINE          a diagnostic with this code on this line of the file itself
    # expect: CODE FILE:LINE     ... on this line of another file (relative to the spec), e.g. its base
    # expect-text: TEXT          some diagnostic's message contains TEXT (e.g. a "did you mean")
Files under tests/broken_specs/bases/ are bases the corpus extends; they are not tested on their own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from ruamel.yaml import YAML

import fsm
from fsm.spec.model import json_schema

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "broken_specs"
SPECS = HERE.parent / "specs"
SCHEMA = SPECS / "agentfsm.schema.json"
BROKEN = sorted(CORPUS.glob("*.yaml"))
SHIPPED = sorted(SPECS.glob("*.yaml"))

# path:line:col: code: message   (the path may itself contain ':' only on Windows drives; not here)
DIAGNOSTIC = re.compile(
    r"^(?P<path>[^:]+):(?P<line>\d+):(?P<col>\d+): (?P<code>[a-z][a-z-]*): (?P<message>.+)$", re.S
)


def expectations(path: Path) -> tuple[list[tuple[str, Path, int]], list[str]]:
    expected, texts = [], []
    for line in path.read_bytes().decode("utf-8", "replace").splitlines():  # not_utf8.yaml is not
        if m := re.match(r"#\s*expect:\s*(\S+)\s+(?:(\S+):)?(\d+)\s*$", line):
            code, file, lineno = m.groups()
            target = (path.parent / file).resolve() if file else path.resolve()
            expected.append((code, target, int(lineno)))
        elif m := re.match(r"#\s*expect-text:\s*(.+?)\s*$", line):
            texts.append(m.group(1))
        elif not line.startswith("#"):
            break
    return expected, texts


def test_corpus_is_large_enough():
    assert len(BROKEN) >= 25
    for path in BROKEN:
        assert expectations(path)[0], f"{path.name} has no '# expect: CODE LINE' header"


@pytest.mark.parametrize("path", BROKEN, ids=[p.stem for p in BROKEN])
def test_broken_spec(path: Path):
    expected, texts = expectations(path)
    diags = fsm.validate_file(path)
    assert diags, f"{path.name} validated clean"
    for d in diags:
        m = DIAGNOSTIC.match(str(d))
        assert m, f"not 'path:line:col: code: message': {d}"
        assert int(m["line"]) >= 1 and int(m["col"]) >= 1, str(d)
        assert Path(m["path"]).exists(), f"diagnostic points at a missing file: {d}"
    got = {(d.code, Path(d.path).resolve(), d.line) for d in diags}
    listing = "\n".join(map(str, diags))
    for code, file, line in expected:
        assert (code, file, line) in got, f"expected {code} at {file.name}:{line}; got:\n{listing}"
    for text in texts:
        assert any(text in d.message for d in diags), f"no diagnostic says {text!r}; got:\n{listing}"


def test_spec_error_lists_every_problem():
    """compile_spec raises SpecError whose message is all the diagnostics, sorted by position."""
    path = CORPUS / "dead_end.yaml"
    with pytest.raises(fsm.SpecError) as info:
        fsm.compile_spec(path)
    diags = info.value.diagnostics
    assert [d.line for d in diags] == sorted(d.line for d in diags)
    assert str(info.value).splitlines() == [str(d) for d in diags]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_specs_validate_clean(path: Path):
    assert fsm.validate_file(path) == []
    agent = fsm.compile_spec(path)
    assert agent.final_states and agent.initial in agent.spec.states


def test_the_installed_cli_validates_the_example_specs_from_anywhere(tmp_path: Path):
    """As a user runs the README's gateway example after `pip install -e`: no PYTHONPATH, another directory; the
    harnesses the example specs name (`examples.gateway.harnesses`) come from the install."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    examples = sorted((SPECS.parent / "examples" / "gateway").glob("*.yaml"))
    out = subprocess.run(
        [sys.executable, "-m", "fsm.cli", "validate", *map(str, examples)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_shipped_specs_present():
    assert {p.stem for p in SHIPPED} >= {"single_turn", "tool_agent", "interaction_agent", "calculator"}


def test_json_schema_is_fresh():
    """specs/agentfsm.schema.json must equal fsm.spec.model.json_schema(). If this fails, regenerate it with
    `agentfsm schema -o specs/agentfsm.schema.json`.
    """
    assert SCHEMA.exists(), "specs/agentfsm.schema.json is missing: regenerate it (see this test's docstring)"
    on_disk = SCHEMA.read_text(encoding="utf-8")
    assert json.loads(on_disk) == json_schema(), "stale schema: regenerate it (see this test's docstring)"
    assert on_disk == json.dumps(json_schema(), indent=2) + "\n", (
        "schema not in canonical form: regenerate it"
    )


def test_json_schema_describes_the_spec():
    schema = json_schema()
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert {"name", "states"} <= set(schema["else"]["required"])  # of a spec without `extends:`
    assert schema["if"] == {"required": ["extends"]}
    assert {"limits", "sampling", "tools", "interaction", "reward", "extends", "trust"} <= set(
        schema["properties"]
    )
    assert "class" in schema["$defs"]["ToolSpec"]["properties"]  # aliases, as users write them


def test_schema_file_is_what_the_cli_writes(tmp_path):
    """`agentfsm schema -o FILE` is how specs/agentfsm.schema.json is made: its output is the file."""
    from fsm.cli.commands import main

    out = tmp_path / "schema.json"
    assert main(["schema", "-o", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == SCHEMA.read_text(encoding="utf-8")


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_specs_pass_the_json_schema(path: Path):
    """What an editor checks: every shipped spec, `extends:` children included, under a standard validator."""
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    doc = YAML(typ="safe").load(path.read_text(encoding="utf-8"))
    errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]
    assert errors == [], f"{path.name}: {errors}"


@pytest.mark.parametrize(
    ("doc", "ok"),
    [
        ({"extends": "base.yaml", "limits": {"response_length": 8}}, True),  # a child need not repeat states
        ({"extends": "base.yaml", "interaction": {"config": {"k": 1}}}, True),  # nor a merged mapping's keys
        ({"name": "x", "states": {"A": {"final": True}}}, True),
        ({"name": "x"}, False),  # without extends, states is required
        ({"states": {"A": {"final": True}}}, False),  # ... and so is name
        ({"name": "x", "states": {}, "interaction": {"config": {}}}, False),  # ... and interaction.class
        ({"extends": "base.yaml", "limts": {}}, False),  # unknown keys stay unknown in a child
        ({"name": "x", "states": {}, "trust": {"allow_modules": ["os"]}}, True),
    ],
)
def test_json_schema_requires_keys_only_without_extends(doc, ok):
    valid = jsonschema.Draft202012Validator(json_schema()).is_valid(doc)
    assert valid is ok, doc


def test_shipped_specs_reference_the_schema():
    for path in SHIPPED:
        first = path.read_text(encoding="utf-8").splitlines()[0]
        assert first == "# yaml-language-server: $schema=agentfsm.schema.json", path.name


def test_missing_file_is_a_diagnostic(tmp_path):
    (d,) = fsm.validate_file(tmp_path / "nope.yaml")
    assert (d.code, d.line, d.col) == ("io", 1, 1) and DIAGNOSTIC.match(str(d))


def test_spec_object_without_a_file_is_validated_too():
    """compile_spec also takes an AgentSpec (no positions): problems still raise, with dotted locations."""
    spec = fsm.load_spec(SPECS / "single_turn.yaml").spec
    broken = spec.model_copy(update={"initial": "START"})
    with pytest.raises(fsm.SpecError) as info:
        fsm.compile_spec(broken)
    assert any(d.code == "unknown-state" and "initial" in d.message for d in info.value.diagnostics)
