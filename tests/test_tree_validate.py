"""`agentfsm validate` on tree specs (docs/trees.md "Validate"), as a user runs it: a real CLI process, its exit
code and its `file:line:col: code: message` lines."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_run_interrupts import REPO
from tests.test_tree_forks import agentfsm

SPECS = REPO / "specs"


def validate(*args: str):
    return agentfsm("validate", *args, timeout=300)


def test_a_child_named_like_a_function_tool_is_a_duplicate(tmp_path: Path):
    """A tool declared by `function:` alone is named by its function: a child of that name gave the model two
    tools named `calculator` and validated clean, statically and not."""
    spec = tmp_path / "two_calculators.yaml"
    spec.write_text(
        f"name: two_calculators\nextends: {SPECS}/planner_solver.yaml\n"
        "tools:\n  - function: specs.calculator:calculator\n"
    )
    for static in ((), ("--static",)):
        out = validate(*static, str(spec))
        assert out.returncode == 2, out.stdout + out.stderr
        text = out.stdout + out.stderr
        # the child's key in the spec that declares it
        assert re.search(
            rf"{SPECS}/planner_solver.yaml:\d+:\d+: duplicate: child machine 'calculator'", text
        ), text
        assert "Traceback" not in text
