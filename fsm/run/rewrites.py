"""Explicit context rewrites, named under the spec's `context.rewrites` and used as state actions: a
model-written summary, a window over the last exchanges, or a user function over the messages. Each starts a
new segment (fsm/run/trajectory.py `start_segment`); the `template` policy's own segments begin in
fsm/run/policy.py.

Each new segment's prompt is the render of its conversation, so every row is exactly what the model was given;
the model's own tokens are never re-tokenized within a segment (they stay as sampled).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fsm.data.rows import RowError, describe
from fsm.families.codec import UnknownRole
from fsm.run.actions import _resumed_turn  # the one model-turn path (resumes, pause gate, versions)
from fsm.run.context import RunContext
from fsm.run.policy import begin, overflow
from fsm.run.trajectory import Trajectory
from fsm.spec.contexts import RewriteSpec
from fsm.tools.isolation import ThreadLane

Action = Callable[[RunContext, Trajectory], Awaitable[None]]
# What a rewrite function may return, as the gateway bounds a harness's request (GatewayLimits): the render that
# follows runs on the event loop, and its time grows with what it is given.
MAX_MESSAGES = 4096
MAX_CHARS = 8 << 20  # the text of every message together
MAX_DEPTH = 32  # levels of nesting in a returned message (a tool call's arguments are a few)
# Text past prompt_length x this cannot fit in prompt_length tokens (real tokenizers average 3-5 characters a
# token): such a rewrite is refused as one whose render is too long is, without rendering it.
CHARS_PER_TOKEN = 16


def _head(messages: list[dict[str, Any]]) -> int:
    """How many leading messages are the task: up to and including the first user message."""
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            return i + 1
    return len(messages)


def window(messages: list[dict[str, Any]], keep_last: int) -> list[dict[str, Any]]:
    """The task and the last `keep_last` exchanges (a model turn and the observations after it)."""
    head = _head(messages)
    starts = [i for i in range(head, len(messages)) if messages[i].get("role") == "assistant"]
    if len(starts) <= keep_last:
        return messages
    return messages[:head] + messages[starts[-keep_last] :]


def _restart(ctx: RunContext, traj: Trajectory, messages: list[dict[str, Any]], reason: str) -> None:
    """The conversation becomes `messages`; a new segment starts from its render (nothing when unchanged)."""
    messages = [dict(m) for m in messages]
    begin(ctx, traj, ctx.codec.encode_prompt(messages, traj.tool_schemas), reason, messages)


def _refused(where: str, why: str) -> RowError:
    """A rewrite function failed or returned what no row can take: its row's error, of kind "rewrite"."""
    return RowError(f"{where}: {why}", "rewrite")


def make_rewrite(name: str, spec: RewriteSpec, fn: Any = None) -> Action:
    """The action a named rewrite of the spec runs; `fn` is the resolved user function, if any."""
    if spec.keep_last is not None:
        keep = spec.keep_last

        async def window_action(ctx: RunContext, traj: Trajectory) -> None:
            new = window(traj.messages, keep)
            if new is not traj.messages:
                _restart(ctx, traj, new, "rewrite")

        window_action.__name__ = name
        return window_action
    if fn is not None:
        call = _caller(name, spec, fn)

        async def function_action(ctx: RunContext, traj: Trajectory) -> None:
            where = f"rewrite {name!r} ({spec.function}) on row {traj.row_name}"
            with ctx.gate.whole():  # until it returns, the trajectory is as it was: a snapshot need not wait
                new = await call([dict(m) for m in traj.messages], ctx.agent.limits.rewrite_timeout_s, where)
            chars = _check(new, where)
            try:
                ctx.codec.check_roles(new)
            except UnknownRole as exc:  # it would vanish from the prompt, and the task with it
                raise _refused(where, f"returned {exc}") from None
            limit = ctx.agent.limits.prompt_length
            if chars > limit * CHARS_PER_TOKEN:  # bounded time: never rendered (see CHARS_PER_TOKEN)
                why = f"a rewrite prompt of {chars} characters, more than prompt_length {limit} tokens hold"
                overflow(traj, why)
            elif new != traj.messages:
                try:
                    _restart(ctx, traj, new, "rewrite")
                except RowError:
                    raise
                except Exception as exc:  # a shape _check lets through that the template cannot take
                    why = f"the chat template cannot render what it returned: {type(exc).__name__}: {exc}"
                    raise _refused(where, why) from None

        function_action.__name__ = name
        return function_action
    summary = spec.summary
    assert summary is not None

    async def summary_action(ctx: RunContext, traj: Trajectory) -> None:
        task = traj.messages[: _head(traj.messages)]
        asking = [*traj.messages, {"role": "user", "content": summary.instruction}]
        if not begin(ctx, traj, ctx.codec.encode_prompt(asking, traj.tool_schemas), "summary", asking):
            return
        limits = ctx.agent.limits
        cap = summary.max_new_tokens or ctx.sampling.max_new_tokens or limits.response_length
        params = ctx.sampling.for_turn(traj, min(cap, limits.response_length))
        t0 = time.perf_counter()
        try:
            ids, logprobs, versions, finish = await _resumed_turn(
                ctx, traj, params, f"{traj.session_id}_s{traj.assistant_turns:02d}", whole=False
            )
        finally:
            traj.metrics.generate_sequences += time.perf_counter() - t0
        if ctx.sampling.logprobs and logprobs is None:
            traj.logprobs_missing = True
        traj.append_generated(ids, logprobs, versions)
        traj.assistant_turns += 1
        traj.last_finish_reason = finish
        message = ctx.codec.assistant_message(ctx.codec.turn_text(ids), [])
        traj.messages.append(message)  # the summary segment's conversation, for --check-tokens
        text = str(message.get("content") or "").strip()
        _restart(ctx, traj, [*task, {"role": "user", "content": summary.prefix + text}], "rewrite")

    summary_action.__name__ = name
    return summary_action


