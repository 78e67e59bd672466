"""Hostile rows, strings, limits, rewards and cycles: each ends as an error row naming what was wrong (or is
made harmless where it enters), the batch keeps one row per input, and nothing waits without a bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

import fsm
from backends.scripted import echo_backend
from fsm.api import RolloutEngine
from fsm.tools.isolation import BLOCKING_STEP_S, BLOCKING_STRIKES, ThreadLane
from tests.conftest import (
    ASSETS,
    PARTS,
    REPO,
    SPECS,
    model_turn,
    run_agent,
    scripted,
    tool_spec,
    tool_turn,
    user_row,
)
from tests.fixtures import parts

# --- rows ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"tools_kwargs": "abc"}, "'tools_kwargs' must map tool names to mappings"),
        ({"tools_kwargs": {"calculator": 5}}, "'tools_kwargs' must map tool names to mappings"),
        (
            {"extra_info": {"tool_selection": 5}},
            "'extra_info.tool_selection' must be a list of tool names, got int 5",
        ),
        ({"extra_info": 5}, "'extra_info' must be a mapping, got int 5"),
        ({"interaction_kwargs": [1]}, "'interaction_kwargs' must be a mapping"),
    ],
)
def test_a_row_of_the_wrong_shape_is_its_own_error_row(tok, bad, words):
    truth = {"reward_model": {"ground_truth": "2"}}
    rows = [
        user_row("What is 1 + 1?", **truth),
        user_row("What is 2 + 2?", **bad),
        user_row("What is 1 + 1?", **truth),
    ]
    with RolloutEngine("calculator", tok, backend=echo_backend()) as engine:
        out = engine.generate_sequences(rows)
    reasons = list(out.non_tensor_batch["termination_reason"])
    assert len(reasons) == 3 and not reasons[0].startswith("error") and not reasons[2].startswith("error")
    assert reasons[1].startswith("error: bad row 1: ") and words in reasons[1], reasons[1]


# --- strings UTF-8 cannot encode ---------------------------------------------------------------------------


def test_lone_surrogates_become_replacement_characters_where_they_enter():
    from fsm.data.rows import encodable, encodable_value

    assert encodable("plain") == "plain" and encodable("é\ud800x\udfff") == "é\ufffdx\ufffd"
    row = encodable_value({"a": ["\ud800", ("x", "\udc00")], "\ud801": 1})
    assert row == {"a": ["\ufffd", ("x", "\ufffd")], "\ufffd": 1}
    clean = {"a": ["é", ("x", 1.5)], 2: None, "o": object()}  # orjson's pass, and the walk past its refusal
    assert encodable_value(clean) is clean and encodable_value(clean["a"]) is clean["a"]
    traj = fsm.Trajectory(0, 0, "s", "u", {}, "PENDING")
    traj.fail("server said \ud800")
    assert traj.termination_reason == "error: server said \ufffd"
    traj.termination_reason.encode("utf-8")


async def test_a_tool_answering_a_lone_surrogate_is_read_as_text(tok, compile_yaml):
    agent = compile_yaml(tool_spec(f"  - function: {PARTS}:lone_surrogate"))
    backend = scripted([tool_turn(tok, ("lone_surrogate", {"text": "hi"})), model_turn(tok, "done")])
    (traj,) = await run_agent(agent, backend, tok, [user_row()])
    assert traj.termination_reason == "done", traj.termination_reason
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["hi \ufffd end"]


@pytest.mark.slow
def test_a_ground_truth_with_a_lone_surrogate_is_written(tmp_path):
    """Through the real `agentfsm run` process: trajectories.jsonl is written, valid UTF-8 and JSON."""
    data = tmp_path / "rows.jsonl"
    row = {
        "raw_prompt": [{"role": "user", "content": "What is 2 + 3?"}],
        "reward_model": {"ground_truth": "5\ud800"},
        "extra_info": {"note": "\udfff"},
    }
    data.write_text(
        json.dumps(row) + "\n"
    )  # ensure_ascii: the file holds the \ud800 escape, as a dataset would
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsm.cli.commands",
            "run",
            str(SPECS / "calculator.yaml"),
            "--data",
            str(data),
            "--out",
            str(out),
            "-q",
            "--max-error-rate",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    (record,) = [
        json.loads(line) for line in (out / "trajectories.jsonl").read_bytes().decode("utf-8").splitlines()
    ]
    assert "ground truth '5\ufffd' is not a number" in record["termination_reason"]
    assert "reward function specs.calculator:compute_score on row" in record["termination_reason"]


# --- limits --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value",
    [
        ("prompt_length", "1e12"),
        ("response_length", 1_000_000_000_000),
        ("max_new_tokens", 2**31),
        ("max_parallel_calls", 10**6),
        ("turn_timeout_s", 1e12),
        ("max_transitions", 10**12),
        ("max_transitions", 10**7),
    ],
)  # 10**7: a 180 MB snapshot
def test_absurd_limits_are_refused_at_validation_with_their_line(write_spec, key, value):
    path = write_spec(f"name: x\nextends: {SPECS / 'single_turn.yaml'}\nlimits:\n  {key}: {value}\n")
    (diag,) = fsm.validate_file(path)
    assert diag.line == 4 and key in str(diag) or diag.line == 4, str(diag)
    assert "less than or equal" in diag.message or "valid integer" in diag.message, diag.message


# --- rewards -------------------------------------------------------------------------------------------------

REWARD_SPEC = """
    name: rewarded
    extends: {specs}/single_turn.yaml
    limits: {reward_timeout_s: 0.5}
    reward: {function: '{parts}:%s'}
