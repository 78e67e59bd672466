"""An event loop in a thread of its own, calls into another thread's loop, and hand-offs to a loop in bursts:
the one primitive behind a RolloutEngine's home loop (fsm/run/local.py), a tool's own loop and its answers
(fsm/tools/isolation.py) and a trainer adapter's calls into the trainer's loop (fsm/adapters/bridge.py).

`submit(coro, loop)` starts `coro` as a task on `loop` from any thread (as `asyncio.run_coroutine_threadsafe`);
`await call(coro, loop)` awaits it from another loop, and `run(coro, loop)` blocks a thread that runs no loop
until it has run. Cancelling the caller (Ctrl-C for `run`) cancels the task there and waits for it to unwind,
so nothing the task holds (a backend, a trainer's client) is closed under it.

`loop.call_soon_threadsafe` writes to the loop's self-pipe on every call, and the woken loop thread then
competes for the GIL once per call; a tool lane makes two such hops per tool call, and with thousands of calls
in flight they come in bursts. A `Mailbox` wakes its loop only for the first callback of a burst, and the loop
runs the whole burst in one go, in order. `settled(future)` is `await asyncio.wrap_future(future)` with its
result coming back that way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import signal
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


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


def submit(
    coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop
) -> tuple[concurrent.futures.Future[T], Callable[[], None]]:
    """Start `coro` as a task on `loop`: a future settled when the task has ended, and a canceller."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()
    tasks: list[asyncio.Task[T]] = []

    def start() -> None:  # runs in the caller's context (contextvars: an open span carries over)
        tasks.append(loop.create_task(coro))
        tasks[0].add_done_callback(lambda task: copy_outcome(task, done))

    def cancel() -> None:
        loop.call_soon_threadsafe(lambda: tasks and tasks[0].cancel())

    loop.call_soon_threadsafe(start)
    return done, cancel


def run(coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop) -> T:
    """Block this thread (which runs no loop) until `coro` has run on `loop`."""
    done, cancel = submit(coro, loop)
    try:
        return done.result()
    except BaseException:
        if not done.done():  # interrupted while waiting: stop the task, let it unwind
            cancel()
            with contextlib.suppress(BaseException):
                done.result()
        raise


async def call(coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop | None) -> T:
    """Await `coro` on `loop` (the caller's own when None or when already on it)."""
    if loop is None or loop is asyncio.get_running_loop():
        return await coro
    done, cancel = submit(coro, loop)
    waiter = asyncio.wrap_future(done)
    try:
        return await asyncio.shield(waiter)
    except asyncio.CancelledError:
        if not done.done():
            cancel()
            with contextlib.suppress(BaseException):
                await asyncio.shield(waiter)
        raise


class LoopThread:
    """A private event loop in a daemon thread.

    `sigint=False` blocks SIGINT in the thread (Ctrl-C belongs to the main thread; the loop's executor threads
    inherit the mask). `on_exit(exc)` hears how the loop ended: None (stopped), or the BaseException a callback
    raised out of it (SystemExit...); then, stopped, it cancels what is left and releases its executor.
    `mailbox` hands callbacks over in bursts.
    """

    def __init__(
        self,
        name: str,
        *,
        sigint: bool = False,
        on_exit: Callable[[BaseException | None], None] | None = None,
    ):
        self.loop = asyncio.new_event_loop()
        self.mailbox = Mailbox(self.loop)
        self._sigint, self._on_exit = sigint, on_exit
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        if not self._sigint and hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        asyncio.set_event_loop(self.loop)
        ended: BaseException | None = None
        try:
            self.loop.run_forever()
        except BaseException as exc:  # a callback raised SystemExit/KeyboardInterrupt: the loop is gone
            ended = exc
        if self._on_exit is not None:
            self._on_exit(ended)
        if (
            ended is None
        ):  # stopped: cancel what is left (an unclosed backend's tasks), then release the executor
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    def current(self) -> bool:
        """Whether the caller runs on this loop."""
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def submit(self, coro: Coroutine[Any, Any, T]) -> tuple[concurrent.futures.Future[T], Callable[[], None]]:
        return submit(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return run(coro, self.loop)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return await call(coro, self.loop)

    def stop(self) -> None:
        """Ask the loop to stop (cancelling what still runs there), without waiting for its thread."""
        if self.thread.is_alive() and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                self.loop.call_soon_threadsafe(self.loop.stop)

    def close(self, timeout: float | None = None) -> None:
        """Stop the loop and wait for its thread to end (at most `timeout` seconds when given)."""
        self.stop()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
