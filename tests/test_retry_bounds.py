"""Retries say what they do and stay bounded (fsm/spec/failures.py, fsm/tools/base.py `tool_retry`,
backends/base.py `RetryPolicy.delay`): a tool's own retry and its state's multiply, as documented, and
`validate` refuses more than MAX_CALL_RUNS runs of one call (tests/broken_specs/retry_runs_multiply.yaml); no
wait is longer than `backoff_max_s`, jitter included; a tool's retry is bounded as a state's is
(tests/broken_specs/tool_retry_unbounded.yaml), and its backoff never overflows into the model's observation."""

from __future__ import annotations

import pytest

from backends.base import RetryPolicy
from fsm.families.parsers import ToolCall
from fsm.run.failures import _policy
from fsm.spec.failures import MAX_CALL_RUNS, MAX_WAIT_S, StateRetry
from fsm.tools.base import BoundTool, FunctionTool, tool_retry
from tests.conftest import model_turn, run_agent, scripted, tool_turn, user_row
from tests.fixtures import flaky


@pytest.fixture(autouse=True)
def fresh_tools():
    flaky.reset(fail_first=100)
    yield
    flaky.RELEASE.set()


async def test_a_tools_own_retry_and_its_states_retry_multiply(tok, compile_yaml):
    """2 attempts of the tool in each of the state's 2 rounds: 4 runs of the one call (the schema descriptions
    and docs/errors.md say so), within the bound validate enforces."""
    agent = compile_yaml("""
        name: multiply
        extends: {specs}/tool_agent.yaml
        tools:
          - function: tests.fixtures.flaky:flaky
            retry: {max_attempts: 2}
        states:
          PROCESSING_TOOLS:
            retry:
              - errors: [tool.exception]
                max_attempts: 2
                backoff_s: 0
        """)
    script = [tool_turn(tok, ("flaky", {"text": "hi"})), model_turn(tok, "done")]
    [traj] = await run_agent(agent, scripted(script), tok, [user_row()])
    assert flaky.CALLS == {"flaky": 4} and 4 <= MAX_CALL_RUNS
    assert traj.termination_reason == (
        "error: tool.exception in PROCESSING_TOOLS: Error executing tool 'flaky': sandbox down (call 4)"
    )


def test_no_state_wait_is_longer_than_backoff_max_s_jitter_included():
    """The defaults (1 s, x2, 30 s cap, 20 % jitter) once waited up to 36 s at the cap; the cap comes last."""
    policy = _policy(StateRetry(errors=["all"]))
    waits = [policy.delay(k) for k in (5, 6, 9) for _ in range(2000)]
    assert max(waits) <= 30.0 and min(waits) >= 0.8 * 16  # still jittered below the cap (attempt 5: 16 s)
    assert max(policy.delay(6) for _ in range(2000)) > 29  # and it reaches the cap


def test_no_wait_overflows_however_many_attempts():
    """2.0 ** 1024 overflows a float: the wait is the cap, never an OverflowError."""
    assert RetryPolicy(attempts=5000, backoff_s=1.0, backoff_max_s=30.0).delay(5000) <= 30.0
    assert tool_retry(10, MAX_WAIT_S).delay(9) == MAX_WAIT_S  # 3600 * 2**8 would be 10 days
    assert tool_retry(5000, 1.0).delay(1025) == MAX_WAIT_S
    assert tool_retry(5000, 0.0).delay(1025) == 0.0  # no backoff is no wait, at any attempt
    assert 0 < tool_retry(5000, 5e-324).delay(1030) < 1e-13  # a power past a float, times a tiny backoff


async def test_a_tools_retry_past_a_thousand_attempts_tells_the_model_the_tools_error():
    """A tool built by hand (the spec refuses more than 10 attempts) retried 1,030 times with no backoff:
    attempt 1,025 once overflowed the backoff (2.0 ** 1024, even times 0) and the model read `(34, 'Numerical
    result out of range')`; it reads the tool's own last error."""
    calls = []

    async def down(text: str) -> str:
        calls.append(text)
        raise ConnectionError(f"down (call {len(calls)})")

    schema = {"type": "function", "function": {"name": "down", "parameters": {"type": "object"}}}
    tool = BoundTool("down", FunctionTool(down, schema), schema, None, tool_retry(1030, 0.0))
    try:
        outcome = await tool.run(ToolCall("down", {"text": "x"}, ""), "key", {}, None)
    finally:
        tool.lane.close()  # type: ignore[union-attr]
    assert len(calls) == outcome.attempts == 1030
    assert outcome.error == "exception" and outcome.text == "Error executing tool 'down': down (call 1030)"
