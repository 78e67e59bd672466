"""Tool-call parsers behind a registry (verl's `multi_turn.format`). Hermes ships first.

A parser turns a model turn's text into tool calls. Unlike verl, a call that cannot be parsed is returned
with `error` set, so the engine answers it with an error observation instead of dropping it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(slots=True)
class ToolCall:
    """A parsed tool call. `error` set means it was malformed: the model is told so, not silently ignored."""

    name: str | None
    arguments: Any  # the JSON value of "arguments" (an object, unless the model wrote something else)
    raw: str
    id: str | None = None
    error: str | None = None


class ToolCallParser(Protocol):
    stop_token_ids: list[int]

    def parse(self, text: str) -> list[ToolCall]: ...

    def content(self, text: str) -> str:
        """The turn's text without its tool-call blocks: what verl keeps as the assistant message's content."""
        ...


PARSERS: dict[str, Callable[[object], ToolCallParser]] = {}  # name -> factory(tokenizer)


def register_parser(name: str):
    def register(factory):
        PARSERS[name] = factory
        return factory

    return register


@register_parser("hermes")
class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn."""

    _call = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids: list[int] = []

    def parse(self, text: str) -> list[ToolCall]:
        calls = [self._parse_one(m.group(1)) for m in self._call.finditer(text)]
        end = text.rfind("</tool_call>")
        tail = text[end + len("</tool_call>") :] if end >= 0 else text
        if "<tool_call>" in tail:
            raw = tail[tail.index("<tool_call>") + len("<tool_call>") :]
            calls.append(ToolCall(None, None, raw, error="unterminated <tool_call>: missing </tool_call>"))
        return calls

    def content(self, text: str) -> str:
        """verl's hermes parser removes the blocks only when both tags occur, and keeps an unterminated one."""
        return self._call.sub("", text) if "<tool_call>" in text and "</tool_call>" in text else text

    @staticmethod
    def _parse_one(raw: str) -> ToolCall:
        """One call; malformed exactly when verl's hermes parser drops it (bad JSON, no string "name", no
        "arguments"). The arguments stay the JSON value the model wrote; the tool policy decides what a
        string or a non-object there means (fsm.tools.base.ToolSet.call)."""
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            return ToolCall(None, None, raw, error=f"Invalid JSON in tool call: {exc}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
            return ToolCall(None, None, raw, error='a tool call must be a JSON object with a string "name" and "arguments"')
        return ToolCall(obj["name"], obj["arguments"], raw)  # a model-written "id" is no call id (verl)


def assistant_message(content: str, calls: list[ToolCall], max_calls: int) -> dict[str, Any]:
    """verl's assistant message for a model turn: its content, and `tool_calls` (the first `max_calls`
    well-formed calls, arguments as a JSON object, or as the JSON text when they are not an object)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    valid = [call for call in calls if call.error is None][:max_calls]
    if valid:
        message["tool_calls"] = [
            {"type": "function", "function": {
                "name": call.name,
                "arguments": call.arguments if isinstance(call.arguments, dict)
                else json.dumps(call.arguments, ensure_ascii=False),
            }} for call in valid
        ]  # fmt: skip
    return message
