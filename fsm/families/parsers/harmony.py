"""gpt-oss's Harmony format: messages with a channel and a recipient; a call is one addressed to a function.

A header is read whole: one that names two channels or two recipients is ambiguous (which one the model
meant is not for the parser to pick), so a call in it is answered as malformed, never made on the first.
"""

from __future__ import annotations

import re

from fsm.families.parsers.base import (
    MAX_CALLS,
    ToolCall,
    capped,
    checked,
    json_arguments,
    register_parser,
    token_ids,
)

AMBIGUOUS = "<ambiguous>"  # the channel or recipient of a header that names two
_TWO = "a Harmony message header names two channels or two recipients; write one <|channel|> and one to=functions.NAME"


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
        self._last: tuple[str, list[tuple[str, str, str, str]]] | None = None

    def messages(self, text: str) -> list[tuple[str, str, str, str]]:
        """(channel, recipient, body, end token or "") of each message of a turn, in order. The last turn's
        answer is kept: a turn is read for its calls, its reasoning and its message, three times in a row."""
        last = self._last
        if last is not None and last[0] is text:
            return last[1]
        out = []
        for piece in text.split("<|start|>"):
            head, sep, rest = piece.partition("<|message|>")
            if not sep:
                continue
            end = self._end.search(rest)
            channels, recipients = self._channel.findall(head), self._recipient.findall(head)
            channel = AMBIGUOUS if len(channels) > 1 else channels[0] if channels else ""
            recipient = AMBIGUOUS if len(recipients) > 1 else recipients[0] if recipients else ""
            out.append((channel, recipient, rest[: end.start()] if end else rest, end.group() if end else ""))
        self._last = (text, out)
        return out

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for channel, recipient, body, end in self.messages(text):
            if not recipient or channel == "analysis":  # calls in the reasoning channel are not made (verl)
                continue
            if AMBIGUOUS in (channel, recipient):
                calls.append(ToolCall(None, None, body, error=_TWO))
                continue
            if end != "<|call|>":
                calls.append(
                    ToolCall(recipient, None, body, error=f"the call to '{recipient}' never reached <|call|>")
                )
            else:
                calls.append(checked(json_arguments(body, recipient)))
            if len(calls) > MAX_CALLS:
                break
        return capped(calls)
