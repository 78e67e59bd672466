"""Pause, weight update and resume with a harness's model call in flight through the gateway: the call waits,
completes, and its tokens carry the weight version that made each of them, as a spec's own turns do
(tests/test_pause.py). The embedded tiny model (backends/hf.py) runs the turns; the harness speaks Chat
Completions over the gateway's real HTTP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from fsm.api import RolloutEngine
from fsm.gateway import HarnessCall, harness
from tests.conftest import ASSETS
from tests.gateway.conftest import row
from tests.gateway.test_hostile import USER, chat, post, spec

pytestmark = pytest.mark.skipif(
    not (ASSETS / "model.safetensors").exists(), reason="the tiny model is missing"
)


async def three_calls(call: HarnessCall) -> list[int]:
    """Three model calls, each answered with the tool's result (or a user nudge when no call was made)."""
    messages: list[dict] = [USER]
    statuses = []
    for _ in range(3):
        status, body = await post(call, "chat/completions", chat(*messages))
        statuses.append(status)
        if status != 200:
            break
        message = body["choices"][0]["message"]
        messages.append(message)
        if message.get("tool_calls"):
            messages += [
                {"role": "tool", "tool_call_id": c["id"], "content": "3"} for c in message["tool_calls"]
            ]
        else:
            messages.append({"role": "user", "content": "Are you sure?"})
    return statuses


pause_harness = harness(three_calls, timeout_s=120)


async def mid_turn(backend: Any, timeout_s: float = 60) -> None:
    """Until the model is in the middle of a turn (some tokens made, not all)."""
    deadline = time.monotonic() + timeout_s
    while not any(job.tokens for job in list(backend._admitted)):
        assert time.monotonic() < deadline, "no model turn was seen in flight"
        await asyncio.sleep(0.0005)


@pytest.mark.parametrize("mode", ["abort", "in_place"])
def test_a_harness_call_in_flight_across_a_weight_update(tmp_path, tokenizer, mode):
    from backends.hf import HFBackend

    path = spec(
        tmp_path,
        "tests.gateway.test_pause:pause_harness",
        "limits: {max_assistant_turns: 3, max_new_tokens: 96, response_length: 1024}",
    )
    backend = HFBackend(ASSETS, torch_threads=1, device="cpu")

    async def main() -> tuple[list, int]:
        async with RolloutEngine(str(path), tokenizer, backend=backend) as engine:
            sampling = engine.sampling({"temperature": 0.0, "logprobs": True})
            run = asyncio.ensure_future(engine.arun([row()], sampling=sampling))
            await mid_turn(backend)
            await engine.apause(mode)
            assert await engine.aupdate_weights_from_disk(ASSETS) == 1
            await engine.aresume()
            trajs = await asyncio.wait_for(run, 120)
            return trajs, engine.weight_version

    try:
        trajs, version = asyncio.run(main())
    finally:
        asyncio.run(backend.close())
    traj = trajs[0]
    assert version == 1
    assert traj.extra["harness"] == {"outcome": "returned", "result": [200, 200, 200]}, traj.extra["harness"]
    assert traj.assistant_turns == 3 and not traj.failed
    versions, mask = traj.response_versions.tolist(), traj.response_mask.tolist()
    turns = [versions[r.start : r.end] for r in traj.runs if r.role == "assistant"]
    assert any(set(t) == {0, 1} for t in turns), (
        turns
    )  # the call in flight: tokens before and after the update
    assert all(v >= 0 for t in turns for v in t) and [v for v in versions if v >= 0] == sorted(
        v for v in versions if v >= 0
    )
    assert all((v == -1) == (m == 0) for v, m in zip(versions, mask))
