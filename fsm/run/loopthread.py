"""A private event loop in a daemon thread: the one loop a RolloutEngine's backend lives on (fsm/api.py).

Sync calls block on it, and async calls from any other loop are bridged to it, so aiohttp sessions and the
in-process model's batching task never see a second loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """A private event loop in a daemon thread: the one loop an engine's backend lives on.

    `run(coro)` blocks a thread that runs no loop until `coro` has run there; `await call(coro)` does the same
    from another loop. Cancelling (Ctrl-C for `run`) cancels the task on this loop and waits for it to unwind,
    so the backend is never closed under a trajectory still running.
    """

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        if hasattr(signal, "pthread_sigmask"):  # Ctrl-C belongs to the main thread (and this one's executor's
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # threads inherit the mask)
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:  # stopped: cancel what is left (an unclosed backend's tasks), then release the executor
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
        """Start `coro` as a task here: a future settled when the task has ended, and a canceller."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        tasks: list[asyncio.Task[T]] = []

        def settle(task: asyncio.Task[T]) -> None:
            if task.cancelled():
                done.cancel()
            elif task.exception() is not None:
                done.set_exception(task.exception())  # type: ignore[arg-type]
            else:
                done.set_result(task.result())

        def start() -> None:  # runs in the caller's context (contextvars: an open span carries over)
            tasks.append(self.loop.create_task(coro))
            tasks[0].add_done_callback(settle)

        self.loop.call_soon_threadsafe(start)
        return done, lambda: self.loop.call_soon_threadsafe(lambda: tasks and tasks[0].cancel())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        done, cancel = self.submit(coro)
        try:
            return done.result()
        except BaseException:
            if not done.done():  # interrupted while waiting: stop the task, let it unwind
                cancel()
                with contextlib.suppress(BaseException):
                    done.result()
            raise

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        done, cancel = self.submit(coro)
        waiter = asyncio.wrap_future(done)
        try:
            return await asyncio.shield(waiter)
        except asyncio.CancelledError:
            if not done.done():
                cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.shield(waiter)
            raise

    def close(self) -> None:
        """Stop the loop (cancelling what still runs there) and wait for its thread to end."""
        if self._thread.is_alive() and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join()
