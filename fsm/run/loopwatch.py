"""Whether an event loop still turns, seen from outside it: one daemon thread for the process.

A run's own watchdog (fsm/run/runtime.py `Runner._watchdog`) is a task on the run's loop, so code that blocks
that loop (an `isolation: none` tool calling `time.sleep` or a blocking socket read, a user action that never
awaits) silences it along with everything else, and Ctrl-C, which needs the loop to stop the rows, seems
ignored. Here a callback on the loop stamps a heartbeat every `TICK_S`; a thread of its own reads the stamps,
logs a loop that has not turned for `stall_s` (with what its owner says is holding it), and answers
`stalled_for(loop)`, which the snapshot path (fsm/run/stream.py) asks before it waits on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("agentfsm.loop")

TICK_S = 0.25  # the heartbeat's period, and how often the thread looks
STALL_S = 3.0  # a loop that has not turned this long is blocked: a warning, and Ctrl-C snapshots without it


@dataclass(eq=False)
class _Watched:
    loop: asyncio.AbstractEventLoop
    thread: int  # the loop's thread (threading.get_ident)
    stall_s: float
    # one per `watch` (the runs on this loop): (the loop's thread, seconds blocked) -> what holds it, or None
    describers: list[Callable[[int, float], str | None]]
    beat: float = field(default_factory=time.monotonic)
    reported: bool = False
    handle: asyncio.TimerHandle | None = None


_LOCK = threading.Lock()
_WATCHED: dict[asyncio.AbstractEventLoop, _Watched] = {}
_THREAD: list[threading.Thread] = []


def watch(describe: Callable[[int, float], str | None], stall_s: float = STALL_S) -> None:
    """Watch the running loop (on it) until `unwatch(describe)`; `describe` names what blocks it (None: not
    one of its rows)."""
    loop = asyncio.get_running_loop()
    with _LOCK:
        w = _WATCHED.get(loop)
        if w is not None:
            w.describers.append(describe)
            w.stall_s = min(w.stall_s, stall_s)
            return
        w = _WATCHED[loop] = _Watched(loop, threading.get_ident(), stall_s, [describe])
        if not _THREAD or not _THREAD[0].is_alive():
            _THREAD[:] = [threading.Thread(target=_look, name="agentfsm loop watch", daemon=True)]
            _THREAD[0].start()

    def beat() -> None:
        w.beat = time.monotonic()
        w.handle = loop.call_later(TICK_S, beat)

    beat()


def unwatch(describe: Callable[[int, float], str | None]) -> None:
    loop = asyncio.get_running_loop()
    with _LOCK:
        w = _WATCHED.get(loop)
        if w is None:
            return
        with contextlib.suppress(ValueError):
            w.describers.remove(describe)
        if w.describers:
            return
        del _WATCHED[loop]
    if w.handle is not None:
        w.handle.cancel()


def stalled_for(loop: asyncio.AbstractEventLoop) -> float:
    """Seconds `loop` has gone without turning (0 when it turns, or is not watched); from any thread."""
    w = _WATCHED.get(loop)
    if w is None:
        return 0.0
    return max(0.0, time.monotonic() - w.beat - TICK_S)


def blocked(loop: asyncio.AbstractEventLoop) -> int | None:
    """The thread of a watched `loop` that has not turned for its `stall_s`; None when it turns."""
    w = _WATCHED.get(loop)
    return w.thread if w is not None and stalled_for(loop) >= w.stall_s else None


def loop_of(thread: int) -> asyncio.AbstractEventLoop | None:
    """The watched loop that runs on `thread`."""
    return next((w.loop for w in list(_WATCHED.values()) if w.thread == thread), None)


def where(thread: int) -> str:
    """Where `thread` runs now, as " at file:line in function" (for a report)."""
    frame = sys._current_frames().get(thread)
    if frame is None:
        return ""
    return f" at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _look() -> None:
    while True:
        time.sleep(TICK_S)
        with _LOCK:
            watched = list(_WATCHED.values())
        for w in watched:
            blocked = stalled_for(w.loop)
            if blocked < w.stall_s:
                w.reported = False
                continue
            if w.reported:
                continue
            w.reported = True
            what = None
            for describe in list(w.describers):
                try:
                    what = describe(w.thread, blocked)
                except Exception as exc:  # a report must never end the watch
                    what = f"cannot say what ({type(exc).__name__}: {exc})"
                if what:
                    break
            log.warning(
                "event loop blocked for %.1f s: %s; nothing else on this loop runs until it returns",
                blocked,
                what or f"code outside any row{where(w.thread)}",
            )
