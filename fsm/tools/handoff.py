"""Hand-offs between threads and an event loop, batched: one wake-up carries every callback queued meanwhile.

`loop.call_soon_threadsafe` writes to the loop's self-pipe on every call, and the woken loop thread then
competes for the GIL once per call. A tool lane (fsm/tools/isolation.py) makes two such hops per tool call, one to
the tool's thread and one back with the result; with thousands of calls in flight they come in bursts.
A `Mailbox` wakes its loop only for the first callback of a burst, and the loop runs the whole burst in one
go, in order. `settled(future)` is `await asyncio.wrap_future(future)` with its result coming back that way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import Callable
from typing import Any


class Mailbox:
    """Callbacks posted from any thread, run on `loop` in posting order, one loop wake-up per burst."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._posted: list[tuple[Callable[..., Any], tuple]] = []

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the loop soon. RuntimeError when the loop is closed (as call_soon_threadsafe)."""
        with self._lock:
            self._posted.append((fn, args))
            if len(self._posted) > 1:  # a wake-up is on its way and will take this one too
                return
        try:
            self.loop.call_soon_threadsafe(self._run_posted)
        except RuntimeError:  # closed: nothing will ever run what was posted
            with self._lock:
                self._posted.clear()
            raise

    def _run_posted(self) -> None:
        with self._lock:
            posted, self._posted = self._posted, []
        for fn, args in posted:
            try:
                fn(*args)
            except Exception as exc:  # as the loop treats a raising callback: reported, the others still run
                self.loop.call_exception_handler({"message": f"exception in {fn!r}", "exception": exc})


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
_mailboxes_lock = threading.Lock()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The loop's one Mailbox (one per loop, so every lane's answers share its wake-ups)."""
    box = _mailboxes.get(loop)
    if box is None:
        with _mailboxes_lock:
            box = _mailboxes.get(loop)
            if box is None:
                box = _mailboxes[loop] = Mailbox(loop)
    return box


def copy_outcome(
    source: concurrent.futures.Future | asyncio.Future, waiter: concurrent.futures.Future | asyncio.Future
) -> None:
    """`source`'s result, exception or cancellation onto `waiter`, across the two kinds of future."""
    if waiter.done():  # the caller stopped waiting
        return
    if source.cancelled():
        waiter.cancel()
    elif (exc := source.exception()) is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(source.result())


async def settled(source: concurrent.futures.Future) -> Any:
    """`await asyncio.wrap_future(source)`: its outcome, handed back through the running loop's Mailbox; the
    caller's cancellation cancels `source` (a call that has not started never starts)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    box = mailbox(loop)

    def back(done: concurrent.futures.Future) -> None:  # on whichever thread settled `source`
        try:
            box.post(copy_outcome, done, waiter)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
            pass

    source.add_done_callback(back)
    try:
        return await waiter
    except asyncio.CancelledError:
        source.cancel()
        raise
