"""The real Codex CLI (npm's @openai/codex, `codex exec`, installed by .ci/codex.sh) as a command harness on the
embedded tiny model: its Responses API requests (SSE), its tools (functions rendered, those of its `namespace`
tool as `{namespace}__{name}`, `web_search` left out and noted on the row), one exchange, and a row that ends
with a recorded reason; then at its defaults on the scripted model, with sub-agents.

Codex's own prompt (about 16,000 tiny-tokenizer tokens) is cut to fit the tiny model's 4,096 positions with
Codex's own options: short instructions, no goal, image, skill instructions or sub-agents."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from examples.gateway import codex
from fsm.gateway import harness
from tests.fixtures.real_tokenizers import DIR as TOKENIZERS
from tests.gateway.test_claude_code import gateway
from tests.gateway.test_real_size import dev_server, stop

ROOT = Path(__file__).resolve().parents[2]
FIT = [
    "-c",
    f"model_instructions_file={json.dumps(str(Path(__file__).with_name('codex_instructions.md')))}",
    "--disable",
    "goals",
    "--disable",
    "view_image",
    "--disable",
    "multi_agent",  # its sub-agent tools (about 6,000 tiny-tokenizer tokens): the scripted test below serves them
    "-c",
    "skills.include_instructions=false",
]
small_codex = harness(command=[sys.executable, codex.__file__, *FIT], timeout_s=300)
# Codex at its defaults, allowed to write in its working folder (`codex exec` is read-only otherwise)
writing_codex = harness(
    command=[sys.executable, codex.__file__, "--sandbox", "workspace-write"], timeout_s=300
)


@pytest.fixture
def codex_cli() -> str:
    found = codex.codex_binary()
    if found is None or (os.path.sep in found and not Path(found).exists()):
        if os.environ.get("CI") == "true":
            pytest.fail(
                "the Codex CLI is missing under CI=true: .ci/run installs it with `bash .ci/codex.sh`"
            )
        pytest.skip("the Codex CLI is not installed: `bash .ci/codex.sh` installs it into .codex-cli/")
    return found


@pytest.mark.slow
def test_the_codex_cli_runs_one_exchange_and_its_row_says_how_it_ended(
    tmp_path: Path, codex_cli: str
) -> None:
    spec = tmp_path / "codex.yaml"
    spec.write_text(
        (ROOT / "examples/gateway/codex.yaml")
        .read_text()
        .replace("extends: base.yaml", f"extends: {ROOT / 'examples/gateway/base.yaml'}")
        .replace("examples.gateway.codex:codex_harness", "tests.gateway.test_codex:small_codex")
    )
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsm.cli",
            "gateway",
            str(spec),
            "--num-prompts",
            "1",
            "-q",
            "--max-error-rate",  # the tiny model's one turn is cut by max_new_tokens: a failed row is a warning
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "AGENTFSM_CODEX": codex_cli},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "trajectories.jsonl").read_text().splitlines()[0])
    assert record["termination_reason"] in ("done", "harness_failed"), record
    if record["termination_reason"] == "harness_failed":  # why is recorded, and said in one line
        assert record["harness"]["outcome"] in ("exit", "error", "timeout"), record["harness"]
        assert "agentfsm: warning: all 1 rows failed, all for one cause: harness_failed" in proc.stderr, (
            proc.stderr
        )
    assert record["num_turns"] >= 1 and record["prompt_tokens"] > 1000, (
        record
    )  # Codex's prompt, then the model's turn
    assert [t["role"] for t in record["turns"]][:1] == ["assistant"]
    assert "exec_command" in record["prompt"]  # its function tools
    (note,) = record["gateway_notes"]
    assert "type 'web_search'" in note, note


SUB_AGENTS = [
    {"prompt": "Count the lines of README.", "answer": "README has 12 lines."},
    {"prompt": "Name the license.", "answer": "The license is MIT."},
]


@pytest.mark.slow
def test_codex_at_its_defaults_runs_sub_agents_and_a_command_through_the_gateway(
    tmp_path: Path, codex_cli: str, real_tokenizer: Any
) -> None:
    """Codex's own prompt, whole (6,109-6,295 Qwen2.5 tokens), on the scripted tool-calling dev server: two
    sub-agents started in parallel with its namespaced `spawn_agent`, `wait_agent`, an exec_command that writes a
    file, then the model finishes. Its sub-agents are child nodes (from Codex's `thread-id` headers), each answer
    the text the parent got back, 0 tokens copied, --check-tokens clean. ~30 s at load 10: Codex's start and
    six real-size calls, one run for the harness, its tree and its file."""
    real_tokenizer("qwen2_5")  # skips (or fails under CI) with the line that fetches it
    tokenizer = str(TOKENIZERS / "qwen2_5")
    workdir = tmp_path / "work"
    workdir.mkdir()
    script = tmp_path / "script.json"
    script.write_text(
        json.dumps(
            [
                {"agents": SUB_AGENTS},
                {"wait": "multi_agent_v1__wait_agent"},
                {"call": "exec_command", "arguments": {"cmd": "printf hi > hello.txt"}},
                {"text": "Done."},
            ]
        )
    )
    spec = tmp_path / "codex.yaml"
    spec.write_text(
        (ROOT / "examples/gateway/codex.yaml")
        .read_text()
        .replace("extends: base.yaml", f"extends: {ROOT / 'examples/gateway/base.yaml'}")
        .replace("examples.gateway.codex:codex_harness", "tests.gateway.test_codex:writing_codex")
        .replace("prompt_length: 4000", "prompt_length: 60000")
        .replace("response_length: 96", "response_length: 4096")
        .replace("max_new_tokens: 32", "max_new_tokens: 1024")
        .replace("max_assistant_turns: 2", "max_assistant_turns: 8")
    )
    server, url = dev_server(
        "--scripted-tools", "--tokenizer", tokenizer, "--context-length", "65536", "--script", str(script)
    )
    try:
        out = tmp_path / "run"
        record = gateway(spec, url, tokenizer, out, workdir, codex_cli, "AGENTFSM_CODEX")
    finally:
        stop(server)
    assert (workdir / "hello.txt").read_text() == "hi"  # written by the command Codex ran
    assert record["termination_reason"] == "done", record
    assert record["harness"]["outcome"] == "exit" and record["harness"]["exit_code"] == 0, record["harness"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["token_check_failures"] == 0 and summary["rows"] == 1  # --check-tokens on every node
    *children, root = record["segments"]  # the row the session ended on last
    assert sorted((s["node"], s["parent"], s["node_kind"]) for s in record["segments"]) == [
        ("0", None, "root"),
        ("0.0", "0", "child"),
        ("0.1", "0", "child"),
    ]
    said = [t["text"] for t in root["turns"] if t["role"] == "assistant"]
    assert said[0].count('"name": "multi_agent_v1__spawn_agent"') == 2, said  # its namespace's function
    assert '"name": "multi_agent_v1__wait_agent"' in said[1] and '"name": "exec_command"' in said[2], said
    assert said[-1].startswith("Done."), said
    # the parent's row goes on in place (no branch: nothing copied); each child's answer is what it got back
    assert root["reason"] == "prompt" and root["prompt_tokens"] > 5_000
    seen = "".join(t["text"] for t in root["turns"] if t["role"] != "assistant")
    answers = []
    for child in children:
        (answer,) = [t["text"].removesuffix("<|im_end|>") for t in child["turns"] if t["role"] == "assistant"]
        assert child["reason"] == "child" and json.dumps(answer)[1:-1] in seen, (answer, seen)
        answers.append(answer)
    assert sorted(answers) == sorted(a["answer"] for a in SUB_AGENTS)
    notes = record["gateway_notes"]  # the parent's and its children's tools: web_search alone is left out
    assert notes and all("(type 'web_search')" in n and "namespace" not in n for n in notes), notes
