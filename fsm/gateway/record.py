"""One model call of a session, recorded on its trajectory: the request's conversation is matched against what
the session has recorded, only the new messages' tokens are appended (the family codec's observation suffix),
the model's turn is generated through the engine's own `generate` action, and the answer comes back parsed.

A conversation here is in one canonical form whatever API carried it (fsm/gateway/openai_api.py and
anthropic_api.py convert): `{"role", "content": str}`, plus `tool_calls: [{"id", "name", "arguments"}]` on an
assistant message and `tool_call_id` on a tool result. What the session recorded is a list of keys of that
form; a request extends the session exactly when its messages start with those keys. The model's own turns
are never re-tokenized: the harness sends them back as text and calls, and the key only confirms they are
the ones recorded. A request that does not extend the session (the harness compacted, edited or branched
the history, or changed the tools) is refused as `HistoryDiverged`: it is never merged.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from fsm.families.parsers import split_reasoning
from fsm.run.actions import generate
from fsm.run.context import RunContext
from fsm.run.trajectory import Trajectory


class GatewayError(Exception):
    """A request the gateway answers with an API error (never a row failure): `status`, a machine `code`,
    and a one-line message the harness's SDK shows."""

    status = 400
    code = "invalid_request"
    kind = "invalid_request_error"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class LimitReached(GatewayError):
    """A call past one of the spec's limits (turns, response length, prompt length)."""

    code = "limit_reached"


class HistoryDiverged(GatewayError):
    """The request's history is not an extension of the session's recorded conversation."""

    code = "history_diverged"


@dataclass(slots=True)
class Call:
    """One model call as the gateway handles it, whatever API it came through."""

    messages: list[dict[str, Any]]  # canonical form
    tools: list[dict[str, Any]] | None  # OpenAI function schemas ({"type": "function", "function": {...}})
    max_tokens: int | None = None
    stream: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # what an API needs to answer (stream options...)


@dataclass(slots=True)
class Answer:
    """The model's turn as every API reports it."""

    content: str
    reasoning: str | None
    tool_calls: list[dict[str, Any]]  # [{"id", "name", "arguments": JSON text}]
    finish: str  # "stop" | "tool_calls" | "length"
    prompt_tokens: int
    completion_tokens: int
    turn: int


def canonical_arguments(arguments: Any) -> str:
    """Call arguments as one JSON text: a harness may send them back as an object or as text."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def message_key(message: dict[str, Any]) -> tuple:
    """What must match for a message to be the one recorded: role, text, calls (ids, names, arguments) and
    the call a tool result answers. Reasoning is not compared: harnesses drop it from history."""
    role = message["role"]
    if role == "assistant":
        calls = tuple((c.get("id"), c["name"], canonical_arguments(c.get("arguments"))) for c in message.get("tool_calls") or ())
        return (role, message.get("content") or "", calls)
    if role == "tool":
        return (role, message.get("content") or "", message.get("tool_call_id"))
    return (role, message.get("content") or "")


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A canonical message as chat templates read it (calls with object arguments, as HF templates expect)."""
    role = message["role"]
    if role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("reasoning"):
            out["reasoning_content"] = message["reasoning"]
        if message.get("tool_calls"):
            out["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {
                "name": c["name"], "arguments": _as_object(c.get("arguments"))}} for c in message["tool_calls"]]  # fmt: skip
        return out
    if role == "tool":
        out = {"role": "tool", "content": message.get("content") or ""}
        if message.get("tool_call_id"):
            out["tool_call_id"] = message["tool_call_id"]
        if message.get("name"):
            out["name"] = message["name"]
        return out
    return {"role": role, "content": message.get("content") or ""}


def _as_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return {} if arguments is None else arguments


