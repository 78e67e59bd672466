"""`agentfsm bench ray`: whether scaling out over Ray actors pays, and what one Ray hop costs a row.

`fsm.adapters.ray_runner.RayRunner` spreads GRPO groups over actors by work stealing. The bench runs the calculator
spec over scripted dev servers that wait a fixed latency per request (`backends.scripted.scripted_servers`),
first in one process, then with each number of actors at the same total concurrency; then it times one row
at a time through an actor against the same row in process, over a zero-latency model, which isolates the
hop. `ray` stays an optional extra: it is imported when the bench runs.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from backends.scripted import echo_backend, scripted_servers
from backends.tiny import ASSET_DIR
from fsm.adapters.ray_runner import RayRunner, _ray
from fsm.api import RolloutEngine
from specs.calculator import make_prompts


def _best_rate(fn: Callable[[], Any], items: int, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return items / best


def bench_ray(
    workers: Sequence[int] = (1, 2),
    rows: int = 128,
    n: int = 4,
    *,
    servers: int = 2,
    latency_s: float = 0.05,
    concurrency: int = 256,
    hop_rows: int = 100,
    repeats: int = 2,
) -> dict[str, Any]:
    """Trajectories/s of the calculator spec over `servers` scripted dev servers (each request waits
    `latency_s`): one process (RolloutEngine), then RayRunner with each count of `workers`, the same total
    `concurrency` of trajectories in flight in every case. Then the per-row cost of the Ray hop: one row at
    a time through an actor vs in process, both over an in-process zero-latency echo model. Actor start-up
    is excluded (`ready()` first, then one warm-up batch); each rate is the best of `repeats` batches (the
    machine may be shared). Call outside an event loop; prints and returns."""
    ray = _ray()
    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False)
    data, tok = make_prompts(rows, seed=1), str(ASSET_DIR)
    result: dict[str, Any] = {
        "rows": rows,
        "n": n,
        "servers": servers,
        "latency_s": latency_s,
        "concurrency": concurrency,
        "cpus": os.cpu_count(),
    }
    try:
        with scripted_servers(servers, latency_s=latency_s) as urls:
            with RolloutEngine("calculator", tok, servers=urls, max_concurrency=concurrency) as engine:
                engine.generate_sequences(data[:16], n=n)
                result["single_process"] = _best_rate(
                    lambda: engine.generate_sequences(data, n=n), rows * n, repeats
                )
            for k in workers:
                with RayRunner(
                    "calculator", tok, servers=urls, workers=k, max_concurrency=max(1, concurrency // k)
                ) as runner:
                    runner.ready()
                    runner.generate_sequences(data[: 8 * k], n=n)
                    result[f"ray_{k}"] = _best_rate(
                        lambda: runner.generate_sequences(data, n=n), rows * n, repeats
                    )
                    result[f"ray_{k}_rows_per_actor"] = list(runner.stats["rows_per_actor"].values())
        # The hop: the same zero-latency model in process and behind one actor, one row at a time.
        hop_data = make_prompts(hop_rows, seed=2)
        with RolloutEngine("calculator", tok, backend=echo_backend()) as engine:
            engine.generate_sequences(hop_data[:10])
            t0 = time.perf_counter()
            for row in hop_data:
                engine.generate_sequences([row])
            local = (time.perf_counter() - t0) / hop_rows
        with RayRunner("calculator", tok, backend_factory=echo_backend, workers=1) as runner:
            runner.ready()
            runner.generate_sequences(hop_data[:10])
            t0 = time.perf_counter()
            for row in hop_data:
                runner.generate_sequences([row])
            remote = (time.perf_counter() - t0) / hop_rows
            actor = runner.actors[0]
            t0 = time.perf_counter()
            for row in hop_data:
                ray.get(actor.echo.remote(row))
            echo = (time.perf_counter() - t0) / hop_rows
        result.update(
            row_in_process_ms=local * 1e3,
            row_through_actor_ms=remote * 1e3,
            ray_hop_ms=(remote - local) * 1e3,
            bare_actor_call_ms=echo * 1e3,
        )
    finally:
        if started:
            ray.shutdown()
    scaling = ", ".join(f"{k} actors {result[f'ray_{k}']:.0f}" for k in workers)
    print(
        f"trajectories/s: 1 process {result['single_process']:.0f}, {scaling} "
        f"({rows}x{n} trajectories, {servers} servers, {latency_s * 1e3:.0f} ms per request, {os.cpu_count()} cpus)",
        file=sys.stderr,
    )
    print(
        f"per row: {result['row_in_process_ms']:.2f} ms in process, {result['row_through_actor_ms']:.2f} ms "
        f"through an actor (hop {result['ray_hop_ms']:.2f} ms; a bare actor call {result['bare_actor_call_ms']:.2f} ms)",
        file=sys.stderr,
    )
    return result
