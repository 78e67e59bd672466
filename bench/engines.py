"""`agentfsm bench engines --server URL --server URL`: the calculator spec over each inference engine's server.

Each server (SGLang, vLLM or the dev server, told apart by backends/engines.py) runs the same rows greedily
through `RolloutEngine(servers=[url])` in this process, the servers taking turns (the order rotates every
repeat, so a machine that gets busier does not favour one). Per engine: wall time of the run, and the
client's CPU time (this process: the engine, its HTTP client, the answer checks) per model call; then
whether every trajectory's tokens were equal across engines. The servers must serve the same model (for
vLLM on CPU, the tiny model with 32-dim heads: backends/tiny/head_pad.py, which computes the same function).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from backends.tiny import ASSET_DIR


async def _run(url: str, rows: list[dict[str, Any]], tokenizer: Any) -> dict[str, Any]:
    from fsm.api import RolloutEngine

    async with RolloutEngine("calculator", tokenizer, servers=[url]) as engine:
        await engine.start()
        wall, cpu = time.perf_counter(), time.process_time()
        trajs = await engine.arun(rows, sampling_params={"temperature": 0.0})
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        stats = engine.backend.stats()  # type: ignore[attr-defined]
        calls = sum(s["requests"] for s in stats["servers"])
        return {
            "engine": engine.backend.provider,
            "wall_s": wall,
            "client_cpu_s": cpu,
            "model_calls": calls,
            "tokens": [(list(t.response_ids), list(t.response_mask)) for t in trajs],
            "failed": sum(1 for t in trajs if t.failed),
        }


def bench_engines(servers: Sequence[str], n: int = 8, repeats: int = 3) -> dict[str, Any]:
    """Per server: median wall time of the run and client CPU per model call over `repeats` alternated runs
    of `n` calculator prompts at T=0; `tokens_equal` says whether every run gave the same token ids."""
    from fsm.api import load_tokenizer
    from specs.calculator import make_prompts

    if len(servers) < 2:
        raise ValueError("bench engines: give two servers or more (--server URL --server URL)")
    rows = make_prompts(n, seed=0)
    tokenizer = load_tokenizer(str(ASSET_DIR))
    runs: dict[str, list[dict[str, Any]]] = {url: [] for url in servers}
    for r in range(repeats):
        order = list(servers[r % len(servers) :]) + list(servers[: r % len(servers)])
        for url in order:
            runs[url].append(asyncio.run(_run(url, rows, tokenizer)))
    first = runs[servers[0]][0]["tokens"]
    out: dict[str, Any] = {"prompts": n, "repeats": repeats, "servers": {}}
    out["tokens_equal"] = all(run["tokens"] == first for rs in runs.values() for run in rs)
    for url, rs in runs.items():
        calls = rs[0]["model_calls"]
        out["servers"][url] = {
            "engine": rs[0]["engine"],
            "model_calls": calls,
            "failed": max(x["failed"] for x in rs),
            "wall_s": statistics.median(x["wall_s"] for x in rs),
            "client_cpu_ms_per_call": statistics.median(
                x["client_cpu_s"] / max(1, x["model_calls"]) for x in rs
            )
            * 1e3,
            "wall_ms_per_call": statistics.median(x["wall_s"] / max(1, x["model_calls"]) for x in rs) * 1e3,
        }
        s = out["servers"][url]
        print(
            f"{s['engine']:>6} {url}: {s['wall_s']:.2f} s for {calls} model calls ({s['wall_ms_per_call']:.1f} ms "
            f"each), client CPU {s['client_cpu_ms_per_call']:.2f} ms per call",
            file=sys.stderr,
        )
    print(f"tokens equal across engines at T=0: {out['tokens_equal']}", file=sys.stderr)
    return out