class Recorder:
    """The recorded side of one session: the conversation keys so far and the tools its prompt was made with."""

    __slots__ = ("keys", "tools", "turns")

    def __init__(self) -> None:
        self.keys: list[tuple] = []
        self.tools: list[dict[str, Any]] | None = None
        self.turns = 0

    def new_messages(self, call: Call) -> list[dict[str, Any]]:
        """The request's messages past the recorded conversation; HistoryDiverged when it does not extend it."""
        if not self.keys:
            return call.messages
        if (call.tools or None) != self.tools:  # dict equality: the order of keys does not matter
            raise HistoryDiverged("the request's tools differ from those the session's prompt was rendered with")
        n = len(self.keys)
        keys = [message_key(m) for m in call.messages[:n]]
        if len(keys) < n or keys != self.keys:
            at = next((i for i, (a, b) in enumerate(zip(keys, self.keys)) if a != b), len(keys))
            raise HistoryDiverged(f"message {at} of the request differs from the session's recorded conversation "
                                  f"({len(call.messages)} messages sent, {n} recorded)")  # fmt: skip
        new = call.messages[n:]
        if any(m["role"] in ("assistant", "system") for m in new):
            raise HistoryDiverged(f"the request adds a {next(m['role'] for m in new if m['role'] in ('assistant', 'system'))} "
                                  "message after the recorded conversation; only tool results and user turns extend it")  # fmt: skip
        if not new and self.keys[-1][0] == "assistant":
            raise HistoryDiverged("the request repeats the recorded conversation without a new message (a branch)")
        return new


async def record_call(ctx: RunContext, traj: Trajectory, recorder: Recorder, call: Call, call_prefix: str) -> Answer:
    """Append the call's new messages to `traj`, generate the model's turn, and return it parsed.

    The first call encodes the prompt (the codec's render, tools included); later ones append only their new
    messages' observation suffix. The turn itself is the engine's `generate` action: budgets, pause/resume,
    per-token weight versions, the span and the parser are the same as a spec's GENERATING state."""
    limits = ctx.agent.limits
    new = recorder.new_messages(call)
    templ = [template_message(m) for m in new]
    if not recorder.keys:
        ids = ctx.codec.encode_prompt(templ, call.tools)
        if len(ids) > limits.prompt_length:
            raise LimitReached(f"the prompt is {len(ids)} tokens, past the spec's limits.prompt_length "
                               f"{limits.prompt_length}", code="context_length_exceeded")  # fmt: skip
        traj.messages = templ
        traj.tool_schemas = call.tools
        traj.prompt_ids.extend(ids)
        recorder.tools = call.tools or None
    elif templ:
        role = "tool" if any(m["role"] == "tool" for m in templ) else "user"
        if not ctx.add_observation(traj, templ, role=role):
            raise LimitReached(f"the new messages do not fit in what is left of limits.response_length "
                               f"{limits.response_length}", code="context_length_exceeded")  # fmt: skip
        if role == "tool":
            traj.user_turns += 1
    recorder.keys.extend(message_key(m) for m in new)
    if len(traj.response_mask) >= limits.response_length:
        raise LimitReached(f"the session has used its limits.response_length {limits.response_length} tokens")
    sub = ctx
    if call.max_tokens is not None:  # the request's own cap, within the spec's
        cap = ctx.sampling.max_new_tokens
        sub = copy.copy(ctx)
        sub.sampling = dataclasses.replace(ctx.sampling, max_new_tokens=call.max_tokens if cap is None else min(cap, call.max_tokens))
    prompt_tokens = len(traj.prompt_ids) + len(traj.response_ids)
    before = len(traj.response_ids)
    await generate(sub, traj)
    ids = traj.response_ids[before:].tolist()
    text = traj.messages[-1]["content"] if traj.messages and traj.messages[-1]["role"] == "assistant" else ""
    calls, traj.pending_calls = traj.pending_calls, []
    family = getattr(ctx.codec, "family", None)
    reasoning, rest = None, text
    if family is not None and family.reasoning == "think":
        reasoning, rest = split_reasoning(text, "think", family.think_tags)
        rest = rest.lstrip("\n")
    elif traj.messages and traj.messages[-1].get("reasoning_content"):
        reasoning = traj.messages[-1]["reasoning_content"]
    valid = [c for c in calls if c.error is None and c.name]
    content = rest if len(valid) < len(calls) else ctx.parser.content(rest)
    if valid:
        content = content.strip()
    turn = recorder.turns
    recorder.turns += 1
    tool_calls = [{"id": c.id or f"{call_prefix}_{turn}_{k}", "name": c.name, "arguments": json.dumps(
        c.arguments if c.arguments is not None else {}, ensure_ascii=False)} for k, c in enumerate(valid)]  # fmt: skip
    finish = "tool_calls" if tool_calls else ("length" if traj.last_finish_reason == "length" else "stop")
    recorder.keys.append(message_key({"role": "assistant", "content": content, "tool_calls": tool_calls}))
    return Answer(content, reasoning, tool_calls, finish, prompt_tokens, len(ids), turn)
