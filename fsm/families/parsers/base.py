"""What every tool-call parser shares: the parsed call, the registry (verl's `multi_turn.format`), verl's
assistant message, and the helpers the families' grammars use; and the families whose calls carry JSON, read
with the bounded decoder here: Hermes/Qwen2.5/Qwen3 (`<tool_call>{...}</tool_call>`), Llama 3.x JSON calls,
Kimi-K2 and DeepSeek-V3 (special-token sections around JSON arguments).

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
import re
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
        message["tool_calls"] = [{"type": "function", "function": _function(call)} for call in valid]
    return message


def _function(call: ToolCall) -> dict[str, Any]:
    args = call.arguments
    return {
        "name": call.name,
        "arguments": args if isinstance(args, dict) else json.dumps(args, ensure_ascii=False),
    }


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
        return None, str(exc)


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
        return ToolCall(name, None, raw, error=f"Invalid JSON in arguments for '{name}': {error}")
    return ToolCall(name, value, raw)


def invalid_call(raw: str, why: str) -> ToolCall:
    """A block whose JSON does not parse: a malformed call, answered with why."""
    return ToolCall(None, None, raw, error=f"Invalid JSON in tool call: {why}")


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


# The families whose calls carry JSON.

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_STRING_OR_CLOSE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|(</tool_call>)', re.DOTALL)
_SHAPE = 'a tool call must be a JSON object with a string "name" and "arguments" (or "parameters")'
_LLAMA_SHAPE = 'a tool call must be a JSON object with a string "name" and "parameters"'


def _string_aware_close(text: str, pos: int) -> int:
    """The first `</tool_call>` at or after `pos` outside a JSON string (as SGLang's Hermes detector reads a
    call), or the nearest one when none is outside. One regex pass: each string is skipped whole."""
    for match in _STRING_OR_CLOSE.finditer(text, pos):
        if match.group(1):
            return match.start()
    return text.find(_CLOSE, pos)


@register_parser("hermes")
class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn.

    Read as SGLang 0.5.23's Hermes/Qwen2.5 detectors read it where they accept what verl 0.9.1 drops (the
    choices and why: docs/families.md, "Tool-call parsing"): the JSON value after `<tool_call>` is read
    string-aware, so a `</tool_call>` inside an argument string does not cut the call; `"parameters"` is
    taken where `"arguments"` is missing; a JSON list of calls in one block is each of them. A call to a tool
    that does not exist stays a call (answered "Unknown function", as verl does; SGLang drops it).
    """

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids: list[int] = []

    def parse(self, text: str) -> list[ToolCall]:
        calls: list[ToolCall] = []
        for _start, _stop, block in self._blocks(text):
            calls.extend(checked(call) for call in block)
            if len(calls) > MAX_CALLS:
                break
        return capped(calls)

    def content(self, text: str) -> str:
        """verl's hermes parser removes the blocks only when both tags occur, and keeps an unterminated one."""
        if _OPEN not in text or _CLOSE not in text:
            return text
        kept, pos = [], 0
        for k, (start, stop, _calls) in enumerate(self._blocks(text)):
            if stop < 0 or k > MAX_CALLS:  # past the calls read, the text stays as the model wrote it
                break
            kept.append(text[pos:start])
            pos = stop
        return "".join(kept) + text[pos:]

    def _blocks(self, text: str) -> Iterator[tuple[int, int, list[ToolCall]]]:
        """(start, end after the closer or -1 when never closed, the block's calls) from left to right.

        A block ends at the first closer outside a JSON string; when what precedes that closer is no JSON
        (a stray quote paired across blocks), at the nearest closer, as verl reads it. No JSON decoder runs
        on more than the block: a failing `raw_decode` deep in a long text costs as much as the text before
        it (its error counts the lines), which made reading from each opener quadratic."""
        pos = 0
        while (start := text.find(_OPEN, pos)) >= 0:
            body = start + len(_OPEN)
            nearest = text.find(_CLOSE, body)
            if nearest < 0:
                error: str | None = f"unterminated {_OPEN}: missing {_CLOSE}"
                yield start, -1, [ToolCall(None, None, text[body:], error=error)]
                return
            # JSON up to the nearest closer has no closer in a string: it is the string-aware one, not looked for
            raw = text[body:nearest]
            value, error = load_json(raw)
            if error is not None and '"' in raw and (end := _string_aware_close(text, body)) != nearest:
                other, other_error = load_json(text[body:end])
                if other_error is None:
                    value, error, raw, nearest = other, None, text[body:end], end
            pos = nearest + len(_CLOSE)
            yield start, pos, self._calls(value, raw) if error is None else [invalid_call(raw, error)]

    @staticmethod
    def _calls(value: Any, raw: str) -> list[ToolCall]:
        """The calls one block's JSON value makes (a list makes each of its items). The arguments stay the
        JSON value the model wrote; the tool policy decides what a string or a non-object there means
        (fsm.tools.base.ToolSet.call). A model-written "id" is no call id (verl)."""
        items = value if isinstance(value, list) and value else [value]
        calls = []
        for obj in items:
            args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
            if (
                not isinstance(obj, dict)
                or not isinstance(obj.get("name"), str)
                or args is None
                and not ("arguments" in obj or "parameters" in obj)
            ):
                calls.append(ToolCall(None, None, raw, error=_SHAPE))
            else:
                calls.append(ToolCall(obj["name"], args, raw))
        return calls


