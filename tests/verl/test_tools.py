"""Tools through fsm_agent and through verl's ToolAgentLoop: verl's own tools (BaseTools from a tool config,
@function_tool functions), the tool policy both ways, tool order, and agent_data.

specs/tool_agent.yaml has verl's tool policy, so arguments the schema does not allow, arguments sent as a
JSON string and a raising tool's long error text all give verl's tokens exactly. The entry's `tool_policy:`
switches agentfsm's stricter behaviour on; then the test asserts the exact difference: only the observation
changes. The native engine's side of the same options is tests/test_tools.py.
"""

from __future__ import annotations

import json

import pytest

from tests.verl.harness import (
    ANSWER,
    Case,
    assert_identical,
    assert_same_requests,
    encode_turns,
    generated,
    needs_verl,
    observations,
    run_both,
    tool_call,
)

STRICT = {"validate_arguments": True, "parse_string_arguments": True, "truncate_errors": True}
SHORT = {"max_tool_response_length": 20}  # for verl's multi_turn and the entry's limits alike


def case(name, calls, *, tools="gen_base", expect=(), **kw) -> tuple[Case, tuple[str, ...]]:
    """A one-round script (the calls, then the answer) and what its observation must contain."""
    return Case(name, ["\n".join(tool_call(n, a) for n, a in calls), ANSWER], tools=tools, **kw), tuple(
        expect
    )


VERL_WAY = [
    case("wrong_type", [("echo", {"text": 7})], expect=["Error executing tool 'echo': "]),
    case("unknown_argument", [("echo", {"text": "hi", "lang": "fr"})], expect=["<tool_response>\nhi\n"]),
    case("missing_argument", [("echo", {})], expect=["Error executing tool 'echo': 'text'"]),
    case(
        "json_string",
        [("echo", json.dumps({"text": "hi"}))],
        expect=["Error executing tool 'echo': string indices must be integers"],
    ),
    case(
        "json_string_function",
        [("echo", json.dumps({"text": "hi"}))],
        tools="gen_function",
        expect=["argument after ** must be a mapping, not str"],
    ),
    case("not_an_object", [("scale", [1, 2])], tools="gen_function", expect=["must be a mapping, not list"]),
    case(
        "null_arguments",
        [("echo", None)],
        expect=["Error executing tool 'echo': argument of type 'NoneType'"],
    ),
    case(
        "function_unknown_argument",
        [("scale", {"x": 2, "y": 1})],
        tools="gen_function",
        expect=["scale() got an unexpected keyword argument 'y'"],
    ),
    case(
        "long_error_not_truncated",
        [("echo", {"fail": "é" * 30 + "END"})],
        multi_turn=SHORT,
        limits=SHORT,
        expect=["Error executing tool 'echo': " + "é" * 30 + "END"],
    ),
    case(
        "long_result_truncated",
        [("echo", {"text": "🙂" * 30 + "END"})],
        multi_turn=SHORT,
        limits=SHORT,
        expect=["🙂" * 10 + "...(truncated)..." + "🙂" * 7 + "END"],
    ),
    case(
        "function_error_not_truncated",
        [("shout", {"text": "a", "fail": "x" * 40})],
        tools="gen_function",
        multi_turn=SHORT,
        limits=SHORT,
        expect=["Error executing tool 'shout': " + "x" * 40],
    ),
    case("list_typed_schema", [("tally", {"add": 2.5})], expect=["tally=2.5 "]),
    case(
        "list_typed_function", [("scale", {"x": 1.5, "factor": None})], tools="gen_function", expect=["3.0"]
    ),
    case(
        "function_returns_a_4_tuple",
        [("odd", {"kind": "quad"})],
        tools="gen_function",
        expect=[
            "Error executing tool 'odd': @function_tool return tuple must have length 1, 2, or 3 (got length 4"
        ],
    ),
    case(
        "function_returns_a_tuple_response",
        [("odd", {"kind": "nested"})],
        tools="gen_function",
        expect=["('héllo', 1)"],
    ),
    case(
        "function_reward_empty_string",
        [("odd", {"kind": "empty_reward"})],
        tools="gen_function",
        expect=["Error executing tool 'odd': could not convert string to float: ''"],
    ),
    case(
        "function_returns_verl_tool_response",
        [("odd", {"kind": "response"})],
        tools="gen_function",
        expect=["tr é"],
    ),
    case("empty_instance_id", [("blank", {"text": "b"})], expect=["id='' b"]),
    case(
        "unknown_tool_order",
        [("search", {"q": "x"})],
        expect=["Unknown function 'search'. Available tools: ['tally', 'echo', 'blank', 'calculator']"],
    ),
    case(
        "function_tools_order",
        [("search", {})],
        tools="gen_function",
        expect=["Available tools: ['echo', 'odd', 'scale', 'shout']"],
    ),  # verl loads a file's functions sorted
    case(
        "tool_selection_order",
        [("search", {})],
        row={"extra_info": {"tool_selection": ["calculator", "nope", "tally", "calculator"]}},
        expect=["Available tools: ['calculator', 'tally']"],
    ),
    case(
        "empty_tool_selection",
        [("search", {})],
        row={"extra_info": {"tool_selection": []}},
        expect=["Available tools: ['tally', 'echo', 'blank', 'calculator']"],
    ),
    case(
        "selection_outside_tools",
        [("search", {})],
        row={"extra_info": {"tool_selection": ["nope"]}},
        expect=["Available tools: []"],
    ),
]


