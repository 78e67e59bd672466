"""Real-size harness requests on CPU (issue 48 §6): the scripted tool-calling model (backends/scripted.py:
ToolScript) answers Claude Code's real first request (tests/fixtures/claude_code_request.json, 25 tools, ~19k
Qwen2.5 tokens) with its own `Write` tool in the family's call format, as real text of the real tokenizer, and
`agentfsm dev-server --scripted-tools --context-length N` serves such a request where the default 4,096 refuses it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from backends.scripted import ToolScript, echo_backend
from fsm.families import codec_for, make_parser
from fsm.gateway.anthropic_api import messages_call
from fsm.gateway.record import template_message

ROOT = Path(__file__).resolve().parents[2]
CAPTURED = json.loads((ROOT / "tests/fixtures/claude_code_request.json").read_text())["body"]


def claude_code_prompt(tokenizer: Any) -> tuple[Any, list[int], list[dict[str, Any]], list[dict[str, Any]]]:
    """The captured first request as the gateway renders it: the codec, the ids, the messages, the tools."""
    call = messages_call(CAPTURED)
    codec = codec_for(tokenizer)
    messages = [template_message(m) for m in call.messages]
    return codec, list(codec.encode_prompt(messages, call.tools)), messages, call.tools or []


@pytest.mark.parametrize("package", ["tiny", "qwen2_5"])
def test_the_scripted_model_writes_a_file_with_the_harness_tool_then_finishes(
    package: str, tokenizer: Any, real_tokenizer: Any
) -> None:
    tok = tokenizer if package == "tiny" else real_tokenizer(package)
    codec, ids, messages, tools = claude_code_prompt(tok)
    assert len(ids) > 15_000  # real size: far past the tiny model's 4,096 positions
    model = ToolScript(tok)
    first = model("s", 0, ids)
    text = tok.decode(first)
    assert "\ufffd" not in text and first[-1] == tok.eos_token_id  # valid text, one turn
    parser = make_parser(None, codec, tools)
    (call,) = parser.parse(text)  # the family's own parser reads the call the gateway will answer with
    assert call.name == "Write" and call.error is None
    assert call.arguments == {"file_path": "/tmp/cc/hello.txt", "content": "hi\n"}  # the prompt's working dir
    # the harness ran it: the next request holds the turn and its result; the model finishes with text
    turn = codec.assistant_message(codec.turn_text(first), parser.parse(text))
    result = {"role": "tool", "content": "File created successfully", "tool_call_id": "c0"}
    then = codec.encode_prompt([*messages, turn, result], tools)
    second = tok.decode(model("s", 1, list(then)), skip_special_tokens=True)
    assert second == "Done." and not parser.parse(second)


def test_a_title_request_without_tools_is_answered_with_text(tokenizer: Any) -> None:
    """A call that offers no write tool (Claude Code's title request) gets the script's last text, never a call
    to a tool the harness did not offer."""
    codec = codec_for(tokenizer)
    ids = codec.encode_prompt([{"role": "user", "content": "Write hello.txt containing hi"}], None)
    assert tokenizer.decode(ToolScript(tokenizer)("s", 0, list(ids)), skip_special_tokens=True) == "Done."


def test_the_echo_model_is_not_text(tokenizer: Any) -> None:
    """Why ToolScript exists: the echo model's ids decode to invalid UTF-8 with the tiny tokenizer (byte pieces)."""
    import asyncio

    from backends.base import GenerateRequest

    res = asyncio.run(echo_backend().generate(GenerateRequest("s", [1, 2, 3], {})))
    assert "\ufffd" in tokenizer.decode(res.token_ids)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def dev_server(*flags: str, timeout_s: float = 300) -> tuple[subprocess.Popen[bytes], str]:
    """`agentfsm dev-server` in a real process on a free port, once it answers /health."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsm.cli", "dev-server", "--port", str(port), *flags],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s  # imports and the tokenizer, on a loaded machine
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"dev server exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}"
            )  # type: ignore[union-attr]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"dev server {url} did not come up in {timeout_s} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_the_dev_server_serves_a_real_size_request_with_context_length(tokenizer: Any) -> None:
    _, ids, _, _ = claude_code_prompt(tokenizer)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 256, "stop_token_ids": [2]}}
    proc, url = dev_server("--scripted-tools", "--context-length", "65536")
    try:
        status, answer = _post(f"{url}/generate", body)
        assert status == 200, answer
        text = tokenizer.decode(answer["output_ids"])
        assert text.startswith('<tool_call>\n{"name": "Write"') and "\ufffd" not in text
        assert answer["meta_info"]["prompt_tokens"] == len(ids)
    finally:
        stop(proc)
    proc, url = dev_server("--scripted-tools")  # the default context: 4,096 tokens
    try:
        status, answer = _post(f"{url}/generate", body)
        assert status == 400 and "longer than the model's context length" in json.dumps(answer), answer
    finally:
        stop(proc)


def test_a_bad_script_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text('[{"write": "hello.txt"}]')
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsm.cli",
            "dev-server",
            "--scripted-tools",
            "--script",
            str(script),
            "--port",
            str(_free_port()),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        'dev server: --scripted-tools: a tool script is a non-empty list of steps, each {"write": {"path", '
        '"content"}}, {"call": NAME, "arguments": {...}}, {"text": TEXT}, {"agents": [{"prompt", "answer"}, '
        '...]} or {"wait": NAME}'
    ], proc.stderr
