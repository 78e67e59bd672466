"""Model families: for each, the tool-call parser, how reasoning is delimited, and how observations are rendered.

A spec names its family (`model: {family: qwen3}`) or leaves it to `auto`, which reads the tokenizer's chat
template. A family is data (`Family`); `register_family` adds one without touching the engine, as verl's
`ToolParser.register` adds a parser. The family's codec renders tool results and user turns through the
tokenizer's own chat template as token suffixes (fsm/families/codec.py), so nothing the model sampled is
ever re-tokenized, whether or not the template is append-only. `qwen2.5` (Hermes calls, ChatML turns) is the
family whose codec does exactly what verl 0.9.1's agent loop does (`verl_exact`); it is also what an
unrecognised template gets.

The package: this module (the registry, `codec_for`, the parser a run uses), codec.py (the Codec),
pieces.py (the chat template rendered past transformers' wrapper, the TemplateKwargs wrapper, tokenizing text
between added tokens, the one decode), parsers/ (every family's tool-call parser, one registry). It imports nothing of the engine outside this package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from fsm.families import parsers as _parsers  # noqa: F401  (registers the families' parsers)
from fsm.families.codec import CALL_OPENERS, Codec, TemplateError, vocabulary_size
from fsm.families.parsers import PARSERS, ToolCall, split_reasoning
from fsm.families.pieces import TemplateKwargs

__all__ = [
    "FAMILIES",
    "Codec",
    "Family",
    "TemplateError",
    "TemplateKwargs",
    "Turn",
    "codec_for",
    "detect_family",
    "family_names",
    "get_family",
    "make_parser",
    "parser_name",
    "register_family",
    "resolve_family",
    "split_turn",
    "vocabulary_size",
]


@dataclass(frozen=True)
class Family:
    """What agentfsm needs to know about a model family beyond its chat template."""

    name: str
    parser: str  # a name in fsm.families.parsers.PARSERS
    detect: tuple[str, ...]  # all of these in a chat template identify the family ("auto"); () never matches
    # <think>...</think>, or Harmony's analysis channel
    reasoning: Literal["none", "think", "harmony"] = "none"
    think_tags: tuple[str, str] = ("<think>", "</think>")  # a `think` family's reasoning block
    # what closes an assistant turn in the template (the observation starts after)
    turn_end: tuple[str, ...] = ()
    # owed (mask 0) after a turn cut before its end token, so the context stays well formed
    cut_closer: str = ""
    strip_stops: tuple[str, ...] = ()  # stop tokens left out of the turn's text (they end it; no content)
    call_arguments: Literal["object", "json"] = "object"  # how the template wants structured calls' arguments
    history: Literal["raw", "harmony"] = "raw"  # the assistant message kept: the text, or Harmony's fields
    append_only: str = "yes"  # README: where the template rewrites earlier turns, and what agentfsm does
    aliases: tuple[str, ...] = field(default=())
    verl_exact: bool = False  # observations cut off a fixed base conversation, messages in verl 0.9.1's form


FAMILIES: dict[str, Family] = {}
_ALIASES: dict[str, str] = {}


def register_family(family: Family) -> Family:
    """Add (or replace) a family; `auto` tries families in registration order, later ones first."""
    FAMILIES[family.name] = family
    for alias in family.aliases:
        _ALIASES[alias] = family.name
    return family


def family_names() -> list[str]:
    return ["auto", *FAMILIES, *_ALIASES]


def get_family(name: str) -> Family:
    name = _ALIASES.get(name, name)
    if name not in FAMILIES:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(family_names())}")
    return FAMILIES[name]


def detect_family(tokenizer: Any) -> Family:
    """The family whose markers the tokenizer's chat template carries; qwen2.5 (ChatML + Hermes) otherwise."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one renders conversations
        template = template.get("default") or next(iter(template.values()), "")
    text = template if isinstance(template, str) else ""
    for family in reversed(FAMILIES.values()):
        if family.detect and all(marker in text for marker in family.detect):
            return family
    return FAMILIES["qwen2.5"]


def resolve_family(name: str, tokenizer: Any) -> Family:
    return detect_family(tokenizer) if name == "auto" else get_family(name)


def codec_for(
    tokenizer: Any,
    family: str | Family = "auto",
    template_kwargs: dict[str, Any] | None = None,
    special_tokens: str = "text",
) -> Codec:
    """The chat codec of the tokenizer's family; `.family` names it (the parser comes from there).
    `template_kwargs` go to every render of the chat template (TemplateKwargs); `special_tokens`: whether
    special-token strings in observations stay "text" (the default) or "allow"ed as control tokens."""
    fam = family if isinstance(family, Family) else resolve_family(family, tokenizer)
    if template_kwargs:
        tokenizer = TemplateKwargs(tokenizer, template_kwargs)
    return Codec(tokenizer, fam, special_tokens)


def parser_name(spec_parser: str | None, codec: Any) -> str:
    """The spec's `parser:` when it names one, else the codec's family's."""
    family = getattr(codec, "family", None)
    return spec_parser or (family.parser if family is not None else "hermes")


@dataclass(frozen=True, slots=True)
class Turn:
    """A model turn split the family's way: its reasoning, the answer text, and the calls it makes."""

    reasoning: str | None  # None: the turn has no reasoning block (or the family none)
    content: str
    calls: list[ToolCall]


