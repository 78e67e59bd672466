"""What a model can write to the tool-call parsers (issue 27, items 1-3): turns with thousands of openers and
no closer are read in linear time, hostile values (deep nesting, huge or non-finite numbers) are answered as
malformed calls instead of raising, and one hostile row does not hold the healthy rows of its batch."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from fsm.families import codec_for, make_parser, split_turn
from fsm.families.parsers import HermesParser
from tests.conftest import model_turn, run_agent, scripted, tool_spec, tool_turn, user_row
from tests.fixtures.family_parser_cases import TOOLS
from tests.fixtures.family_tokenizers import family_tokenizer
from tests.fixtures.parts import __name__ as PARTS

# family -> turns made of one piece repeated n times (the model looping on an opener)
ATTACKS = {
    "qwen3": ["<tool_call>", '<tool_call>{"a": "', '<tool_call>["', "<tool_call>x</tool_call>", "<think>"],
    "qwen2.5": ["<tool_call>", '<tool_call>\n{"name": "add", "arguments": {"a": "</tool_call>'],
    "qwen3_coder": ["<tool_call>", "<tool_call><function=add>", "<function=add><parameter=a>", "<parameter="],
    "glm45": ["<tool_call>", "<tool_call>add<arg_key>", "<arg_key>a</arg_key><arg_value>"],
    "seed_oss": ["<seed:tool_call>", "<seed:tool_call><function=add>", "<function=add><parameter=a>"],
    "kimi_k2": [
        "<|tool_calls_section_begin|><|tool_call_begin|>",
        "<|tool_call_begin|>f<|tool_call_argument_begin|>",
    ],
    "deepseek_v3": ["<｜tool▁call▁begin｜>", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"],
    "gpt_oss": ["<|start|>assistant<|channel|>commentary to=functions.add<|message|>", "<|channel|>"],
    "llama3_1": ["{", '{"name": "add", "parameters": {"a": 1}};', '{"name": "'],
}


def _read(family: str, text: str) -> float:
    """Seconds to do what a turn costs the engine: parse it, split it, build its messages (best of 3)."""
    codec = codec_for(family_tokenizer(family), family)
    best = float("inf")
    for _ in range(3):
        parser = make_parser(None, codec, TOOLS)  # a fresh one: nothing kept from the last repeat
        t0 = time.perf_counter()
        calls = parser.parse(text)
        split_turn(text, codec.family, parser)
        codec.assistant_message(text, calls)
        if hasattr(parser, "content"):
            parser.content(text)
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.mark.parametrize(("family", "piece"), [(f, p) for f, ps in ATTACKS.items() for p in ps])
def test_a_turn_of_repeated_openers_is_read_in_linear_time(family, piece):
    """16,000 openers took 18 s (hermes) to 75 s (kimi_k2) with lazy regexes; linear, they take milliseconds,
    and twice the text takes about twice the time."""
    n = 16_000
    t_n, t_2n = _read(family, piece * n), _read(family, piece * (2 * n))
    assert t_n < 1.0, f"{family}: {n} x {piece!r} took {t_n:.2f} s"
    assert t_2n < 3 * t_n + 0.05, f"{family}: {t_n:.3f} s for n, {t_2n:.3f} s for 2n: not linear"


def _calls(family: str, text: str, tools=TOOLS):
    codec = codec_for(family_tokenizer(family), family)
    return make_parser(None, codec, tools).parse(text)


DEEP = "[" * 100_000 + "]" * 100_000
DEEPISH = "[" * 150 + "]" * 150  # parses, but deeper than any writer downstream should recurse
HUGE = "9" * 5000

# family -> a call whose arguments hold {VALUE}
CALL = {
    "qwen3": '<tool_call>\n{{"name": "add", "arguments": {{"a": {v}}}}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=add>\n<parameter=note>\n{v}\n</parameter>\n</function>\n</tool_call>",
    "glm45": "<tool_call>add\n<arg_key>note</arg_key>\n<arg_value>{v}</arg_value>\n</tool_call>",
    "seed_oss": "<seed:tool_call>\n<function=add>\n<parameter=note>{v}</parameter>\n</function>\n</seed:tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
    '{{"a": {v}}}<|tool_call_end|><|tool_calls_section_end|>',
    "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{{"a": {v}}}<｜tool▁call▁end｜>',
    "gpt_oss": '<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{{"a": {v}}}'
    "<|call|>",
    "llama3_1": '{{"name": "add", "parameters": {{"a": {v}}}}}',
}
# The XML families read an untyped value as JSON; `note` is typed "object" for them in OBJECT_TOOLS.
OBJECT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"note": {"type": "object"}, "a": {"type": "number"}},
            },
        },
    }
]


@pytest.mark.parametrize("family", sorted(CALL))
@pytest.mark.parametrize(
    "value",
    [DEEP, DEEPISH, HUGE, "NaN", "Infinity", "1e999", "-1e999"],
    ids=["deep", "deeper-than-100", "5000-digits", "NaN", "Infinity", "1e999", "-1e999"],
)
def test_hostile_values_are_answered_as_malformed_calls(family, value):
    """Each was a row error (RecursionError, ValueError, OverflowError, or NaN written into the outputs)."""
    calls = _calls(family, CALL[family].format(v=value), OBJECT_TOOLS)
    assert len(calls) == 1 and calls[0].error and calls[0].arguments is None, calls
    json.dumps([c.arguments for c in calls], allow_nan=False)  # what is kept can be written


@pytest.mark.parametrize("value", ["1e999", "nan", "-inf", HUGE + "e999"])
def test_qwen3_coder_non_finite_numbers_are_malformed(value):
    text = f"<tool_call>\n<function=add>\n<parameter=a>\n{value}\n</parameter>\n</function>\n</tool_call>"
    calls = _calls("qwen3_coder", text, OBJECT_TOOLS)
    assert len(calls) == 1 and calls[0].error and "parameter 'a'" in calls[0].error


def test_a_5000_digit_integer_for_an_integer_parameter_is_malformed():
    text = f"<tool_call>\n<function=add>\n<parameter=a>\n{HUGE}\n</parameter>\n</function>\n</tool_call>"
    calls = _calls("qwen3_coder", text)  # TOOLS: a is an integer
    assert len(calls) == 1 and calls[0].error


def test_python_literals_that_are_not_json_stay_text():
    """A set or bytes literal is no JSON value: the text reaches the tool, never an unwritable object."""
    for literal in ("{1, 2}", "b'x'", "(1+2j)"):
        text = f"<seed:tool_call>\n<function=add>\n<parameter=note>{literal}</parameter>\n</function>\n</seed:tool_call>"
        (call,) = _calls("seed_oss", text, OBJECT_TOOLS)
        assert call.error is None and call.arguments == {"note": literal}


def test_a_hostile_turn_does_not_hold_the_healthy_rows(tok, compile_yaml):
    """One row's turn of 16,000 `<tool_call>` openers beside seven healthy rows: it used to hold the event
    loop for 18 s while it was parsed (the healthy rows went from 0.6 s to 17.4 s). Now the healthy rows end
    about when they end alone, and the hostile row's malformed call is answered, not a row error."""
    agent = compile_yaml(tool_spec(f"  - function: {PARTS}:echo").replace("512", "20000"))
    hostile = model_turn(tok, "<tool_call>" * 16_000)
    healthy = [tool_turn(tok, ("echo", {"text": "hi"})), model_turn(tok, "It is 3.")]

    async def run(hostile_row: int | None) -> tuple[float, list]:
        done: list[float] = []

        def turn(row: int, sample: int, k: int, prompt: list[int]) -> list[int]:
            if row == hostile_row:
                return hostile if k == 0 else model_turn(tok, "Sorry.")
            if k == 1:
                done.append(time.perf_counter())
            return healthy[k]

        rows = [user_row(f"{k} + 2?") for k in range(7)] + (
            [user_row("loop")] if hostile_row is not None else []
        )
        t0 = time.perf_counter()
        trajs = await run_agent(agent, scripted(turn, latency_s=0.05), tok, rows, check_tokens=False)
        assert len(done) == 7
        return max(done) - t0, trajs

    alone, _ = asyncio.run(run(None))
    beside, trajs = asyncio.run(run(7))
    assert beside < alone + 1.0, (
        f"healthy rows took {beside:.2f} s beside the hostile row, {alone:.2f} s alone"
    )
    hostile_traj = trajs[7]
    assert hostile_traj.termination_reason != "error", hostile_traj.termination_reason
    answers = [m["content"] for m in hostile_traj.messages if m["role"] == "tool"]
    assert answers and "unterminated <tool_call>" in answers[0], answers


def test_hermes_content_is_linear_and_keeps_an_unterminated_block():
    text = "a<tool_call>{}</tool_call>b" + "<tool_call>" * 50_000
    t0 = time.perf_counter()
    assert HermesParser().content(text) == "ab" + "<tool_call>" * 50_000
    assert time.perf_counter() - t0 < 0.5
