"""gpt-oss's Harmony format: messages with a channel and a recipient; a call is one addressed to a function."""

from __future__ import annotations

import re

from fsm.families.parsers.base import ToolCall, json_arguments, register_parser, token_ids


@register_parser("gpt_oss")
class HarmonyParser:
    """gpt-oss (Harmony): a call is a commentary (or analysis) message addressed `to=functions.NAME`, whose
    body runs to `<|call|>`. The recipient may sit in the header before or after the channel, and the first
    message of a turn has no `<|start|>assistant` (the prompt ends with it). `<|call|>` is a stop token."""

    _end = re.compile(r"<\|call\|>|<\|end\|>|<\|return\|>")
    _channel = re.compile(r"<\|channel\|>\s*(\w+)")
    _recipient = re.compile(r"to=functions\.([^\s<]+)")

    def __init__(self, tokenizer: object = None):
        self.stop_token_ids = token_ids(tokenizer, "<|call|>", "<|return|>")

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
                calls.append(json_arguments(body, recipient))
        return calls