@register_parser("llama3_json")
class Llama3JsonParser:
    """Llama 3.1/3.2/3.3 JSON calls: the turn is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`; several separated by `;`). A turn that starts with `{` and does not parse is a malformed
    call; any other text is an answer. Stops at `<|eom_id|>` too (the model's end of a tool message)."""

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids = token_ids(tokenizer, "<|eom_id|>")

    def parse(self, text: str) -> list[ToolCall]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>") :].strip()
        if not body.startswith("{"):
            return []
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(body) and (not calls or body[pos] == "{"):  # text after the calls is not a call
            read = decode_at(body, pos)
            if read is None:
                calls.append(invalid_call(body[pos:], load_json(body[pos:])[1] or ""))
                break
            obj, end = read
            raw = body[pos:end]
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or args is None:
                calls.append(ToolCall(None, None, raw, error=_LLAMA_SHAPE))
            else:
                calls.append(ToolCall(obj["name"], args, raw))
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
            if len(calls) > MAX_CALLS:
                break
        return capped([checked(call) for call in calls])


_SECTION = "<|tool_calls_section_begin|>"


def _marked(text: str, begin: str, sep: str, end: str) -> Iterator[tuple[str, str]]:
    """(head, body) of each `begin HEAD sep BODY end` from left to right, as the lazy regex
    `begin(.*?)sep(.*?)end` finds them, but each character looked at once."""
    pos = 0
    while (b := text.find(begin, pos)) >= 0:
        s = text.find(sep, b + len(begin))
        e = text.find(end, s + len(sep)) if s >= 0 else -1
        if e < 0:
            return
        yield text[b + len(begin) : s], text[s + len(sep) : e]
        pos = e + len(end)


@register_parser("kimi_k2")
class KimiK2Parser:
    """Kimi-K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
    {json}<|tool_call_end|>...<|tool_calls_section_end|>`. The id `functions.NAME:IDX` is kept as the call's
    id (the template renders tool results under it). Stops at `<|im_end|>`, as verl's."""

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids = token_ids(tokenizer, "<|im_end|>")

    def parse(self, text: str) -> list[ToolCall]:
        if _SECTION not in text:
            return []
        calls = []
        for raw_id, raw_args in _marked(
            text, "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
        ):
            raw_id = raw_id.strip()
            name = raw_id.removeprefix("functions.")
            head, colon, index = name.rpartition(":")
            if colon and index.isdigit() and head:
                name = head
            if not name or any(c.isspace() or c == ":" for c in name):
                name = raw_id
            call = json_arguments(raw_args.strip(), name)
            call.id = raw_id
            calls.append(checked(call))
            if len(calls) > MAX_CALLS:
                return capped(calls)
        section = text[text.index(_SECTION) :]
        if section.count("<|tool_call_begin|>") > len(calls):
            calls.append(
                ToolCall(
                    None, None, section, error="unterminated <|tool_call_begin|>: missing <|tool_call_end|>"
                )
            )
        return calls


@register_parser("deepseek_v3")
class DeepSeekV3Parser:
    """DeepSeek-V3.1 `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>`, and V3/R1's
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{json}\\n```<｜tool▁call▁end｜>`."""

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids: list[int] = []

    def parse(self, text: str) -> list[ToolCall]:
        if "<｜tool▁calls▁begin｜>" not in text and "<｜tool▁call▁begin｜>" not in text:
            return []
        calls = []
        for head, body in _marked(text, "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"):
            fenced = _fenced(body) if head.strip() == "function" else None
            if fenced:
                calls.append(checked(json_arguments(fenced[1], fenced[0])))
            else:
                calls.append(checked(json_arguments(body.strip(), head.strip())))
            if len(calls) > MAX_CALLS:
                return capped(calls)
        if text.count("<｜tool▁call▁begin｜>") > len(calls):
            raw = text[text.rfind("<｜tool▁call▁begin｜>") :]
            calls.append(
                ToolCall(
                    None, None, raw, error="unterminated <｜tool▁call▁begin｜>: missing <｜tool▁call▁end｜>"
                )
            )
        return calls


def _fenced(body: str) -> tuple[str, str] | None:
    """(name, JSON) of V3/R1's `NAME\\n```json\\n{json}\\n```` body, or None when it is not that shape."""
    name, newline, rest = body.partition("\n")
    rest = rest.rstrip()
    for fence in ("```json\n", "```\n"):
        if (
            newline
            and name
            and len(rest) >= len(fence) + 4
            and rest.startswith(fence)
            and rest.endswith("\n```")
        ):
            return name.strip(), rest[len(fence) : -len("\n```")]
    return None
