"""How a model call of a session is matched against what the session recorded: the request's conversation in
one canonical form, keyed, and the plan for recording it (fsm/gateway/turn.py records it on its node of the
session's tree, fsm/gateway/tree.py).

A conversation here is in one canonical form whatever API carried it (fsm/gateway/openai_api.py,
anthropic_api.py and gemini_api.py convert): `{"role", "content": str}`, plus `tool_calls: [{"id", "name",
"arguments"}]` and `reasoning` on an assistant message and `tool_call_id` on a tool result. The model's own
turns are never re-tokenized: the key only confirms the harness sent back the ones recorded. A request either
extends the current segment or starts a `branch` or `history` segment: docs/gateway.md, "Histories".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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


@dataclass(slots=True)
class Call:
    """One model call as the gateway handles it, whatever API it came through."""

    messages: list[dict[str, Any]]  # canonical form
    tools: list[dict[str, Any]] | None  # OpenAI function schemas ({"type": "function", "function": {...}})
    max_tokens: int | None = None
    stream: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # what an API needs to answer (stream options...)
    child: tuple[str, ...] = ()  # the child session it came through (fsm/gateway/tree.py), () for the session


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


AUX = "aux:"  # an auxiliary call's line ends with AUX + its kind (fsm/gateway/tree.py records it on a node of its own)
AUX_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}")
# System prompts of calls that are not the agent's own turns, by what they hold: (kind, text). Configurable
# (GatewayLimits.auxiliary_prompts); these are the harnesses' own (opencode's title agent, Claude Code's /compact,
# Gemini CLI's and qwen-code's history compression, Gemini CLI's model router, which scores each request first).
AUX_PROMPTS: tuple[tuple[str, str], ...] = (
    ("title", "You are a title generator"),
    ("compaction", "tasked with summarizing conversations"),
    ("compaction", "summarizes internal chat history"),
    ("router", "You are a specialized Task Routing AI"),
)


def auxiliary(
    call: Call,
    header: str | None,
    prompts: tuple[tuple[str, str], ...],
    system_kind: Callable[[list[str], tuple[tuple[str, str], ...]], str | None] | None = None,
) -> str | None:
    """The kind of a call that is not the agent's own turn (a title, a compaction), or None: the harness's
    header (`x-agentfsm-call: KIND`) first, then a title schema the request asks its answer to follow (Claude
    Code's `output_config.format`), then a system prompt holding one of `prompts` (`prompt_kind`, or
    `system_kind` in its place: a session's, which keeps the answer for the system prompt it saw last)."""
    if header:
        kind = header.strip().lower()
        if not AUX_KIND.fullmatch(kind):
            raise GatewayError(
                f"x-agentfsm-call: {header[:64]!r} is not a call kind (1-32 lowercase letters, digits or '_')"
            )
        return kind
    if call.extra.get("title_schema"):
        return "title"
    system = [m.get("content") or "" for m in call.messages if m["role"] == "system"]
    return (system_kind or prompt_kind)(system, prompts)


def prompt_kind(system: list[str], prompts: tuple[tuple[str, str], ...]) -> str | None:
    """The kind of the first of `prompts` whose text one of the `system` prompts holds, or None."""
    return next((kind for kind, text in prompts for prompt in system if text in prompt), None)


def unsupported_tool(where: str, tool: dict[str, Any]) -> str:
    """How a tool the gateway does not serve is named in its note or its refusal."""
    name = tool.get("name")
    return f"{where} (type {str(tool.get('type'))[:64]!r}" + (
        f", {name[:64]!r})" if isinstance(name, str) else ")"
    )


def with_dropped(
    call: Call, dropped: list[str], body: dict[str, Any] | None = None, fields: tuple[str, ...] = ()
) -> Call:
    """`call` with the tools it left out, and the request `fields` of `body` no local model serves (a hosted
    model's thinking budget, context editing, effort), each named with its value for the row's note."""
    if dropped:
        call.extra["dropped_tools"] = dropped
    unserved = [
        f"{name} {json.dumps(body[name], sort_keys=True)[:80]}"
        for name in fields
        if body and body.get(name) is not None
    ]
    if unserved:
        call.extra["dropped_fields"] = unserved
    return call


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
    the call a tool result answers, and the reasoning of a turn that has some: a harness that drops it holds
    another conversation than the row (the template renders the turn without it), so it starts a segment."""
    role = message["role"]
    if role == "assistant":
        calls = tuple(
            (c.get("id"), c["name"], canonical_arguments(c.get("arguments")))
            for c in message.get("tool_calls") or ()
        )
        reasoning = message.get("reasoning")
        return (role, message.get("content") or "", calls) + ((reasoning,) if reasoning else ())
    if role == "tool":
        return (role, message.get("content") or "", message.get("tool_call_id"))
    return (role, message.get("content") or "")


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A canonical message as chat templates read it (calls with object arguments, as HF templates expect)."""
    role = message["role"]
    if role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("reasoning"):  # as Qwen3's, GLM's... templates read it, and as gpt-oss's does
            out["reasoning_content"] = out["thinking"] = message["reasoning"]
        if message.get("tool_calls"):
            out["tool_calls"] = [
                {
                    "id": c.get("id"),
                    "type": "function",
                    "function": {"name": c["name"], "arguments": _as_object(c.get("arguments"))},
                }
                for c in message["tool_calls"]
            ]
        return out
    if role == "tool":
        out = {"role": "tool", "content": message.get("content") or ""}
        if message.get("tool_call_id"):
            out["tool_call_id"] = message["tool_call_id"]
        if message.get("name"):
            out["name"] = message["name"]
        return out
    return {"role": role, "content": message.get("content") or ""}


def call_arguments(text: str) -> dict[str, Any]:
    """An answer's call arguments (JSON text) as the object the Messages and Gemini APIs send: {} when the
    text is not a JSON object."""
    args = _as_object(text)
    return args if isinstance(args, dict) else {}


def _as_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return {} if arguments is None else arguments


@dataclass(slots=True)
class Plan:
    """How a request is recorded: `kind` is "first" (the session's first prompt), "extend" (the current segment
    goes on), "branch" (a new segment from an earlier turn's context, `mark`) or "history" (a new segment whose
    prompt is the request's conversation); `new` are the messages appended as observations ("extend",
    "branch") or the whole prompt ("first", "history")."""

    kind: str
    new: list[dict[str, Any]]
    keys: list[tuple]
    # (segment, keys, messages, context tokens) after a model turn
    mark: tuple[int, int, int, int] | None = None


# what a harness sends that the model did not write: the observations a model turn answers. A system message
# among them is rendered where it stands (Claude Code ends its requests with one, after the user's turn).
OBSERVED = ("tool", "user", "system")


def ends_on_observation(messages: list[dict[str, Any]]) -> None:
    """A request must end with a user turn or tool results (system messages after them included): the model
    answers them."""
    answered = [m["role"] for m in messages if m["role"] != "system"]
    if not answered or answered[-1] not in ("tool", "user"):
        last = answered[-1] if answered else (messages[-1]["role"] if messages else "no")
        raise GatewayError(
            f"the request ends with {'an' if last == 'assistant' else 'a'} {last} message: the model "
            "answers a user turn or tool results (continuing a message is not supported)"
        )


def too_many_segments(n: int, limit: int) -> GatewayError:
    return GatewayError(
        f"the request's history differs from the session's and would start segment {n + 1}, past the "
        f"gateway's max_segments ({limit})",
        code="too_many_segments",
    )


def _observations(messages: list[dict[str, Any]]) -> bool:
    return all(m["role"] in OBSERVED for m in messages)


class Recorder:
    """The recorded side of one session: per segment of its trajectory, the conversation keys and the tools its
    prompt was rendered with, and a mark after each model turn (where a branch can reattach)."""

    __slots__ = ("keys", "sent", "tools", "turns", "max_segments", "segments", "marks", "seq")

    def __init__(self, max_segments: int = 32) -> None:
        self.keys: list[tuple] = []  # the current segment's conversation
        # the same messages as last sent (and answered): keys[i] is sent[i]'s key
        self.sent: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] | None = None  # the current segment's tools
        self.turns = 0
        self.max_segments = max_segments
        # (keys, tools) per segment, by its number in the session (fsm/gateway/tree.py numbers a tree's segments)
        self.segments: dict[int, tuple[list[tuple], list[dict[str, Any]] | None]] = {}
        self.marks: list[tuple[int, int, int, int]] = []  # (segment, keys, messages, context tokens) per turn
        self.seq = -1  # the current segment's number

    def extends(self, call: Call) -> tuple[Plan | None, list[tuple]]:
        """The "extend" plan when `call` goes on with the current segment (else None), and the keys of its
        messages (empty when the quick path matched: only the new ones were keyed)."""
        messages = call.messages
        ends_on_observation(messages)
        tools = call.tools or None  # dict equality below: the order of keys does not matter
        n = len(self.keys)
        same = bool(self.segments) and tools == self.tools and _observations(messages[n:])
        if same and messages[:n] == self.sent:
            # the harness sent back exactly what it sent and got before (one C-level comparison of the dicts), so
            # only the new messages need keys: a call costs O(new messages), not O(history)
            return Plan("extend", messages[n:], [message_key(m) for m in messages[n:]]), []
        keys = [message_key(m) for m in messages]
        # (nothing new: the recorded conversation ends with an observation no turn answered yet)
        if same and keys[:n] == self.keys:
            return Plan("extend", messages[n:], keys[n:]), keys
        return None, keys

    def branch_mark(self, call: Call, keys: list[tuple]) -> tuple[int, int, int, int] | None:
        """The longest earlier model turn whose conversation `call` continues with observations (None: none)."""
        tools = call.tools or None
        best = None
        for mark in self.marks:
            seg, nk = mark[0], mark[1]
            seg_keys, seg_tools = self.segments[seg]
            if (
                len(keys) > nk
                and (best is None or nk > best[1])
                and tools == seg_tools
                and keys[:nk] == seg_keys[:nk]
                and _observations(call.messages[nk:])
            ):
                best = mark
        return best

    def begin(
        self,
        keys: list[tuple],
        tools: list[dict[str, Any]] | None,
        sent: list[dict[str, Any]],
        seq: int | None = None,
    ) -> None:
        """A new segment's conversation starts with `keys`, the keys of the messages `sent`; `seq`: its number
        in the session (default: the next of this recorder's)."""
        self.keys, self.tools, self.sent = list(keys), tools or None, list(sent)
        self.seq = len(self.segments) if seq is None else seq
        self.segments[self.seq] = (self.keys, self.tools)

    def extend(self, keys: list[tuple], sent: list[dict[str, Any]]) -> None:
        """The current segment goes on with the messages `sent` (their keys `keys`)."""
        self.keys.extend(keys)
        self.sent.extend(sent)

    def turn(self, traj: Trajectory, message: dict[str, Any]) -> None:
        """The model's turn was recorded: its message as the answer gave it, its key, and the mark a later
        branch can reattach to."""
        self.keys.append(message_key(message))
        self.sent.append(message)
        context = len(traj.prompt_ids) + len(traj.response_ids)
        self.marks.append((self.seq, len(self.keys), len(traj.messages), context))
        self.turns += 1
