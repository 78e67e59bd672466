"""Real harnesses from PyPI through the gateway, on a scripted model: token-exact rows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsm.api import RolloutEngine
from tests.conftest import extra
from tests.gateway.conftest import ANSWER, assert_token_exact, row, scripted

ROOT = Path(__file__).resolve().parents[2]
SPECS = ["base", "chat_stream", "anthropic", "agents_sdk", "langgraph"]
NEEDS = {
    "base": "openai",
    "chat_stream": "openai",
    "anthropic": "anthropic",
    "agents_sdk": "agents",
    "langgraph": "langgraph",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", SPECS)
def test_harness_rows_are_token_exact(name, tokenizer):
    extra(NEEDS[name], "gateway")  # the harness itself, from PyPI
    backend = scripted(tokenizer)
    with RolloutEngine(f"examples/gateway/{name}.yaml", tokenizer, backend=backend) as engine:
        trajs = engine._run_sync(engine.arun([row(), row("What is 2 + 1?")], n=2))
    for traj in trajs:
        assert traj.error is None, traj.error
        assert traj.extra["harness"]["outcome"] == "returned", traj.extra["harness"]
        assert ANSWER.split("\n")[0] in traj.extra["harness"]["result"]
        assert traj.assistant_turns == 2 and traj.user_turns == 1
        assert traj.path == ["HARNESS", "GENERATING", "HARNESS", "GENERATING", "HARNESS", "TERMINATED"]
        tool = [m for m in traj.messages if m["role"] == "tool"]
        assert [m["content"] for m in tool] == ["3"]  # the harness ran the calculator itself
        assert_token_exact(traj, backend)
        assert traj.reward_score == 1.0


# the coding CLIs' example harnesses (examples/gateway), each a script a row runs as its command, by the
# variable that names its CLI
COMMAND_HARNESSES = {
    "claude_code": "AGENTFSM_CLAUDE_CODE",
    "codex": "AGENTFSM_CODEX",
    "gemini_cli": "AGENTFSM_GEMINI_CLI",
    "opencode": "AGENTFSM_OPENCODE",
    "qwen_code": "AGENTFSM_QWEN_CODE",
}


@pytest.mark.parametrize("name", sorted(COMMAND_HARNESSES))
def test_a_coding_cli_harness_command_starts_without_importing_the_gateway(name: str, tmp_path: Path) -> None:
    """A row's command runs the example script, which only starts the CLI: importing fsm.gateway first (the spec's
    action object; transformers) cost each row about 3 s before the CLI started (`true` stands in for it here)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        COMMAND_HARNESSES[name]: shutil.which("true") or "/bin/true",
        "AGENTFSM_ROW": json.dumps({"raw_prompt": [{"role": "user", "content": "x"}]}),
        "AGENTFSM_WORKDIR": str(tmp_path),
        "AGENTFSM_MODEL": "agentfsm",
        "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
        "OPENAI_API_KEY": "k",
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:9",
        "ANTHROPIC_API_KEY": "k",
    }
    script = ROOT / "examples" / "gateway" / f"{name}.py"
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    heavy = sorted(n for n in imported if n.split(".")[0] in ("fsm", "transformers", "torch"))
    assert not heavy, heavy[:20]
