"""Chat-template arithmetic, done once per tokenizer: prompts, observation suffixes, the turn closer.

An observation (tool results, a user reply) is rendered as the *suffix* it adds to a conversation: the
template renders `BASE + observation` and the tokens of `BASE` are cut off. BASE is a fixed two-message
conversation rendered once, so nothing already in a trajectory is re-tokenized. The "turn closer" is what
the template puts after the end-of-turn token of an assistant message (Qwen's `\\n` after `<|im_end|>`):
the model stops at `<|im_end|>`, so those tokens are owed, with mask 0, before the next observation.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from fsm.segments import SegmentEncoder


class TemplateError(Exception):
    """The chat template cannot be used append-only (e.g. it rewrites earlier turns)."""


_BASE = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]


def vocabulary_size(tokenizer: Any) -> int:
    """How many ids a model answer may use: the tokenizer's, or the model's embedding rows when its
    config.json sits beside the tokenizer (Qwen pads 151,665 tokens to 151,936 rows; a sampled padding id is
    a valid, if useless, token the trainer can embed)."""
    size = len(tokenizer)
    config = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "config.json"
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        rows = json.loads(config.read_text()).get("vocab_size")
        if type(rows) is int and rows > size:
            size = rows
    return size


class ChatCodec:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.segments = SegmentEncoder(tokenizer)
        self.eos_id: int = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else 0
        self._base_ids = self.render(_BASE, add_generation_prompt=False)
        if self.eos_id not in self._base_ids:
            raise TemplateError(f"the chat template never emits eos {tokenizer.eos_token!r} after a turn")
        last_eos = len(self._base_ids) - 1 - self._base_ids[::-1].index(self.eos_id)
        self.turn_closer: list[int] = [self.eos_id, *self._base_ids[last_eos + 1 :]]
        self.vocab_size: int = vocabulary_size(tokenizer)
        self.eos_text: str = self.decode([self.eos_id], skip_special_tokens=False)
        # An observation's text is tokenized alone, without the base conversation, when it starts with an added
        # token (Qwen's <|im_start|>): tokenizers split text at added tokens before anything else, so its ids
        # are exactly those of the full render. Otherwise the full render is tokenized and cut.
        self._base_text = self.render_text(_BASE, add_generation_prompt=False)
        added = getattr(tokenizer, "get_added_vocab", None)
        self._added_tokens = tuple(added()) if callable(added) else ()

    def render(
        self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None, add_generation_prompt: bool
    ) -> list[int]:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
            tokenize=True, return_dict=False,
        )  # fmt: skip

    def render_text(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def encode_prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """The ids `render` gives; the pieces every prompt repeats (system message, tool schemas) are
        tokenized once (fsm/segments.py)."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                  tokenize=False)  # fmt: skip
        return self.segments.encode(text)

    def encode_observation(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids that `messages` (tool/user turns) append, generation prompt included."""
        if self._added_tokens:
            text, n = self.render_text(_BASE + messages, add_generation_prompt=True), len(self._base_text)
            if text.startswith(self._base_text) and text.startswith(self._added_tokens, n):
                return self.segments.encode(text[n:])
        full = self.render(_BASE + messages, add_generation_prompt=True)
        n = len(self._base_ids)
        if full[:n] != self._base_ids:
            raise TemplateError(
                "the chat template is not append-only: rendering more turns changed earlier tokens"
            )
        return full[n:]

    def observation(
        self, messages: list[dict[str, Any]], last: list[int] | None, history: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[int]]:
        """(the template tokens owed after the model turn that ended with `last` (None: the context does not
        end with a model turn), the observation's ids). FamilyCodec (fsm/families/codec.py) also reads
        `history`, the conversation so far."""
        return (self.closer_for(last) if last is not None else []), self.encode_observation(messages)

    def turn_text(self, ids: list[int]) -> str:
        """A model turn as text for its parser and the conversation: special tokens kept, eos left out."""
        return self.decode(ids[:-1] if ids and ids[-1] == self.eos_id else ids, skip_special_tokens=False)

    def assistant_message(self, text: str, calls: list[Any]) -> dict[str, Any]:
        return {"role": "assistant", "content": text}

    def verl_message(self, message: dict[str, Any], ids: list[int], parser: Any, max_calls: int) -> dict[str, Any]:
        """A model turn's message as verl 0.9.1's AgentData holds it, which tools read: the text decoded with
        its eos, tool-call blocks moved to `tool_calls` (fsm/families/parsers assistant_message)."""
        text = message["content"]
        from fsm.families.parsers import assistant_message  # here: fsm.families imports this module

        content = parser.content(text) + (self.eos_text if ids[-1:] == [self.eos_id] else "")
        return assistant_message(content, parser.parse(text), max_calls)

    def interaction_message(self, message: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        """A model turn as a user simulator reads it: its text with special tokens skipped (verl 0.7.1)."""
        return {"role": "assistant", "content": self.decode(ids)}

    def closer_for(self, generated: list[int]) -> list[int]:
        """Template tokens owed after a model turn: the tail after eos, or eos + tail if the turn was cut."""
        if generated and generated[-1] == self.eos_id:
            return self.turn_closer[1:]
        return self.turn_closer

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def check(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        ids: list[int],
        ends_with_observation: bool,
    ) -> str | None:
        """Compare a trajectory's ids with a full re-render of its messages; describe the first difference."""
        expected = self.render(messages, tools=tools, add_generation_prompt=ends_with_observation)
        if not ends_with_observation and expected[len(ids) :] in (self.turn_closer[1:], self.turn_closer):
            expected = expected[: len(ids)]  # a final model turn owes no closer (nor eos, if the budget cut it)
        if expected == ids:
            return None
        i = next((k for k, (a, b) in enumerate(zip(ids, expected)) if a != b), min(len(ids), len(expected)))
        got, want = (
            self.decode(ids[i : i + 8], skip_special_tokens=False),
            self.decode(expected[i : i + 8], skip_special_tokens=False),
        )
        return f"token {i}: trajectory has {got!r}, a re-render has {want!r} ({len(ids)} vs {len(expected)} tokens)"
