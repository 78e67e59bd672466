"""Signals during a run: SIGINT (Ctrl-C) and SIGTERM (a scheduler preempting the job) handled alike, by one
handler for the whole run, whoever runs it (`agentfsm run`, or a program embedding the engine with
`keep=`, fsm/output/keep.py). Before the rollout starts a signal cancels the caller's task; once it runs, the
first one stops it, its journal flushed and its finished rows kept (fsm/output/keep.py), and a second one
exits at once with 130.
Also here: a signal wakes the engine's own loop at once, and the one-line notices a signal prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
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

    @property
    def armed(self) -> bool:
        return self._notice is not None

    def _signal(
        self, name: str
    ) -> None:  # on the caller's loop, free while the engine's thread runs the rows
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
        loop = asyncio.get_running_loop()
        previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
        try:
            for sig in SIGNALS:
                loop.add_signal_handler(sig, self._signal, sig.name)
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or no signals here
            yield
            return
        try:
            yield
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)
            with contextlib.suppress(ValueError, TypeError):  # remove_signal_handler left the defaults behind
                for sig, handler in previous.items():
                    if handler is not None:
                        signal.signal(sig, handler)


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
