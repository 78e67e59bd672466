"""Deadlines that stand still while a server is paused (backends/sglang.py's /generate attempts).

SGLang holds a request that reaches it while `/pause_generation` is in force in its front end, where an
`/abort_request` never reaches it, and runs it after `/continue_generation` (tests/fixtures/sglang/pauses.json,
"late"). A client that paused the server itself must therefore neither let such a request time out nor
send it the deadline's abort: the clock of every wait below runs only while the server is not paused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class PauseClock:
    """The pause state one client set on its server, and waits timed by unpaused time only."""

    def __init__(self) -> None:
        self.mode: str | None = None  # the /pause_generation mode in force; None: running
        self._running = asyncio.Event()
        self._running.set()
        self._wakes: set[Callable[[], None]] = set()  # the running clocks, stopped the moment a pause begins
        # The clocks whose deadline is the latest so far (every attempt with the same timeout: nearly all), in
        # deadline order, served by one shared timer (`_expire`): asyncio's heap of a timer per call compares
        # its entries in Python (docs/benchmarks.md, the fifth pass). Others get a timer of their own.
        self._due: dict[Callable[[], None], float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop `_due` and `_timer` belong to
        self._last = 0.0  # no deadline in `_due` is later: a new one at or past it keeps the order

    def set(self, mode: str | None) -> None:
        self.mode = mode
        if mode is None:
            self._running.set()
        else:
            self._running.clear()
            for wake in list(self._wakes):
                wake()

    async def wait(self, future: asyncio.Future[Any], timeout_s: float) -> bool:
        """Wait for `future` up to `timeout_s` seconds of unpaused time; True when it is done. Each unpaused
        stretch is one future and no task, with no timer of its own unless its deadline comes before one
        already waiting (this runs once per generate call, so the stretch is written here, not in a coroutine
        of its own)."""
        loop = future.get_loop()  # the running one, without get_running_loop's getpid() system call
        left = timeout_s
        while not future.done():
            if self.mode is not None:  # paused: wait for the answer or the continue, the clock stopped
                resumed = asyncio.ensure_future(self._running.wait())
                try:
                    await asyncio.wait({future, resumed}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    resumed.cancel()
                continue
            if left <= 0:
                return False
            # until `future` is done, `left` passed or a pause began
            waiter = loop.create_future()

            def wake(_: object = None, waiter: asyncio.Future[None] = waiter) -> None:
                if not waiter.done():
                    waiter.set_result(None)

            future.add_done_callback(wake)
            t0 = loop.time()
            when, timer = t0 + left, None
            # the shared timer, (re)armed for this first deadline; none armed: the clocks left in `_due` are woken
            if loop is not self._loop or not self._due or self._timer is None:
                if self._timer is not None:
                    self._timer.cancel()
                self._loop, self._due, self._timer = loop, {}, loop.call_at(when, self._expire)
            elif when < self._last:  # maybe before the latest waiting: a timer of its own
                timer = loop.call_at(when, wake)
            if timer is None:
                self._due[wake] = self._last = when
            self._wakes.add(wake)
            try:
                await waiter
            finally:
                if timer is None:
                    self._due.pop(wake, None)
                else:
                    timer.cancel()
                future.remove_done_callback(wake)
                self._wakes.discard(wake)
            left -= loop.time() - t0
        return True

    def _expire(self) -> None:
        """The shared timer: wake each clock whose deadline passed, in order, then wait for the next one's."""
        assert self._loop is not None
        now, self._timer = self._loop.time(), None
        for wake, when in self._due.items():  # a wake only resolves its waiter: `_due` stays as it is
            if when > now:
                self._timer = self._loop.call_at(when, self._expire)
                return
            wake()
