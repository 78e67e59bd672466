"""Tools: verl's lifecycle (create -> execute -> calc_reward -> release, per call), plain functions,
timeouts, retries, argument checks against the tool's JSON schema (a complaint the model reads instead of a
TypeError in the tool) and response truncation.

Every way a call can go wrong ends as text the model reads (an error observation) plus a counter, except a
tool that raises a BaseException (SystemExit, KeyboardInterrupt, its own CancelledError) or whose worker
process dies: that ends its trajectory (`ToolCrashed`). Tool code runs in the tool's own lane
(fsm/tools/isolation.py), never in the event loop's default executor, and on the event loop itself only when the
spec says the tool only awaits (`isolation: none`), so a timeout always fires on time. Tool instances are
built once per compiled spec and shared.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import inspect
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from backends.base import RetryPolicy, retry
from fsm.data.rows import encodable
from fsm.families.parsers import ToolCall
from fsm.spec.failures import MAX_WAIT_S
from fsm.spec.model import DEFAULT_TOOL_WORKERS, LimitsSpec, ToolPolicySpec
from fsm.tools.isolation import (
    KEY,
    KEY_ENV,
    START_CLOCK,
    InlineLane,
    Lane,
    LoopLane,
    ThreadLane,
    ToolCrashed,
    ToolUnavailable,
    crashed,
    cut,
    shrink,
)
from fsm.tools.processes import ProcessLane

__all__ = [
    "AgentData",
    "BaseTool",
    "BoundTool",
    "CallOutcome",
    "FunctionTool",
    "ToolCrashed",
    "ToolResponse",
    "ToolSet",
    "ToolUnavailable",
    "heartbeat",
    "idempotency_key",
    "normalize_return",
]

# the running call's heartbeat (its trajectory's AgentData.heartbeat): the lanes copy the caller's context into
# the tool's thread or event loop, so a plain function reaches it with `fsm.heartbeat()`
_BEAT: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "agentfsm_beat", default=None
)


def idempotency_key() -> str | None:
    """The running tool call's idempotency key, `{session}_c{turn}_{call}`: `fsm.idempotency_key()` from a plain
    function's thread or coroutine, `agent_data.idempotency_key` in a class tool. The same on every run of one
    call (a tool's own retry, a state's retry, a resume after a kill), different for every other call of the
    run. Execution is at least once (a kill between the tool's effect and the journal's record of its result
    runs the call again); a tool that records its effect under this key and does nothing for a key it has seen
    has each effect exactly once. None outside a tool call. Under `isolation: process` the worker has it in its
    environment too (AGENTFSM_IDEMPOTENCY_KEY), for a program the tool starts."""
    key = KEY.get()  # carried into the tool's thread or event loop as _BEAT is
    return key if key is not None else os.environ.get(KEY_ENV)  # in an `isolation: process` worker


def heartbeat() -> bool:
    """The tool calling this is alive: `fsm.heartbeat()`, a plain function tool's `agent_data.heartbeat()`, from
    its thread or coroutine. A state with `heartbeat_s` fails a call that goes that long without one (the call's
    start counts). False, and nothing done, outside a tool call (a function called by hand) and under
    `isolation: process` (another process: give such a tool `timeout_s` instead)."""
    beat = _BEAT.get()
    if beat is None:
        return False
    beat()
    return True


@dataclass
class ToolResponse:
    """verl's ToolResponse: text, plus optional multimodal lists."""

    text: str | None = None
    image: list | None = None
    video: list | None = None


class BaseTool:
    """verl-compatible tool base. Subclass and override `execute` (and the rest as needed)."""

    def __init__(self, config: dict, tool_schema: dict):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema["function"]["name"]

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or "", ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[ToolResponse, float, dict]:
        raise NotImplementedError

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