@needs_verl
@pytest.mark.parametrize("case, expect", VERL_WAY, ids=[c.name for c, _ in VERL_WAY])
async def test_verl_policy_is_verl(case: Case, expect, tok, tmp_path):
    """tool_agent.yaml's tool policy is verl's: every token, logprob and extra field as verl has them."""
    pair = await run_both(case, tok, tmp_path)
    assert_identical(pair)
    assert_same_requests(pair, tok.eos_token_id)
    (obs,) = observations(tok, pair.verl)[:1]
    for text in expect:
        assert text in obs, (text, obs)


@needs_verl
async def test_tool_selection_orders_the_prompts_tools(tok, tmp_path):
    """The prompt shows the selected tools' schemas in the selection's order, as verl's does."""
    row = {"extra_info": {"tool_selection": ["calculator", "tally"]}}
    pair = await run_both(Case("selection", [ANSWER], tools="gen_base", row=row), tok, tmp_path)
    assert_identical(pair)
    prompt = tok.decode(pair.fsm.prompt_ids)
    assert (
        prompt.index('"name": "calculator"') < prompt.index('"name": "tally"')
        and '"name": "echo"' not in prompt
    )


@needs_verl
async def test_agent_data_extra_fields_like_verl(tok, tmp_path):
    """A tool that keeps state in agent_data.extra_fields (and reads request_id, tools_kwargs, messages and the
    counters) sees what verl's AgentData shows it; the state comes back in extra_fields, as in verl. The tool's
    None reward stays out of tool_rewards on both sides."""
    turns = [
        tool_call("tally", {"add": 2}),
        tool_call("tally", {"add": 3}) + "\n" + tool_call("tally", {"add": 1}),
        ANSWER,
    ]
    row = {"tools_kwargs": {"tally": {"create_kwargs": {"seed": 1}}, "echo": {}}}
    pair = await run_both(
        Case(
            "tally",
            turns,
            tools="gen_base",
            row=row,
            limits={"max_parallel_calls": 2},
            multi_turn={"max_parallel_calls": 2},
            response_length=512,
        ),
        tok,
        tmp_path,
    )
    assert_identical(pair)  # includes extra_fields["tally"], and request_id: each loop's own
    assert pair.fsm.extra_fields["tally"] == 6 and pair.fsm.extra_fields["tool_rewards"] == []
    first, second = observations(tok, pair.fsm)[:2]
    assert "tally=2 turns=1/0 messages=2 " in first and "kwargs=['echo', 'tally'] same_request=True" in first
    assert (
        "tally=5 turns=2/1 messages=4 " in second or "tally=6 turns=2/1 messages=4 " in second
    )  # concurrent
    assert pair.fsm.extra_fields["termination_reason"] == "done"


STRICT_WAY = [
    case(
        "wrong_type",
        [("echo", {"text": 7})],
        expect=["Error: invalid arguments for 'echo': argument 'text' should be string, got int"],
    ),
    case(
        "unknown_argument",
        [("echo", {"text": "hi", "lang": "fr"})],
        expect=["Error: invalid arguments for 'echo': unexpected argument(s) 'lang'; expected 'text'"],
    ),
    case("json_string", [("echo", json.dumps({"text": "hi"}))], expect=["hi"]),
    case(
        "not_an_object",
        [("scale", [1, 2])],
        tools="gen_function",
        expect=["Error: invalid arguments for 'scale': arguments must be a JSON object, got list"],
    ),
    case(
        "long_error_truncated",
        [("shout", {"text": "a", "fail": "é" * 30 + "END"})],
        tools="gen_function",
        multi_turn=SHORT,
        limits=SHORT,
        expect=["Error exec...(truncated)...éééééééEND"],
    ),
]


@needs_verl
@pytest.mark.parametrize("case, expect", STRICT_WAY, ids=[c.name for c, _ in STRICT_WAY])
async def test_strict_policy_changes_only_the_observation(case: Case, expect, tok, tmp_path):
    """The entry's tool_policy switches agentfsm's checks on: the model's turns stay verl's, the observation
    is agentfsm's answer."""
    case.tool_policy = STRICT
    pair = await run_both(case, tok, tmp_path)
    assert pair.fsm.prompt_ids == pair.verl.prompt_ids and pair.fsm.num_turns == pair.verl.num_turns == 4
    assert generated(pair.fsm) == generated(pair.verl) == encode_turns(tok, case.turns)
    (obs,) = observations(tok, pair.fsm)
    assert obs.startswith(f"\n<|im_start|>user\n<tool_response>\n{expect[0]}\n</tool_response>"), obs
    assert observations(tok, pair.verl) != [obs]


@needs_verl
@pytest.mark.parametrize(
    "tools, call", [("gen_base", ("tally", {"add": 2.5})), ("gen_function", ("scale", {"x": 1.5}))]
)
async def test_list_typed_schema_under_strict_checks_is_verl(tools, call, tok, tmp_path):
    """A schema `type` list (`int | float`) used to crash the argument check; valid arguments now pass it and
    the trajectory is verl's, token for token."""
    ((c, _),) = [case("list_type", [call], tools=tools, tool_policy=STRICT)]
    pair = await run_both(c, tok, tmp_path)
    assert_identical(pair)
    assert pair.fsm.extra_fields["termination_reason"] == "done"
