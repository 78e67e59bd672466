"""The families' tool-call parsers: agentfsm's extraction equals verl 0.9.1's on the same texts (recorded in
tests/fixtures/verl_family_parsers.json by tests/verl/family_parsers_golden.py; tests/verl/test_family_parsers.py
re-checks it against verl itself), except where a documented verl bug loses or invents a call; parse -> render ->
parse round trips through each family's real chat template; split_turn separates reasoning, answer, calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsm.families import codec_for, make_parser, split_turn
from tests.fixtures.family_parser_cases import CASES, TOOLS
from tests.fixtures.family_tokenizers import FAMILIES, family_tokenizer

GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "verl_family_parsers.json").read_text())


def parse(family: str, text: str):
    """What the engine does with a turn: ids -> text (special tokens kept) -> the family's parser."""
    tok = family_tokenizer(family)
    codec = codec_for(tok, family)
    return make_parser(None, codec, TOOLS).parse(codec.turn_text(tok.encode(text, add_special_tokens=False)))


def made(calls) -> list[dict]:
    return [{"name": c.name, "arguments": c.arguments} for c in calls if c.error is None]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_extraction_as_verl(case):
    name, family, _verl_parser, text, differs = case
    ours, theirs = parse(family, text), GOLDEN["cases"][name]
    verl = [{"name": c["name"], "arguments": c["arguments"]} for c in theirs]
    if differs is None:
        assert made(ours) == verl and not [c for c in ours if c.error]
        assert [c.id for c in ours if c.id] == [c["id"] for c in theirs if c["id"]]
    elif "error" in differs or "JSON error" in differs or "answers it" in differs:
        assert [c.error for c in ours if c.error] and made(ours) == [], ours  # answered, never dropped
    elif "reasoning" in differs:
        assert verl and ours == []
    else:  # a call verl misses
        assert verl == [] and made(ours) == [{"name": "add", "arguments": {"a": 2, "b": 3}}]


CALLS = [("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parse_render_parse(family):
    """A structured assistant message rendered by the family's template parses back to the same calls."""
    tok = family_tokenizer(family)
    codec = codec_for(tok, family)
    calls = CALLS[:1] if family in ("gpt_oss", "llama3_1") else CALLS  # these templates render one call a turn
    message = {"role": "assistant", "content": "",
               "tool_calls": [codec_call(codec, n, a, k) for k, (n, a) in enumerate(calls)]}  # fmt: skip
    if family == "gpt_oss":
        message["thinking"] = "Add them."
    user = [{"role": "user", "content": "Add."}]
    prompt = tok.apply_chat_template(user, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(user + [message], tools=TOOLS, tokenize=False)
    assert full.startswith(prompt)
    completion = full[len(prompt) :]
    parsed = make_parser(None, codec, TOOLS).parse(completion)
    assert [(c.name, c.arguments) for c in parsed] == calls and not [c for c in parsed if c.error]


def codec_call(codec, name, args, k):
    """An OpenAI-style call, with the arguments as the family's template takes them."""
    args = json.dumps(args) if codec.family.call_arguments == "json" else args
    return {"id": f"functions.{name}:{k}", "type": "function", "function": {"name": name, "arguments": args}}


@pytest.mark.parametrize(
    ("family", "text", "reasoning", "content", "n_calls"),
    [
        ("qwen3", "<think>\nWhy not.\n</think>\n\nSure. <tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>",
         "\nWhy not.\n", "Sure.", 1),
        ("qwen3", "<think>\nstill thinking <tool_call>", "\nstill thinking <tool_call>", "", 0),
        ("deepseek_v3", "I think.</think>It is 5.", "I think.", "It is 5.", 0),
        ("glm45", "\n<think>hm</think>\nIt is 5.", "hm", "\nIt is 5.", 0),
        ("gpt_oss", "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>It is 5."
         "<|return|>", "hm", "It is 5.", 0),
        ("kimi_k2", "Adding.<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
         "{}<|tool_call_end|><|tool_calls_section_end|>", None, "Adding.", 1),
        ("llama3_1", "It is 5.", None, "It is 5.", 0),
    ],
)  # fmt: skip
def test_split_turn(family, text, reasoning, content, n_calls):
    codec = codec_for(family_tokenizer(family), family)
    turn = split_turn(text, codec.family, make_parser(None, codec))
    assert (turn.reasoning, turn.content, len(turn.calls)) == (reasoning, content, n_calls)


def test_a_call_left_open_in_reasoning_is_not_made():
    """Unclosed reasoning is all reasoning: no call is executable (a budget cut mid-thought)."""
    assert parse("qwen3", '<think>\nI will call <tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>') == []
