"""Families whose calls carry JSON: Hermes/Qwen2.5/Qwen3 (`<tool_call>{...}</tool_call>`), Llama 3.x JSON
calls, Kimi-K2 and DeepSeek-V3 (special-token sections around JSON arguments). Each scans its markers with
`str.find` from left to right (linear in the turn) and reads JSON with fsm.families.parsers.base's bounded
decoder; every call passes `checked`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from fsm.families.parsers.base import (
    MAX_CALLS,
    ToolCall,
    capped,
    checked,
    decode_at,
    json_arguments,
    load_json,
    register_parser,
    token_ids,
)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_STRING_OR_CLOSE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|(</tool_call>)', re.DOTALL)
_SHAPE = 'a tool call must be a JSON object with a string "name" and "arguments" (or "parameters")'


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
            end = _string_aware_close(text, body) if '"' in text[body:nearest] else nearest
            value, error = load_json(text[body:end])
            if error is not None and end != nearest:
                end = nearest
                value, error = load_json(text[body:end])
            raw, pos = text[body:end], end + len(_CLOSE)
            yield (
                start,
                pos,
                self._calls(value, raw)
                if error is None
                else [
                    ToolCall(
                        None,
                        None,
                        raw,
                        error=f"Invalid JSON in tool call: {error.removeprefix('Invalid JSON: ')}",
                    )
                ],
            )

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
                _value, error = load_json(body[pos:])
                calls.append(
                    ToolCall(
                        None,
                        None,
                        body[pos:],
                        error=f"Invalid JSON in tool call: {(error or '').removeprefix('Invalid JSON: ')}",
                    )
                )
                break
            obj, end = read
            raw = body[pos:end]
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or args is None:
                calls.append(
                    ToolCall(
                        None,
                        None,
                        raw,
                        error='a tool call must be a JSON object with a string "name" and "parameters"',
                    )
                )
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
