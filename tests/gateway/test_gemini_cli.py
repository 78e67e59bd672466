"""The real Gemini CLI (npm's @google/gemini-cli 0.61.0, `gemini -p`, installed by .ci/gemini_cli.sh) with its
defaults, through `agentfsm gateway`'s Gemini API (`streamGenerateContent`), on the scripted tool-calling dev server
over the real Qwen2.5 tokenizer: one task, write a file with its `write_file` tool and finish.

Gemini CLI first asks its model router (a system prompt of its own, `responseJsonSchema`) to score the request; the
scripted model answers in its JSON (backends/scripted.py ROUTER_ANSWERS), so it asks once and does not retry. Those
calls are rows of their own, tagged `router` (GatewayLimits.auxiliary_prompts), so the agent's conversation is one
row. Each row passes the token check. Gemini CLI has no sub-agent tool at its defaults here. Skipped when the CLI or
the tokenizer is missing (naming the script that installs it), failed under CI=true."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from backends.scripted import ToolScript
from examples.gateway import gemini_cli
from tests.fixtures.real_tokenizers import DIR as TOKENIZERS
from tests.gateway.test_claude_code import gateway
from tests.gateway.test_real_size import dev_server, stop

ROOT = Path(__file__).resolve().parents[2]
# the output format of Gemini CLI 0.61.0's routers' system prompts (its classifier's, then its numerical one's)
ROUTERS = {
    "model_choice": """You are a specialized Task Routing AI. Respond *only* in JSON format according to the following
schema. {"type": "object", "properties": {"reasoning": {"type": "string"}, "model_choice": {"type": "string",
"enum": ["flash", "pro"]}}, "required": ["reasoning", "model_choice"]}""",
    "complexity_score": """You are a specialized Task Routing AI. Respond *only* in JSON format according to the
following schema. {"type": "OBJECT", "properties": {"complexity_reasoning": {"type": "STRING"}, "complexity_score":
{"type": "INTEGER"}}, "required": ["complexity_reasoning", "complexity_score"]}""",
}


@pytest.fixture
def gemini() -> str:
    found = gemini_cli.gemini_binary()
    if found is None or (os.path.sep in found and not Path(found).exists()):
        if os.environ.get("CI") == "true":
            pytest.fail(
                "Gemini CLI is missing under CI=true: .ci/run installs it with `bash .ci/gemini_cli.sh`"
            )
        pytest.skip("Gemini CLI is not installed: `bash .ci/gemini_cli.sh` installs it into .gemini-cli/")
    return found


@pytest.mark.parametrize("field", sorted(ROUTERS))
def test_the_scripted_model_answers_a_router_in_the_json_it_asks_for(tokenizer: Any, field: str) -> None:
    """Gemini CLI retries a router answer that is not its JSON five times with backoff (5-30 s apart) before it
    falls back to its pro model: the scripted model answers the JSON that picks that model at once, whatever
    its step (here the first: a write)."""
    script = ToolScript(tokenizer)
    messages = [
        {"role": "system", "content": ROUTERS[field]},
        {"role": "user", "content": "Write hello.txt."},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = tokenizer.decode(
        script(prompt=tokenizer.encode(prompt), session_id="s", turn=0), skip_special_tokens=True
    )
    answer = json.loads(text)
    assert answer[field] in ("pro", 100) and set(answer) == set(
        json.loads(ROUTERS[field].split("schema. ")[1])["required"]
    )


@pytest.mark.slow
def test_gemini_cli_with_its_defaults_writes_a_file_through_the_gateway(
    tmp_path: Path, gemini: str, real_tokenizer: Any
) -> None:
    """19 s measured on the shared 2-core machine at load 4 (130 s there before the scripted model answered the
    router in its JSON: five router calls with 5-30 s of backoff between them): Gemini CLI's start, one router
    call and two 10k-token calls. One run for the harness, its rows and its file."""
    real_tokenizer("qwen2_5")  # skips (or fails under CI) with the line that fetches it
    tokenizer = str(TOKENIZERS / "qwen2_5")
    workdir = tmp_path / "work"
    workdir.mkdir()
    server, url = dev_server("--scripted-tools", "--tokenizer", tokenizer, "--context-length", "65536")
    try:
        out = tmp_path / "run"
        spec = ROOT / "examples/gateway/gemini_cli.yaml"
        record = gateway(spec, url, tokenizer, out, workdir, gemini, "AGENTFSM_GEMINI_CLI")
    finally:
        stop(server)
    assert (workdir / "hello.txt").read_text() == "hi\n"  # written by Gemini CLI's own write_file tool
    assert record["termination_reason"] == "done" and record["reward_score"] == 1.0, record
    assert record["harness"]["outcome"] == "exit" and record["harness"]["exit_code"] == 0, record["harness"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["token_check_failures"] == 0 and summary["rows"] == 1  # --check-tokens on every row
    *side, root = record["segments"]  # the row the session ended on last: the agent's own
    assert side and all((s["node_kind"], s["policy"]) == ("router", "router") for s in side), side
    assert root["node"] == "0" and root["node_kind"] == "root" and root["prompt_tokens"] > 5_000, root
    said = [t["text"] for t in root["turns"] if t["role"] == "assistant"]
    assert len(said) == 2 and '"name": "write_file"' in said[0] and said[1].startswith("Done."), said
    notes = " ".join(record["gateway_notes"])  # its thinking config is left out and said on the row
    assert "generationConfig.thinkingConfig" in notes, notes
    print(f"Gemini CLI's first request: {root['prompt_tokens']} Qwen2.5 tokens, {len(side)} router rows")
