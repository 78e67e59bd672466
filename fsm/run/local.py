"""The single-process engine's working parts, composed: one Runner and its backend on one event loop in a thread
the engine owns (`LoopThread`), the run's one owner on that loop (the `Stream`: batches and the continuous mode
alike), and the control calls there (`Controls`). `fsm.api.RolloutEngine` is the contract over this.

Calls from any other loop (a sync form's own, fsm/output/engine.py `sync_form`) are bridged to it, so aiohttp
sessions and the in-process model's batching task never see a second loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from backends.base import Abortable, Backend, Lifecycle, Pausable
from fsm.run import heap, resume, signals
from fsm.run.codec import SnapshotError
from fsm.run.context import Policy, Sampling
from fsm.run.engine import Command, Controls, Owned, SnapshotAsk, Take, under
from fsm.run.journal import write as write_journal
from fsm.run.runtime import Runner
from fsm.run.stream import Group, Stream
from fsm.run.trajectory import Trajectory
from fsm.tools.isolation import close_loop, copy_outcome

T = TypeVar("T")
PAUSE_TIMEOUT_S = 10.0  # a snapshot's pause of the servers (abort mode) waits at most this long
AT_EXIT_S = 5.0  # an engine left open at exit (or dropped) waits this long for its loop's tasks to end
log = logging.getLogger("agentfsm.stream")


# -- the engine's loop thread, and the hand-offs onto a loop ---------------------------------------------------
# Here, in the stage that hands it coroutines, so that what runs on it is started by the code that made it (a
# tool's own loop thread is fsm/tools/isolation.py `LoopLane`'s). Cancelling a caller of `submit`/`call`/`run`
# cancels the task there and waits for it to unwind, so nothing it holds is closed under it.


def submit(
    coro: Coroutine[Any, Any, T] | Callable[[], Coroutine[Any, Any, T]], loop: asyncio.AbstractEventLoop
) -> tuple[concurrent.futures.Future[T], Callable[[], None]]:
    """Start `coro` as a task on `loop`: a future settled when the task has ended, and a canceller. Given as a
    function, the coroutine is made on `loop` as the task starts, and not at all when cancelled first: a loop
    that code blocks may never get to it, or only as it stops (`Local.take_snapshot`), and none is unawaited."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()
    tasks: list[asyncio.Task[T]] = []
    cancelled: list[bool] = []

    def start() -> None:  # runs in the caller's context (contextvars: an open span carries over)
        if cancelled:  # before it started: it never does
            done.cancel()
            return
        tasks.append(loop.create_task(coro() if callable(coro) else coro))
        tasks[0].add_done_callback(lambda task: copy_outcome(task, done))

    def cancel() -> None:
        cancelled.append(True)
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
    """A private event loop in a daemon thread: an engine's home (`Local`), RayRunner's sync forms'. SIGINT is
    blocked in the thread (Ctrl-C belongs to the main thread; the loop's executor threads inherit the mask). Once
    stopped, it cancels what is left (an unclosed backend's tasks) and releases its executor."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        except BaseException:  # a callback raised SystemExit/KeyboardInterrupt out of it: the loop is gone
            return
        close_loop(self.loop)

    def current(self) -> bool:
        """Whether the caller runs on this loop."""
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def submit(
        self, coro: Coroutine[Any, Any, T] | Callable[[], Coroutine[Any, Any, T]]
    ) -> tuple[concurrent.futures.Future[T], Callable[[], None]]:
        return submit(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return run(coro, self.loop)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return await call(coro, self.loop)

    def stop(self) -> None:
        """Ask the loop to stop (cancelling what still runs there), without waiting for its thread."""
        with contextlib.suppress(RuntimeError):  # closed already
            self.loop.call_soon_threadsafe(self.loop.stop)

    def close(self, timeout: float | None = None) -> None:
        """Stop the loop and wait for its thread to end (at most `timeout` seconds when given)."""
        self.stop()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)


class Local:
    """One runner, its backend, its stream and its control calls, on the loop thread it owns (started on first
    use). `build`: awaited once on that loop before the backend starts, it returns the backend to use (servers
    whose engine is asked first); the runner's backend stays as it is when there is none."""

    def __init__(
        self,
        runner: Runner,
        tracer: Any,
        name: str,
        build: Callable[[], Awaitable[Backend]] | None = None,
        on_started: Callable[[], object] | None = None,
        freeze_heap: bool = True,
    ):
        self.runner, self.tracer, self.name = runner, tracer, name
        self.freeze_heap = freeze_heap  # tried once, by the first run that puts heap.FREEZE_AT rows in flight
        self._heap: heap.Held | None = None  # this engine's hold on the frozen heap (fsm/run/heap.py)
        self._on_started = on_started  # hears that the backend has started (the fault counters start)
        self.agent, self.codec = runner.agent, runner.codec
        self.controls = Controls(runner, self.start_here)
        self.owned = Owned()  # services its runs start (a harness's gateway), closed with it
        self._build = build
        self._home: LoopThread | None = None
        self._at_exit: Any = None  # the home loop's stop at exit (or when dropped)
        self._started: asyncio.Future[None] | None = None  # the backend's start(), on the home loop
        self._stream: Stream | None = None  # started by the first call
        self._stream_task: asyncio.Future[None] | None = None
        self.closed = False
        self.wedged = False  # a snapshot was taken while code blocked the loop: that loop runs nothing more

    @property
    def backend(self) -> Backend:
        return self.runner.backend

    @property
    def policies(self) -> dict[str, Policy]:
        return self.runner.policies

    @property
    def weight_version(self) -> int:
        return self.runner.gate.version

    @property
    def paused(self) -> bool:
        return self.runner.gate.paused

    # -- the loop ----------------------------------------------------------------------------------------------

    def home(self, coro: Coroutine[Any, Any, Any] | None = None) -> LoopThread:
        """The loop thread, started on first use; RuntimeError once closed (`coro`, never to run, is closed)."""
        if self.closed:
            if coro is not None:
                coro.close()
            raise RuntimeError("this RolloutEngine is closed")
        if self._home is None:
            self._home = home = LoopThread(f"agentfsm engine ({self.name})")
            # An engine dropped unclosed stops its thread; one still open at exit too, so that its tasks end on
            # their loop (not as "Task was destroyed but it is pending!" tracebacks), within AT_EXIT_S.
            self._at_exit = weakref.finalize(self, home.close, AT_EXIT_S)
        return self._home

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the engine's loop, from whichever loop the caller runs."""
        home = self.home(coro)
        if home.current():
            return await coro
        return await home.call(under(self.owned, coro))

    # -- on the loop -------------------------------------------------------------------------------------------

    async def start_here(self) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self._start_backend())
        await asyncio.shield(self._started)

    async def _start_backend(self) -> None:
        if self._build is not None:
            build, self._build = self._build, None
            self.runner.backend = await build()
        for backend in [self.backend, *self._policy_backends()]:  # the spec's other policies' models too
            if isinstance(backend, Lifecycle):
                await backend.start()
        # The servers' weight version, when they report an int: the counter goes on from there.
        reported = await self._reported_version()
        if reported is not None and reported > self.runner.gate.version:
            self.runner.gate.version = reported
        if self._on_started is not None:
            self._on_started()

    def _policy_backends(self) -> list[Backend]:
        """The backends of the spec's policies other than the runner's own, each once."""
        seen = {id(self.backend)}
        out = []
        for policy in self.runner.policies.values():
            if policy.backend is not None and id(policy.backend) not in seen:
                seen.add(id(policy.backend))
                out.append(policy.backend)
        return out

    async def _reported_version(self) -> int | None:
        version = getattr(self.backend, "weight_version", None)
        info = getattr(self.backend, "model_info", None)
        if version is None and info is not None:
            with contextlib.suppress(Exception):  # a server that cannot say (soon): keep counting from 0
                info = await asyncio.wait_for(info(), 5.0)
                version = (info[0] if isinstance(info, list) and info else info or {}).get("weight_version")
        try:
            return int(version) if version is not None else None
        except (TypeError, ValueError):
            return None

    async def stream_here(self) -> Stream:
        await self.start_here()
        if self._stream is None:
            self._stream = Stream(self.runner, lambda: self.runner.gate.version)
        if self._stream_task is None:
            self._stream_task = asyncio.ensure_future(self._stream.serve())
        return self._stream

    async def run_here(
        self, rows: Sequence[Any], n: int, sampling: Sampling, on_done: Callable[[Trajectory], None] | None
    ) -> list[Trajectory]:
        owner = await self.stream_here()  # the engine's one owner, the continuous mode's too
        ctx, trajs = self.runner.prepare(rows, n, self.runner.make_context(sampling=sampling))
        self._freeze_for(len(trajs))
        await owner.run(trajs, ctx, on_done)
        return trajs

    def _freeze_for(self, more: int) -> None:
        """Freeze the heap (fsm/run/heap.py) once `more` trajectories join those in flight past FREEZE_AT: only
        then do full collections cost a batch much, and only then is the one collection before it paid. On the
        loop, at once: the collection holds the interpreter wherever it runs, and no await can lose the hold."""
        if self.freeze_heap and len(self.runner.live) + more >= heap.FREEZE_AT:
            self.freeze_heap = False
            self._heap = heap.hold()

    async def submit_here(
        self, rows: Sequence[Any], n: int, sampling: Sampling, first_index: int | None
    ) -> list[str]:
        stream = await self.stream_here()
        self._freeze_for(len(rows) * n)
        return await stream.submit(rows, n, sampling, first_index)

    async def take_here(self, ask: Take) -> list[Group]:
        stream = await self.stream_here()
        async with asyncio.timeout(ask.timeout):
            return await stream.take(ask.num_groups, ask.max_staleness, ask.stale, ask.exhausted_ok)

    @property
    def stream_stats(self) -> dict[str, Any]:
        return {} if self._stream is None else self._stream.groups.counters()

    async def control_here(self, command: Command) -> Any:
        return await self.controls.run(command)

    # -- snapshots ---------------------------------------------------------------------------------------------

    async def take_snapshot(self, ask: SnapshotAsk) -> dict[str, Any]:
        """RolloutEngine.asnapshot: through the loop, or from outside it when code blocks it."""
        home = self.home()
        if home.current():
            return await self._snapshot_here(ask)

        async def there() -> dict[str, Any]:  # made on the loop, if ever it gets to it (`submit`)
            return await under(self.owned, self._snapshot_here(ask))

        done, cancel = home.submit(there)
        waiter = asyncio.wrap_future(done)
        while True:  # a loop that code blocks runs nothing we send it: snapshot from outside it then
            try:
                # `wait`, not `wait_for`: the snapshot's own TimeoutError (a row that did not reach a boundary in
                # `timeout`) is its answer, not our tick running out, and it must reach the caller
                await asyncio.wait((waiter,), timeout=signals.TICK_S)
            except asyncio.CancelledError:
                cancel()
                raise
            if waiter.done():
                return waiter.result()
            thread = signals.blocked(home.loop)
            if thread is not None and self._stream is not None:
                try:
                    taken = await asyncio.to_thread(self._snapshot_blocked, thread, ask)
                except SnapshotError:  # it turned meanwhile: the loop takes the snapshot after all
                    continue
                cancel()  # the one sent to the loop: never started now, or stopped there
                return taken

    async def _snapshot_here(self, ask: SnapshotAsk) -> dict[str, Any]:
        stream = await self.stream_here()
        gate = self.runner.gate
        path, stop, timeout = ask.path, ask.stop, ask.timeout
        paused = ask.abort_turns and not gate.paused
        if paused:
            gate.close()  # first: no new turn starts while the servers abort the running ones
            await self._pause_or_abort()
        try:
            if path is None:  # journal only: park everyone at a boundary (each recorded there), flush, stop
                try:
                    ready, running = await stream.park(timeout)
                    if stream.journal is not None:
                        await asyncio.to_thread(stream.journal.writer.sync)
                finally:
                    await self._after_snapshot(stream, stop)
                return _counts(ready, running, 0, None)
            data = await stream.snapshot(self._header(ask), timeout)
            try:
                written = await asyncio.to_thread(_write, Path(path), data["records"], ask.fallback)
            finally:
                await self._after_snapshot(stream, stop)
        finally:  # stopped or going on: the servers serve again (a stop has cancelled our turns by now)
            if paused:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(PAUSE_TIMEOUT_S):
                        await self.controls.call("continue_generation", (), {}, False)
                gate.open()
        return _counts(data["ready"], data["running"], data["restarted"], written)

    def _header(self, ask: SnapshotAsk) -> dict[str, Any]:
        return {**resume.identity(self.agent, self.codec), "meta": dict(ask.meta or {})}

    async def _after_snapshot(self, stream: Stream, stop: bool) -> None:
        """The stream stops (`stop`: its running trajectories are cancelled) or goes on past its boundary."""
        try:
            if stop:
                await self.stop_stream()
        finally:
            stream.boundary.open()

    def _wedge(self) -> None:
        """Code blocks the loop for good: nothing more runs there, and the exit does not wait for its thread."""
        self.wedged = True
        if self._at_exit is not None:
            self._at_exit.detach()

    def _snapshot_blocked(self, thread: int, ask: SnapshotAsk) -> dict[str, Any]:
        """`snapshot` while the loop is blocked (see `Stream.snapshot_blocked`), on a thread of the caller's. The
        engine is left `wedged`: nothing more can run on its loop, and closing it skips the loop."""
        assert self._stream is not None
        if ask.path is None:  # journal only: each trajectory is there as it was at its last state boundary
            journal = self._stream.journal
            if journal is not None:
                journal.writer.sync()
            self._wedge()
            ready = list(self._stream.groups.ready)
            return _counts(len(ready), len(self._stream._running), 0, None, blocked=True, finished=ready)
        data, ready = self._stream.snapshot_blocked(self._header(ask), thread)
        self._wedge()
        written = _write(Path(ask.path), data["records"], ask.fallback)
        return _counts(len(ready), data["running"], data["restarted"], written, blocked=True, finished=ready)

    async def _pause_or_abort(self) -> None:
        """Every model turn in flight ends with its partial output: the servers pause in abort mode, or, where
        they cannot (no /pause_generation), each trajectory's request in flight is aborted."""
        try:
            async with asyncio.timeout(PAUSE_TIMEOUT_S):
                done = await self.controls.call("pause_generation", ("abort",), {}, False)
            if done is not None or isinstance(self.backend, Pausable):
                return
            why = "the backend has no pause_generation"
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        if not isinstance(self.backend, Abortable):
            log.warning(
                "snapshot: pausing the servers failed (%s) and the backend cannot abort; waiting for "
                "turns in flight",
                why,
            )
            return
        log.warning("snapshot: pausing the servers failed (%s); aborting the requests in flight instead", why)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PAUSE_TIMEOUT_S):
                aborts = (self.backend.abort(sid) for sid in list(self.runner.live))
                await asyncio.gather(*aborts, return_exceptions=True)

    async def journal_here(self, journal: Any) -> None:
        """Record this engine's continuous mode in `journal` (fsm/run/journal.py Recorder; None: stop)."""
        (await self.stream_here()).journal = self.controls.journal = journal

    async def restore_here(self, path: str | Path | Mapping[str, Any]) -> dict[str, Any]:
        tools = None  # a snapshot's side-effecting calls (a journal's: its Recorder holds them, fsm/output/keep.py)
        if isinstance(path, Mapping):  # read and checked already (a journal's, fsm/run/resume.py)
            data = path
        else:
            loaded = await asyncio.to_thread(resume.load, path, self.agent, self.codec)
            data, tools = loaded.data, loaded.tool_results
        await (await self.stream_here()).restore(data, tools)
        return dict(data.get("meta") or {})

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def stop_stream(self) -> None:
        task, self._stream_task = self._stream_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _close_here(self) -> None:
        try:
            await self.stop_stream()
            await self.owned.aclose()  # after the runs that used them: their sessions have ended
            for backend in [self.backend, *self._policy_backends()] if self._started is not None else []:
                if isinstance(backend, Lifecycle):
                    await backend.close()
            self.agent.tools.close()  # idle tool threads, loops and worker processes (tools restart on use)
        finally:  # the run's owner closes its tracer: every span ended is exported or counted as dropped
            held, self._heap = self._heap, None
            if held is not None:
                held.release()
            close_tracer = getattr(self.tracer, "close", None)
            if close_tracer is not None:
                await asyncio.to_thread(close_tracer)

    async def aclose(self) -> None:
        """Close the backend, then stop the loop's thread."""
        if self.closed:
            return
        if self.wedged:  # code blocks its loop for good (`snapshot`): the process exits around it
            self.closed, self._home = True, None
            return
        if self._home is not None:
            try:
                await self.call(self._close_here())
            finally:
                home, self._home, self.closed = self._home, None, True
                if home.current():  # e.g. from an on_done callback: the loop stops after this task
                    home.close()
                else:
                    await asyncio.to_thread(home.close)
        self.closed = True

    def close(self) -> None:
        if self.closed:
            return
        if self.wedged:  # as `aclose`: nothing sent to its loop would ever run
            self.closed, self._home = True, None
            return
        if self._home is not None:
            try:
                self._home.run(under(self.owned, self._close_here()))
            finally:
                home, self._home, self.closed = self._home, None, True
                home.close()
        self.closed = True


def _counts(ready: int, running: int, restarted: int, path: Path | None, **blocked: Any) -> dict[str, Any]:
    """A snapshot's answer (`asnapshot`): groups ready and running, trajectories restarted, the path written."""
    where = None if path is None else str(path)
    return {
        "ready_groups": ready,
        "running_groups": running,
        "restarted": restarted,
        "path": where,
        **blocked,
    }


def _write(path: Path, data: list[dict[str, Any]], fallback: Callable[[], Path] | None) -> Path:
    """Write a snapshot to `path`, or where it cannot be written (a full disk), into the directory `fallback()`
    makes; the path written."""
    try:
        write_journal(path, data)
        return path
    except OSError as exc:
        if fallback is None:
            raise
        log.warning(
            "snapshot: cannot write %s (%s); writing it to a fallback directory", path, exc.strerror or exc
        )
        kept = fallback() / path.name
        write_journal(kept, data)
        return kept
