"""Real harnesses from PyPI through the gateway, on a scripted model: token-exact rows."""

from __future__ import annotations

import pytest

from fsm.api import RolloutEngine
from tests.conftest import extra
from tests.gateway.conftest import ANSWER, assert_token_exact, row, scripted

SPECS = ["base", "chat_stream", "anthropic", "agents_sdk", "langgraph"]
NEEDS = {
    "base": "openai",
    "chat_stream": "openai",
    "anthropic": "anthropic",
    "agents_sdk": "agents",
    "langgraph": "langgraph",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", SPECS)
def test_harness_rows_are_token_exact(name, tokenizer):
    extra(NEEDS[name], "gateway")  # the harness itself, from PyPI
    backend = scripted(tokenizer)
    with RolloutEngine(f"examples/gateway/{name}.yaml", tokenizer, backend=backend) as engine:
        trajs = engine._run_sync(engine.arun([row(), row("What is 2 + 1?")], n=2))
    for traj in trajs:
        assert traj.error is None, traj.error
        assert traj.extra["harness"]["outcome"] == "returned", traj.extra["harness"]
        assert ANSWER.split("\n")[0] in traj.extra["harness"]["result"]
        assert traj.assistant_turns == 2 and traj.user_turns == 1
        assert traj.path == ["HARNESS", "GENERATING", "HARNESS", "GENERATING", "HARNESS", "TERMINATED"]
        tool = [m for m in traj.messages if m["role"] == "tool"]
        assert [m["content"] for m in tool] == ["3"]  # the harness ran the calculator itself
        assert_token_exact(traj, backend)
        assert traj.reward_score == 1.0
