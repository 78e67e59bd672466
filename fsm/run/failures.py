"""A state's action under its declared failure rules (fsm/spec/failures.py): timeout, heartbeat, retry, catch.

The driver (fsm/run/runtime.py) runs a state with rules through `run_state`; a state without any keeps the
driver's own two lines, so existing specs run exactly as before. Each failure a rule handles is recorded once,
as a `Failure` in `traj.failures` (its kind as the rules name it: `classify`); one no rule handles goes up to the
driver, which records the row's, with the attempt it failed at.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from backends.base import BackendError, BackendTimeout, GenerationAborted, RetryPolicy
from fsm.data.rows import RowError
from fsm.run.agent import CompiledAgent, Edge
from fsm.spec.failures import StateRetry, matches
from fsm.tools.isolation import ToolCrashed


class StateFailure(Exception):
    """A failure a state's rules name, raised where no exception existed before: a tool error that a retry or
    catch names (otherwise an observation) and a missed heartbeat."""

    def __init__(self, error: str, message: str):
        super().__init__(message)
        self.error = error


@dataclass(frozen=True, slots=True)
class Failure:
    """One failure, recorded once where it happens: the one that ended a row (`Trajectory.failure`, by the
    driver, fsm/run/runtime.py) or one a state's retry or catch handled (`Trajectory.failures`, by
    fsm/run/failures.py). Metrics, spans, summaries, records and `on_error` read its fields; nothing parses a
    message back for its kind."""

    kind: str  # low-cardinality: "backend", "timeout", "aborted", "bad_row", "reward", "tool.exception", a class...
    state: str  # the state it happened in
    cause: str  # what happened, one message (a row's: its `error`, as `termination_reason` quotes it)
    attempt: int = 1  # the attempt of the state's action that failed (its retry rules count them)
    handled: str | None = None  # "retry" or "catch": a state's rule handled it; None: it ended the row
    to: str | None = None  # a catch's target state
    on_error: str = "mask"  # a row it ended: what the row became (fsm/spec/failures.py)
    at_ns: int = field(default_factory=time.time_ns)

    def record(self) -> dict[str, Any]:
        """A handled failure as trajectories.jsonl's `failures` lists it."""
        out = {"handled": self.handled, "state": self.state, "error": self.kind, "attempt": self.attempt}
        out["message"] = self.cause[:500]
        if self.to is not None:
            out["to"] = self.to
        return out | {"at_ns": self.at_ns}

    @classmethod
    def legacy(cls, error: Any, state: Any, extra: Any) -> Failure | None:
        """A row's failure as engines before `Failure` wrote it (`error` text, `extra.on_error`), so that their runs
        resume with their failed rows failed."""
        on_error = str(extra.get("on_error", "mask")) if isinstance(extra, dict) else "mask"
        return cls("error", str(state), error, on_error=on_error) if isinstance(error, str) else None


# what a rule names each exception (the first class it is an instance of), after StateFailure's own name
_NAMES = (
    (ToolCrashed, "tool.crashed"),
    (GenerationAborted, "backend.aborted"),
    (BackendTimeout, "backend.timeout"),
    (BackendError, "backend"),
    (TimeoutError, "timeout"),
    (Exception, "error"),
)


def classify(exc: BaseException) -> str | None:
    """The error name of `exc` (fsm.spec.failures.ERRORS), None for what no rule may handle: a bad row or a
    limit (RowError), and BaseExceptions (a cancellation, a Ctrl-C)."""
    if isinstance(exc, StateFailure):
        return exc.error
    return None if isinstance(exc, RowError) else next((n for c, n in _NAMES if isinstance(exc, c)), None)


def _policy(r: StateRetry) -> RetryPolicy:  # RetryPolicy's fields in order
    return RetryPolicy(r.max_attempts, r.backoff_s, r.multiplier, r.backoff_max_s, r.jitter)


async def _watched(action: Awaitable[None], traj: Any, heartbeat_s: float, state: str) -> None:
    """`action` cancelled when no heartbeat came for `heartbeat_s` (the start counts as one)."""
    traj.heartbeat_at = time.monotonic()
    task = asyncio.ensure_future(action)
    try:
        while True:
            left = traj.heartbeat_at + heartbeat_s - time.monotonic()
            if left <= 0:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                why = f"no heartbeat from the tools of {state} for {heartbeat_s:g}s (heartbeat_s)"
                raise StateFailure("heartbeat", why)
            done, _ = await asyncio.wait({task}, timeout=left)
            if done:
                return task.result()
    finally:
        if not task.done():  # our own cancellation: the action goes with it
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _attempt(
    action: Callable[[Any, Any], Awaitable[None]], ctx: Any, traj: Any, state: str, timeout: float | None
) -> None:
    st = ctx.agent.spec.states[state]
    call = action(ctx, traj)
    if st.heartbeat_s is not None:
        call = _watched(call, traj, st.heartbeat_s, state)
    if timeout is None:
        await call
    else:
        async with asyncio.timeout(timeout):
            await call


async def run_state(
    agent: CompiledAgent, state: str, ctx: Any, traj: Any, action_timeout: float | None
) -> Edge | None:
    """Run `state`'s action under its rules: None when it succeeded (the driver picks the edge), the catch
    edge to take when a caught failure ended it. A failure no rule handles raises, as without rules."""
    st = agent.spec.states[state]
    limits = [t for t in (st.timeout_s, action_timeout) if t is not None]
    timeout = min(limits) if limits else None
    action = agent.actions[state]
    pending = list(getattr(traj, "pending_calls", []) or [])  # a retried tool round answers the same calls
    attempts: dict[int, int] = {}  # retry rule -> attempts so far
    while True:
        try:
            await _attempt(action, ctx, traj, state, timeout)
            return None
        except Exception as exc:
            error = classify(exc)
            if error is None:
                raise
            message = str(exc) or type(exc).__name__
            if isinstance(exc, TimeoutError) and st.timeout_s is not None and timeout == st.timeout_s:
                message = f"action of {state} exceeded timeout_s {st.timeout_s:g}s"
            k = next((i for i, r in enumerate(st.retry) if matches(r.errors, error)), None)
            n = attempts.get(k, 1) if k is not None else 1
            if k is not None and n < st.retry[k].max_attempts:
                attempts[k] = n + 1
                traj.failures.append(Failure(error, state, message, n, "retry"))
                traj.pending_calls = list(pending)
                await asyncio.sleep(_policy(st.retry[k]).delay(n))
                continue
            for edge in agent.catches.get(state, ()):
                if edge.catch is not None and matches(list(edge.catch), error):
                    traj.failures.append(Failure(error, state, message, n, "catch", edge.dest))
                    traj.pending_calls = list(pending)  # a failed tool round: observe_error answers each call
                    return edge
            if isinstance(exc, StateFailure):  # named by a rule that is now spent: the row ends as it says
                exc = RowError(f"{error} in {state}: {message}", error)
            elif error == "timeout" and timeout == st.timeout_s:
                exc = RowError(f"timeout: {message}", "timeout")
            exc.attempt = n  # type: ignore[attr-defined]  # the driver records the row's failure with it
            raise exc from None
