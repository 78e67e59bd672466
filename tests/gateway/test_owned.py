"""The gateway's state belongs to the engine that runs it (fsm/run/engine.py `owned`): each engine gets its own
loopback gateway, sessions and harness threads, closes them when it closes, and shares none of it with another
engine in the same process."""

from __future__ import annotations

import socket

import pytest

from fsm.api import RolloutEngine
from fsm.run.engine import Owned
from tests.conftest import extra
from tests.gateway.conftest import row, scripted


def _mine(services: Owned, key: str):
    def missing():
        raise AssertionError(f"the engine owns no {key!r}")

    return services.get(key, missing)


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_two_engines_share_no_gateway_state_and_each_closes_its_own(tokenizer):
    extra("openai", "gateway")  # the harness (an OpenAI SDK loop)
    a = RolloutEngine("examples/gateway/base.yaml", tokenizer, backend=scripted(tokenizer))
    b = RolloutEngine("examples/gateway/base.yaml", tokenizer, backend=scripted(tokenizer))
    try:
        done = [a._run_sync(a.arun([row()])), b._run_sync(b.arun([row()]))]
        assert all(t.extra["harness"]["outcome"] == "returned" for trajs in done for t in trajs)
        mine_a, mine_b = a.owned, b.owned  # what owned() is in each engine's runs
        assert mine_a is not mine_b
        gateway_a, gateway_b = _mine(mine_a, "gateway"), _mine(mine_b, "gateway")
        assert gateway_a is not gateway_b and gateway_a.port != gateway_b.port
        runs_a, runs_b = _mine(mine_a, "gateway.harnesses"), _mine(mine_b, "gateway.harnesses")
        assert runs_a is not runs_b
        assert (
            runs_a.live == {} == runs_b.live and not runs_a.tasks and not runs_b.tasks
        )  # every row ended its own
        a.close()
        assert _refused(gateway_a.port) and not _refused(gateway_b.port)
        (again,) = b._run_sync(b.arun([row()]))  # the other engine's gateway still serves
        assert again.extra["harness"]["outcome"] == "returned"
    finally:
        a.close()
        b.close()
    assert _refused(gateway_b.port)
    with pytest.raises(RuntimeError, match="closed"):
        a._run_sync(a.arun([row()]))


def test_a_served_gateway_is_the_engines_and_closes_with_it(tokenizer):
    """`serve(engine)` gives the engine its gateway (no process-wide table of attached gateways): its harnesses
    call that one, a second is refused in one line, and the engine's close closes it."""
    from fsm.gateway.serve import serve

    extra("openai", "gateway")
    engine = RolloutEngine("examples/gateway/base.yaml", tokenizer, backend=scripted(tokenizer))
    try:
        gateway = serve(engine)
        (traj,) = engine._run_sync(engine.arun([row()]))
        assert traj.extra["harness"]["outcome"] == "returned"
        assert _mine(engine.owned, "gateway") is gateway and gateway.port
        with pytest.raises(ValueError, match="has a gateway already"):
            serve(engine)
    finally:
        engine.close()
    assert _refused(gateway.port)
