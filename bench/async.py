"""`agentfsm bench async`: synchronous steps against the continuous mode, on the same rows and servers.

Synchronous: each step is `generate_sequences(B rows, n)`, then a (fake) train step, then a weight update;
the step waits for its slowest trajectory, and the servers idle while the trainer trains.
Continuous: 2B rows are submitted ahead; each step `take`s B finished groups (staleness bounded), trains,
updates the weights, and submits B more rows, while everything unfinished keeps generating.

The servers are scripted dev servers (SGLang's HTTP protocol, in a thread of their own) whose per-request
latency has a long tail: lognormal around `median_s`, and a few requests `slow_s` longer. A request's latency
is a function of its prompt and how often that prompt was asked before, so both modes meet the same
latencies. Measured in one run: trajectories/s, the servers' idle share (time with no request in flight),
and the staleness of the groups trained on. The weight update is a no-op on scripted servers; until
engines count versions (`engine.apause` present), the bench counts them itself.

Named `async.py` as the command is; it is imported with importlib (`async` is a keyword).
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
import zlib
from collections import Counter
from typing import Any

from backends.base import BaseBackend, GenerateRequest, GenerateResult
from backends.devserver import DevServer
from backends.scripted import echo_backend


class TailLatency(BaseBackend):
    """The echo model with long-tailed latency, counting the time it has no request in flight."""

    def __init__(self, median_s: float, sigma: float, slow_share: float, slow_s: float):
        self.inner = echo_backend()
        self.model_name, self.context_length = "echo", None
        self.median_s, self.sigma, self.slow_share, self.slow_s = median_s, sigma, slow_share, slow_s
        self.reset()

    def reset(self) -> None:
        self.seen: Counter[int] = Counter()
        self.inflight, self.idle_s, self.since = 0, 0.0, time.perf_counter()

    def idle_share(self) -> float:
        idle = self.idle_s + (time.perf_counter() - self.since if self.inflight == 0 else 0.0)
        return idle  # seconds; divided by the window by the caller

    def latency(self, prompt: list[int]) -> float:
        key = zlib.crc32(b",".join(str(t).encode() for t in prompt))
        k = self.seen[key]
        self.seen[key] += 1
        u1 = (zlib.crc32(f"{key}:{k}:a".encode()) + 0.5) / 2**32
        u2 = (zlib.crc32(f"{key}:{k}:b".encode()) + 0.5) / 2**32
        z = math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)  # Box-Muller: a normal draw
        slow = self.slow_s if (zlib.crc32(f"{key}:{k}:s".encode()) / 2**32) < self.slow_share else 0.0
        return self.median_s * math.exp(self.sigma * z) + slow

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        now = time.perf_counter()
        if self.inflight == 0:
            self.idle_s += now - self.since
        self.inflight += 1
        try:
            await asyncio.sleep(self.latency(list(request.prompt_ids)))
            return await self.inner.generate(request)
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.since = time.perf_counter()


class Servers:
    """`count` dev servers over TailLatency backends, on an event loop in their own thread."""

    def __init__(self, count: int, **latency: Any):
        self.backends = [TailLatency(**latency) for _ in range(count)]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench servers", daemon=True)
        self.thread.start()
        self.servers = [DevServer(b) for b in self.backends]
        for s in self.servers:
            asyncio.run_coroutine_threadsafe(s.start(), self.loop).result(30)
        self.urls = [s.url for s in self.servers]

    def reset(self) -> None:
        self.loop.call_soon_threadsafe(lambda: [b.reset() for b in self.backends])

    def idle_seconds(self) -> list[float]:
        async def read() -> list[float]:
            return [b.idle_share() for b in self.backends]

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(10)

    def close(self) -> None:
        for s in self.servers:
            asyncio.run_coroutine_threadsafe(s.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def _update(engine: Any, step: int) -> None:
    """A weight update (the scripted servers load nothing; the engine's version counter moves on)."""
    await engine.aupdate_weights_from_disk("/bench/no-op-checkpoint")


async def _sync_steps(engine: Any, rows: list[dict], steps: int, batch: int, n: int, train_s: float) -> dict:
    staleness: Counter[int] = Counter()
    for step in range(steps):
        await engine.agenerate_sequences(rows[step * batch : (step + 1) * batch], n=n)
        staleness[0] += batch  # trained on at once: never stale
        await asyncio.sleep(train_s)
        await _update(engine, step)
    return {"staleness": dict(staleness)}


async def _continuous(
    engine: Any, rows: list[dict], steps: int, batch: int, n: int, train_s: float, max_staleness: int
) -> dict:
    ahead = 2 * batch
    await engine.asubmit(rows[:ahead], n=n)
    sent = ahead
    for step in range(steps):
        await engine.atake(batch, max_staleness=max_staleness, stale="rerun", timeout=300)
        if sent < len(rows):
            await engine.asubmit(rows[sent : sent + batch], n=n)
            sent += batch
        await asyncio.sleep(train_s)  # the trainer trains; the rows in flight keep generating
        await _update(engine, step)
    stats = engine.stream_stats
    return {"staleness": stats["staleness"], "stale_rerun": stats["stale_rerun"]}


def bench_async(
    *,
    servers: int = 2,
    steps: int = 8,
    batch: int = 16,
    n: int = 4,
    train_s: float = 0.3,
    median_s: float = 0.08,
    sigma: float = 0.6,
    slow_share: float = 0.02,
    slow_s: float = 1.5,
    max_staleness: int = 2,
    concurrency: int = 512,
) -> dict[str, Any]:
    from backends.tiny import ASSET_DIR
    from fsm.api import RolloutEngine
    from specs.calculator import make_prompts

    rows = make_prompts(steps * batch + 2 * batch, seed=1)  # the continuous mode submits 2 steps ahead
    fleet = Servers(servers, median_s=median_s, sigma=sigma, slow_share=slow_share, slow_s=slow_s)
    results: dict[str, Any] = {}
    try:
        for mode in ("synchronous", "continuous"):
            engine = RolloutEngine(
                "calculator", str(ASSET_DIR), servers=fleet.urls, max_concurrency=concurrency
            )
            try:

                async def go(engine: Any = engine, mode: str = mode) -> dict:
                    async with engine:
                        fleet.reset()
                        t0 = time.perf_counter()
                        if mode == "synchronous":
                            out = await _sync_steps(engine, rows, steps, batch, n, train_s)
                        else:
                            out = await _continuous(engine, rows, steps, batch, n, train_s, max_staleness)
                        out["wall_s"] = time.perf_counter() - t0
                        out["idle_s"] = fleet.idle_seconds()
                        return out

                out = asyncio.run(go())
            finally:
                engine.close()
            trajs = steps * batch * n
            results[mode] = {
                "trajectories": trajs,
                "wall_s": round(out["wall_s"], 3),
                "trajectories_per_s": round(trajs / out["wall_s"], 1),
                "server_idle_share": round(sum(out["idle_s"]) / (len(out["idle_s"]) * out["wall_s"]), 3),
                "staleness": {int(k): v for k, v in sorted(out["staleness"].items())},
                **({"stale_rerun": out["stale_rerun"]} if "stale_rerun" in out else {}),
            }
    finally:
        fleet.close()
    results["speedup"] = round(
        results["continuous"]["trajectories_per_s"] / results["synchronous"]["trajectories_per_s"], 2
    )
    results["setup"] = {
        "servers": servers,
        "steps": steps,
        "groups_per_step": batch,
        "n": n,
        "train_s": train_s,
        "latency": f"lognormal(median {median_s}s, sigma {sigma}) + {slow_s}s on {slow_share:.0%}",
        "max_staleness": max_staleness,
        "stale": "rerun",
    }
    print(table(results), file=sys.stderr)
    return results


def table(results: dict[str, Any]) -> str:
    head = f"{'mode':<12} {'traj/s':>8} {'wall s':>8} {'idle share':>11}  staleness (groups)"
    lines = [head, "-" * len(head)]
    for mode in ("synchronous", "continuous"):
        r = results[mode]
        stale = ", ".join(f"{k}: {v}" for k, v in r["staleness"].items())
        lines.append(
            f"{mode:<12} {r['trajectories_per_s']:>8} {r['wall_s']:>8} {r['server_idle_share']:>11}  {stale}"
        )
    lines.append(f"speedup: {results['speedup']}x  ({results['setup']['latency']})")
    return "\n".join(lines)
