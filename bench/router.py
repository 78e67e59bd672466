"""`agentfsm bench router`: what one placement decision of `backends.router.Router.choose` costs.

The router decides on every model call, so its decision must stay small next to a transition of the
engine. The bench pins a running batch's sessions and groups first, then times decisions for pinned
sessions (every turn after the first) and for new sessions of GRPO groups (first turns, group affinity).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from backends.base import GenerateRequest
from backends.router import Router
from backends.scripted import ScriptedBackend


def bench_router(
    n: int = 100_000, servers: int = 8, sessions: int = 4096, group_size: int = 8
) -> dict[str, Any]:
    """µs per `choose()` decision: for pinned sessions (every turn after the first) and for new sessions of
    GRPO groups under group affinity (first turns). Prints one line and returns the numbers."""
    router = Router([ScriptedBackend({}, model_name=f"s{i}") for i in range(servers)], group_affinity=True)
    for i in range(sessions):  # pin sessions and groups as a running batch would have
        req = GenerateRequest(f"traj{i}", [], {}, group_id=f"g{i // group_size}")
        router._pin(req, router.choose(req.session_id, req.group_id))
    for i, s in enumerate(router.servers):
        s.in_flight = i % 3
    pinned = [f"traj{i % sessions}" for i in range(n)]
    fresh = [(f"new{i}", f"g{i // group_size}") for i in range(n)]
    choose = router.choose
    t0 = time.perf_counter()
    for sid in pinned:
        choose(sid, None)
    t1 = time.perf_counter()
    for sid, gid in fresh:
        choose(sid, gid)
    t2 = time.perf_counter()
    out = {
        "decisions": 2 * n,
        "servers": servers,
        "sticky_us": (t1 - t0) / n * 1e6,
        "new_us": (t2 - t1) / n * 1e6,
    }
    print(
        f"router decision: {out['sticky_us']:.2f} µs sticky, {out['new_us']:.2f} µs new ({servers} servers)",
        file=sys.stderr,
    )
    return out
