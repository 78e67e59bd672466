"""What every tool-call parser shares: the parsed call, the registry (verl's `multi_turn.format`), verl's
assistant message, and the helpers the families' grammars use.

A parser turns a model turn's text into tool calls. Unlike verl, a call that cannot be parsed is returned
with `error` set, so the engine answers it with an error observation instead of dropping it.

The text is the model's, so nothing here may be slower than linear in it or raise on it: blocks are found
with `str.find` from left to right (a lazy regex over a turn with many openers and no closer is quadratic),
JSON is read by one bounded decoder (no NaN/Infinity, no overflowing numbers, at most MAX_DEPTH levels),
and whatever a parser returns passes `checked`, which turns any value a tool or an output file could not
take into a malformed call.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Callable, Iterator
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
            {
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": call.arguments
                    if isinstance(call.arguments, dict)
                    else json.dumps(call.arguments, ensure_ascii=False),
                },
            }
            for call in valid
        ]
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


def split_reasoning(
    text: str, style: str, tags: tuple[str, str] = ("<think>", "</think>")
) -> tuple[str | None, str]:
    """(reasoning, the rest) of a `think` family's turn. The reasoning runs to the turn's LAST closer: from a
    leading opener (the family's tags), or from the start when the prompt opened the block. A block never
    closed is all reasoning. The last, not the first: Qwen3's and GLM's templates take the answer after the
    last `</think>`, so a call written between two closers (a nested `<think>`) was still thought, not made."""
    if style != "think":
        return None, text
    opener, closer = tags
    head = text.lstrip()
    if head.startswith(opener):
        body = head[len(opener) :]
        end = body.rfind(closer)
        return (body, "") if end < 0 else (body[:end], body[end + len(closer) :])
    end = text.rfind(closer)
    if end >= 0:
        return text[:end], text[end + len(closer) :]
    return None, text


# --- reading the model's values, bounded ---------------------------------------------------------------------

MAX_DEPTH = 100  # nesting levels an argument may have (every JSON writer downstream recurses on it)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]}{'...' if len(text) > 20 else ''} is out of range")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_constant)  # ints: Python's digit limit


def load_json(raw: str) -> tuple[Any, str | None]:
    """(value, None), or (None, why) when `raw` is not one bounded JSON value (never raises)."""
    try:
        return _DECODER.decode(raw), None
    except RecursionError:
        return None, "JSON nested too deeply"
    except ValueError as exc:  # JSONDecodeError, a number out of range, an integer past Python's digit limit
        return None, f"Invalid JSON: {exc}"


def decode_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at `pos` (after whitespace) and where it ends, or None (never raises)."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def literal(raw: str) -> tuple[Any, bool]:
    """A Python literal as templates that render values with `| string` write them (`{'a': True}`), as
    JSON-able data: (value, True), or (None, False) when it is not one."""
    if len(raw) > 1_000_000:
        return None, False
    try:
        value = ast.literal_eval(raw)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None, False
    return (value, True) if problem(value) is None else (None, False)


def problem(value: Any) -> str | None:
    """Why `value` cannot be a tool call's arguments (JSON's types only, finite numbers, at most MAX_DEPTH
    levels), or None. Iterative, linear in the value's size. Tuples pass as lists would."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"arguments nested deeper than {MAX_DEPTH} levels"
        if isinstance(item, dict):
            for key, sub in item.items():
                if not isinstance(key, str):
                    return f"an object key {key!r} is not a string"
                stack.append((sub, depth + 1))
        elif isinstance(item, (list, tuple)):
            stack.extend((sub, depth + 1) for sub in item)
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"the number {item} is not finite"
        elif isinstance(item, int) and not isinstance(item, bool):
            if item.bit_length() > 14_000:  # ~4,300 digits: past it, str() (and so every writer) raises
                return "an integer too long to write"
        elif not (item is None or isinstance(item, (str, bool))):
            return f"a {type(item).__name__} is not a JSON value"
    return None


def checked(call: ToolCall) -> ToolCall:
    """The call, or the same call answered as malformed when its arguments are nothing a tool can take."""
    if call.error is None and call.arguments is not None:
        why = problem(call.arguments)
        if why is not None:
            call.error, call.arguments = f"arguments for '{call.name}': {why}", None
    return call


MAX_CALLS = 100  # calls read from one turn; past them one malformed call says the rest were not read


def capped(calls: list[ToolCall]) -> list[ToolCall]:
    """At most MAX_CALLS calls, and then one that tells the model the rest were not read. Parsers stop
    reading once they hold more than MAX_CALLS, so a turn of thousands of (malformed) calls costs no more
    than a turn of a hundred, here and in the answers."""
    if len(calls) <= MAX_CALLS:
        return calls
    rest = ToolCall(
        None, None, "", error=f"more than {MAX_CALLS} tool calls in one turn: the rest were not read"
    )
    return calls[:MAX_CALLS] + [rest]


def json_arguments(raw: str, name: str) -> ToolCall:
    value, error = load_json(raw)
    if error is not None:
        return ToolCall(
            name,
            None,
            raw,
            error=f"Invalid JSON in arguments for '{name}': {error.removeprefix('Invalid JSON: ')}",
        )
    return ToolCall(name, value, raw)


def blocks(text: str, opener: str, closer: str) -> Iterator[tuple[int, int, int]]:
    """(start of the opener, start of the body, end of the body) of each `opener...closer` block from left
    to right, each body ending at the nearest closer; a last block left open ends the text (its body end is
    -1). Linear: each character is looked at by one `find`."""
    pos = 0
    while (start := text.find(opener, pos)) >= 0:
        body = start + len(opener)
        end = text.find(closer, body)
        yield start, body, end
        if end < 0:
            return
        pos = end + len(closer)


# --- typing values by the tool's schema (families whose calls carry text, not JSON) --------------------------

STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def schema_types(tools: list[dict] | None) -> dict[str, dict[str, str]]:
    """tool name -> parameter -> its schema type (lower case; "" when the schema names none or several), built
    once per run from the tools' schemas (OpenAI form, or the bare function)."""
    out: dict[str, dict[str, str]] = {}
    for schema in tools or []:
        fn = schema.get("function", schema) if isinstance(schema, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn["name"]] = {k: _type_of(v) for k, v in props.items()} if isinstance(props, dict) else {}
    return out


def _type_of(prop: Any) -> str:
    if not isinstance(prop, dict):
        return ""
    kind = prop.get("type")
    if isinstance(kind, list):  # ["string", "null"]: the one type that is not null
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind is None and "enum" in prop and all(isinstance(v, str) for v in prop["enum"]):
        kind = "string"
    if kind is None and "properties" in prop:
        kind = "object"
    return str(kind).strip().lower() if isinstance(kind, str) else ""


class SchemaTyped:
    """A parser that types parameter values by the tools' schemas. `tools` is set once per run (fsm.families
    make_parser passes the spec's schemas); the table of types is built then, not per call."""

    _types: dict[str, dict[str, str]]

    @property
    def tools(self) -> list[dict]:
        return self._tools

    @tools.setter
    def tools(self, schemas: list[dict]) -> None:
        self._tools = list(schemas or [])
        self._types = schema_types(self._tools)

    def types(self, name: str) -> dict[str, str] | None:
        """The parameter types of tool `name`, or None when no tool has that name."""
        return self._types.get(name)