def _caller(name: str, spec: RewriteSpec, fn: Any) -> Callable[[list, float | None, str], Awaitable[Any]]:
    """`fn` called under the rewrite's deadline: a coroutine on the run's loop, a sync function in threads of
    its own (never holding the loop; past the deadline its thread is written off, as a reward's is). Whatever it
    raises ends its row, BaseExceptions too: a KeyboardInterrupt it raises once left the loop and killed the
    engine's thread, a hang with no way out."""
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
    lane: list[ThreadLane] = []  # made on first use

    async def call(messages: list[dict[str, Any]], limit: float | None, where: str) -> Any:
        try:
            async with asyncio.timeout(limit):
                if is_async:
                    out = await fn(messages)
                else:
                    if not lane:
                        lane.append(ThreadLane(f"rewrite {name}", 4))
                    out = await lane[0].call(fn, messages)
                if inspect.isawaitable(out):
                    out = await out
                return out
        except TimeoutError:
            raise _refused(where, f"no result within {limit:g} s (limits.rewrite_timeout_s)") from None
        except RowError:
            raise
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the run cancels this row: not the function's doing
            raise _refused(where, f"raised CancelledError: {exc}") from None
        except BaseException as exc:  # KeyboardInterrupt, SystemExit, GeneratorExit from the function
            raise _refused(where, f"raised {type(exc).__name__}: {exc}") from None

    return call


def _check(new: Any, where: str) -> int:
    """A non-empty list of at most MAX_MESSAGES chat messages of JSON values holding at most MAX_CHARS characters in
    all (tool calls' arguments too), nested at most MAX_DEPTH deep, whose content is text or content parts with
    text: checked before anything walks or renders it. The characters it holds."""
    if not isinstance(new, list) or not new:
        raise _refused(where, f"must return a non-empty list of chat messages, got {type(new).__name__}")
    if len(new) > MAX_MESSAGES:
        raise _refused(where, f"returned {len(new)} messages, past the bound of {MAX_MESSAGES}")
    chars = 0
    for k, m in enumerate(new):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            what = type(m).__name__ if not isinstance(m, dict) else "a mapping without a role string"
            raise _refused(where, f"must return a non-empty list of chat messages; message {k} is {what}")
        chars += _size(m, MAX_CHARS - chars, where, k)
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
                    why = f"must be a mapping whose text is a string, got {describe(part)}"
                    raise _refused(where, f"message {k}'s content part {j} {why}")
        elif not (content is None or isinstance(content, str)):
            why = f"must be text or content parts, got {describe(content)}"
            raise _refused(where, f"message {k}'s content {why}")
    return chars


def _size(value: Any, budget: int, where: str, k: int) -> int:
    """The characters of message `k`'s strings and keys, each other item counted as one; RowError once they pass
    `budget` (the walk stops there), for a value nested past MAX_DEPTH, or for one that is not JSON."""
    size, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _refused(where, f"message {k} is nested deeper than {MAX_DEPTH} levels")
        if item is None or isinstance(item, (bool, int, float)):
            size += 1
        elif isinstance(item, str):
            size += len(item)
        elif isinstance(item, (dict, list, tuple)):
            size += 1 + len(item) + sum(len(key) for key in item if isinstance(key, str))
        else:
            raise _refused(where, f"message {k} holds a {type(item).__name__}, which is not a JSON value")
        if size > budget:  # before a container's items are stacked: a list of 10^7 costs nothing
            raise _refused(where, f"returned more than {MAX_CHARS} characters of messages (at message {k})")
        if isinstance(item, dict):
            for key, sub in item.items():
                if not isinstance(key, str):
                    raise _refused(where, f"message {k} has a key that is not a string: {describe(key)}")
                stack.append((sub, depth + 1))
        elif isinstance(item, (list, tuple)):
            stack.extend((sub, depth + 1) for sub in item)
    return size