class ReasoningAwareParser:
    """A family's parser that reads calls only outside the reasoning block: a call the model only thought
    about is not made (verl's hermes parser makes it)."""

    def __init__(self, parser: Any, family: Family):
        self.inner, self.family = parser, family
        self.stop_token_ids = parser.stop_token_ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("inner", "family", "stop_token_ids"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def parse(self, text: str) -> list[ToolCall]:
        return self.inner.parse(split_reasoning(text, "think", self.family.think_tags)[1])


def make_parser(spec_parser: str | None, codec: Any, tool_schemas: list[dict] | None = None) -> Any:
    """The run's tool-call parser: the spec's or the family's, reading outside the family's reasoning."""
    parser = PARSERS[parser_name(spec_parser, codec)](codec.tokenizer)
    if hasattr(parser, "tools"):  # parsers that convert values by the tools' schemas (qwen3_coder)
        parser.tools = list(tool_schemas or [])
    family = getattr(codec, "family", None)
    return (
        ReasoningAwareParser(parser, family) if family is not None and family.reasoning == "think" else parser
    )


def split_turn(text: str, family: Family, parser: Any) -> Turn:
    """A turn's reasoning, answer and calls (the answer is the text outside reasoning and call markup)."""
    if family.reasoning == "harmony":
        messages = parser.messages(text) if hasattr(parser, "messages") else []
        reasoning: str | None = "\n".join(
            body for channel, rcpt, body, _ in messages if channel == "analysis" and not rcpt
        )
        content = "".join(body for channel, rcpt, body, _ in messages if channel == "final")
        return Turn(reasoning or None, content, parser.parse(text))
    reasoning, rest = split_reasoning(text, family.reasoning, family.think_tags)
    calls = parser.parse(rest) if not isinstance(parser, ReasoningAwareParser) else parser.inner.parse(rest)
    starts = [k for k in (rest.find(m) for m in CALL_OPENERS) if k >= 0]
    content = rest[: min(starts)] if starts and calls else rest
    return Turn(reasoning, content.strip() if calls else rest, calls)


# --- the families agentfsm ships ----------------------------------------------------------------------------
# Registered from least to most specific: `auto` tries the last first (Qwen3-Coder's template also has Qwen3's
# markers, Qwen3's has Qwen2.5's).

register_family(
    Family(
        "llama3_1",
        "llama3_json",
        detect=("<|start_header_id|>", "<|eot_id|>"),
        turn_end=("<|eot_id|>", "<|eom_id|>"),
        cut_closer="<|eot_id|>",
        strip_stops=("<|eom_id|>",),
        aliases=("llama3", "llama3.1"),
        append_only="yes (tool results render as `ipython` turns)",
    )
)
register_family(
    Family(
        "qwen2.5",
        "hermes",
        detect=("<|im_start|>", "<tool_call>"),
        verl_exact=True,
        aliases=("hermes", "chatml"),
        append_only="yes",
    )
)
register_family(
    Family(
        "qwen3",
        "hermes",
        detect=("<|im_start|>", "<tool_call>", "<think>"),
        reasoning="think",
        turn_end=("<|im_end|>",),
        cut_closer="<|im_end|>",
        aliases=("qwen3.5",),
        append_only="no: a new user turn drops the reasoning of earlier turns; agentfsm keeps the sampled "
        "reasoning (a re-render differs there)",
    )
)
register_family(
    Family(
        "qwen3_coder",
        "qwen3_coder",
        detect=("<|im_start|>", "<function=", "<parameter="),
        turn_end=("<|im_end|>",),
        cut_closer="<|im_end|>",
        append_only="yes",
    )
)
register_family(
    Family(
        "deepseek_v3",
        "deepseek_v3",
        detect=("<｜tool▁call▁begin｜>",),
        reasoning="think",
        turn_end=("<｜end▁of▁sentence｜>",),
        cut_closer="<｜end▁of▁sentence｜>",
        call_arguments="json",
        aliases=("deepseek_v3.1", "deepseek_r1"),
        append_only="yes in non-thinking mode; the template re-renders earlier turns without their reasoning",
    )
)
register_family(
    Family(
        "kimi_k2",
        "kimi_k2",
        detect=("<|tool_calls_section_begin|>",),
        turn_end=("<|im_end|>",),
        cut_closer="<|im_end|>",
        append_only="yes",
    )
)
register_family(
    Family(
        "seed_oss",
        "seed",
        detect=("<seed:tool_call>",),
        reasoning="think",
        think_tags=("<seed:think>", "</seed:think>"),
        turn_end=("<seed:eos>",),
        cut_closer="<seed:eos>",
        aliases=("seed",),
        append_only="yes",
    )
)
register_family(
    Family(
        "glm45",
        "glm45",
        detect=("<arg_key>", "<|observation|>"),
        reasoning="think",
        turn_end=("</tool_call>",),
        strip_stops=("<|observation|>", "<|user|>"),
        aliases=("glm4.5", "glm4.6", "glm4.7"),
        append_only="no: a new user turn drops earlier reasoning (`<think></think>` instead); agentfsm keeps the "
        "sampled tokens. The model ends a turn with the next turn's own `<|observation|>`/`<|user|>`, "
        "which agentfsm does not append twice",
    )
)
register_family(
    Family(
        "gpt_oss",
        "gpt_oss",
        detect=("<|channel|>", "<|message|>"),
        reasoning="harmony",
        turn_end=("<|call|>", "<|end|>", "<|return|>"),
        cut_closer="<|end|>",
        history="harmony",
        aliases=("harmony", "gpt-oss"),
        append_only="no: the template drops analysis once a final answer follows, renders a past final answer "
        "with <|end|> where the model sampled <|return|>, and writes a call's recipient before the "
        "channel; agentfsm keeps the sampled tokens",
    )
)
