"""`agentfsm bench prefix-cache`: how much prefill the router's placement saves, measured without a GPU.

Scripted dev servers (`backends.devserver`) keep a prefix cache of what they served and report
`cached_tokens` as SGLang does; behind the router they make the hit rate of a placement policy measurable.
Running it with group affinity off and on shows what sending a GRPO group's samples to one server buys on
their shared first-turn prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from backends.base import GenerateRequest
from backends.devserver import DevServer
from backends.router import Router
from backends.scripted import echo_backend
from backends.sglang import SGLangBackend


async def _bench_prefix_cache(
    n_groups: int, n: int, affinity: bool, turns: int, servers: int
) -> dict[str, Any]:
    system = list(range(100, 132))  # a system prompt shared by every row
    async with contextlib.AsyncExitStack() as stack:
        devs = [
            await stack.enter_async_context(DevServer(echo_backend(latency_s=0.005))) for _ in range(servers)
        ]
        router = await stack.enter_async_context(
            Router([SGLangBackend(d.url) for d in devs], group_affinity=affinity, health_interval_s=0)
        )

        first = [0, 0]  # first-turn prompt and cached tokens: where group affinity makes its difference

        async def sample(g: int, k: int) -> None:
            context = system + [1000 + (g * 7919 + j) % 5000 for j in range(64)]  # the group's prompt
            for t in range(turns):
                req = GenerateRequest(
                    f"g{g}s{k}", context, {"max_new_tokens": 16}, rid=f"g{g}s{k}_t{t:02d}", group_id=f"g{g}"
                )
                res = await router.generate(req)
                if t == 0:
                    first[0] += len(context)
                    first[1] += res.cached_tokens or 0
                context = context + res.token_ids + [3, 4 + k, 5 + t]  # a per-sample observation turn
            await router.release(f"g{g}s{k}")

        await asyncio.gather(*(sample(g, k) for g in range(n_groups) for k in range(n)))
        stats = router.stats()
    return {
        "n_groups": n_groups,
        "n": n,
        "turns": turns,
        "servers": servers,
        "affinity": affinity,
        "hit_rate": stats["cache_hit_rate"],
        "first_turn_hit_rate": first[1] / max(1, first[0]),
        "prompt_tokens": stats["prompt_tokens"],
        "cached_tokens": stats["cached_tokens"],
        "group_routes": stats["group"],
        "new_routes": stats["new"],
        "requests_per_server": [s["requests"] for s in stats["servers"]],
    }


def bench_prefix_cache(
    n_groups: int = 16, n: int = 8, affinity: bool = True, *, turns: int = 3, servers: int = 3
) -> dict[str, Any]:
    """Prefix-cache hit rate (cached/prompt tokens) of `servers` scripted dev servers behind the router, for
    `n_groups` GRPO groups of `n` samples running `turns` turns concurrently. Call outside an event loop."""
    return asyncio.run(_bench_prefix_cache(n_groups, n, affinity, turns, servers))
