"""The sync forms' loop (fsm/output/engine.py `SyncLoop`): one per calling thread, kept from call to call instead of
`asyncio.run`'s loop per call, yet each call as `asyncio.run` would run it: in a copy of the caller's context, with
what it leaves running cancelled at its end; closed by the engine's `close()` in that thread or when the thread ends."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import threading
from typing import Any

from backends.scripted import echo_backend
from fsm import RolloutEngine
from tests.conftest import ASSETS

var: contextvars.ContextVar[int | None] = contextvars.ContextVar("var", default=None)


def test_a_thread_s_sync_calls_share_a_loop_each_call_as_asyncio_run_would_run_it():
    seen: list[tuple[asyncio.AbstractEventLoop, int | None]] = []
    left: list[asyncio.Task[Any]] = []

    async def probe() -> None:
        seen.append((asyncio.get_running_loop(), var.get()))
        var.set(-1)  # the call's own copy: the caller's context keeps its value
        left.append(asyncio.get_running_loop().create_task(asyncio.sleep(3600)))

    engine = RolloutEngine("calculator", str(ASSETS), backend=echo_backend())
    try:
        engine.flush_cache()  # a sync form: the thread's loop made
        for value in (1, 2):
            var.set(value)
            engine._run_sync(probe())
            assert var.get() == value
            assert left[-1].cancelled()  # left running: cancelled at the call's end
        (first, one), (second, two) = seen
        assert first is second and not first.is_closed() and (one, two) == (1, 2)

        other: list[asyncio.AbstractEventLoop] = []
        thread = threading.Thread(target=lambda: (engine._run_sync(probe()), other.append(seen[-1][0])))
        thread.start()
        thread.join()
        del thread
        gc.collect()
        assert other[0] is not first and other[0].is_closed()  # its thread ended
    finally:
        engine.close()
    assert first.is_closed()  # the engine closed in this thread
