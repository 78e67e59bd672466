"""agentfsm's router over two real vLLM 0.32 servers (CPU, the padded tiny model): bounded-load placement (new
sessions go elsewhere, running ones stay), a server killed and restarted (failover, then take-back), and request
priority honoured by the engine.

Server a is the suite's (`vllm`, tests/vllm/conftest.py), never killed; b is the module's own, started with
`--scheduling-policy priority --max-num-seqs 2`: it is killed and restarted, and its two sequences make a waiting
queue the priority test can observe (a vLLM server's start is 30-45 s; the fleet started two of its own before).
Skipped without the vllm virtualenv, as tests/vllm.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.base import GenerateRequest, GenerateResult
from backends.launcher import VLLMLauncher
from backends.router import Router, by_turn
from backends.vllm import VLLMBackend
from tests.sglang.scenarios import PROMPT
from tests.vllm.conftest import PYTHON, READY_S, free_port, need_venv

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
SLOW = 1500  # new tokens, eos ignored: a turn that stays in flight for seconds on this machine


def launcher(model: Path, port: int, logs: Path) -> VLLMLauncher:
    return VLLMLauncher(
        str(model),
        base_port=port,
        device="cpu",
        python=str(PYTHON),
        log_dir=logs,
        startup_timeout_s=READY_S,
        extra_args=["--scheduling-policy", "priority", "--max-num-seqs", "2"],
    )


class Fleet:
    """The suite's server (a) and one launched here (b); `kill()` stops b, `restart()` launches it again on its
    port."""

    def __init__(self, suites: str, model: Path, logs: Path, loop: asyncio.AbstractEventLoop):
        self.model, self.logs, self.loop = model, logs, loop
        self.port = free_port()
        self.launcher = launcher(model, self.port, logs / "b")
        self.urls = [suites, f"http://127.0.0.1:{self.port}"]

    async def start(self) -> None:
        await self.launcher.__aenter__()

    async def kill(self) -> None:
        await self.launcher.stop()

    async def restart(self) -> None:
        self.launcher = launcher(self.model, self.port, self.logs / "b-again")
        await self.launcher.__aenter__()

    async def stop(self) -> None:
        await self.launcher.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, vllm) -> Iterator[Fleet]:
    need_venv()
    loop = asyncio.new_event_loop()
    f = Fleet(vllm.url, vllm.model, tmp_path_factory.mktemp("fleet"), loop)
    try:
        loop.run_until_complete(f.start())
        yield f
    finally:
        loop.run_until_complete(f.stop())
        loop.close()


def run(fleet: Fleet, coro: Any) -> Any:
    return fleet.loop.run_until_complete(coro)


def req(session: str, max_new: int = 4, turn: int = 0, **kw: Any) -> GenerateRequest:
    params = {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}
    return GenerateRequest(session, list(PROMPT), params, rid=f"{session}_t{turn:02d}", turn=turn, **kw)


async def until(cond: Any, timeout_s: float, what: str) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.05)
    assert cond(), what


async def waiting(c: VLLMBackend) -> float:
    """vLLM's own count of requests in its waiting queue."""
    status, _, data = await c._send("GET", "/metrics")
    assert status == 200
    found = re.findall(r"^vllm:num_requests_waiting{[^}]*} ([0-9.e+-]+)$", data.decode(), re.M)
    return sum(float(v) for v in found)


def clients(fleet: Fleet) -> list[VLLMBackend]:
    return [VLLMBackend(u, max_retries=1, backoff_s=0.01) for u in fleet.urls]


