"""Families whose calls are XML-like tags around parameter values: Qwen3-Coder, GLM-4.5 and Seed-OSS.

A value here is text, so its type comes from the tool's schema, as SGLang's and vLLM's parsers type it: a
string parameter keeps the text exactly (a string "42", "true", "null" or " x" stays that string), numbers,
booleans, objects and arrays are read as such (objects also as the Python literal Seed's template writes
with `| string`), and a parameter no schema knows is JSON when it parses, else text. A number that is not
finite ("1e999", "nan") makes the call malformed. Markers are found with `str.find`, left to right.
"""

from __future__ import annotations

from typing import Any

from fsm.families.parsers.base import (
    MAX_CALLS,
    STRING_TYPES,
    SchemaTyped,
    ToolCall,
    blocks,
    capped,
    checked,
    literal,
    load_json,
    register_parser,
    token_ids,
)


class Malformed(ValueError):
    """A parameter value that makes the call malformed (its message says why)."""


def typed(raw: str, kind: str | None, *, strip: bool = True) -> Any:
    """A parameter's text as the value its schema type says. `kind` None: no schema knows the parameter;
    "": the schema gives no single type. Non-string values are read with the text's edges stripped."""
    if kind in STRING_TYPES:
        return raw
    value = raw.strip() if strip else raw
    if kind is not None and kind != "" and value in ("null", "None"):
        return None
    if kind is not None and kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            pass  # "2.0", or not a number: read below as a number, else kept as text
        kind = "number"
    if kind is not None and kind.startswith(("num", "float", "double")):
        try:
            number = float(value)
        except ValueError:
            number = None  # not a number: read below like an untyped value; the tool's validation answers it
        if number is not None and (number != number or number in (float("inf"), float("-inf"))):
            raise Malformed(f"the number {value[:20]!r} is out of range (not finite)")
        if number is not None:
            integral = number.is_integer() and "." not in value and "e" not in value.lower()
            return int(number) if integral else number
    if kind is not None and kind.startswith("bool") and value.lower() in ("true", "false"):
        return value.lower() == "true"
    parsed, error = load_json(value)
    if error is None:
        return parsed
    if any(why in error for why in ("out of range", "not a JSON value", "too deeply", "digits")):
        raise Malformed(error)
    if kind not in (None, "") and value[:1] in "{[(":  # an object or array written as a Python literal
        parsed, ok = literal(value)
        if ok:
            return parsed
    return value


def _ends(text: str, start: int, closer: str) -> int:
    """Where the block opened at `start` ends: its nearest closer, or the end of the text."""
    end = text.find(closer, start)
    return len(text) if end < 0 else end


def one_call_per_block(text: str, opener: str, closer: str, parse_one: Any) -> list[ToolCall]:
    """Families whose every opener..closer block holds one call (GLM, Seed): each block's call, checked, left to
    right; an unterminated block is one malformed call and ends the turn."""
    calls = []
    for _start, body, end in blocks(text, opener, closer):
        if end < 0:
            calls.append(ToolCall(None, None, text[body:], error=f"unterminated {opener}: missing {closer}"))
            break
        calls.append(checked(parse_one(text[body:end])))
        if len(calls) > MAX_CALLS:
            break
    return capped(calls)


@register_parser("qwen3_coder")
class Qwen3CoderParser(SchemaTyped):
    """`<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>` (Qwen3-Coder, Qwen3.5).

    As in verl (and Qwen's reference parser): a final `<tool_call>`, `<function=` or `<parameter=` may be left
    open; one newline is cut from each end of a value; values are typed by the tool's schema (module doc),
    except that a string parameter keeps "null" as text (Qwen's reference makes any "null" None; a string
    argument "null" must reach the tool as the template rendered it). A header with no `>` is malformed.
    """

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids: list[int] = []
        self.tools = []

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for _start, body, end in blocks(text, "<tool_call>", "</tool_call>"):
            block = text[body : len(text) if end < 0 else end]
            pos = 0
            while (f := block.find("<function=", pos)) >= 0:
                stop = _ends(block, f, "</function>")
                calls.append(checked(self._parse_one(block[f + len("<function=") : stop])))
                pos = stop + len("</function>")
                if len(calls) > MAX_CALLS:
                    return capped(calls)
        return calls

    def _parse_one(self, raw: str) -> ToolCall:
        end = raw.find(">")
        if end < 0:
            return ToolCall(None, None, raw, error="malformed <function=...>: no '>' after the function name")
        name, args, body, pos = raw[:end], {}, raw[end + 1 :], 0
        types = self.types(name)
        while (p := body.find("<parameter=", pos)) >= 0:
            stop = _ends(body, p, "</parameter>")
            pos = stop + len("</parameter>")
            param = body[p + len("<parameter=") : stop]
            cut = param.find(">")
            if cut < 0:
                continue  # verl skips a parameter with no '>'
            key, value = param[:cut], param[cut + 1 :]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            try:
                args[key] = self._value(value, types.get(key) if types is not None else None)
            except Malformed as exc:
                return ToolCall(name, None, raw, error=f"parameter '{key}' of '{name}': {exc}")
        return ToolCall(name, args, raw)

    @staticmethod
    def _value(value: str, kind: str | None) -> Any:
        """Qwen's rules: a parameter no schema knows stays text ("null": None), one whose schema names no
        type is a string; else by its type."""
        if kind is None:
            return None if value.lower() == "null" else value
        return typed(value, kind or "string", strip=False)