def normalize_return(ret: Any) -> tuple[ToolResponse, float, dict]:
    """verl's normalize_function_tool_return: str, dict, ToolResponse or a (response, reward, metrics) tuple,
    with its errors: a tuple of another length, a reward float() refuses ("" included) or metrics dict()
    refuses become the error observation verl's loop shows."""
    if isinstance(ret, tuple):
        if not 1 <= len(ret) <= 3:
            raise TypeError(
                f"@function_tool return tuple must have length 1, 2, or 3 (got length {len(ret)}: {ret!r}). "
                "Use (response,), (response, reward), or (response, reward, metrics)."
            )
        response, reward, metrics = (*ret, None, None)[:3]
        return (
            _response(response),
            0.0 if reward is None else float(reward),
            {} if metrics is None else dict(metrics),
        )
    return _response(ret), 0.0, {}


def _response(value: Any) -> ToolResponse:
    """One response value as verl renders it: a tuple inside a tuple is its repr, not a second tuple. verl's
    own ToolResponse (a pydantic model) passes as ours does."""
    if isinstance(value, ToolResponse) or type(value).__name__ == "ToolResponse":
        return value
    if isinstance(value, str):
        return ToolResponse(text=value)
    if isinstance(value, dict):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    return ToolResponse(text=str(value))


class FunctionTool(BaseTool):
    """A plain function as a tool, run in its lane: by default its own threads for a sync function and its
    own event loop for a coroutine function; the run's loop under `isolation: none`, worker processes under
    `isolation: process`."""

    def __init__(self, fn: Callable[..., Any], tool_schema: dict, lane: Lane | None = None):
        super().__init__({}, tool_schema)
        self.fn = fn
        self.keep_chars: int | None = None  # set by BoundTool.keep: a ThreadLane cuts answers in its thread
        if lane is None:
            is_async = inspect.iscoroutinefunction(fn)
            lane = LoopLane(self.name) if is_async else ThreadLane(self.name, DEFAULT_TOOL_WORKERS)
        self.lane = lane

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[ToolResponse, float, dict]:
        if not isinstance(parameters, Mapping):
            # Arguments that are no JSON object reach the tool as verl passes them, and the model reads the
            # complaint verl's FunctionTool gets: Python's, from `fn(**args)` or `asyncio.to_thread(fn, **args)`.
            call = self.fn if inspect.iscoroutinefunction(self.fn) else asyncio.to_thread
            name = f"{call.__module__}.{call.__qualname__}"
            raise TypeError(f"{name}() argument after ** must be a mapping, not {type(parameters).__name__}")
        # cut in the thread, as a worker
        if self.keep_chars is not None and isinstance(self.lane, ThreadLane):
            return normalize_return(await self.lane.call(_cut_return, self.fn, self.keep_chars, **parameters))
        return normalize_return(await self.lane.call(self.fn, **parameters))


def _cut_return(fn: Callable[..., Any], keep: int, /, **parameters: Any) -> Any:
    """`fn`'s return with its text cut to its first and last `keep` characters, in the tool's own thread: a
    huge answer dies there instead of waiting whole for the event loop."""
    return shrink(fn(**parameters), keep)


