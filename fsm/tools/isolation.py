"""Containment for user tool code: where a tool's code runs so that its timeout is enforced and nothing it
does (hang, spin, raise SystemExit, return 50 MB, die) reaches the event loop, the model or other rows
(what a user sees: docs/errors.md, Tools). Standard library only: a tool's worker process imports it.

Every tool gets a *lane* of its own, and no lane uses the loop's default executor (the embedded model's
decode and reward scoring run there: a tool stuck in it once starved decode for a minute).
- `ThreadLane` (sync functions): the tool's daemon threads. Python cannot stop a thread, so a call past its
  timeout is *written off* and replaced; past `max_stuck` of them the lane refuses calls rather than grow.
- `LoopLane` (coroutines, class tools' lifecycle): the tool's own loop in a daemon thread, because a
  coroutine that never awaits cannot be interrupted by the loop that runs it; a loop that has not run a
  cancellation `grace_s` after it was sent is wedged, written off and replaced.
- `InlineLane` (`isolation: none`: coroutines that only await, code that only computes briefly): the run's own
  loop, no hand-off (a hop costs more CPU than such code's work); every step is timed, and code that holds the
  loop past `blocking_s` a few times a minute moves to a lane of its own. Opt-in only: one that spins for good
  would hold the loop.
- `ProcessLane` (`isolation: process`, fsm/tools/processes.py): worker processes, one call at a time, the
  worker's process group SIGKILLed past the timeout. Fault containment, not a security sandbox.
Whatever the tool raises that is not an `Exception` comes back as `ToolCrashed`, ending only its trajectory;
a long answer is cut (`shrink`) where the tool ran, so a 50 MB string never crosses a hand-off.

A lane's answer crosses back to the caller's loop: `call_soon_threadsafe` wakes that loop (a self-pipe write, a
GIL contest) per call, and a lane's thousands of calls come in bursts: a `Mailbox` wakes its loop once per burst
and runs it in order; a `Hop` is one call's answer handed back so. (An engine's own loop thread, and the
hand-offs onto it, are fsm/run/local.py's.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import copy
import functools
import inspect
import json
import logging
import queue
import resource
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("agentfsm.tools")

STUCK_PER_WORKER = 4  # a ThreadLane refuses calls past workers * this many written-off threads
WEDGED_AFTER_S = 1.0  # a LoopLane that has not run a cancellation this long after it was sent is wedged
BLOCKING_STEP_S = 0.05  # an InlineLane tool step holding the event loop this long is a stall
# BLOCKING_STRIKES stalls within BLOCKING_WINDOW_S and within its last BLOCKING_AMONG steps move the code to a lane
# of its own (one alone may be garbage collection, the process waiting for a core, or the GIL held by a thread the
# OS put off: a busy machine strikes a well-behaved tool now and then, code that blocks strikes on most steps)
BLOCKING_STRIKES, BLOCKING_WINDOW_S, BLOCKING_AMONG = 3, 60.0, 20


class ToolCrashed(Exception):
    """The tool raised a BaseException (SystemExit, KeyboardInterrupt, its own CancelledError...) or its
    worker process died: the trajectory ends with this message as its reason; other rows go on."""


class ToolUnavailable(Exception):
    """The lane cannot start the call (too many calls stuck past their timeout, a worker that cannot
    start). The model reads it as an error observation."""


def crashed(name: str, exc: BaseException) -> ToolCrashed:
    detail = f": {exc}" if str(exc) else ""
    return ToolCrashed(f"tool {name!r} raised {type(exc).__name__}{detail}")


def cut(text: str, keep: int | None) -> str:
    return text if keep is None or len(text) <= 2 * keep else text[:keep] + text[-keep:]


def shrink(ret: Any, keep: int | None, outer: bool = True) -> Any:
    """The tool's return with its text cut, shaped as fsm.tools.base.normalize_return reads it (a tuple inside
    the (response, reward, metrics) tuple is text: its repr)."""
    if isinstance(ret, str):
        return cut(ret, keep)
    if isinstance(ret, dict):
        return cut(json.dumps(ret, ensure_ascii=False), keep)
    if isinstance(ret, tuple) and outer:
        return (shrink(ret[0], keep, outer=False), *ret[1:]) if 1 <= len(ret) <= 3 else ret
    if type(ret).__name__ == "ToolResponse" and isinstance(getattr(ret, "text", None), str):
        ret = copy.copy(ret)
        ret.text = cut(ret.text, keep)
        return ret
    return cut(str(ret), keep)


class Lane(Protocol):
    """Where one tool's code runs. `ready` is awaited outside the call's timeout (it may start a worker)."""

    async def ready(self) -> None:
        return None

    async def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any: ...
    def close(self) -> None: ...


# --- answers back to the caller's loop -----------------------------------------------------------------


AnyFuture = concurrent.futures.Future | asyncio.Future


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
            box = _mailboxes.setdefault(loop, Mailbox(loop))
    return box


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close a stopped loop of a thread of ours as `asyncio.run` closes its own: its tasks cancelled and awaited,
    then its async generators and its default executor shut down."""
    left = asyncio.all_tasks(loop)
    for task in left:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.run_until_complete(loop.shutdown_default_executor())
    loop.close()


