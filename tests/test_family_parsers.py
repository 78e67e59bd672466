"""The families' tool-call parsers: agentfsm's extraction equals verl 0.9.1's on the same texts (recorded in
tests/fixtures/verl_family_parsers.json by tests/verl/family_parsers_golden.py; tests/verl/test_family_parsers.py
re-checks it against verl itself), except where a documented verl bug loses or invents a call; parse -> render ->
parse round trips through each family's real chat template; split_turn separates reasoning, answer, calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsm.families import codec_for, make_parser, split_turn
from tests.fixtures.family_parser_cases import CASES, TOOLS, G, H
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
    calls = (
        CALLS[:1] if family in ("gpt_oss", "llama3_1") else CALLS
    )  # these templates render one call a turn
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [codec_call(codec, n, a, k) for k, (n, a) in enumerate(calls)],
    }
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
        (
            "qwen3",
            '<think>\nWhy not.\n</think>\n\nSure. <tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
            "\nWhy not.\n",
            "Sure.",
            1,
        ),
        ("qwen3", "<think>\nstill thinking <tool_call>", "\nstill thinking <tool_call>", "", 0),
        ("deepseek_v3", "I think.</think>It is 5.", "I think.", "It is 5.", 0),
        ("glm45", "\n<think>hm</think>\nIt is 5.", "hm", "\nIt is 5.", 0),
        (
            "gpt_oss",
            "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>It is 5."
            "<|return|>",
            "hm",
            "It is 5.",
            0,
        ),
        (
            "kimi_k2",
            "Adding.<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
            "{}<|tool_call_end|><|tool_calls_section_end|>",
            None,
            "Adding.",
            1,
        ),
        ("llama3_1", "It is 5.", None, "It is 5.", 0),
    ],
)
def test_split_turn(family, text, reasoning, content, n_calls):
    codec = codec_for(family_tokenizer(family), family)
    turn = split_turn(text, codec.family, make_parser(None, codec))
    assert (turn.reasoning, turn.content, len(turn.calls)) == (reasoning, content, n_calls)


def test_a_call_left_open_in_reasoning_is_not_made():
    """Unclosed reasoning is all reasoning: no call is executable (a budget cut mid-thought)."""
    assert (
        parse("qwen3", '<think>\nI will call <tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>')
        == []
    )


# A tool whose parameters cover the types a template renders differently: strings that look like other
# types, numbers, booleans, arrays, objects, nesting, unicode, edge whitespace.
TYPED = {
    "type": "function",
    "function": {
        "name": "typed",
        "description": "Every argument type.",
        "parameters": {
            "type": "object",
            "properties": {
                "s_int": {"type": "string"},
                "s_bool": {"type": "string"},
                "s_null": {"type": "string"},
                "s_list": {"type": "string"},
                "s_lead": {"type": "string"},
                "s_uni": {"type": "string"},
                "s_json": {"type": "string"},
                "i": {"type": "integer"},
                "n": {"type": "number"},
                "t": {"type": "boolean"},
                "f": {"type": "boolean"},
                "arr": {"type": "array"},
                "obj": {"type": "object"},
                "opt": {"type": ["string", "null"]},
                "e": {"type": "string", "enum": ["a b", "c"]},
            },
            "required": ["s_int"],
        },
    },
}
TYPED_ARGS = {
    "s_int": "42",
    "s_bool": "true",
    "s_null": "null",
    "s_list": "[1, 2]",
    "s_lead": "  two leading spaces",
    "s_uni": "ünïcødé ✓ 中文",
    "s_json": '{"k": 1}',
    "i": 42,
    "n": 1.5,
    "t": True,
    "f": False,
    "arr": [1, "a", None, [2.5]],
    "obj": {"k": [1, {"n": None}], "t": True, "s": "x y"},
    "opt": "7",
    "e": "a b",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_argument_type_round_trips_through_the_template(family):
    """A call rendered by the family's own template parses back to the same arguments: the values are typed
    by the tool's schema (a string "42" stays a string), never by what the text looks like (issue 26.3)."""
    tok = family_tokenizer(family)
    codec = codec_for(tok, family)
    message = {"role": "assistant", "content": "", "tool_calls": [codec_call(codec, "typed", TYPED_ARGS, 0)]}
    if family == "gpt_oss":
        message["thinking"] = "Call it."
    user = [{"role": "user", "content": "Go."}]
    prompt = tok.apply_chat_template(user, tools=[TYPED], add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(user + [message], tools=[TYPED], tokenize=False)
    assert full.startswith(prompt)
    parsed = make_parser(None, codec, [TYPED]).parse(full[len(prompt) :])
    assert [(c.name, c.error) for c in parsed] == [("typed", None)]
    assert parsed[0].arguments == TYPED_ARGS
    assert [type(v) for v in parsed[0].arguments.values()] == [type(v) for v in TYPED_ARGS.values()]


def hermes(text: str):
    return make_parser("hermes", codec_for(family_tokenizer("qwen2.5"), "qwen2.5"), TOOLS).parse(text)


def test_hermes_reads_what_sglang_reads():
    """SGLang's Hermes detector accepts these and verl 0.9.1 drops them; agentfsm makes the calls (the choice
    and why: docs/families.md)."""
    (call,) = hermes('<tool_call>\n{"name": "add", "parameters": {"a": 1, "b": 2}}\n</tool_call>')
    assert (call.name, call.arguments, call.error) == ("add", {"a": 1, "b": 2}, None)
    calls = hermes(
        '<tool_call>\n[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"b": 2}}]'
        "\n</tool_call>"
    )
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 1}, None),
        ("add", {"b": 2}, None),
    ]
    (call,) = hermes(
        '<tool_call>\n{"name": "add", "arguments": {"note": "</tool_call> is a tag"}}\n</tool_call>'
    )
    assert (call.name, call.arguments, call.error) == ("add", {"note": "</tool_call> is a tag"}, None)


