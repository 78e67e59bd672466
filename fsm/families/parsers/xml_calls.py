"""Families whose calls are XML-like tags around parameter values: Qwen3-Coder, GLM-4.5 and Seed-OSS."""

from __future__ import annotations

import json
import re
from typing import Any

from fsm.families.parsers.base import ToolCall, register_parser, token_ids


def _json_value(raw: str) -> Any:
    """A parameter value as GLM and Seed parsers read it: JSON when it parses, else the text."""
    value = raw.strip()
    try:
        return json.loads(value)
    except ValueError:
        return value


@register_parser("qwen3_coder")
class Qwen3CoderParser:
    """`<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>` (Qwen3-Coder, Qwen3.5).

    As in verl (and Qwen's reference parser): a final `<tool_call>`, `<function=` or `<parameter=` may be left
    open; one newline is cut from each end of a value; values convert by the tool's schema type when the
    tool is known (`tools`), else stay strings. A function header with no `>` is malformed.
    """

    _call = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", re.DOTALL)
    _function = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
    _parameter = re.compile(r"<parameter=(.*?)</parameter>|<parameter=(.*?)$", re.DOTALL)

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids: list[int] = []
        self.tools: list[dict] = []  # schemas, for value types (fsm/run/context.py sets the spec's)

    def parse(self, text: str) -> list[ToolCall]:
        if "<tool_call>" not in text:
            return []
        blocks = [a or b for a, b in self._call.findall(text)] or [text]
        functions = [a or b for block in blocks for a, b in self._function.findall(block)]
        return [self._parse_one(raw) for raw in functions]

    def _parse_one(self, raw: str) -> ToolCall:
        end = raw.find(">")
        if end < 0:
            return ToolCall(None, None, raw, error="malformed <function=...>: no '>' after the function name")
        name, args = raw[:end], {}
        types = self._types(name)
        for a, b in self._parameter.findall(raw[end + 1 :]):
            body = a or b
            cut = body.find(">")
            if cut < 0:
                continue  # verl skips a parameter with no '>'
            value = body[cut + 1 :]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[body[:cut]] = _convert(value, types.get(body[:cut]) if types else None, bool(types))
        return ToolCall(name, args, raw)

    def _types(self, name: str) -> dict[str, str]:
        for schema in self.tools:
            fn = schema.get("function", schema)
            if fn.get("name") == name:
                props = (fn.get("parameters") or {}).get("properties") or {}
                return {k: str(v.get("type", "string")).strip().lower() if isinstance(v, dict) else "string"
                        for k, v in props.items()}  # fmt: skip
        return {}


def _convert(value: str, kind: str | None, known_tool: bool) -> Any:
    """Qwen3-Coder's value conversion by schema type (the rules verl's qwen3_coder parser follows)."""
    if value.lower() == "null":
        return None
    if kind is None:
        return value
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if number - int(number) != 0 else int(number)
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        import ast

        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            return value


@register_parser("glm45")
class GLM45Parser:
    """GLM-4.5/4.6/4.7: `<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`; values are
    JSON when they parse, else text. The model ends a calling turn with `<|observation|>` and an answer with
    `<|user|>` (its generation_config's eos ids), so it stops at both."""

    _call = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids = token_ids(tokenizer, "<|observation|>", "<|user|>")

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for raw in self._call.findall(text):
            first = raw.find("<arg_key>")
            name = (raw if first < 0 else raw[:first]).strip()
            if not name:
                calls.append(ToolCall(None, None, raw, error="a <tool_call> must start with the function name"))
                continue
            pairs = self._pair.findall(raw[first:]) if first >= 0 else []
            calls.append(ToolCall(name, {k.strip(): _json_value(v) for k, v in pairs}, raw))
        tail = text[text.rfind("</tool_call>") + len("</tool_call>") :] if "</tool_call>" in text else text
        if "<tool_call>" in tail:
            raw = tail[tail.index("<tool_call>") + len("<tool_call>") :]
            calls.append(ToolCall(None, None, raw, error="unterminated <tool_call>: missing </tool_call>"))
        return calls


@register_parser("seed")
class SeedParser:
    """Seed-OSS: `<seed:tool_call><function=NAME><parameter=K>V</parameter></function></seed:tool_call>`;
    values are JSON when they parse, else text (verl's `seed` parser reads them so)."""

    _call = re.compile(r"<seed:tool_call>(.*?)</seed:tool_call>", re.DOTALL)
    _function = re.compile(r"<function=([^>\n]+)>\s*(.*?)</function>", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids = []

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for raw in self._call.findall(text):
            fn = self._function.search(raw)
            if fn is None:
                calls.append(ToolCall(None, None, raw, error="a <seed:tool_call> needs <function=NAME>...</function>"))
                continue
            args = {k.strip(): _json_value(v) for k, v in self._parameter.findall(fn.group(2))}
            calls.append(ToolCall(fn.group(1).strip(), args, raw))
        tail = text[text.rfind("</seed:tool_call>") + len("</seed:tool_call>") :] if "</seed:tool_call>" in text else text
        if "<seed:tool_call>" in tail:
            raw = tail[tail.index("<seed:tool_call>") + len("<seed:tool_call>") :]
            calls.append(ToolCall(None, None, raw, error="unterminated <seed:tool_call>: missing </seed:tool_call>"))
        return calls
