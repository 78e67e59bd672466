"""Side-effecting tools under retries, kills and resumes (docs/running.md "Tool side effects"): real
`agentfsm run` processes against a scripted server in this process, tools that count their runs in a file
(tests/fixtures/effects.py), real SIGKILLs.

- A failed call is journaled as an attempt, never as the call's result: a state's `retry` runs the tool again,
  and only a successful result is answered from the journal on resume.
- Execution is at least once (a kill between the effect and the journal write runs the call again); the tool
  gets its idempotency key (`fsm.idempotency_key()`, `agent_data.idempotency_key`), the same on every run of
  the call, so a tool that dedups by it has each effect exactly once."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from backends.scripted import ScriptedBackend
from fsm.run.journal import JOURNAL, rebuild, records
from tests.conftest import ASSETS, REPO, model_turn, tool_turn
from tests.test_cli import _ThreadServer
from tests.test_run_interrupts import ENV

EFFECTS = "tests.fixtures.effects"
ROWS = 4


def _spec(tmp_path: Path, tool: str, states: str = "") -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"name: effects\nextends: {REPO / 'specs' / 'calculator.yaml'}\n"
        f"tools:\n  - function: {EFFECTS}:{tool}\n    schema: specs.calculator:TOOL_SCHEMA\n{states}"
    )
    return spec


def _data(tmp_path: Path) -> Path:
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "raw_prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
                    "reward_model": {"ground_truth": str(2 * i)},
                }
            )
            + "\n"
            for i in range(ROWS)
        )
    )
    return data


@pytest.fixture
def server(tok):
    """Each row asks the calculator for its question once, then answers: the turn depends on the prompt only,
    so a resumed row asks the same."""

    def turn(session_id: str, n: int, prompt: list[int]) -> list[int]:
        text = tok.decode(prompt)
        if "<tool_response>" in text:
            return model_turn(tok, "Done.")
        question = re.findall(r"What is (\d+ \+ \d+)\?", text)[-1]
        return tool_turn(tok, ("calculator", {"expression": question}))

    served = _ThreadServer(ScriptedBackend(turn, model_name="scripted"))
    yield served.url
    served.close()


def _argv(spec: Path, data: Path, url: str, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fsm.cli.commands",
        "run",
        str(spec),
        "--data",
        str(data),
        "--server",
        url,
        "--tokenizer",
        str(ASSETS),
        "--out",
        str(out),
        "-q",
        *extra,
    ]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trajectories.jsonl").open()]


def _tool_answers(row: dict) -> list[str]:
    """The tool results the model read, from their rendered turns."""
    return [
        m
        for t in row["turns"]
        if t["role"] == "tool"
        for m in re.findall(r"<tool_response>\n(.*?)\n", t["text"])
    ]


RETRY_ONCE = """\
states:
  PROCESSING_TOOLS:
    retry:
      - errors: [tool.exception]
        max_attempts: 2
        backoff_s: 0
"""


def test_a_state_retry_runs_a_failed_side_effecting_call_again_in_a_journaled_run(
    tmp_path, server, monkeypatch
):
    """The tool fails on its first run for each question (after its effect). The state's retry runs it again
    and every row succeeds, as without a journal; the failure is journaled as an attempt, the success as the
    call's result (what a resume answers from)."""
    effects = tmp_path / "effects.txt"
    env = {**ENV, "AGENTFSM_EFFECTS": str(effects)}
    out = tmp_path / "out"
    spec, data = _spec(tmp_path, "first_fails", RETRY_ONCE), _data(tmp_path)
    done = subprocess.run(
        _argv(spec, data, server, out), env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    runs = effects.read_text().splitlines()
    assert sorted(runs) == sorted(f"{i} + {i}" for i in range(ROWS) for _ in range(2))  # 2 runs each
    rows = _rows(out)
    assert [r["termination_reason"] for r in rows] == ["done"] * ROWS
    assert [_tool_answers(r) for r in rows] == [[f"ok {i} + {i}"] for i in range(ROWS)]
    recs = [r for r in records(out / JOURNAL).records if r["t"] == "tool"]
    assert sorted("o" in r for r in recs) == [False] * ROWS + [True] * ROWS  # attempt, then result
    for r in recs:
        if "o" not in r:
            assert r["attempt"]["error"] == "exception" and "sandbox down" in r["attempt"]["text"]
    rebuilt = rebuild(records(out / JOURNAL))
    assert sorted(o["text"] for o in rebuilt.tool_results.values()) == [f"ok {i} + {i}" for i in range(ROWS)]
