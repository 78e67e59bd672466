"""A model family's chat codec: prompts, observation suffixes, what a model turn owes, its text and messages.

Everything is done through the tokenizer's own chat template, once per tokenizer, and nothing already in a
trajectory is ever re-tokenized. An observation (tool results, a user reply) is rendered as the *suffix* it
adds to a conversation, cut one of two ways (`Family.verl_exact` picks):

- a fixed base conversation (`verl_exact`, qwen2.5/Hermes, what verl 0.9.1's ToolAgentLoop does): the template
  renders `BASE + observation` and the tokens of `BASE` are cut off. It needs a template whose render of BASE
  never changes when turns follow. The "turn closer" is what the template puts after the end-of-turn token of
  an assistant message (ChatML's `\\n` after `<|im_end|>`): the model stops at `<|im_end|>`, so those tokens
  are owed, with mask 0, before the next observation.
- a cut in the text (every other family, append-only template or not: Qwen3 and GLM drop earlier reasoning
  when a user turn follows, Harmony rewrites a past final answer): the template renders `base + observation`
  once with a marker in the first observation's content; the suffix starts after the last end-of-turn token
  (or the base assistant's own marker) before it, so whatever the template does to the base turns never
  reaches the suffix. The text before the cut depends only on the observation's shape (roles, call ids, tool
  names), so it is kept per shape and later observations of that shape render once.

Either way the suffix's text is tokenized on its own (fsm/families/pieces.py): it starts at a control token or
at the newline after one, which is also where the full render splits.

Special-token strings in a message's content are tokenized as text, so no message can plant a turn of its own
(the model's own turns excepted); every role must be one the template renders (`check_roles`). Both rules:
docs/families.md, "Codec, real tokenizers and what an observation may contain".
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, cast

from fsm.families.parsers import PARSERS, ToolCall, assistant_message, split_reasoning
from fsm.families.parsers.harmony import HarmonyParser
from fsm.families.pieces import ByteDecoder, ChatRender, PieceEncoder, decode


class TemplateError(Exception):
    """The chat template cannot be used (e.g. it never ends a turn, or hides an observation's content)."""


class UnknownRole(TemplateError):
    """A message whose role the chat template does not render: it would vanish from the prompt (Qwen's template
    drops a `usr` or `wizard` message without a word), so it is refused where it enters. `index` is the
    message's position in what was given, for the caller to name its field."""

    def __init__(self, index: int, role: Any, family: str, known: list[str]):
        self.index, self.role = index, role
        super().__init__(
            f"message {index} has role {role!r}, which the {family} chat template does not render "
            f"(it renders {', '.join(known)})"
        )


_BASE = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
_ROLES = (
    "system",
    "user",
    "assistant",
    "tool",
)  # what every codec renders (observations, prompts, model turns)
_MARK_ROLE = "agentfsmRoleMark"
_MARK_ASSISTANT = "agentfsmAssistantMark"  # plain ASCII: every template copies it through unchanged
_MARK_OBSERVATION = "agentfsmObservationMark"
# where a family's call markup starts in a turn's text: the answer is what comes before
CALL_OPENERS = (
    "<tool_call>",
    "<seed:tool_call>",
    "<|tool_calls_section_begin|>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<|python_tag|>",
    '{"name"',
)


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


def _texts(content: Any) -> list[str]:
    """The text of a message's content: itself, or its content parts' `text`."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def _longest_token_bytes(tokenizer: Any) -> int:
    """The most bytes of text one token decodes to. A vocabulary entry's own UTF-8 form is never shorter than
    what it decodes to (a byte-level entry spells each byte with a char of one or two bytes; a SentencePiece
    '▁' or '<0x0A>' is longer than its byte), so entries are decoded longest first until none left can beat
    the longest found."""
    entries = sorted(((len(t.encode()), t) for t in tokenizer.get_vocab()), reverse=True)
    most = 1
    for size, token in entries:
        if size <= most:
            break
        most = max(most, len(tokenizer.convert_tokens_to_string([token]).encode()))
    return most


class Codec:
    """The chat codec of `tokenizer` for `family` (an fsm.families.Family); build it with fsm.families.codec_for."""

    def __init__(self, tokenizer: Any, family: Any, special_tokens: str = "text"):
        """`special_tokens`: "text" (special-token strings in an observation's content are text) or "allow"."""
        self.tokenizer = tokenizer
        self.family = family
        self.pieces = PieceEncoder(tokenizer)
        self._render = ChatRender(tokenizer)  # the template compiled once, past transformers' wrapper
        self._bytes = ByteDecoder.of(tokenizer)  # decodes from each id's bytes where that is exact
        self.eos_id: int = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else 0
        self.vocab_size: int = vocabulary_size(tokenizer)
        self.eos_text: str = (
            self.decode([self.eos_id], skip_special_tokens=False) if self.eos_id is not None else ""
        )
        self._parser = PARSERS[family.parser](tokenizer)
        self._verl_exact: bool = family.verl_exact
        added = getattr(tokenizer, "added_tokens_decoder", None)
        specials = sorted(
            {t.content for t in added.values() if getattr(t, "special", False)}
            if isinstance(added, dict)
            else (),
            key=len,
            reverse=True,
        )
        self._specials = (
            re.compile("|".join(map(re.escape, specials))) if specials and special_tokens != "allow" else None
        )
        self._roles: dict[Any, bool] = dict.fromkeys(_ROLES, True)  # role -> whether the template renders it
        if self._verl_exact:
            self.stop_ids: set[int] = {self.eos_id}
            self._strip_ids = {self.eos_id}
            self._base_ids = self.render(_BASE, add_generation_prompt=False)
            if self.eos_id not in self._base_ids:
                raise TemplateError(f"the chat template never emits eos {tokenizer.eos_token!r} after a turn")
            last_eos = len(self._base_ids) - 1 - self._base_ids[::-1].index(self.eos_id)
            self.turn_closer: list[int] = [self.eos_id, *self._base_ids[last_eos + 1 :]]
            # An observation's text is tokenized alone, without the base conversation, when it starts with an
            # added token (Qwen's <|im_start|>): tokenizers split text at added tokens before anything else, so
            # its ids are exactly those of the full render. Otherwise the full render is tokenized and cut.
            self._base_text = self._text(_BASE, False)
            added = getattr(tokenizer, "get_added_vocab", None)
            self._added_tokens = tuple(added()) if callable(added) else ()
        else:
            self.stop_ids = {self.eos_id, *self._parser.stop_token_ids}
            self._strip_ids = {self.eos_id, *self._ids(*family.strip_stops)}
            self.turn_closer = self._encode(family.cut_closer)
            # an observation's shape -> the render's text before its suffix
            self._prefixes: dict[tuple, str] = {}
            # a template that cannot work fails now
            self.encode_observation([{"role": "user", "content": "U"}])

    def fewest_tokens(self, messages: list[dict[str, Any]]) -> int:
        """A floor on the tokens the messages' render takes, without tokenizing: the text of their user, system and
        tool contents (which a template renders, at most trimmed; an assistant's may be dropped) over the most
        bytes one token decodes to. A request far past the context is refused on it before tokenizing it whole."""
        most = getattr(self, "_most_token_bytes", None)
        if most is None:
            most = self._most_token_bytes = _longest_token_bytes(self.tokenizer)
        size = sum(
            len(m["content"].strip().encode())
            for m in messages
            if m.get("role") in ("user", "system", "tool") and isinstance(m.get("content"), str)
        )
        return size // most

    def _ids(self, *tokens: str) -> list[int]:
        unk = getattr(self.tokenizer, "unk_token_id", None)
        ids = [self.tokenizer.convert_tokens_to_ids(t) for t in tokens]
        return [i for i in ids if isinstance(i, int) and i >= 0 and i != unk]

    def _encode(self, text: str) -> list[int]:
        return self.pieces.encode(text) if text else []

    def _text(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self._render.text(messages, None, add_generation_prompt)

    # --- renders ----------------------------------------------------------------------------------------------

    def render(
        self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None, add_generation_prompt: bool
    ) -> list[int]:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )

    def encode_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool = True
    ) -> list[int]:
        """The ids `render` gives; the pieces every prompt repeats (system message, tool schemas) are
        tokenized once (fsm/families/pieces.py). Every prompt is made here (a row's, a rewrite's, the template
        policy's, a gateway request's), so the rules for what enters one are here: each message's role is one the
        template renders (`check_roles`), and special-token strings in the content of a message that is not the
        model's own are text (the module's docstring), as in an observation."""
        self.check_roles(messages)
        shielded = None
        if self._specials is not None and any(
            self._special_in(m) for m in messages if m.get("role") != "assistant"
        ):
            messages, shielded = self._shield(messages, skip_assistant=True)
        text = self._render.text(messages, tools, add_generation_prompt)
        return self.pieces.encode(text, shielded)

    def check_roles(self, messages: list[dict[str, Any]]) -> None:
        """UnknownRole for the first message whose role the chat template does not render. A role past the four
        every codec uses is tried once (a message of that role after a user message: is its content in the
        render?), so `developer` or `ipython` pass where the template knows them."""
        for k, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            known = self._roles.get(role) if isinstance(role, str) else False
            if known is None and isinstance(role, str):  # (None only for a str role)
                known = self._roles[role] = self._renders_role(role)
            if not known:
                raise UnknownRole(k, role, self.family.name, [r for r, ok in self._roles.items() if ok])

    def _renders_role(self, role: str) -> bool:
        if len(self._roles) >= 256:  # a bound on what a stream of odd roles can make us keep
            return False
        try:
            text = self._text([{"role": "user", "content": "U"}, {"role": role, "content": _MARK_ROLE}], True)
        except Exception:  # a template that raises on the role does not render it either
            return False
        return _MARK_ROLE in text

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Exactly the model's text (fsm/families/pieces.py decode: no clean-up of tokenization spaces)."""
        if self._bytes is not None and type(ids) is list:
            return self._bytes.decode(ids, skip_special_tokens)
        return decode(self.tokenizer, ids, skip_special_tokens=skip_special_tokens)

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
        for channel, recipient, body, _end in cast(HarmonyParser, self._parser).messages(text):
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
            message["tool_calls"] = [
                self._call(c.name or "", c.arguments, c.id, k) for k, c in enumerate(calls)
            ]
        return message

    def verl_message(
        self, message: dict[str, Any], ids: list[int], parser: Any, max_calls: int
    ) -> dict[str, Any]:
        """A model turn's message as tools read it. `verl_exact`: as verl 0.9.1's AgentData holds it, the text
        decoded with its eos, tool-call blocks moved to `tool_calls` (fsm/families/parsers assistant_message); other
        families: the family's own message (verl's form is ChatML/hermes's)."""
        if not self._verl_exact:
            return message
        text = message["content"]
        content = parser.content(text) + (self.eos_text if ids[-1:] == [self.eos_id] else "")
        return assistant_message(content, parser.parse(text), max_calls)

    def interaction_message(self, message: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        """A model turn as a user simulator reads it. `verl_exact`: its text with special tokens skipped (verl
        0.7.1); other families: `content`, the answer without the reasoning."""
        return {"role": "assistant", "content": self.decode(ids)} if self._verl_exact else message

    def _call(self, name: str | None, arguments: Any, call_id: str | None, k: int) -> dict[str, Any]:
        if self.family.call_arguments == "json" and not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
        elif self.family.call_arguments == "object" and not isinstance(arguments, dict):
            arguments = {}
        return {
            "id": call_id or f"call_{k}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    # --- observations ---------------------------------------------------------------------------------------

    def closer_for(self, generated: list[int]) -> list[int]:
        """Template tokens owed after a model turn. `verl_exact`: the tail after eos, or eos + tail if the turn
        was cut; other families: nothing when it ended on a stop token, the family's end token if it was cut."""
        if self._verl_exact:
            return self.turn_closer[1:] if generated and generated[-1] == self.eos_id else self.turn_closer
        return [] if generated and generated[-1] in self.stop_ids else self.turn_closer

    def observation(
        self,
        messages: list[dict[str, Any]],
        last: list[int] | None,
        history: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """(the template tokens owed after the model turn that ended with `last` (None: the context does not
        end with a model turn), the observation's ids); `history` is the conversation so far."""
        closer = self.closer_for(last) if last is not None else []
        ids = self.encode_observation(messages, history)
        if last and not closer and ids and ids[0] == last[-1] and last[-1] != self.eos_id:
            ids = ids[1:]  # GLM: the model stopped on the observation's own first token (<|observation|>)
        return closer, ids

    def encode_observation(
        self, messages: list[dict[str, Any]], history: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids that `messages` (tool results / a user turn) append after a model turn, generation prompt
        included. Special-token strings in their content are text (see the module's docstring)."""
        shielded = None
        if self._specials is not None and any(self._special_in(m) for m in messages):
            messages, shielded = self._shield(messages)
        if self._verl_exact:
            return self._base_cut(messages, shielded)
        return self._marker_cut(messages, history, shielded)

    def _special_in(self, message: dict[str, Any]) -> bool:
        assert self._specials is not None
        return any(self._specials.search(text) for text in _texts(message.get("content")))

    def _shield(
        self, messages: list[dict[str, Any]], skip_assistant: bool = False
    ) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """The messages with each special-token string in their content (text, or the text of content parts)
        replaced by a plain-ASCII placeholder (templates copy it through), and the placeholders' table for the
        tokenizer. `skip_assistant`: the model's own turns keep what it wrote (a re-render gives its tokens)."""
        table: dict[str, str] = {}

        def placeholder(match: re.Match) -> str:
            key = f"agentfsmSpecial{len(table)}Mark"
            table[key] = match.group(0)
            return key

        assert self._specials is not None
        sub = self._specials.sub

        def shield(content: Any) -> Any:
            if isinstance(content, str):
                return sub(placeholder, content)
            if isinstance(content, list):
                return [
                    dict(p, text=sub(placeholder, p["text"]))
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                    else p
                    for p in content
                ]
            return content

        out = [
            m
            if skip_assistant and m.get("role") == "assistant" or "content" not in m
            else dict(m, content=shield(m["content"]))
            for m in messages
        ]
        return out, table

    def _base_cut(self, messages: list[dict[str, Any]], shielded: dict[str, str] | None = None) -> list[int]:
        if self._added_tokens:
            text, n = self._text(_BASE + messages, True), len(self._base_text)
            if text.startswith(self._base_text) and (shielded or text.startswith(self._added_tokens, n)):
                return self.pieces.encode(text[n:], shielded)
        full = self.render(_BASE + messages, add_generation_prompt=True)
        n = len(self._base_ids)
        if full[:n] != self._base_ids:
            raise TemplateError(
                "the chat template is not append-only: rendering more turns changed earlier tokens"
            )
        return full[n:]

    def _marker_cut(
        self,
        messages: list[dict[str, Any]],
        history: list[dict[str, Any]] | None,
        shielded: dict[str, str] | None = None,
    ) -> list[int]:
        """Tool results are rendered after a call to the same tools (Harmony names the tool)."""
        base = [{"role": "user", "content": "U"}, self._base_assistant(messages, history)]
        text = self._text(base + messages, True)
        key = (
            tuple((m.get("role"), m.get("tool_call_id"), m.get("name")) for m in messages),
            tuple((c["function"]["name"], c["id"]) for c in base[1].get("tool_calls", ())),
        )
        prefix = self._prefixes.get(key)  # what precedes the suffix depends on the turns' shape, not contents
        if prefix is not None and text.startswith(prefix):
            return self.pieces.encode(text[len(prefix) :], shielded)
        marked = [dict(messages[0], content=_MARK_OBSERVATION), *messages[1:]]
        probe = self._text(base + marked, True)
        at = probe.find(_MARK_OBSERVATION)
        if at < 0 or text[:at] != probe[:at]:
            raise TemplateError(
                f"the {self.family.name} chat template does not render the observation's content"
            )
        cut = probe.rfind(_MARK_ASSISTANT, 0, at)
        cut = cut + len(_MARK_ASSISTANT) if cut >= 0 else 0
        for marker in self.family.turn_end:
            k = probe.rfind(marker, cut, at)
            if k >= 0:
                cut = max(cut, k + len(marker))
        if cut == 0:
            raise TemplateError(
                f"the {self.family.name} chat template shows no end of the assistant turn before "
                "an observation"
            )
        if len(self._prefixes) >= 4096:
            self._prefixes.clear()
        self._prefixes[key] = text[:cut]
        return self.pieces.encode(text[cut:], shielded)

    def _base_assistant(
        self, messages: list[dict[str, Any]], history: list[dict[str, Any]] | None
    ) -> dict[str, Any]:
        if messages[0].get("role") != "tool":
            return {"role": "assistant", "content": _MARK_ASSISTANT}
        last = history[-1] if history and history[-1].get("role") == "assistant" else None
        calls = self._calls_of(last) if last is not None else []
        n = sum(m.get("role") == "tool" for m in messages)
        calls = (calls + [("tool", None)] * n)[: max(n, 1)]
        return {
            "role": "assistant",
            "content": _MARK_ASSISTANT,
            "tool_calls": [self._call(name, {}, cid, k) for k, (name, cid) in enumerate(calls)],
        }

    def _calls_of(self, message: dict[str, Any]) -> list[tuple[str, str | None]]:
        if "tool_calls" in message:
            return [(c["function"]["name"], c.get("id")) for c in message["tool_calls"]]
        return [(c.name or "tool", c.id) for c in self._parser.parse(message.get("content") or "")]

    # --- check mode -----------------------------------------------------------------------------------------

    def structured(self, message: dict[str, Any]) -> dict[str, Any]:
        """An assistant message as a chat server holds it after parsing the model's text: its calls as
        `tool_calls`, its reasoning as `reasoning_content`, the answer as `content`. A turn with a malformed call
        is kept as text (a server could not structure it either), and so is one that runs on after its calls."""
        if (
            message.get("role") != "assistant"
            or "tool_calls" in message
            or not isinstance(message.get("content"), str)
        ):
            return message
        text, reasoning = message["content"], message.get("reasoning_content")
        if reasoning is None and self.family.reasoning == "think":
            reasoning, text = split_reasoning(text, "think", self.family.think_tags)
            text = text.lstrip("\n") if reasoning is not None else text
        calls = self._parser.parse(text)
        if not calls or any(c.error is not None or not c.name for c in calls) or text != text.rstrip():
            # malformed, or text after the calls (a turn cut there): kept as the model wrote it
            return message
        starts = [k for k in (text.find(m) for m in CALL_OPENERS) if k >= 0]
        out: dict[str, Any] = {
            "role": "assistant",
            "content": text[: min(starts)].strip() if starts else "",
            "tool_calls": [self._call(c.name, c.arguments, c.id, k) for k, c in enumerate(calls)],
        }
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        return out

    def check(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        ids: list[int],
        ends_with_observation: bool,
    ) -> str | None:
        """Compare the ids with the template's render of the structured conversation (`structured`: the calls
        and reasoning of each turn that tool results answer, parsed out of the model's text, as a chat server
        renders the next turn's context; a final turn is kept as the model wrote it), so a
        template that renders calls or reasoning differently from how the model wrote them is caught, not
        copied back from the raw text. Describe the first difference. A final model turn owes nothing the
        template adds after it (its end token, a newline).

        Where the whole render differs, the row is compared as each generation saw it (`_as_generated`): a
        template that rewrites an earlier turn only once a later one follows (gpt-oss drops a call's analysis
        when a final answer follows it) gave each turn its context as the row holds it."""
        ids = list(ids)
        messages = [
            self.structured(m) if messages[k + 1 : k + 2] and messages[k + 1].get("role") == "tool" else m
            for k, m in enumerate(messages)
        ]
        expected = self.encode_prompt(messages, tools, add_generation_prompt=ends_with_observation)
        if self._verl_exact:
            if not ends_with_observation and expected[len(ids) :] in (self.turn_closer[1:], self.turn_closer):
                # a final model turn owes no closer (nor eos, if the budget cut it)
                expected = expected[: len(ids)]
        else:
            if not ends_with_observation and ids and ids[-1] in self._strip_ids - {self.eos_id}:
                # GLM's last turn ends on the next turn's own token (<|user|>), which the template adds
                ids = ids[:-1]
            if not ends_with_observation and self._owes_nothing(expected, ids):
                expected = expected[: len(ids)]
        if expected == ids:
            return None
        if (
            not self._verl_exact
            and not ends_with_observation
            and self._as_generated(messages, tools, ids, expected)
        ):
            return None
        i = next((k for k, (a, b) in enumerate(zip(ids, expected)) if a != b), min(len(ids), len(expected)))
        got, want = (
            self.decode(ids[i : i + 8], skip_special_tokens=False),
            self.decode(expected[i : i + 8], skip_special_tokens=False),
        )
        return f"token {i}: trajectory has {got!r}, a re-render has {want!r} ({len(ids)} vs {len(expected)} tokens)"

    def _owes_nothing(self, expected: list[int], ids: list[int]) -> bool:
        """`expected` is `ids` then only what the template adds after a final turn (end markers, whitespace)."""
        if expected[: len(ids)] != ids:
            return False
        rest = self.decode(expected[len(ids) :], skip_special_tokens=False)
        for marker in (*self.family.turn_end, self.family.cut_closer, *self.family.strip_stops):
            rest = rest.replace(marker, "") if marker else rest
        return not rest.strip()

    def _as_generated(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, ids: list[int], full: list[int]
    ) -> bool:
        """Whether each model turn's context in `ids` is the template's render of the conversation before it (the
        prompt a chat server gives that turn), and the row ends with its last turn as the template writes it at
        the end of `full` (the whole render, followed by nothing but end markers)."""
        turns = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
        if not turns:
            return False
        for k in turns:
            context = self.render(messages[:k], tools=tools, add_generation_prompt=True)
            if ids[: len(context)] != context:
                return False
        tail = ids[len(context) :]
        return any(
            full[end - len(tail) : end] == tail and self._owes_nothing(full[end - len(tail) :], tail)
            for end in range(len(full), max(len(tail), len(full) - 8) - 1, -1)
        )
