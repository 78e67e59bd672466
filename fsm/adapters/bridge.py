"""Awaiting a trainer's engine from the RolloutEngine's own loop.

A RolloutEngine runs its backend on an event loop of its own (fsm/api.py). A trainer's inference client (an
OpenRLHF rollout actor, SkyRL's InferenceEngineClient) belongs to the trainer's loop: its futures, locks and
sessions must be awaited there. So a generate function that calls it hands the call to that loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def on_loop(coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop | None) -> T:
    """Await `coro` on `loop` (the caller's loop when None or when already on it)."""
    if loop is None or loop is asyncio.get_running_loop():
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))
