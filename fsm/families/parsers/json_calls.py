"""Families whose calls carry JSON: Hermes/Qwen2.5/Qwen3 (`<tool_call>{...}</tool_call>`), Llama 3.x JSON
calls, Kimi-K2 and DeepSeek-V3 (special-token sections around JSON arguments)."""

from __future__ import annotations

import json
import re

from fsm.families.parsers.base import ToolCall, json_arguments, register_parser, token_ids


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


@register_parser("kimi_k2")
class KimiK2Parser:
    """Kimi-K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
    {json}<|tool_call_end|>...<|tool_calls_section_end|>`. The id `functions.NAME:IDX` is kept as the call's
    id (the template renders tool results under it). Stops at `<|im_end|>`, as verl's."""

    _call = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL)
    _name = re.compile(r"^(?:functions\.)?([^:\s]+)(?::\d+)?$")

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids = token_ids(tokenizer, "<|im_end|>")

    def parse(self, text: str) -> list[ToolCall]:
        if "<|tool_calls_section_begin|>" not in text:
            return []
        calls = []
        for raw_id, raw_args in self._call.findall(text):
            raw_id = raw_id.strip()
            match = self._name.match(raw_id)
            name = match.group(1) if match else raw_id
            call = json_arguments(raw_args.strip(), name)
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
                calls.append(json_arguments(fenced.group("args"), fenced.group("name").strip()))
            else:
                calls.append(json_arguments(body.strip(), head.strip()))
        if text.count("<｜tool▁call▁begin｜>") > len(calls):
            raw = text[text.rfind("<｜tool▁call▁begin｜>") :]
            calls.append(ToolCall(None, None, raw, error="unterminated <｜tool▁call▁begin｜>: missing <｜tool▁call▁end｜>"))
        return calls