def test_hermes_keeps_a_call_to_an_unknown_tool_and_answers_malformed_shapes():
    """SGLang drops a call to a tool that does not exist; agentfsm keeps it, so the model is answered
    "Unknown function" (verl's answer) rather than silently ignored."""
    (call,) = hermes('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    assert (call.name, call.error) == ("nope", None)
    for body in (
        '{"name": "add"}',
        '{"arguments": {}}',
        "[]",
        '[{"name": "add", "arguments": {}}, 3]',
        "add(1, 2)",
    ):
        calls = hermes(f"<tool_call>\n{body}\n</tool_call>")
        assert calls and calls[-1].error, body
    # a stray quote does not swallow the next call: the block ends at its own closer, as verl reads it
    calls = hermes(
        '<tool_call>it\'s "broken</tool_call> <tool_call>{"name": "add", "arguments": {}}</tool_call>'
    )
    assert [(c.name, c.error is None) for c in calls] == [(None, False), ("add", True)]


def test_a_harmony_header_with_two_channels_or_recipients_is_answered_as_malformed():
    codec = codec_for(family_tokenizer("gpt_oss"), "gpt_oss")
    parser = make_parser(None, codec, TOOLS)
    for header in (
        "<|channel|>analysis<|channel|>commentary to=functions.add",
        "<|channel|>commentary to=functions.add<|channel|>analysis",
        "<|channel|>commentary to=functions.add to=functions.sub",
    ):
        (call,) = parser.parse(f'<|start|>assistant{header}<|message|>{{"a": 1}}<|call|>')
        assert call.error and "two channels or two recipients" in call.error, header


@pytest.mark.parametrize("family", ["qwen3", "glm45", "deepseek_v3"])
def test_a_call_between_two_reasoning_closers_is_not_made(family):
    """Nested `<think>`: the reasoning runs to the last `</think>` (Qwen3's and GLM's templates take the answer
    after it), so a call written after the first `</think>` but before the last was still thought."""
    call = {
        "qwen3": H.format(a=1, b=2),
        "glm45": G.format(a=1, b=2),
        "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜>',
    }[family]
    text = f"<think>plan <think>inner</think> {call} </think>It is 3."
    assert parse(family, text) == []
    assert made(parse(family, f"<think>plan <think>inner</think></think>{call}")) != []