"""


@pytest.mark.parametrize(
    "fn, words",
    [
        ("hanging_reward", "no result within 0.5 s (limits.reward_timeout_s)"),
        ("failing_reward", "ValueError: could not convert string to float"),
    ],
)
async def test_a_reward_that_hangs_or_fails_names_itself_and_the_row(tok, compile_yaml, fn, words):
    agent = compile_yaml(REWARD_SPEC % fn)
    t0 = time.monotonic()
    trajs = await run_agent(agent, echo_backend(), tok, [user_row(uid="row-7"), user_row(uid="row-8")])
    assert time.monotonic() - t0 < 20
    for traj, uid in zip(trajs, ("row-7", "row-8")):
        assert (
            traj.termination_reason == (f"error: reward: reward function {PARTS}:{fn} on row {uid}: {words}")
            or words in traj.termination_reason
        ), traj.termination_reason
        assert f"reward function {PARTS}:{fn} on row {uid}" in traj.termination_reason


INLINE_REWARD_SPEC = """
    name: rewarded
    extends: {specs}/single_turn.yaml
    reward: {function: '{parts}:%s', isolation: none, kwargs: {seconds: %s}}
"""


async def test_a_reward_declared_isolation_none_runs_on_the_runs_loop(tok, compile_yaml):
    parts.REWARD_THREADS.clear()
    agent = compile_yaml(INLINE_REWARD_SPEC % ("sleepy_reward", 0))
    trajs = await run_agent(agent, echo_backend(), tok, [user_row(), user_row()])
    assert [t.reward_score for t in trajs] == [1.0, 1.0]
    assert parts.REWARD_THREADS == [threading.current_thread().name] * 2  # no hand-off to another thread
    default = compile_yaml(REWARD_SPEC % "thread_reward")  # isolation: thread, the default
    parts.REWARD_THREADS.clear()
    await run_agent(default, echo_backend(), tok, [user_row()])
    assert parts.REWARD_THREADS == [f"agentfsm-tool-reward {PARTS}:thread_reward"]


async def test_an_inline_reward_that_blocks_the_loop_moves_to_threads_of_its_own(tok, compile_yaml, caplog):
    """Calls past BLOCKING_STEP_S (a sync sleep), BLOCKING_STRIKES of them, move the reward to threads of its
    own, with a warning naming it: the run's loop is not blocked by it again."""
    parts.REWARD_THREADS.clear()
    agent = compile_yaml(INLINE_REWARD_SPEC % ("sleepy_reward", BLOCKING_STEP_S * 2))
    rows = [user_row(uid=f"row-{k}") for k in range(BLOCKING_STRIKES + 1)]
    trajs = await run_agent(agent, echo_backend(), tok, rows)
    assert [t.reward_score for t in trajs] == [1.0] * len(rows)
    loop_thread = threading.current_thread().name
    assert parts.REWARD_THREADS == [loop_thread] * BLOCKING_STRIKES + [
        f"agentfsm-tool-reward {PARTS}:sleepy_reward"
    ]
    assert isinstance(agent.reward.lane.moved, ThreadLane)
    words = f"reward '{PARTS}:sleepy_reward' (isolation: none) held the event loop {BLOCKING_STRIKES} times"
    assert words in caplog.text and "run on threads of its own from now on" in caplog.text


