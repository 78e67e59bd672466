"""What every tool-call parser shares: the parsed call, the registry (verl's `multi_turn.format`), verl's
assistant message, and the helpers the families' grammars use.

A parser turns a model turn's text into tool calls. Unlike verl, a call that cannot be parsed is returned
with `error` set, so the engine answers it with an error observation instead of dropping it.
"""

from __future__ import annotations

import json
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


def token_ids(tokenizer: Any, *tokens: str) -> list[int]:
    """Ids of the tokens the tokenizer has as single tokens (a stop list never holds unk)."""
    if tokenizer is None:
        return []
    ids = []
    unk = getattr(tokenizer, "unk_token_id", None)
    for token in tokens:
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid >= 0 and tid != unk:
            ids.append(tid)
    return ids


def split_reasoning(text: str, style: str, tags: tuple[str, str] = ("<think>", "</think>")) -> tuple[str | None, str]:
    """(reasoning, the rest) of a `think` family's turn. The reasoning is a leading `<think>...</think>` (the
    family's tags), or everything before a `</think>` when the prompt opened the block; a block never closed
    is all reasoning."""
    if style != "think":
        return None, text
    opener, closer = tags
    head = text.lstrip()
    if head.startswith(opener):
        body = head[len(opener) :]
        end = body.find(closer)
        return (body, "") if end < 0 else (body[:end], body[end + len(closer) :])
    end = text.find(closer)
    if end >= 0 and opener not in text[:end]:
        return text[:end], text[end + len(closer) :]
    return None, text


def json_arguments(raw: str, name: str) -> ToolCall:
    try:
        return ToolCall(name, json.loads(raw), raw)
    except ValueError as exc:
        return ToolCall(name, None, raw, error=f"Invalid JSON in arguments for '{name}': {exc}")