def copy_outcome(source: AnyFuture, waiter: AnyFuture) -> None:
    """`source`'s result, exception or cancellation onto `waiter`, across the two kinds of future."""
    if waiter.done():  # the caller stopped waiting
        return
    if source.cancelled():
        waiter.cancel()
    elif (exc := source.exception()) is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(source.result())


class Hop:
    """One call's answer handed back to the caller's loop from the thread that ran it, through the loop's
    Mailbox: what `asyncio.wrap_future` of a concurrent future does, without the future (a Condition and its
    lock built per call, their locks taken for each callback). `cancelled`: the caller stopped waiting, so
    a call that has not started never starts (the lane checks it under its own lock or on its own loop)."""

    __slots__ = ("waiter", "box", "cancelled")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.waiter: asyncio.Future = loop.create_future()
        self.box = mailbox(loop)
        self.cancelled = False

    def answer(self, result: Any = None, error: BaseException | None = None) -> None:
        """From any thread: the outcome onto the caller's waiter, through its loop's Mailbox."""
        try:
            self.box.post(_answer, self.waiter, result, error)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
            pass


def _answer(waiter: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if waiter.done():  # the caller stopped waiting
        return
    if error is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(result)


# --- threads: sync functions -----------------------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    context: contextvars.Context
    hop: Hop
    started: bool = False  # a thread took it (under the lane's lock; a cancelled hop is never started)
    finished: bool = False  # its thread is done with it (under the lane's lock)
    written_off: bool = False  # its caller gave up while it ran: the thread leaves the pool when done
    clock: Any = None  # the caller's StartTimeout: it counts from when a thread takes the job


# fsm/tools/base.py's StartTimeout of the call being made: a ThreadLane's thread stamps its `started` when it takes
# the call (a wait in the queue is not the tool's: thousands of calls in flight queue for a few threads)
START_CLOCK: contextvars.ContextVar[Any] = contextvars.ContextVar("agentfsm_start", default=None)
# the running tool call's idempotency key (fsm/tools/base.py `idempotency_key`); a ProcessLane's worker: KEY_ENV
KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("agentfsm_key", default=None)
KEY_ENV = "AGENTFSM_IDEMPOTENCY_KEY"
# who calls (the run's driver sets the trajectory's session id): an InlineLane's step in progress records it
CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("agentfsm_caller", default=None)
# thread ident -> (label, caller, start) of the InlineLane step running on that thread's loop now: a step
# that never returns blocks the loop, and the run's loop watch (fsm/run/signals.py) reads here whom to name
INLINE_STEPS: dict[int, tuple[str, str | None, float]] = {}


class ThreadLane(Lane):
    """A sync tool's own daemon threads: at most `workers` running calls; a timed-out call's thread is
    written off (it no longer counts) and replaced, up to `max_stuck` written-off threads still running."""

    def __init__(self, name: str, workers: int, max_stuck: int | None = None):
        self.name, self.workers = name, workers
        self.max_stuck = max_stuck if max_stuck is not None else workers * STUCK_PER_WORKER
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0  # serving threads, written-off ones excluded
        self._idle = 0  # serving threads waiting for a job that no queued job is promised to
        self._backlog = 0  # queued jobs waiting for a thread to free up
        self.stuck = 0  # written-off threads still running their call
        self.written_off = 0  # over the lane's life

    async def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        hop = Hop(asyncio.get_running_loop())
        job = _Job(fn, args, kwargs, contextvars.copy_context(), hop, clock=START_CLOCK.get())
        if job.clock is not None:
            job.clock.started = None  # until a thread takes it
        self._submit(job)
        try:
            return await hop.waiter
        except asyncio.CancelledError:  # a timeout (ours or the action's) or shutdown: stop waiting for it
            self._write_off(job)
            raise

    def _submit(self, job: _Job) -> None:
        with self._lock:
            if self.stuck >= self.max_stuck:
                raise ToolUnavailable(
                    f"tool {self.name!r} has {self.stuck} calls still running past their timeout, so no new "
                    "call starts until one returns (make the tool honour its timeout, or use isolation: process)"
                )
            self._queue.put(job)
            if self._idle:
                self._idle -= 1
            elif self._threads < self.workers:
                self._start_thread()
            else:
                self._backlog += 1

    def _start_thread(self) -> None:  # under the lock
        self._threads += 1
        threading.Thread(target=self._serve, name=f"agentfsm-tool-{self.name}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:  # close()
                return
            with self._lock:
                job.started = not job.hop.cancelled
            if job.started:
                if job.clock is not None:
                    job.clock.started = time.monotonic()
                _run_job(self.name, job)
            with self._lock:
                job.finished = True
                if job.written_off:  # a replacement took this thread's place
                    self.stuck -= 1
                    return
                if self._backlog:
                    self._backlog -= 1
                else:
                    self._idle += 1
            del job  # its result (a 50 MB answer) is not kept alive while this thread waits

    def _write_off(self, job: _Job) -> None:
        with self._lock:
            job.hop.cancelled = True
            if not job.started or job.finished:  # still queued, it will never run; or done
                return
            job.written_off = True
            self._threads -= 1
            self.stuck += 1
            self.written_off += 1
            if self._backlog:  # a queued call was waiting for this thread: its replacement starts now
                self._backlog -= 1
                self._start_thread()

    def close(self) -> None:
        """Let the idle threads end (stuck ones are abandoned; daemons never delay exit). Reusable after."""
        with self._lock:
            for _ in range(self._idle):
                self._queue.put(None)
            self._threads -= self._idle
            self._idle = 0


def _run_job(name: str, job: _Job) -> None:
    try:
        result = job.context.run(job.fn, *job.args, **job.kwargs)
    except Exception as exc:
        job.hop.answer(error=exc)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt...: the tool's, never a signal to us
        job.hop.answer(error=crashed(name, exc))
    else:
        job.hop.answer(result)


# --- an event loop of its own: coroutines ----------------------------------------------------------------


class _ToolLoop:
    """A tool's event loop in a daemon thread (SIGINT is not blocked there: it is the tool's own thread);
    `pending` futures fail if the loop dies under them. Once stopped, it cancels what is left and releases its
    executor."""

    def __init__(self, name: str):
        self.name = name
        self.pending: set[Hop] = set()
        self.cancel_sent: float | None = None  # a cancellation the loop has not run yet, sent at this time
        self.loop = asyncio.new_event_loop()
        self.mailbox = Mailbox(self.loop)
        self.thread = threading.Thread(target=self._main, name=f"agentfsm-tool-loop-{name}", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        except BaseException as exc:  # a tool's callback raised SystemExit/KeyboardInterrupt out of it
            self._gone(crashed(self.name, exc))
            return
        self._gone(ToolCrashed(f"tool {self.name!r}: its event loop was stopped during the call"))
        close_loop(self.loop)

    def _gone(self, exc: Exception) -> None:
        for hop in list(self.pending):  # nobody else would ever answer their callers
            hop.answer(error=exc)

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):  # closed already
            self.loop.call_soon_threadsafe(self.loop.stop)

    def alive(self, grace_s: float) -> bool:
        sent = self.cancel_sent
        return self.thread.is_alive() and (sent is None or time.monotonic() - sent < grace_s)


class LoopLane(Lane):
    """Coroutines of one tool on the tool's own event loop thread, so a busy loop blocks only that thread."""

    def __init__(self, name: str, grace_s: float = WEDGED_AFTER_S):
        self.name, self.grace_s = name, grace_s
        self._lock = threading.Lock()
        self._current: _ToolLoop | None = None
        self.written_off = 0  # wedged loops left behind

    def _loop(self) -> _ToolLoop:
        with self._lock:
            current = self._current
            if current is not None and not current.alive(self.grace_s):
                self.written_off += 1  # wedged by a coroutine that never yields: leave its thread behind
                current = None
            if current is None:
                current = self._current = _ToolLoop(self.name)
            return current

    async def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        tool_loop = self._loop()
        hop = Hop(asyncio.get_running_loop())
        context = contextvars.copy_context()
        tasks: list[asyncio.Task] = []

        def start() -> None:  # on the tool's loop
            if hop.cancelled:  # the caller gave up before the call started
                tool_loop.pending.discard(hop)
                return
            task = tool_loop.loop.create_task(self._guarded(fn, args, kwargs), context=context)
            task.add_done_callback(functools.partial(_settle, self.name, hop, tool_loop.pending))
            tasks.append(task)

        def cancel() -> None:  # on the tool's loop: running it at all proves the loop is not wedged
            tool_loop.cancel_sent = None
            for task in tasks:
                task.cancel()

        tool_loop.pending.add(hop)
        tool_loop.mailbox.post(start)
        try:
            return await hop.waiter
        except asyncio.CancelledError:  # our caller gave up: cancel the tool's task, if its loop still runs
            hop.cancelled = True
            if tool_loop.cancel_sent is None:
                tool_loop.cancel_sent = time.monotonic()
            if not tool_loop.loop.is_closed():
                tool_loop.loop.call_soon_threadsafe(cancel)
            raise

    async def _guarded(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        try:
            result = fn(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result
        except Exception:
            raise
        except BaseException as exc:  # must not reach the loop: Task re-raises SystemExit out of run_forever
            task = asyncio.current_task()
            if isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling():
                raise  # ours: the caller gave up
            raise crashed(self.name, exc) from exc

    def close(self) -> None:
        with self._lock:
            current, self._current = self._current, None
        if current is not None:
            current.stop()


def _settle(name: str, hop: Hop, pending: set[Hop], task: asyncio.Task) -> None:
    pending.discard(hop)
    if task.cancelled():
        hop.answer(error=ToolCrashed(f"tool {name!r} was cancelled"))
    else:
        hop.answer(task.result() if (error := task.exception()) is None else None, error)


# --- the run's own loop: isolation: none -----------------------------------------------------------------


class InlineLane(Lane):
    """Code awaited on the caller's loop, no hand-off: a tool's coroutine, each step timed, or (`threads` > 0) a
    sync function that only computes briefly (a reward's regex), timed whole. BLOCKING_STRIKES stalls among its
    recent steps move the calls to a lane of their own: a `LoopLane` for coroutines, a `ThreadLane` of `threads`
    for a sync function (the call that stalled finishes where it is). `label` names the code in warnings and the
    loop watch's report."""

    def __init__(self, name: str, *, threads: int = 0, label: str | None = None):
        self.name, self.threads = name, threads
        self.label = label or f"tool {name!r}"
        self.steps = 0  # steps timed so far
        # recent stalls: when they ended (time.monotonic), at which step
        self.stalls: list[tuple[float, int]] = []
        self.moved: Lane | None = None  # where the calls go once the code has stalled the loop

    async def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        if self.moved is not None:
            return await self.moved.call(fn, *args, **kwargs)
        if self.threads:
            return _timed_call(self, fn, args, kwargs)
        result = fn(*args, **kwargs)
        return await _Timed(self, result) if inspect.iscoroutine(result) else result

    def blocked(self, seconds: float) -> None:
        """A step held the loop `seconds` (past BLOCKING_STEP_S)."""
        now, step = time.monotonic(), self.steps
        recent = [(t, k) for t, k in self.stalls if now - t < BLOCKING_WINDOW_S and step - k < BLOCKING_AMONG]
        self.stalls = recent + [(now, step)]
        if self.moved is None and len(self.stalls) >= BLOCKING_STRIKES:
            self.moved = ThreadLane(self.name, self.threads) if self.threads else LoopLane(self.name)
            log.warning(
                "%s (isolation: none) held the event loop %d times in %g s, last for %.3f s in one step; its "
                "calls run on %s of its own from now on (declare it isolation: thread)",
                self.label,
                len(self.stalls),
                BLOCKING_WINDOW_S,
                seconds,
                "threads" if self.threads else "an event loop thread",
            )

    def close(self) -> None:
        if self.moved is not None:
            self.moved.close()


def _timed_call(lane: InlineLane, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """A sync function called on the loop, timed as one step; what it raises that is not an `Exception` comes
    back as `ToolCrashed`, as from a `ThreadLane`."""
    here, clock = threading.get_ident(), time.perf_counter
    lane.steps += 1
    t0, used = clock(), _usage()
    INLINE_STEPS[here] = (lane.label, CALLER.get(), t0)
    try:
        return fn(*args, **kwargs)
    except Exception:
        raise
    except BaseException as exc:  # SystemExit, KeyboardInterrupt...: the function's, never a signal to us
        raise crashed(lane.name, exc) from None
    finally:
        INLINE_STEPS.pop(here, None)
        if (took := clock() - t0) >= BLOCKING_STEP_S and _held(used, BLOCKING_STEP_S):
            lane.blocked(took)


class _Timed:
    """Awaits a coroutine step by step (as `await` would: what it yields goes to the task and back), timing
    each step for its lane."""

    __slots__ = ("coro", "lane")

    def __init__(self, lane: InlineLane, coro: Any):
        self.lane, self.coro = lane, coro

    def __await__(self) -> Any:
        coro, lane, clock, limit = self.coro, self.lane, time.perf_counter, BLOCKING_STEP_S
        steps, here, name, caller = INLINE_STEPS, threading.get_ident(), lane.label, CALLER.get()
        value: Any = None
        error: BaseException | None = None
        while True:
            lane.steps += 1
            t0, used = clock(), _usage()
            steps[here] = (name, caller, t0)  # a new tuple per step: a reader can tell one step from the next
            try:
                step = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
            finally:
                steps.pop(here, None)
                if (took := clock() - t0) >= limit and _held(used, limit):
                    lane.blocked(took)
            value = error = None
            try:
                value = yield step
            except GeneratorExit:  # this awaitable is being closed: close the tool's coroutine with it
                coro.close()
                raise
            except BaseException as exc:  # a cancellation (the timeout's): the coroutine gets to handle it
                error = exc


# this thread's resource usage so far (Linux); None where the OS does not count it per thread
_usage: Callable[[], Any] = (
    functools.partial(resource.getrusage, resource.RUSAGE_THREAD)
    if hasattr(resource, "RUSAGE_THREAD")
    else lambda: None
)


def _held(before: Any, limit: float) -> bool:
    """Whether a step that took `limit` or more held the loop itself: it blocked (a voluntary context switch: a
    sleep, I/O, a lock, the GIL) or ran on the CPU that long. A step the OS only kept waiting for a core (a busy
    machine: involuntary switches alone) did not, and a tool moved for it would be told to change its spec."""
    if before is None:
        return True
    after = _usage()
    ran = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return after.ru_nvcsw > before.ru_nvcsw or ran >= limit
