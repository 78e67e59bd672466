"""The real Claude Code CLI (npm's @anthropic-ai/claude-code 2.1.197, `claude -p`, installed by .ci/claude_code.sh)
with its defaults, through `agentfsm gateway`, on the scripted tool-calling dev server (`agentfsm dev-server
--scripted-tools`) over the real Qwen2.5 tokenizer (.ci/tokenizers.sh): one task, write a file and finish. Claude
Code writes the file with its own `Write` tool, the row passes the token check, and the session is one row.

Skipped when the CLI or the tokenizer is missing (naming the script that installs it), failed under CI=true."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.gateway import claude_code
from tests.fixtures.real_tokenizers import DIR as TOKENIZERS
from tests.gateway.test_real_size import dev_server, stop

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def claude_cli() -> str:
    found = claude_code.claude_binary()
    if found is None or (os.path.sep in found and not Path(found).exists()):
        if os.environ.get("CI") == "true":
            pytest.fail(
                "Claude Code is missing under CI=true: .ci/run installs it with `bash .ci/claude_code.sh`"
            )
        pytest.skip("Claude Code is not installed: `bash .ci/claude_code.sh` installs it into .claude-cli/")
    return found


def gateway(spec: Path, server: str, tokenizer: str, out: Path, workdir: Path, cli: str) -> dict[str, Any]:
    """`agentfsm gateway SPEC` for one row against `server`; the row's record (the run must succeed)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsm.cli",
            "gateway",
            str(spec),
            "--server",
            server,
            "--tokenizer",
            tokenizer,
            "--num-prompts",
            "1",
            "--check-tokens",
            "-q",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "AGENTFSM_CLAUDE_CODE": cli,
            "AGENTFSM_WORKDIR": str(workdir),
        },
        capture_output=True,
        text=True,
        timeout=600,  # Claude Code's start and two 19k-token calls on a loaded 2-core machine
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = (out / "trajectories.jsonl").read_text().splitlines()
    return json.loads(line)


def test_what_a_local_model_does_not_serve_is_named_for_the_row() -> None:
    """Claude Code's default thinking budget, context editing and effort are read and left out, each named with its
    value; its cache_control and metadata change nothing a server does and are not named."""
    from fsm.gateway.anthropic_api import messages_call
    from tests.gateway.test_real_size import CAPTURED

    assert messages_call(CAPTURED).extra["dropped_fields"] == [
        'thinking {"type": "adaptive"}',
        'context_management {"edits": [{"keep": "all", "type": "clear_thinking_20251015"}]}',
        'output_config {"effort": "high"}',
    ]


@pytest.mark.slow
def test_claude_code_with_its_defaults_writes_a_file_through_the_gateway(
    tmp_path: Path, claude_cli: str, real_tokenizer: Any
) -> None:
    real_tokenizer("qwen2_5")  # skips (or fails under CI) with the line that fetches it
    tokenizer = str(TOKENIZERS / "qwen2_5")
    workdir = tmp_path / "work"
    workdir.mkdir()
    server, url = dev_server("--scripted-tools", "--tokenizer", tokenizer, "--context-length", "65536")
    try:
        out = tmp_path / "run"
        record = gateway(ROOT / "examples/gateway/claude_code.yaml", url, tokenizer, out, workdir, claude_cli)
    finally:
        stop(server)
    assert (workdir / "hello.txt").read_text() == "hi\n"  # written by Claude Code's own Write tool
    assert record["termination_reason"] == "done" and record["reward_score"] == 1.0, record
    harness = dict(record["harness"])
    contained = harness.pop(
        "contained"
    )  # fsm/gateway/reaper.py: its own PID namespace where Linux allows one
    assert contained == "pid+proc" or contained.startswith("no: "), contained
    assert harness == {"outcome": "exit", "exit_code": 0, "result": "Done."}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["token_check_failures"] == 0 and summary["rows"] == 1  # --check-tokens on the row
    batch = torch.load(out / "batch.pt", weights_only=False)
    assert batch["batch"]["responses"].shape[0] == 1  # one session, one task: one training row
    assert record["prompt_tokens"] > 15_000, record["prompt_tokens"]  # Claude Code's real first request
    assert "claude-code-20250219" not in record["prompt"]  # headers are not the prompt
    (note,) = record["gateway_notes"]  # what no local model serves is left out, and said once on the row
    assert note.startswith("request fields left out") and 'thinking {"type": "adaptive"}' in note, note
    (write, *_), done = [t for t in record["turns"] if t["role"] == "assistant"], record["turns"][-1]
    assert '"name": "Write"' in write["text"] and str(workdir / "hello.txt") in write["text"]
    assert done["role"] == "assistant" and done["text"].startswith("Done."), record["turns"]
    print(f"Claude Code's first request: {record['prompt_tokens']} Qwen2.5 tokens")