@pytest.mark.parametrize("isolation", ["none", "thread"])
async def test_a_reward_that_raises_system_exit_ends_its_row_only(tok, compile_yaml, isolation):
    """What a reward raises that is not an Exception is its own, never a signal to the run, wherever it runs."""
    declared = (REWARD_SPEC % "exiting_reward").replace("_reward'}", f"_reward', isolation: {isolation}}}")
    agent = compile_yaml(declared)
    trajs = await run_agent(agent, echo_backend(), tok, [user_row(uid="row-7")])
    (traj,) = trajs
    assert traj.termination_reason == (
        f"error: reward: reward function {PARTS}:exiting_reward on row row-7: ToolCrashed: tool "
        f"'reward {PARTS}:exiting_reward' raised SystemExit: 3"
    ), traj.termination_reason


async def test_a_row_without_ground_truth_is_an_error_whatever_the_model_wrote(tok):
    answer = model_turn(tok, "#### 5")
    async with RolloutEngine("calculator", tok, backend=scripted([answer])) as engine:
        (traj,) = await engine.arun([user_row("What is 2 + 3?")])
    assert "has no reward_model.ground_truth" in traj.termination_reason
    assert "reward function specs.calculator:compute_score on row" in traj.termination_reason


# --- cycles --------------------------------------------------------------------------------------------------

CYCLE = """
    name: spins
    extends: {specs}/single_turn.yaml
    limits: {max_transitions: 500}
    states:
      GENERATING:
        action: generate
        next:
          - {to: PONDER}
      PONDER:
        action: '{parts}:noop'
        next:
          - {to: MUSE, when: {not: always_false}}
          - {to: MUSE}
      MUSE:
        action: '{parts}:noop'
        next:
          - {to: TERMINATED, when: has_tool_calls}
          - {to: PONDER}
"""


async def test_a_cycle_that_never_ends_is_an_error_row_at_max_transitions(tok, compile_yaml):
    agent = compile_yaml(CYCLE.replace("{not: always_false}", "has_tool_calls"))
    t0 = time.monotonic()
    (traj,) = await run_agent(agent, echo_backend(), tok, [user_row()])
    assert time.monotonic() - t0 < 10
    assert traj.termination_reason.startswith("error: max_transitions: 500 transitions"), (
        traj.termination_reason
    )


def test_validate_warns_about_a_cycle_that_spends_no_budget(write_spec):
    text = (
        CYCLE.replace("{specs}", str(SPECS))
        .replace("{parts}", PARTS)
        .replace("{not: always_false}", "has_tool_calls")
    )
    path = write_spec(__import__("textwrap").dedent(text))
    proc = subprocess.run(
        [sys.executable, "-m", "fsm.cli.commands", "validate", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warning, ok = proc.stdout.splitlines()
    assert ": warning: cycle-without-budget: the cycle through PONDER, MUSE runs no action" in warning
    assert ok == f"{path}: ok (1 warning)"
    assert all(d.severity == "warning" for d in fsm.validate_file(path))
    for shipped in SPECS.glob("*.yaml"):
        assert fsm.validate_file(shipped) == [], shipped


def test_assets_dir_is_the_tokenizer():  # the tests above load it through RolloutEngine's default
    assert (ASSETS / "tokenizer.json").exists()
