"""The real Claude Code CLI (npm's @anthropic-ai/claude-code 2.1.197, `claude -p`, installed by .ci/claude_code.sh)
with its defaults, through `agentfsm gateway`, on the scripted tool-calling dev server (`agentfsm dev-server
--scripted-tools`) over the real Qwen2.5 tokenizer (.ci/tokenizers.sh): one task, two sub-agents started in parallel
with Claude Code's own `Agent` tool, then write a file and finish. Claude Code writes the file with its own `Write`
tool; the session is a tree of three rows (the agent's, one per sub-agent, linked by the `x-claude-code-agent-id`
header Claude Code sends), each passes the token check, and nothing is copied between them.

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
SUB_AGENTS = [
    {"prompt": "Answer with the word pong.", "answer": "pong"},
    {"prompt": "Say ping.", "answer": "ping"},
]


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


def gateway(
    spec: Path,
    server: str,
    tokenizer: str,
    out: Path,
    workdir: Path,
    cli: str,
    cli_env: str = "AGENTFSM_CLAUDE_CODE",
) -> dict[str, Any]:
    """`agentfsm gateway SPEC` for one row against `server`, the harness's CLI at `cli` (named by `cli_env`); the
    row's record (the run must succeed)."""
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
            cli_env: cli,
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
def test_claude_code_with_its_defaults_runs_sub_agents_and_writes_a_file_through_the_gateway(
    tmp_path: Path, claude_cli: str, real_tokenizer: Any
) -> None:
    """About 60-120 s on a loaded 2-core machine: Claude Code's start and five real-size calls (two of ~19k
    tokens, two sub-agents' of ~11k), one run for the harness, its tree and its file."""
    real_tokenizer("qwen2_5")  # skips (or fails under CI) with the line that fetches it
    tokenizer = str(TOKENIZERS / "qwen2_5")
    workdir = tmp_path / "work"
    workdir.mkdir()
    script = tmp_path / "script.json"
    script.write_text(
        json.dumps(
            [{"agents": SUB_AGENTS}, {"write": {"path": "hello.txt", "content": "hi\n"}}, {"text": "Done."}]
        )
    )
    server, url = dev_server(
        "--scripted-tools", "--tokenizer", tokenizer, "--context-length", "65536", "--script", str(script)
    )
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
    assert summary["token_check_failures"] == 0 and summary["rows"] == 1  # --check-tokens on every row
    batch = torch.load(out / "batch.pt", weights_only=False)
    assert batch["batch"]["responses"].shape[0] == 3  # one session: the agent's row and one per sub-agent
    *children, root = record["segments"]  # the row the session ended on last
    assert [(s["node"], s["parent"], s["node_kind"]) for s in record["segments"]] == [
        ("0.0", "0", "child"),
        ("0.1", "0", "child"),
        ("0", None, "root"),
    ]
    # the agent's own row: its calls, the sub-agents' answers as their results, the write, its answer; the
    # children begin where its calling turn ended, and none of their tokens is copied into it (no branch)
    assert root["reason"] == "prompt" and [t["role"] for t in root["turns"]].count("assistant") == 3
    calling = root["prompt_tokens"] + root["turns"][0]["n_tokens"]
    results = root["turns"][2]["text"]
    answers = []  # the two ran in parallel: either may be the first child
    for child in children:
        assert child["reason"] == "child" and child["branch_offset"] == calling, child
        (answer,) = [t["text"].removesuffix("<|im_end|>") for t in child["turns"] if t["role"] == "assistant"]
        # the sub-agent's answer is the tool result the agent saw (Claude Code adds its agent id after it)
        assert f"<tool_response>\n{answer}agentId: " in results, results
        answers.append(answer)
    assert sorted(answers) == sorted(a["answer"] for a in SUB_AGENTS)
    assert record["prompt_tokens"] > 15_000, record["prompt_tokens"]  # Claude Code's real first request
    assert "claude-code-20250219" not in record["prompt"]  # headers are not the prompt
    # what no local model serves is left out, and said once on the row (the sub-agents' calls turn thinking off)
    note, *others = record["gateway_notes"]
    assert note.startswith("request fields left out") and 'thinking {"type": "adaptive"}' in note, note
    assert all(n.startswith("request fields left out") for n in others), others
    (_, write, *_), done = [t for t in record["turns"] if t["role"] == "assistant"], record["turns"][-1]
    assert '"name": "Write"' in write["text"] and str(workdir / "hello.txt") in write["text"]
    assert done["role"] == "assistant" and done["text"].startswith("Done."), record["turns"]
    print(f"Claude Code's first request: {record['prompt_tokens']} Qwen2.5 tokens")