def truncate(text: str, limit: int, side: str) -> str:
    """verl >= 0.8 semantics: 'left' keeps the tail, 'right' keeps the head, 'middle' keeps both ends."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    return text[: limit // 2] + "...(truncated)..." + text[-(limit // 2) :]


@dataclass
class CallOutcome:
    """What one tool call produced: the observation text, rewards, and whether it failed (and why)."""

    name: str
    text: str
    reward: float | None = 0.0  # None: the tool returned no reward (verl keeps it out of tool_rewards)
    score: float | None = None  # calc_reward
    error: str | None = None  # error.type for spans: "timeout", "exception", "unknown_tool", ...
    attempts: int = 0
    call_id: str | None = None
    metrics: dict = field(default_factory=dict)


def tool_retry(attempts: int, backoff_s: float) -> RetryPolicy:
    """The spec's `retry:` as a policy: the wait before attempt k is backoff_s * 2**(k-2), exactly (no jitter:
    one tool's calls are not a fleet of clients retrying together), and never longer than a state's retry may
    wait (MAX_WAIT_S), whatever a program that builds tools by hand asks."""
    return RetryPolicy(attempts=attempts, backoff_s=backoff_s, backoff_max_s=MAX_WAIT_S, jitter=0.0)


class AgentData:
    """What a tool receives as `agent_data`: verl's ToolAgentLoop AgentData, as a view of one trajectory.

    Tools keep per-trajectory state in `extra_fields` (a dict on the trajectory, exported with its extra
    fields as verl exports agent_data.extra_fields) and read `request_id` (the trajectory's sticky session
    id), `tools_kwargs`, `messages` and the counters. `prompt_ids` is the whole context so far and
    `response_ids` the last model turn, as in verl. Text only: the multimodal fields are empty.
    """

    __slots__ = ("_traj", "_messages", "_key")
    image_data = video_data = audio_data = routed_experts = mm_processor_output = None

    def __init__(
        self,
        traj: Any,
        messages: Callable[[], list[dict[str, Any]]] | None = None,
        key: str | None = None,
    ):
        self._traj = traj  # an fsm.run.trajectory.Trajectory (not imported: trajectory sits above tools)
        self._messages = messages  # verl's view of the conversation; default: the trajectory's own
        self._key = key  # the call's idempotency key (one AgentData per call)

    extra_fields = property(lambda self: self._traj.extra_fields)

    def heartbeat(self) -> None:
        """The tool is alive: a state with `heartbeat_s` fails a call that stops calling this (any thread)."""
        self._traj.heartbeat_at = time.monotonic()

    request_id = property(lambda self: self._traj.session_id)
    # this call's idempotency key (fsm.idempotency_key() says what it promises): `execute` gets what `create`
    # returned as its instance_id, which need not be the key
    idempotency_key = property(lambda self: self._key)
    tools_kwargs = property(lambda self: self._traj.tools_kwargs)
    messages = property(lambda self: self._messages() if self._messages else self._traj.messages)
    turn_scores = property(lambda self: self._traj.turn_scores)
    tool_rewards = property(lambda self: self._traj.tool_rewards)
    user_turns = property(lambda self: self._traj.user_turns)
    assistant_turns = property(lambda self: self._traj.assistant_turns)
    prompt_ids = property(lambda self: self._traj.context_ids())
    response_mask = property(lambda self: self._traj.response_mask.tolist())
    response_logprobs = property(lambda self: self._traj.response_logprobs.tolist())
    mm_processor_kwargs = property(lambda self: {})

    @property
    def response_ids(self) -> list[int]:
        last = self._traj.runs.last("assistant")
        return self._traj.response_ids[last.start : last.end].tolist() if last else []

    @property
    def metrics(self) -> dict[str, Any]:  # a snapshot, as verl's per-trajectory metrics dict reads
        m = self._traj.metrics
        return {
            "generate_sequences": m.generate_sequences,
            "tool_calls": m.tool_calls,
            "num_preempted": m.num_preempted,
        }


class StartTimeout:
    """`async with StartTimeout(s):` is `asyncio.timeout(s)` counted from when the lane started running the
    call inside (a ThreadLane stamps `started` when a thread takes it; other lanes start at once). The check
    runs only when the timeout would have fired; one object per call, no closure."""

    __slots__ = ("timeout_s", "started", "_loop", "_cm", "_timer", "_token")
    _timer: asyncio.TimerHandle | None

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    async def __aenter__(self) -> StartTimeout:
        self._loop = asyncio.get_running_loop()
        self.started: float | None = time.monotonic()
        self._token = START_CLOCK.set(self)
        self._cm = asyncio.timeout(None)
        await self._cm.__aenter__()
        self._timer = self._loop.call_later(self.timeout_s, self._check)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._timer is not None  # set by __aenter__, and by `_check` while the call runs
        self._timer.cancel()
        # The timer's context holds this object (START_CLOCK): dropped here, the call's task, its timeout and
        # its context are freed when the call ends rather than left to the cyclic collector.
        self._timer = None
        START_CLOCK.reset(self._token)
        await self._cm.__aexit__(*exc)

    def _check(self) -> None:
        started, now = self.started, time.monotonic()
        if started is not None and now >= started + self.timeout_s:
            self._cm.reschedule(self._loop.time())  # expires now
        else:  # still queued (look again a timeout later), or started after the timer was set
            wait = self.timeout_s if started is None else started + self.timeout_s - now
            self._timer = self._loop.call_later(wait, self._check)


@dataclass
class BoundTool:
    """A tool instance with its policy (timeout, retries) and its lane, built once per compiled spec."""

    name: str
    tool: Any  # BaseTool-like
    schema: dict
    timeout_s: float | None
    retry: RetryPolicy  # `execute` attempts and waits (the spec's `retry:`)
    lane: Lane | None = None  # default: a FunctionTool's own; a class tool's methods run on a LoopLane
    keep_chars: int | None = None  # an answer is cut to its first and last this many characters at once

    def __post_init__(self) -> None:
        self._ours = isinstance(self.tool, FunctionTool)
        if self.lane is None:
            self.lane = self.tool.lane if self._ours else LoopLane(self.name)
        # BaseTool's own create/calc_reward/release do nothing: not called at all (no hop, no timeout scope)
        self._create, self._calc_reward, self._release = (
            getattr(method := getattr(self.tool, name, None), "__func__", method)
            is not getattr(BaseTool, name)
            for name in ("create", "calc_reward", "release")
        )
        self._ready = not isinstance(self.lane, (ThreadLane, LoopLane, InlineLane))  # theirs are no-ops

    @property
    def description(self) -> str:
        return self.schema.get("function", {}).get("description", "")

    def keep(self, chars: int | None) -> None:
        """Answers only ever need their first and last `chars` characters (the response limit); None: all."""
        self.keep_chars = chars
        if isinstance(self.lane, ProcessLane):
            self.lane.keep_chars = chars  # cut in the worker: a 50 MB answer never crosses the socket
        elif isinstance(self.tool, FunctionTool):
            self.tool.keep_chars = chars  # a ThreadLane cuts in the tool's thread

    async def run(
        self, call: ToolCall, instance_id: str, create_kwargs: dict, agent_data: Any
    ) -> CallOutcome:
        """create -> execute (with timeout and retries) -> calc_reward, then release no matter what.

        An Exception from the tool is an error observation; a BaseException (SystemExit, KeyboardInterrupt,
        GeneratorExit, a CancelledError of its own) raises ToolCrashed. Only our caller's cancellation
        (the action's timeout, shutdown) passes through as such."""
        beating = _BEAT.set(getattr(agent_data, "heartbeat", None))  # the lanes carry it into the tool's call
        keyed = KEY.set(instance_id)  # the call's idempotency key, as the caller named the instance
        try:
            return await self._run(call, instance_id, create_kwargs, agent_data)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            assert task is not None  # a coroutine's
            if task.cancelling():
                raise
            raise crashed(self.name, exc) from exc
        except Exception:
            raise
        except BaseException as exc:  # from lifecycle methods run outside a lane (a FunctionTool's own)
            raise crashed(self.name, exc) from exc
        finally:
            KEY.reset(keyed)
            _BEAT.reset(beating)

    async def _step(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One lifecycle method, timed. A class tool's run on its lane; a FunctionTool's `execute` puts the
        function in the lane itself."""
        assert self.lane is not None  # set in __post_init__
        call = method(*args, **kwargs) if self._ours else self.lane.call(method, *args, **kwargs)
        if self.timeout_s is None:
            return await call
        async with StartTimeout(self.timeout_s):  # from when the call starts: a lane's queue is no part
            return await call

    async def _run(
        self, call: ToolCall, instance_id: str, create_kwargs: dict, agent_data: Any
    ) -> CallOutcome:
        outcome = CallOutcome(self.name, "", call_id=call.id)
        if self._create:
            try:
                created_id, _ = await self._step(self.tool.create, instance_id, create_kwargs=create_kwargs)
            except ToolCrashed:
                raise
            # e.g. a sandbox that cannot start: nothing was created, nothing to release
            except Exception as exc:
                outcome.error = "exception"
                outcome.text = f"Error executing tool '{self.name}': {self._why(exc)}"
                return outcome
            instance_id = created_id  # verl passes what create returned, '' included
        if not (self._calc_reward or self._release):
            await self._execute(outcome, call, instance_id, agent_data)
            outcome.score = 0.0 if outcome.error is None else None  # BaseTool.calc_reward's
            return outcome
        try:
            await self._execute(outcome, call, instance_id, agent_data)
            if outcome.error is None:
                try:
                    score = await self._step(self.tool.calc_reward, instance_id) if self._calc_reward else 0.0
                    outcome.score = float(score)
                except ToolCrashed:
                    raise
                except Exception:  # the observation stands; the failure is counted, the score left out
                    outcome.error = "calc_reward"
        finally:
            if self._release and instance_id:  # verl releases only a non-empty id
                await self._release_instance(instance_id)
        return outcome

    async def _execute(self, outcome: CallOutcome, call: ToolCall, instance_id: str, agent_data: Any) -> None:
        """`execute`, retried as the spec's `retry:` says (backends/base.py `retry` runs the loop); the outcome holds
        the answer, or the last failure as the text the model reads."""

        async def attempt(k: int) -> None:
            outcome.attempts = k
            if self._ready:
                assert self.lane is not None  # set in __post_init__
                await self.lane.ready()  # a worker process starts outside the timeout
            response, reward, metrics = await self._step(
                self.tool.execute, instance_id, call.arguments, agent_data=agent_data
            )
            outcome.text = cut(response.text or "", self.keep_chars)
            outcome.reward, outcome.metrics, outcome.error = reward, metrics, None
            # a huge answer is not held while calc_reward and release run: `response` dies with this frame

        try:
            if self.retry.attempts == 1 and self.retry.window_s is None:
                await attempt(1)
            else:
                await retry(self.retry, attempt, retryable=lambda exc: not isinstance(exc, ToolCrashed))
        except ToolCrashed:
            raise
        except TimeoutError as exc:  # ours, or the tool's own (an HTTP client's) when timeout_s is None
            outcome.error, outcome.text = (
                "timeout",
                f"Error: tool '{self.name}' timed out after {self.timeout_s:g}s"
                if self.timeout_s is not None
                else f"Error executing tool '{self.name}': {exc or 'timed out'}",
            )
        except Exception as exc:  # a tool may raise anything; the model is told what happened
            outcome.error, outcome.text = "exception", f"Error executing tool '{self.name}': {exc}"

    async def _release_instance(self, instance_id: str) -> None:
        try:
            await self._step(self.tool.release, instance_id)
        except TimeoutError:
            raise RuntimeError(f"tool '{self.name}': release timed out after {self.timeout_s:g}s") from None

    def _why(self, exc: Exception) -> str:
        if isinstance(exc, TimeoutError) and self.timeout_s is not None:
            return f"timed out after {self.timeout_s:g}s"
        return str(exc)


class ToolSet:
    """The tools of one spec: schemas for the chat template, and call execution with every policy applied."""

    def __init__(self, tools: list[BoundTool], limits: LimitsSpec, policy: ToolPolicySpec | None = None):
        self.by_name = {t.name: t for t in tools}
        self.schemas = [t.schema for t in tools]
        self.limits = limits
        self.policy = policy or ToolPolicySpec()
        # Truncation keeps at most this many characters at either end, so answers are cut to that at once. But
        # middle truncation at a limit of 1 keeps verl's `text[-0:]`, the whole text after the marker.
        limit = limits.max_tool_response_length
        whole = limits.tool_response_truncate_side == "middle" and limit // 2 == 0
        for tool in tools:
            tool.keep(None if whole else limit)

    def close(self) -> None:
        """Stop the tools' idle threads and loops and kill their worker processes (stuck threads are
        daemons, abandoned). Optional: nothing here delays process exit. Tools start afresh when called."""
        for tool in self.by_name.values():
            if tool.lane is not None:  # always (set in __post_init__)
                tool.lane.close()

    def active_names(self, selection: Any) -> list[str] | None:
        """verl's extra_info.tool_selection: the named tools that exist, in the selection's order; None (every
        tool) when there is no selection or it is empty, as in verl."""
        selection = list(selection) if selection is not None else []
        if not selection or not self.by_name:
            return None
        return [name for name in dict.fromkeys(selection) if name in self.by_name]

    def schemas_for(self, selection: Any) -> list[dict] | None:
        """The schemas the prompt shows: every tool's in declaration order, or the selection's in its order."""
        if not self.schemas:
            return None
        names = self.active_names(selection)
        return self.schemas if names is None else [self.by_name[name].schema for name in names]

    async def call(
        self,
        call: ToolCall,
        instance_id: str,
        tools_kwargs: dict,
        traj: Any,
        active: list[str] | None = None,
        messages: Callable[[], list[dict[str, Any]]] | None = None,
    ) -> CallOutcome:
        """Run one call of `traj` (its tool gets `agent_data=AgentData(traj)`); every failure becomes an
        observation with `error` set."""
        if call.error is not None:
            return _refused(call, call.name or "?", f"Error: {call.error}", "malformed_call")
        tool = self.by_name.get(call.name or "")
        if tool is None or (active is not None and call.name not in active):
            names = list(active if active is not None else self.by_name)  # verl: the tool list's order
            text = f"Unknown function '{call.name}'. Available tools: {names}"
            return _refused(call, call.name or "?", text, "unknown_tool")
        policy, args = self.policy, call.arguments
        if isinstance(args, str) and policy.parse_string_arguments:
            try:
                args = json.loads(args)
            except json.JSONDecodeError as exc:
                text = f"Error: Invalid JSON in arguments for '{tool.name}': {exc}"
                return _refused(call, tool.name, text, "bad_arguments")
        if policy.validate_arguments and (problem := check_arguments(tool.schema, args)):
            text = f"Error: invalid arguments for '{tool.name}': {problem}"
            return _refused(call, tool.name, text, "bad_arguments")
        if args is not call.arguments:
            call = dataclasses.replace(call, arguments=args)
        create_kwargs = (tools_kwargs.get(tool.name) or {}).get("create_kwargs", {})
        agent_data = AgentData(traj, messages, instance_id) if traj is not None else None
        outcome = await tool.run(call, instance_id, create_kwargs, agent_data)
        outcome.text = encodable(outcome.text) if isinstance(outcome.text, str) else outcome.text
        if outcome.error in (None, "calc_reward") or policy.truncate_errors:  # verl cuts results only
            outcome.text = truncate(
                outcome.text, self.limits.max_tool_response_length, self.limits.tool_response_truncate_side
            )
        return outcome


def _refused(call: ToolCall, name: str, text: str, error: str) -> CallOutcome:
    """A call answered without running the tool: the model reads `text`."""
    return CallOutcome(name, text, error=error, call_id=call.id)


_JSON_TYPES: dict[str, type | tuple[type, ...]] = dict(
    string=str, integer=int, number=(int, float), boolean=bool, array=list, object=dict, null=type(None)
)


def _json_type_ok(value: Any, type_: str) -> bool:
    """`value` (from json.loads) is a JSON Schema `type_`; an unknown type name accepts anything."""
    if not isinstance(type_, str) or type_ not in _JSON_TYPES:
        return True
    if isinstance(value, bool):  # a bool is an int in Python, never in JSON
        return type_ == "boolean"
    if type_ == "integer":  # JSON Schema: a number with no fractional part (2.0 included)
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, _JSON_TYPES[type_])


def check_arguments(schema: dict, args: Any) -> str | None:
    """A readable complaint about arguments that do not fit the schema, or None. A property's `type` may be
    a list of names (`int | float` is ["integer", "number"]); `nullable: true` (transformers' Optional)
    also accepts null."""
    if not isinstance(args, dict):
        return f"arguments must be a JSON object, got {type(args).__name__}"
    params = schema.get("function", schema).get("parameters") or {}
    props: dict = params.get("properties") or {}
    missing = [name for name in params.get("required", []) if name not in args]
    if missing:
        return f"missing required argument(s) {', '.join(map(repr, missing))}"
    unknown = [name for name in args if props and name not in props]
    if unknown:
        return (
            f"unexpected argument(s) {', '.join(map(repr, unknown))}; expected {', '.join(map(repr, props))}"
        )
    for name, value in args.items():
        prop = props.get(name) or {}
        types = prop.get("type")
        if types is None or (value is None and prop.get("nullable")):
            continue
        types = [types] if isinstance(types, str) else list(types)
        if not any(_json_type_ok(value, t) for t in types):
            return f"argument {name!r} should be {' or '.join(map(str, types))}, got {type(value).__name__}"
    return None
