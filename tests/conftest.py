"""Shared fixtures for the engine tests: the real tokenizer, scripted model turns, spec files, runs.

A "turn" is what the scripted model emits on one call: token ids ending in eos (`<|im_end|>`), exactly
what SGLang returns for a turn that stopped. Helpers build them from text so tests read as conversations.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

import fsm
from backends.scripted import ScriptedBackend

REPO = Path(__file__).resolve().parents[1]
SPECS = REPO / "specs"
ASSETS = REPO / "backends" / "tiny" / "assets"


def launched(*args: str) -> subprocess.Popen[str]:
    """`agentfsm *args` started, not awaited: a second process that runs beside a test's other work."""
    return subprocess.Popen(
        [sys.executable, "-m", "fsm.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


PARTS = "tests.fixtures.parts"


@pytest.fixture(scope="session")
def tok():
    return AutoTokenizer.from_pretrained(ASSETS)


def encode_text(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def model_turn(tok, text: str, *, eos: bool = True) -> list[int]:
    """The ids a model emits for `text`: its tokens, then eos (unless the turn is cut)."""
    return encode_text(tok, text) + ([tok.eos_token_id] if eos else [])


def hermes_text(calls: Sequence[tuple[str, dict] | str], prefix: str = "") -> str:
    """Assistant text with hermes tool calls; a call given as a str is inserted raw (for malformed calls)."""
    parts = [prefix] if prefix else []
    for call in calls:
        body = call if isinstance(call, str) else json.dumps({"name": call[0], "arguments": call[1]})
        parts.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(parts)


def tool_turn(tok, *calls: tuple[str, dict] | str, prefix: str = "") -> list[int]:
    """A model turn that calls tools: `tool_turn(tok, ("echo", {"text": "hi"}))`."""
    return model_turn(tok, hermes_text(calls, prefix))


@pytest.fixture
def turn(tok) -> Callable[..., list[int]]:
    return lambda text, eos=True: model_turn(tok, text, eos=eos)


@pytest.fixture
def call(tok) -> Callable[..., list[int]]:
    return lambda *calls, prefix="": tool_turn(tok, *calls, prefix=prefix)


def session_parts(session_id: str) -> tuple[int, int]:
    """Runner session ids are "{run}-{row}-{sample}": (row index, sample index)."""
    _, row, sample = session_id.rsplit("-", 2)
    return int(row), int(sample)


def scripted(script: Any, **kwargs: Any) -> ScriptedBackend:
    """A ScriptedBackend from any of:
    - a list of turns: every session replays it;
    - a dict {row index: list of turns};
    - a callable (row, sample, turn, prompt_ids) -> ids.
    Running past the end of a script raises BackendUnavailable (the backend's own behaviour)."""
    from backends.base import BackendUnavailable

    def turn_fn(session_id: str, turn: int, prompt_ids: list[int]) -> list[int]:
        row, sample = session_parts(session_id)
        if callable(script):
            return script(row, sample, turn, prompt_ids)
        turns = script[row] if isinstance(script, dict) else script
        if turn >= len(turns):
            raise BackendUnavailable(f"script has no turn {turn} for row {row}")
        return turns[turn]

    return ScriptedBackend(turn_fn, **kwargs)


def user_row(text: str = "What is 1 + 2?", **fields: Any) -> dict[str, Any]:
    """A dataset row in verl's format."""
    return {"raw_prompt": [{"role": "user", "content": text}], **fields}


@pytest.fixture
def write_spec(tmp_path) -> Callable[..., Path]:
    """Write a YAML spec (dedented) into tmp_path and return its path."""

    def write(text: str, name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
        return path

    return write


@pytest.fixture
def compile_yaml(write_spec) -> Callable[..., fsm.CompiledAgent]:
    """Compile a YAML text; `{specs}` and `{parts}` are replaced by the shipped specs dir and the parts module."""

    def compile_(text: str, name: str = "spec.yaml") -> fsm.CompiledAgent:
        text = textwrap.dedent(text).replace("{specs}", str(SPECS)).replace("{parts}", PARTS)
        return fsm.compile_spec(write_spec(text, name))

    return compile_


async def run_agent(agent, backend, tok, rows, *, n: int = 1, check_tokens: bool = True, **kwargs):
    runner = fsm.Runner(agent, backend, tok, check_tokens=check_tokens)
    return await runner.run(rows, n=n, **kwargs)


def response_text(tok, traj, *, skip_special_tokens: bool = False) -> str:
    return tok.decode(traj.response_ids.tolist(), skip_special_tokens=skip_special_tokens)


def observation_texts(tok, traj, role: str = "tool") -> list[str]:
    """Decoded text of each observation segment of `role` (what the model was shown)."""
    ids = traj.response_ids.tolist()
    return [tok.decode(ids[s.start : s.end]) for s in traj.runs if s.role == role]


def tool_messages(traj) -> list[str]:
    return [m["content"] for m in traj.messages if m["role"] == "tool"]


def tool_spec(tools: str, limits: str = "", extra: str = "") -> str:
    """A spec extending the shipped tool_agent with the given tools/limits YAML blocks."""
    return f"""
        name: test_tools
        extends: {{specs}}/tool_agent.yaml
        limits:
          prompt_length: 1024
          response_length: 512
        {limits}
        tools:
        {tools}
        {extra}
    """


async def until(condition: Callable[[], Any], what: str, timeout_s: float = 60.0) -> None:
    """Wait for `condition()` (sync or async) to hold: tests wait for a state, never for a fixed time, so they
    hold on a loaded machine; the timeout only turns a regression into a failure instead of a hang."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        await asyncio.sleep(0.005)


def assert_same_batch_files(ref: Path, out: Path) -> None:
    """Two run directories hold the same batch.pt: same rows in the same order, every tensor equal."""
    import torch

    a = torch.load(ref / "batch.pt", weights_only=False)
    b = torch.load(out / "batch.pt", weights_only=False)
    assert list(a["non_tensor_batch"]["uid"]) == list(b["non_tensor_batch"]["uid"])
    for key, value in a["batch"].items():
        assert torch.equal(value, b["batch"][key]), key


@pytest.fixture
def real_tokenizer() -> Callable[..., Any]:
    """`real_tokenizer(package, template=None)`: a real full-size tokenizer from .tokenizers/ (fetched by
    .ci/tokenizers.sh); skips the test when absent, fails it under CI (tests/fixtures/real_tokenizers.py)."""
    from tests.fixtures.real_tokenizers import real_tokenizer as load

    return load


def extra(module: str, name: str) -> Any:
    """`module`, imported, from the optional extra `name`; without it the test is skipped with the line that
    installs it (so the README's `pip install -e ".[test]"` gives a green suite), except under CI=true, where
    .ci/run installs every extra and a missing one must fail."""
    if os.environ.get("CI", "").lower() == "true":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"needs the {name} extra: pip install -e '.[{name}]'")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests against a real SGLang or vLLM server (their start is minutes) are slow too: `-m "not slow"` is the
    contributors' quick run, the whole suite is CI's."""
    for item in items:
        if item.get_closest_marker("sglang") or item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.slow)