_GLM_PAIRS = "each <arg_key>k</arg_key> must be followed by <arg_value>v</arg_value>"


@register_parser("glm45")
class GLM45Parser(SchemaTyped):
    """GLM-4.5/4.6/4.7: `<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`; values are
    typed by the schema (module doc); the template writes a string as is and anything else as JSON. The model
    ends a calling turn with `<|observation|>` and an answer with `<|user|>` (its generation_config's eos
    ids), so it stops at both."""

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids = token_ids(tokenizer, "<|observation|>", "<|user|>")
        self.tools = []

    def parse(self, text: str) -> list[ToolCall]:
        return one_call_per_block(text, "<tool_call>", "</tool_call>", self._parse_one)

    def _parse_one(self, raw: str) -> ToolCall:
        first = raw.find("<arg_key>")
        name = (raw if first < 0 else raw[:first]).strip()
        if not name:
            return ToolCall(None, None, raw, error="a <tool_call> must start with the function name")
        types, args, pos = self.types(name), {}, max(first, 0)
        while first >= 0 and (k := raw.find("<arg_key>", pos)) >= 0:
            k_end = raw.find("</arg_key>", k)
            v = raw.find("<arg_value>", k_end) if k_end >= 0 else -1
            v_end = raw.find("</arg_value>", v) if v >= 0 else -1
            if v_end < 0 or raw[k_end + len("</arg_key>") : v].strip():
                return ToolCall(name, None, raw, error=_GLM_PAIRS)
            key = raw[k + len("<arg_key>") : k_end].strip()
            kind = types.get(key, "") if types is not None else None
            try:
                args[key] = typed(raw[v + len("<arg_value>") : v_end], kind)
            except Malformed as exc:
                return ToolCall(name, None, raw, error=f"argument '{key}' of '{name}': {exc}")
            pos = v_end + len("</arg_value>")
        return ToolCall(name, args, raw)


@register_parser("seed")
class SeedParser(SchemaTyped):
    """Seed-OSS: `<seed:tool_call><function=NAME><parameter=K>V</parameter></function></seed:tool_call>`;
    values are typed by the schema (module doc). The template writes a string as is and anything else with
    Jinja's `| string` (Python's repr: `True`, `None`, `{'a': 1}`), which the typing reads back."""

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids: list[int] = []
        self.tools = []

    def parse(self, text: str) -> list[ToolCall]:
        return one_call_per_block(text, "<seed:tool_call>", "</seed:tool_call>", self._parse_one)

    def _parse_one(self, raw: str) -> ToolCall:
        f = raw.find("<function=")
        gt = raw.find(">", f) if f >= 0 else -1
        stop = raw.find("</function>", gt) if gt >= 0 else -1
        name = raw[f + len("<function=") : gt].strip() if gt >= 0 else ""
        if stop < 0 or not name or "\n" in name:
            return ToolCall(None, None, raw, error="a <seed:tool_call> needs <function=NAME>...</function>")
        types, args, body, pos = self.types(name), {}, raw[gt + 1 : stop], 0
        while (p := body.find("<parameter=", pos)) >= 0:
            gt = body.find(">", p)
            end = body.find("</parameter>", gt) if gt >= 0 else -1
            key = body[p + len("<parameter=") : gt] if gt >= 0 else ""
            if end < 0 or not key.strip() or "\n" in key:
                return ToolCall(name, None, raw, error="each <parameter=NAME> must end with </parameter>")
            key = key.strip()
            try:
                args[key] = typed(body[gt + 1 : end], types.get(key, "") if types is not None else None)
            except Malformed as exc:
                return ToolCall(name, None, raw, error=f"parameter '{key}' of '{name}': {exc}")
            pos = end + len("</parameter>")
        return ToolCall(name, args, raw)
