"""Observation suffixes for any family's chat template, append-only or not.

fsm/chat.py cuts a fixed base conversation's tokens off `base + observation`, which needs a template whose
render of the base never changes when turns follow; Qwen3 and GLM drop earlier reasoning when a user turn
follows, Harmony rewrites a past final answer. Here the cut is made in the text instead: the template renders
`base + observation` once with a marker in the first observation's content; the suffix starts after the last
end-of-turn token (or the base assistant's own marker) before it, so whatever the template does to the base
turns never reaches the suffix. The text before the cut depends only on the observation's shape (roles, call
ids, tool names), so it is kept per shape and later observations of that shape render once. The suffix is tokenized on its own: it starts at a control token or at the
newline after one, which is also where the full render splits.
"""

from __future__ import annotations

from typing import Any

from fsm.chat import ChatCodec, TemplateError, vocabulary_size
from fsm.families.parsers import PARSERS, ToolCall, split_reasoning
from fsm.segments import SegmentEncoder

_MARK_ASSISTANT = "agentfsmAssistantMark"  # plain ASCII: every template copies it through unchanged
_MARK_OBSERVATION = "agentfsmObservationMark"


class FamilyCodec(ChatCodec):
    """A ChatCodec for a family (fsm.families.Family): same interface, the family's turn boundaries."""

    def __init__(self, tokenizer: Any, family: Any):
        self.tokenizer = tokenizer
        self.segments = SegmentEncoder(tokenizer)
        self.family = family
        self.eos_id: int = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else 0
        self.vocab_size: int = vocabulary_size(tokenizer)
        self._parser = PARSERS[family.parser](tokenizer)
        self.stop_ids: set[int] = {self.eos_id, *self._parser.stop_token_ids}
        self._strip_ids = {self.eos_id, *self._ids(*family.strip_stops)}
        self.turn_closer: list[int] = self._encode(family.cut_closer)
        self._prefixes: dict[tuple, str] = {}  # an observation's shape -> the render's text before its suffix
        self.encode_observation([{"role": "user", "content": "U"}])  # a template that cannot work fails now

    def _ids(self, *tokens: str) -> list[int]:
        unk = getattr(self.tokenizer, "unk_token_id", None)
        ids = [self.tokenizer.convert_tokens_to_ids(t) for t in tokens]
        return [i for i in ids if isinstance(i, int) and i >= 0 and i != unk]

    def _encode(self, text: str) -> list[int]:
        return self.segments.encode(text) if text else []

    def _text(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    # --- a model turn ---------------------------------------------------------------------------------------

    def turn_text(self, ids: list[int]) -> str:
        """The turn as text for its parser and history: special tokens kept, a final eos/stop token left out
        (Harmony keeps its <|call|>: it belongs to the call's grammar)."""
        end = len(ids) - 1 if ids and ids[-1] in self._strip_ids else len(ids)
        return self.decode(ids[:end], skip_special_tokens=False)

    def assistant_message(self, text: str, calls: list[ToolCall]) -> dict[str, Any]:
        """The assistant message kept in the conversation, as the family's template reads it back: the answer
        with its `reasoning_content`, Harmony's fields (its template refuses channel tokens in content), or
        the text. Reasoning stays in the context; a user simulator reads `content`, the answer."""
        if self.family.reasoning == "think":  # the answer as content, the reasoning beside it: templates
            reasoning, answer = split_reasoning(text, "think", self.family.think_tags)  # render both back
            if reasoning is not None:
                return {"role": "assistant", "content": answer.lstrip("\n"), "reasoning_content": reasoning}
        if self.family.history != "harmony":
            return {"role": "assistant", "content": text}
        final, analysis = "", []
        for channel, recipient, body, _end in self._parser.messages(text):
            if recipient:
                continue
            if channel == "final":
                final = body
            else:
                analysis.append(body)
        message: dict[str, Any] = {"role": "assistant", "content": "" if calls else final}
        if analysis:
            message["thinking"] = "\n".join(analysis)
        if calls:
            message["tool_calls"] = [self._call(c.name or "", c.arguments, c.id, k) for k, c in enumerate(calls)]
        return message

    def verl_message(self, message: dict[str, Any], ids: list[int], parser: Any, max_calls: int) -> dict[str, Any]:
        return message  # tools read the family's own message (verl's form is ChatML/hermes's)

    def interaction_message(self, message: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        return message  # a user simulator reads `content`: the answer, without the reasoning

    def _call(self, name: str, arguments: Any, call_id: str | None, k: int) -> dict[str, Any]:
        import json

        if self.family.call_arguments == "json" and not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
        elif self.family.call_arguments == "object" and not isinstance(arguments, dict):
            arguments = {}
        return {"id": call_id or f"call_{k}", "type": "function", "function": {"name": name, "arguments": arguments}}

    # --- observations ---------------------------------------------------------------------------------------

    def closer_for(self, generated: list[int]) -> list[int]:
        """Owed after a model turn: nothing when it ended on a stop token, the family's end token if it was cut."""
        return [] if generated and generated[-1] in self.stop_ids else self.turn_closer

    def observation(
        self, messages: list[dict[str, Any]], last: list[int] | None, history: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[int]]:
        closer = self.closer_for(last) if last is not None else []
        ids = self.encode_observation(messages, history)
        if last and not closer and ids and ids[0] == last[-1] and last[-1] != self.eos_id:
            ids = ids[1:]  # GLM: the model stopped on the observation's own first token (<|observation|>)
        return closer, ids

    def encode_observation(self, messages: list[dict[str, Any]], history: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids that `messages` (tool results / a user turn) append after a model turn, generation prompt
        included. Tool results are rendered after a call to the same tools (Harmony names the tool)."""
        base = [{"role": "user", "content": "U"}, self._base_assistant(messages, history)]
        text = self._text(base + messages, True)
        key = (tuple((m.get("role"), m.get("tool_call_id"), m.get("name")) for m in messages),
               tuple((c["function"]["name"], c["id"]) for c in base[1].get("tool_calls", ())))  # fmt: skip
        prefix = self._prefixes.get(key)  # what precedes the suffix depends on the turns' shape, not contents
        if prefix is not None and text.startswith(prefix):
            return self._encode(text[len(prefix) :])
        marked = [dict(messages[0], content=_MARK_OBSERVATION), *messages[1:]]
        probe = self._text(base + marked, True)
        at = probe.find(_MARK_OBSERVATION)
        if at < 0 or text[:at] != probe[:at]:
            raise TemplateError(f"the {self.family.name} chat template does not render the observation's content")
        cut = probe.rfind(_MARK_ASSISTANT, 0, at)
        cut = cut + len(_MARK_ASSISTANT) if cut >= 0 else 0
        for marker in self.family.turn_end:
            k = probe.rfind(marker, cut, at)
            if k >= 0:
                cut = max(cut, k + len(marker))
        if cut == 0:
            raise TemplateError(f"the {self.family.name} chat template shows no end of the assistant turn before "
                                "an observation")  # fmt: skip
        if len(self._prefixes) >= 4096:
            self._prefixes.clear()
        self._prefixes[key] = text[:cut]
        return self._encode(text[cut:])

    def _base_assistant(self, messages: list[dict[str, Any]], history: list[dict[str, Any]] | None) -> dict[str, Any]:
        if messages[0].get("role") != "tool":
            return {"role": "assistant", "content": _MARK_ASSISTANT}
        last = history[-1] if history and history[-1].get("role") == "assistant" else None
        calls = self._calls_of(last) if last is not None else []
        n = sum(m.get("role") == "tool" for m in messages)
        calls = (calls + [("tool", None)] * n)[: max(n, 1)]
        return {"role": "assistant", "content": _MARK_ASSISTANT,
                "tool_calls": [self._call(name, {}, cid, k) for k, (name, cid) in enumerate(calls)]}  # fmt: skip

    def _calls_of(self, message: dict[str, Any]) -> list[tuple[str, str | None]]:
        if "tool_calls" in message:
            return [(c["function"]["name"], c.get("id")) for c in message["tool_calls"]]
        return [(c.name or "tool", c.id) for c in self._parser.parse(message.get("content") or "")]

    # --- check mode -----------------------------------------------------------------------------------------

    def check(self, messages: list[dict[str, Any]], tools: list[dict] | None, ids: list[int],
              ends_with_observation: bool) -> str | None:  # fmt: skip
        """Compare the ids with a full re-render of the messages; describe the first difference. A final model
        turn owes nothing the template adds after it (its end token, a newline)."""
        ids = list(ids)
        expected = self.render(messages, tools=tools, add_generation_prompt=ends_with_observation)
        if not ends_with_observation and ids and ids[-1] in self._strip_ids - {self.eos_id}:
            ids = ids[:-1]  # GLM's last turn ends on the next turn's own token (<|user|>), which the template adds
        if not ends_with_observation and expected[: len(ids)] == ids:
            rest = self.decode(expected[len(ids) :], skip_special_tokens=False)
            for marker in (*self.family.turn_end, self.family.cut_closer, *self.family.strip_stops):
                rest = rest.replace(marker, "") if marker else rest
            if not rest.strip():
                expected = expected[: len(ids)]
        if expected == ids:
            return None
        i = next((k for k, (a, b) in enumerate(zip(ids, expected)) if a != b), min(len(ids), len(expected)))
        got, want = (self.decode(ids[i : i + 8], skip_special_tokens=False),
                     self.decode(expected[i : i + 8], skip_special_tokens=False))  # fmt: skip
        return f"token {i}: trajectory has {got!r}, a re-render has {want!r} ({len(ids)} vs {len(expected)} tokens)"
