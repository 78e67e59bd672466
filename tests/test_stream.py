"""The continuous mode (fsm/run/stream.py): submit rows, take whole GRPO groups in completion order, staleness
bounded with a declared policy, none lost or duplicated; and trajectories that keep running across a weight
update."""

from __future__ import annotations

import asyncio
import time
from array import array

import pytest
import torch

from backends.base import BaseBackend, GenerateRequest, GenerateResult
from backends.devserver import DevServer
from backends.scripted import echo_backend
from fsm import RolloutEngine
from fsm.run.stream import StreamEmpty, version_span
from fsm.run.trajectory import Trajectory
from specs.calculator import make_prompts
from tests.conftest import until


class SlowRows(BaseBackend):
    """The echo model, with each row's latency set by its row number (session ids are run-row-sample)."""

    def __init__(self, delays: dict[int, float], default_s: float = 0.0):
        self.inner = echo_backend()
        self.delays, self.default_s = delays, default_s
        self.model_name, self.context_length = "echo", None

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        row = int(request.session_id.split("-")[-2])
        await asyncio.sleep(self.delays.get(row, self.default_s))
        return await self.inner.generate(request)


def wait_until(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def uids_of(batch) -> list[str]:
    return list(batch.non_tensor_batch["uid"])


def test_take_returns_whole_groups_once_each_matching_generate_sequences(tok):
    rows = make_prompts(6)
    with RolloutEngine("calculator", tok, backend=echo_backend()) as engine:
        reference = engine.generate_sequences(rows, n=2)
        assert engine.submit(rows, n=2) == [r["uid"] for r in rows]
        batches = [engine.take(2, timeout=30) for _ in range(3)]
        with pytest.raises(StreamEmpty, match="submit rows first"):
            engine.take(1)
        stats = engine.stream_stats
    seen = [u for b in batches for u in uids_of(b)]
    assert sorted(seen) == sorted(uids_of(reference))  # none lost, none duplicated
    for b in batches:
        assert len(b) == 4 and b.batch["responses"].shape[1] == engine.agent.limits.response_length
        u = uids_of(b)
        assert u[0] == u[1] and u[2] == u[3]  # groups whole and contiguous
    by_uid = {}
    for b in batches:
        for i, u in enumerate(uids_of(b)):
            by_uid.setdefault(u, []).append(b.batch["responses"][i])
    for i, u in enumerate(uids_of(reference)):
        assert any(torch.equal(reference.batch["responses"][i], r) for r in by_uid[u])
    assert stats["submitted_groups"] == stats["finished_groups"] == stats["taken_groups"] == 6
    assert stats["staleness"] == {0: 6}


def test_groups_come_back_in_completion_order(tok):
    rows = make_prompts(4)
    delays = {0: 0.4, 1: 0.0, 2: 0.2, 3: 0.05}
    with RolloutEngine("calculator", tok, backend=SlowRows(delays)) as engine:
        engine.submit(rows, n=2)
        order = [uids_of(engine.take(1, timeout=30))[0] for _ in range(4)]
    assert order == [rows[i]["uid"] for i in (1, 3, 2, 0)]


def test_take_timeout(tok):
    with RolloutEngine("calculator", tok, backend=SlowRows({}, default_s=5.0)) as engine:
        engine.submit(make_prompts(1), n=1)
        with pytest.raises(TimeoutError):
            engine.take(1, timeout=0.2)


@pytest.mark.parametrize("policy", ["drop", "rerun"])
def test_stale_groups_are_dropped_or_rerun_and_counted(tok, policy):
    rows = make_prompts(3)
    with RolloutEngine("calculator", tok, backend=echo_backend()) as engine:
        engine.submit(rows[:2], n=2)
        first = engine.take(1, timeout=30)  # the other group is finished meanwhile or soon
        assert first.meta_info["staleness"] == [0]
        wait_until(lambda: engine.stream_stats["ready_groups"] == 1)  # the second group, finished
        engine.runner.gate.version = 2  # two updates later (the scripted backend has no weights to load),
        # the waiting group is 2 versions old; rows generated from now on carry version 2
        engine.submit(rows[2:], n=2)
        batch = engine.take(1, max_staleness=1, stale=policy, timeout=30)
        stats = engine.stream_stats
        if policy == "rerun":
            rest = engine.take(1, max_staleness=1, stale=policy, timeout=30)
            assert sorted(uids_of(batch)[::2] + uids_of(rest)[::2]) == [rows[1]["uid"], rows[2]["uid"]]
            assert engine.stream_stats["stale_rerun"] == 1
        else:
            assert uids_of(batch)[::2] == [rows[2]["uid"]]
            assert stats["stale_dropped"] == 1
            with pytest.raises(StreamEmpty):
                engine.take(1)
    assert batch.meta_info["staleness"] == [0]


async def test_async_forms_and_stream_from_another_loop(tok):
    rows = make_prompts(5)
    async with RolloutEngine("calculator", tok, backend=SlowRows({0: 0.2})) as engine:
        uids = await engine.asubmit(rows, n=3)
        got = [g async for g in engine.stream()]
        assert sorted(g.uid for g in got) == sorted(uids)
        assert got[-1].uid == rows[0]["uid"]  # the slow row comes last
        assert all(len(g.trajectories) == 3 for g in got)
        await engine.asubmit(rows[:2], n=1)
        batch = await engine.atake(2, timeout=30)
    assert len(batch) == 2


def test_version_span_fallback_and_versions():
    t = Trajectory(0, 0, "s", "u", {}, "START")
    assert version_span(t, 7) == (7, 7)  # no model tokens: the version current at the finish
    t.response_ids.extend([7, 8, 9])
    t.response_mask.extend(b"\x01\x00\x01")
    t.response_versions = array("i", [3, -1, 5])
    assert version_span(t, 7) == (3, 5)


class TestAcrossWeightUpdates:
    """Trajectories in flight keep running across pause / update / resume."""

    async def test_groups_span_an_update_and_staleness_is_measured(self, tok):
        rows = make_prompts(4)
        async with DevServer(SlowRows({}, default_s=0.05)) as server:  # pause and weight loading over HTTP
            async with RolloutEngine("calculator", tok, servers=[server.url]) as engine:
                await engine.asubmit(rows, n=2)
                await until(lambda: server._live, "turns in flight at the server")
                await engine.apause(mode="retract")
                v = await engine.aupdate_weights_from_disk("/checkpoints/step-1")
                await engine.aresume()
                batch = await engine.atake(4, max_staleness=1, timeout=30)
        assert engine.weight_version == v
        assert sorted(set(uids_of(batch))) == sorted(r["uid"] for r in rows)  # none lost across the update
        assert "weight_versions" in batch.batch.keys()
        assert batch.meta_info["weight_version_max"] == v
        assert all(s <= 1 for s in batch.meta_info["staleness"])
