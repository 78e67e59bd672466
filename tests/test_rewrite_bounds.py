"""What a `context.rewrites` function returns is bounded and checked whole before anything walks or renders it
(issue 50): a tool call with 20 MB of arguments escaped the 8 MiB bound (it counted only content: 259 s and an
8 GB peak rendering it, 5.9 GB and an abort on a larger machine), and a content part whose text was not a string
was a raw `TypeError` from the chat template. Each now ends its row alone, in one line naming the rewrite, the row
and the message, beside a healthy row that comes out as it does alone.
"""

from __future__ import annotations

import time

import pytest

from fsm.run.rewrites import MAX_CHARS, MAX_DEPTH
from tests.conftest import run_agent, scripted, user_row

SPEC = """
    name: bounds
    extends: {specs}/calculator.yaml
    context:
      rewrites:
        squash: {function: tests.test_rewrite_bounds:%s}
    states:
      PROCESSING_TOOLS:
        action: call_tools
        next: [{to: SQUASH}]
      SQUASH:
        action: squash
        next: [{to: GENERATING}]
"""


def _attacking(build):
    """A rewrite that appends what `build()` returns on the row that asks "Attack.", and leaves others as they are."""

    def rewrite(messages):
        return [*messages, *build()] if any(m.get("content") == "Attack." for m in messages) else messages

    return rewrite


def _call(arguments):
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": arguments}]}


huge_arguments = _attacking(
    lambda: [_call({"name": "calculator", "arguments": {"expression": "1" * (20 << 20)}})]
)
huge_argument_text = _attacking(
    lambda: [_call({"name": "calculator", "arguments": '"' + "1" * (20 << 20) + '"'})]
)
many_items = _attacking(lambda: [_call({"name": "calculator", "arguments": {"terms": [1] * 10_000_000}})])
nested_part = _attacking(
    lambda: [{"role": "user", "content": [{"type": "text", "text": [{"type": "text"}]}]}]
)
mapping_content = _attacking(lambda: [{"role": "user", "content": {"text": "hi"}}])
calls_not_a_list = _attacking(lambda: [{"role": "assistant", "content": "", "tool_calls": 5}])
object_inside = _attacking(lambda: [_call({"name": "calculator", "arguments": {"x": object()}})])


def _deep():
    value: dict = {}
    for _ in range(MAX_DEPTH + 5):
        value = {"a": value}
    return [_call({"name": "calculator", "arguments": value})]


deep_arguments = _attacking(_deep)


async def _two_rows(compile_yaml, tok, call, turn, fn: str):
    agent = compile_yaml(SPEC % fn, f"{fn}.yaml")
    rows = [
        user_row("Add.", reward_model={"ground_truth": "2"}),
        user_row("Attack.", reward_model={"ground_truth": "2"}),
    ]
    script = [call(("calculator", {"expression": "1 + 1"})), turn("#### 2")]
    return await run_agent(agent, scripted(script), tok, rows)


@pytest.mark.parametrize(
    "fn, says",
    [
        ("huge_arguments", f"returned more than {MAX_CHARS} characters of messages (at message 3)"),
        ("huge_argument_text", f"returned more than {MAX_CHARS} characters of messages (at message 3)"),
        ("many_items", f"returned more than {MAX_CHARS} characters of messages (at message 3)"),
        ("deep_arguments", f"message 3 is nested deeper than {MAX_DEPTH} levels"),
        ("object_inside", "message 3 holds a object, which is not a JSON value"),
        (
            "nested_part",
            "message 3's content part 0 must be a mapping whose text is a string, got dict {'type': 'text', "
            "'text': [{'type': 'text'}]}",
        ),
        (
            "calls_not_a_list",
            "the chat template cannot render what it returned: TypeError: 'int' object is not iterable",
        ),
        ("mapping_content", "message 3's content must be text or content parts, got dict {'text': 'hi'}"),
    ],
)
async def test_a_rewrite_past_the_bounds_or_out_of_shape_ends_its_row_in_one_line(
    compile_yaml, tok, call, turn, fn, says
):
    t0 = time.monotonic()
    good, bad = await _two_rows(compile_yaml, tok, call, turn, fn)
    assert good.error is None and good.termination_reason == "done" and good.token_check is None, good.error
    assert bad.failed and bad.error == (
        f"rewrite 'squash' (tests.test_rewrite_bounds:{fn}) on row {bad.row_name}: {says}"
    ), bad.error
    assert bad.num_segments == 1  # never rendered into a segment
    assert time.monotonic() - t0 < 60  # a loaded machine; the render it replaces took 259 s
