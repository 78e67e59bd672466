"""A new user's first steps, through the CLI process run from another directory (issue 26.12): a tools module
beside the spec is found without PYTHONPATH; a module found nowhere says where import paths are looked for;
`render -o` into a folder that does not exist yet creates it. docs/authoring.md documents these."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "PYTHONPATH"},
    "PYTHONPATH": str(REPO),
}  # the engine only: the spec's folder is not on it

SPEC = """
    name: my_agent
    extends: {repo}/specs/tool_agent.yaml
    tools:
      - function: {module}:shout
"""
TOOLS = '''
    def shout(text: str) -> str:
        """Say it louder.

        Args:
            text: What to say.
        """
        return text.upper()
'''


def cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsm.cli", *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_a_tools_module_beside_the_spec_is_found_from_any_directory(tmp_path):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir(), elsewhere.mkdir()
    (project / "my_tools_2612.py").write_text(textwrap.dedent(TOOLS))
    (project / "agent.yaml").write_text(textwrap.dedent(SPEC.format(repo=REPO, module="my_tools_2612")))
    proc = cli("validate", str(project / "agent.yaml"), cwd=elsewhere)
    assert proc.returncode == 0 and proc.stdout.strip() == f"{project / 'agent.yaml'}: ok", (
        proc.stdout + proc.stderr
    )


def test_a_module_found_nowhere_says_where_it_was_looked_for(tmp_path):
    (tmp_path / "agent.yaml").write_text(textwrap.dedent(SPEC.format(repo=REPO, module="nowhere_2612")))
    proc = cli("validate", str(tmp_path / "agent.yaml"), cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "cannot import module 'nowhere_2612'" in proc.stdout + proc.stderr
    assert f"looked for on sys.path and in the spec's folder {tmp_path}" in proc.stdout + proc.stderr, (
        proc.stdout
    )


def test_render_into_a_missing_folder_creates_it(tmp_path):
    out = tmp_path / "diagrams" / "new" / "agent.dot"
    proc = cli("render", str(REPO / "specs" / "calculator.yaml"), "-o", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().startswith("digraph")
