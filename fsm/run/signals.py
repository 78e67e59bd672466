"""What reaches a run's event loop from outside it: signals, and a watch on whether the loop still turns.

SIGINT (Ctrl-C) and SIGTERM (a scheduler preempting the job) are handled alike, by one handler for the whole run,
whoever runs it (`agentfsm run`, or a program embedding the engine with `keep=`, fsm/output/keep.py). Before the
rollout starts a signal cancels the caller's task; once it runs, the first one stops it, its journal flushed and
its finished rows kept, and a second one exits at once with 130. A signal also wakes the engine's own loop at once.

The run's watchdog (fsm/run/runtime.py `Runner._watchdog`) is a task on the run's loop, so code that blocks that
loop (an `isolation: none` tool calling `time.sleep`, a user action that never awaits) silences it, and Ctrl-C,
which needs the loop to stop the rows, seems ignored. So a callback on the loop stamps a heartbeat every `TICK_S`;
one daemon thread for the process reads the stamps, logs a loop that has not turned for `stall_s` (with what its
owner says holds it), and answers `stalled_for(loop)`, which the snapshot path (fsm/run/stream.py) asks first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)  # a scheduler's preemption is handled as Ctrl-C


def say_now(line: str) -> None:
    """One line on stderr at once (from a signal handler: no buffering, no rich)."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def warn(message: str) -> None:
    print(f"agentfsm: warning: {message}", file=sys.stderr)


def term_is_ctrl_c() -> None:
    """SIGTERM (a scheduler preempting the job) is handled as Ctrl-C everywhere outside the rollout too."""
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, lambda signum, frame: signal.default_int_handler(signum, frame))


class Interrupts:
    """The run's one handler of SIGINT and SIGTERM, on the caller's event loop, through the loop's wakeup fd: the
    loop wakes whichever thread the signal hit (asyncio.run's own handler waits for the main thread to run
    Python, which it does not while it sleeps on a rollout in the engine's thread). Inside `listening(task)`
    a signal cancels `task`, until `arm(notice)`: from then the first one sets `stop` (and prints `notice(name)`)
    and a second one exits the process at once with 130. Leaving `listening` puts back the
    handlers that were there. Main thread only: elsewhere no handler is set (signals stay the program's)."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self._task: asyncio.Task[Any] | None = None
        self._notice: Callable[[str], str] | None = None

    def arm(self, notice: Callable[[str], str]) -> None:
        self._notice = notice

    # on the caller's loop, free while the engine's thread runs the rows
    def _signal(self, name: str) -> None:
        if self._notice is None:
            if self._task is not None:
                self._task.cancel()
            return
        if self.stop.is_set():  # the second one: now (the journal holds every step but those in flight)
            say_now("agentfsm: exiting at once; the journal keeps every step but those in flight")
            os._exit(130)
        self.stop.set()
        say_now(self._notice(name))

    @contextlib.contextmanager
    def listening(self, task: asyncio.Task[Any] | None = None) -> Iterator[None]:
        self._task = task
        with handling(self._signal):
            yield


@contextlib.contextmanager
def handling(handler: Callable[[str], None]) -> Iterator[None]:
    """SIGINT and SIGTERM call `handler(name)` on the running loop while inside, and the handlers from before are
    back after; off the main thread (or where there are no signals) nothing is handled."""
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        for sig in SIGNALS:
            loop.add_signal_handler(sig, handler, sig.name)
    except (ValueError, RuntimeError, NotImplementedError):
        yield
        return
    try:
        yield
    finally:
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
        with contextlib.suppress(ValueError, TypeError):  # remove_signal_handler left the defaults behind
            for sig, was in previous.items():
                if was is not None:
                    signal.signal(sig, was)


@contextlib.asynccontextmanager
async def signals_wake_the_loop() -> AsyncIterator[None]:
    """A signal (Ctrl-C) wakes the loop at once, whichever thread the kernel delivered it to. Python runs its
    handler on the main thread when that thread next runs Python code; a loop asleep in select() with no
    timer due (every row waiting on a hung tool thread, the watchdog off) would otherwise sleep through it,
    and Ctrl-C would seem missed. Main thread only, and only where no wakeup fd is set already (asyncio's
    own signal handlers set one)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    rsock, wsock = socket.socketpair()
    rsock.setblocking(False)
    wsock.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(wsock.fileno(), warn_on_full_buffer=False)
    except ValueError:
        previous = None
    if previous is None or previous != -1:  # not ours to take: put back what was there
        if previous is not None:
            signal.set_wakeup_fd(previous)
        rsock.close()
        wsock.close()
        yield
        return

    def drain() -> None:
        with contextlib.suppress(OSError):
            while rsock.recv(4096):
                pass

    loop.add_reader(rsock.fileno(), drain)
    try:
        yield
    finally:
        loop.remove_reader(rsock.fileno())
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        rsock.close()
        wsock.close()


# The loop watch: whether a loop still turns, seen from a thread of its own.

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