def test_bounded_load_moves_new_sessions_and_keeps_running_ones(fleet):
    async def go() -> None:
        router = Router(clients(fleet), health_interval_s=0, load_bound=1.25)
        async with router:
            a, b = fleet.urls
            router.servers[1].healthy = False  # six sessions placed while server b was out...
            placed = [await router.generate(req(f"run{i}")) for i in range(6)]
            assert {r.server for r in placed} == {a}
            router.servers[1].healthy = True  # ...and b is back: a holds 6 of 6 sessions, over its bound
            busy = [asyncio.create_task(router.generate(req(f"busy{i}", SLOW))) for i in range(2)]
            await until(lambda: router.servers[1].in_flight == 2, 10, "the two busy turns in flight on b")
            # b has more requests in flight (2 against 0): least-loaded alone would pick a...
            router.load_bound = None
            assert router.choose("new0") == 0
            router.load_bound = 1.25
            # ...the bound sends the new session to b, and the running sessions' next turns stay on a
            bounded = router.counts["bounded"]
            new = await router.generate(req("new0"))
            assert new.server == b and new.route == "new" and router.counts["bounded"] == bounded + 1
            again = [await router.generate(req(f"run{i}", turn=1)) for i in range(6)]
            assert {r.server for r in again} == {a} and {r.route for r in again} == {"sticky"}
            assert router.counts["moved"] == 0
            for i in range(2):  # cleanup: the busy turns end early (or have ended), with what they made
                await router.abort(f"busy{i}")
            await asyncio.gather(*busy)

    run(fleet, go())


def test_priority_reaches_the_engine_and_jumps_the_queue(fleet):
    """Server b's `--max-num-seqs 2`: two turns run, the rest wait. A turn sent last with priority -8 (by_turn of a
    trajectory at turn 8) is served before the turns of priority 0 that waited longer. The order is checked only
    once vLLM has shown three low turns waiting and then the high turn queued behind them (its waiting count at 4):
    on a loaded machine a low turn can end before either is seen, and the round is then run again."""

    async def round_(k: int, c: VLLMBackend) -> list[str] | None:
        """The turns' names in the order they ended, or None when the high turn was not seen queued in time."""
        done: list[str] = []

        async def turn(name: str, priority: int, n: int = 0) -> GenerateResult:
            r = await c.generate(req(name, 200, turn=n, priority=priority))
            done.append(name)
            return r

        low = [asyncio.create_task(turn(f"low{k}{i}", 0)) for i in range(5)]
        async with asyncio.timeout(60):  # the low turns sent first: two run, three wait
            while not done and await waiting(c) < 3:
                await asyncio.sleep(0.02)
        if done:  # a low turn ended before three were seen waiting (a loaded machine): run the round again
            await asyncio.gather(*low)
            return None
        high_req = req(f"high{k}", 200, turn=8)
        assert by_turn(high_req) == -8
        high = asyncio.create_task(turn(f"high{k}", by_turn(high_req), 8))
        queued = False
        async with asyncio.timeout(60):
            while not done and not high.done() and not queued:
                queued = await waiting(c) >= 4
                await asyncio.sleep(0.02)
        results = await asyncio.gather(*low, high)
        assert all(len(r.token_ids) == 200 for r in results)
        return done if queued else None

    async def go() -> None:
        c = clients(fleet)[1]
        async with c:
            for k in range(4):
                done = await round_(k, c)
                if done is not None:
                    # served ahead of at least the two low turns still waiting after the running ones
                    assert done.index(f"high{k}") <= 3, done
                    return
            raise AssertionError("in 4 rounds, the high turn never reached vLLM while 3 low turns waited")

    run(fleet, go())


def test_a_killed_server_fails_over_and_is_taken_back_after_restart(fleet):
    async def go() -> None:
        router = Router(clients(fleet), health_interval_s=0.5, cooldown_s=0.5, load_bound=1.25)
        async with router:
            a, b = fleet.urls
            first = [await router.generate(req(f"s{i}")) for i in range(4)]
            on_b = [f"s{i}" for i, r in enumerate(first) if r.server == b]
            assert on_b and len(on_b) < 4  # spread over both
            await fleet.kill()
            moved = [await router.generate(req(s, turn=1)) for s in on_b]  # failover: every turn answered
            assert {r.server for r in moved} == {a} and {r.route for r in moved} == {"moved"}
            assert router.counts["moved"] == len(
                on_b
            )  # by a health check or a failed attempt, whichever came first
            await fleet.restart()
            await until(lambda: router.servers[1].healthy, 60, "the restarted server back in the router")
            # take-back: a new session goes to the restarted server; the moved ones stay where they run now
            assert (await router.generate(req("fresh"))).server == b
            stay = [await router.generate(req(s, turn=2)) for s in on_b]
            assert {r.server for r in stay} == {a} and {r.route for r in stay} == {"sticky"}

    run(fleet, go())
