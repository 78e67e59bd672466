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
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fsm
from backends.scripted import ScriptedBackend
from fsm.run.fold import rebuild
from fsm.run.journal import JOURNAL, records
from tests.conftest import ASSETS, REPO, model_turn, run_agent, scripted, tool_turn, user_row
from tests.fixtures import effects
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


KILLS = 3


def _lines(path: Path, kind: str) -> list[list[str]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [line.split(" ", 2)[1:] for line in text.splitlines() if line.startswith(kind + " ")]


def test_a_tool_that_dedups_by_its_key_has_each_effect_once_over_repeated_kill_9s(tmp_path, server, tok):
    """A real `agentfsm run` is SIGKILLed three times, each time between a call's effect and the journal's
    record of its result (the tool sleeps 1 s after its effect), and resumed until it completes. Each killed
    call runs again (at least once: 2 runs of its key), and the tool, which dedups by the key it is given, has
    made each effect exactly once. The last run, never killed, needs no such window: it runs without the sleep."""
    effects = tmp_path / "effects.txt"
    env = {**ENV, "AGENTFSM_EFFECTS": str(effects), "AGENTFSM_EFFECT_DELAY_S": "1"}
    out = tmp_path / "out"
    spec, data = _spec(tmp_path, "deduped"), _data(tmp_path)
    argv = _argv(spec, data, server, out, "--concurrency", "1")
    resume = [*argv[:4], "--resume", str(out), *argv[7:]]  # no spec, no --data: the journal names them
    kills = 0
    while True:
        last = {"AGENTFSM_EFFECT_DELAY_S": "0"} if kills == KILLS else {}
        proc = subprocess.Popen(argv, env={**env, **last}, cwd=REPO, stderr=subprocess.PIPE, text=True)
        made = len(_lines(effects, "effect"))
        deadline = time.monotonic() + 300
        killed = False
        while kills < KILLS and proc.poll() is None and time.monotonic() < deadline:
            if len(_lines(effects, "effect")) > made:  # an effect made; its result is not journaled for 1 s
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
            time.sleep(0.01)
        err = proc.communicate(timeout=300)[1]
        if not killed:
            assert proc.returncode == 0, err
            break
        assert proc.returncode == -signal.SIGKILL, err
        kills, argv = kills + 1, resume
    assert kills == KILLS
    runs = [key for (key,) in _lines(effects, "run")]
    made = _lines(effects, "effect")
    keys = [key for key, _ in made]
    assert len(keys) == len(set(keys)) == ROWS  # each effect exactly once
    assert sorted(json.loads(e) for _, e in made) == [f"{i} + {i}" for i in range(ROWS)]
    assert all(re.fullmatch(r"[0-9a-f]{8}-\d+-0_c0_0", key) for key in keys), keys  # {session}_c{turn}_{call}
    assert sorted(runs.count(key) for key in keys) == [1] * (ROWS - KILLS) + [2] * KILLS  # at least once
    rows = _rows(out)
    assert [r["termination_reason"] for r in rows] == ["done"] * ROWS
    assert [_tool_answers(r) for r in rows] == [[f"ok {i} + {i}"] for i in range(ROWS)]
    assert sorted(rebuild(records(out / JOURNAL)).tool_results) == sorted(keys)


async def test_a_class_tool_reads_the_calls_key_whatever_instance_create_named(tok, compile_yaml):
    """`execute` gets the instance `create` returned; the key it reads (agent_data.idempotency_key, and
    fsm.idempotency_key() on the tool's own loop) is still the call's, and nothing outside a call has one."""
    effects.Keyed.SEEN.clear()
    agent = compile_yaml(f"""
        name: keyed
        extends: {{specs}}/tool_agent.yaml
        tools:
          - class: {EFFECTS}:Keyed
            schema: specs.calculator:TOOL_SCHEMA
        """)
    script = [tool_turn(tok, ("calculator", {"expression": "1 + 1"})), model_turn(tok, "Done.")]
    [traj] = await run_agent(agent, scripted(script), tok, [user_row()])
    key = f"{traj.session_id}_c0_0"
    assert effects.Keyed.SEEN == [(f"sandbox-{key}", key, key)]
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == [f"key {key}"]
    assert fsm.idempotency_key() is None


async def test_a_process_isolated_tool_reads_the_calls_key_in_its_worker(tok, compile_yaml):
    """Under `isolation: process` the worker gets each call's key with its arguments; two rows, one worker: each
    call reads its own, none the other's."""
    agent = compile_yaml(f"""
        name: keyed
        extends: {{specs}}/tool_agent.yaml
        tools:
          - function: {EFFECTS}:key_echo
            schema: specs.calculator:TOOL_SCHEMA
            isolation: process
            workers: 1
        """)
    script = [tool_turn(tok, ("calculator", {"expression": "1 + 1"})), model_turn(tok, "Done.")]
    try:
        trajs = await run_agent(agent, scripted(script), tok, [user_row(), user_row()])
    finally:
        agent.tools.close()
    for traj in trajs:
        answers = [m["content"] for m in traj.messages if m["role"] == "tool"]
        assert answers == [f"key {traj.session_id}_c0_0"]
