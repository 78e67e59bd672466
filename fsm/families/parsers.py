"""Tool-call parsers of the model families beyond Hermes, registered beside it in fsm.parsers.PARSERS.

Each reads a model turn's text (decoded with its special tokens) and returns every call the model made, in
order. A call the family's grammar opens but that does not parse comes back with `error` set, so the engine
answers it (fsm/tools/base.py) instead of dropping it; where verl 0.9.1 has a parser for the family, the calls it
extracts from a text are the calls extracted here (tests/test_family_parsers.py holds the two together).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fsm.parsers import ToolCall, register_parser


def _token_ids(tokenizer: Any, *tokens: str) -> list[int]:
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


def _json_value(raw: str) -> Any:
    """A parameter value as GLM and Seed parsers read it: JSON when it parses, else the text."""
    value = raw.strip()
    try:
        return json.loads(value)
    except ValueError:
        return value


def _json_arguments(raw: str, name: str) -> ToolCall:
    try:
        return ToolCall(name, json.loads(raw), raw)
    except ValueError as exc:
        return ToolCall(name, None, raw, error=f"Invalid JSON in arguments for '{name}': {exc}")


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
        self.stop_token_ids = _token_ids(tokenizer, "<|observation|>", "<|user|>")

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


@register_parser("gpt_oss")
class HarmonyParser:
    """gpt-oss (Harmony): a call is a commentary (or analysis) message addressed `to=functions.NAME`, whose
    body runs to `<|call|>`. The recipient may sit in the header before or after the channel, and the first
    message of a turn has no `<|start|>assistant` (the prompt ends with it). `<|call|>` is a stop token."""

    _end = re.compile(r"<\|call\|>|<\|end\|>|<\|return\|>")
    _channel = re.compile(r"<\|channel\|>\s*(\w+)")
    _recipient = re.compile(r"to=functions\.([^\s<]+)")

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids = _token_ids(tokenizer, "<|call|>", "<|return|>")

    def messages(self, text: str) -> list[tuple[str, str, str, str]]:
        """(channel, recipient, body, end token or "") of each message of a turn, in order."""
        out = []
        for piece in text.split("<|start|>"):
            head, sep, rest = piece.partition("<|message|>")
            if not sep:
                continue
            end = self._end.search(rest)
            channel, recipient = self._channel.search(head), self._recipient.search(head)
            out.append((channel.group(1) if channel else "", recipient.group(1) if recipient else "",
                        rest[: end.start()] if end else rest, end.group() if end else ""))  # fmt: skip
        return out

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for channel, recipient, body, end in self.messages(text):
            if not recipient or channel == "analysis":  # calls in the reasoning channel are not made (verl)
                continue
            if end != "<|call|>":
                calls.append(ToolCall(recipient, None, body, error=f"the call to '{recipient}' never reached <|call|>"))
            else:
                calls.append(_json_arguments(body, recipient))
        return calls


@register_parser("kimi_k2")
class KimiK2Parser:
    """Kimi-K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
    {json}<|tool_call_end|>...<|tool_calls_section_end|>`. The id `functions.NAME:IDX` is kept as the call's
    id (the template renders tool results under it). Stops at `<|im_end|>`, as verl's."""

    _call = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL)
    _name = re.compile(r"^(?:functions\.)?([^:\s]+)(?::\d+)?$")

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids = _token_ids(tokenizer, "<|im_end|>")

    def parse(self, text: str) -> list[ToolCall]:
        if "<|tool_calls_section_begin|>" not in text:
            return []
        calls = []
        for raw_id, raw_args in self._call.findall(text):
            raw_id = raw_id.strip()
            match = self._name.match(raw_id)
            name = match.group(1) if match else raw_id
            call = _json_arguments(raw_args.strip(), name)
            call.id = raw_id
            calls.append(call)
        section = text[text.index("<|tool_calls_section_begin|>") :]
        if section.count("<|tool_call_begin|>") > len(calls):
            calls.append(ToolCall(None, None, section, error="unterminated <|tool_call_begin|>: missing <|tool_call_end|>"))
        return calls


@register_parser("deepseek_v3")
class DeepSeekV3Parser:
    """DeepSeek-V3.1 `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>`, and V3/R1's
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{json}\\n```<｜tool▁call▁end｜>`."""

    _call = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
    _fenced = re.compile(r"^(?P<name>[^\n]+)\n```(?:json)?\n(?P<args>.*)\n```\s*$", re.DOTALL)

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids = []

    def parse(self, text: str) -> list[ToolCall]:
        if "<｜tool▁calls▁begin｜>" not in text and "<｜tool▁call▁begin｜>" not in text:
            return []
        calls = []
        for head, body in self._call.findall(text):
            fenced = self._fenced.match(body) if head.strip() == "function" else None
            if fenced:
                calls.append(_json_arguments(fenced.group("args"), fenced.group("name").strip()))
            else:
                calls.append(_json_arguments(body.strip(), head.strip()))
        if text.count("<｜tool▁call▁begin｜>") > len(calls):
            raw = text[text.rfind("<｜tool▁call▁begin｜>") :]
            calls.append(ToolCall(None, None, raw, error="unterminated <｜tool▁call▁begin｜>: missing <｜tool▁call▁end｜>"))
        return calls


@register_parser("llama3_json")
class Llama3JsonParser:
    """Llama 3.1/3.2/3.3 JSON calls: the turn is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`; several separated by `;`). A turn that starts with `{` and does not parse is a malformed
    call; any other text is an answer. Stops at `<|eom_id|>` too (the model's end of a tool message)."""

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids = _token_ids(tokenizer, "<|eom_id|>")

    def parse(self, text: str) -> list[ToolCall]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>") :].strip()
        if not body.startswith("{"):
            return []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body) and (not calls or body[pos] == "{"):  # text after the calls is not a call
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError as exc:
                calls.append(ToolCall(None, None, body[pos:], error=f"Invalid JSON in tool call: {exc}"))
                break
            raw = body[pos:end]
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or args is None:
                calls.append(ToolCall(None, None, raw, error='a tool call must be a JSON object with a string "name" and "parameters"'))
            else:
                calls.append(ToolCall(obj["name"], args, raw))
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return calls
