"""fsm/tools/base.py: argument checks, the tool policy both ways (verl's in tool_agent.yaml, agentfsm's stricter
one in calculator.yaml and by default), error texts, tool order under tool_selection, and agent_data.

The same behaviours through verl's own ToolAgentLoop are in tests/verl/test_tools.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import fsm
from fsm.run.compile import infer_schema
from fsm.tools.base import check_arguments
from tests.conftest import (
    PARTS,
    SPECS,
    model_turn,
    run_agent,
    scripted,
    tool_messages,
    tool_spec,
    tool_turn,
    user_row,
)
from tests.fixtures import parts

ECHO = f"{PARTS}:echo"
VERL = "tool_policy: {validate_arguments: false, parse_string_arguments: false, truncate_errors: false}"
STRICT = "tool_policy: {validate_arguments: true, parse_string_arguments: true, truncate_errors: true}"


async def run_tools(
    tok, compile_yaml, tools: str, turns: list, *, policy: str = "", limits: str = "", rows=None
):
    """tool_agent.yaml (verl's policy) with `tools`, or with another `policy` block; the model ends with "done"."""
    agent = compile_yaml(tool_spec(tools, limits, extra=policy))
    backend = scripted(turns + [model_turn(tok, "done")])
    trajs = await run_agent(agent, backend, tok, rows or [user_row()])
    return agent, backend, trajs


def test_shipped_specs_policies():
    """tool_agent.yaml is verl's ToolAgentLoop: verl's policy; calculator.yaml switches agentfsm's on, and a spec
    that says nothing gets agentfsm's."""
    verl = fsm.load_spec(SPECS / "tool_agent.yaml").spec.tool_policy
    assert not (verl.validate_arguments or verl.parse_string_arguments or verl.truncate_errors)
    strict = fsm.load_spec(SPECS / "calculator.yaml").spec.tool_policy
    assert strict.validate_arguments and strict.parse_string_arguments and strict.truncate_errors
    assert fsm.load_spec(SPECS / "single_turn.yaml").spec.tool_policy == strict


# --- argument checks ----------------------------------------------------------------------------------------

SCALE = {
    "function": {
        "name": "scale",
        "parameters": {
            "type": "object",
            "required": ["x"],
            "properties": {
                "x": {"type": ["integer", "number"]},
                "factor": {"type": "integer", "nullable": True},
                "tags": {"type": ["array", "null"]},
            },
        },
    }
}


@pytest.mark.parametrize(
    "args, problem",
    [
        ({"x": 2}, None),
        ({"x": 2.5}, None),
        ({"x": 2, "factor": None, "tags": None}, None),  # nullable, and "null" in a type list
        ({"x": 2, "factor": 3.0}, None),  # JSON Schema: an integer is a number without a fraction
        ({"x": 2, "tags": ["a"]}, None),
        ({"x": "2"}, "argument 'x' should be integer or number, got str"),
        ({"x": True}, "argument 'x' should be integer or number, got bool"),
        ({"x": 2, "factor": 1.5}, "argument 'factor' should be integer, got float"),
        ({"x": 2, "tags": "a"}, "argument 'tags' should be array or null, got str"),
        ({}, "missing required argument(s) 'x'"),
        ({"x": 1, "y": 2}, "unexpected argument(s) 'y'; expected 'x', 'factor', 'tags'"),
        ("{}", "arguments must be a JSON object, got str"),
        ([1], "arguments must be a JSON object, got list"),
        (None, "arguments must be a JSON object, got NoneType"),
    ],
)
def test_check_arguments(args, problem):
    """A list `type` (a Python `int | float` annotation) is valid JSON Schema: the value may be any of them."""
    assert check_arguments(SCALE, args) == problem


def test_check_arguments_tolerates_odd_schemas():
    weird = {
        "function": {
            "parameters": {"properties": {"x": {"type": [{"not": "a name"}]}, "y": {"type": "decimal"}}}
        }
    }
    assert check_arguments(weird, {"x": 1, "y": "z"}) is None  # types it cannot name are not enforced
    assert check_arguments({"function": {"name": "f"}}, {"anything": 1}) is None  # no parameters declared


# --- the tool policy, both ways -------------------------------------------------------------------------------

ADD = f"  - function: {PARTS}:add"


@pytest.mark.parametrize(
    "arguments, strict, verl",
    [
        (
            {},
            "Error: invalid arguments for 'add': missing required argument(s) 'a', 'b'",
            "Error executing tool 'add': add() missing 2 required positional arguments: 'a' and 'b'",
        ),
        (
            {"a": 1, "b": "2"},
            "Error: invalid arguments for 'add': argument 'b' should be integer, got str",
            "Error executing tool 'add': unsupported operand type(s) for +: 'int' and 'str'",
        ),
        (
            {"a": 1, "b": True},
            "Error: invalid arguments for 'add': argument 'b' should be integer, got bool",
            '{"sum": 2}',
        ),
        (
            {"a": 1, "b": 2, "c": 3},
            "Error: invalid arguments for 'add': unexpected argument(s) 'c'; expected 'a', 'b'",
            "Error executing tool 'add': add() got an unexpected keyword argument 'c'",
        ),
        (
            [1, 2],
            "Error: invalid arguments for 'add': arguments must be a JSON object, got list",
            "Error executing tool 'add': ",
        ),
        ({"a": 1, "b": 2}, '{"sum": 3}', '{"sum": 3}'),  # a dict result is JSON (verl's normalization)
    ],
)
@pytest.mark.parametrize("policy", ["strict", "verl"])
async def test_argument_validation(tok, compile_yaml, arguments, strict, verl, policy):
    """Strict: arguments that do not fit the schema are answered with what is wrong. verl: the tool runs."""
    _, _, (traj,) = await run_tools(
        tok,
        compile_yaml,
        ADD,
        [tool_turn(tok, ("add", arguments))],
        policy=STRICT if policy == "strict" else "",
    )
    (msg,) = tool_messages(traj)
    expected = strict if policy == "strict" else verl
    assert msg.startswith(expected) and (len(msg) == len(expected) or expected.endswith(": "))
    assert traj.metrics.tool_errors == (0 if msg.startswith("{") else 1)


@pytest.mark.parametrize("policy", ["strict", "verl"])
async def test_arguments_as_a_json_string(tok, compile_yaml, policy):
    raw = '{"name": "echo", "arguments": "{\\"text\\": \\"via string\\"}"}'
    bad = '{"name": "echo", "arguments": "{\\"text\\": "}'
    _, _, (traj,) = await run_tools(
        tok,
        compile_yaml,
        f"  - function: {ECHO}",
        [tool_turn(tok, raw, bad)],
        policy=STRICT if policy == "strict" else "",
        limits="  max_parallel_calls: 2",
    )
    if policy == "strict":  # parsed, then checked like any other arguments
        assert tool_messages(traj) == [
            "via string",
            "Error: Invalid JSON in arguments for 'echo': Expecting value: line 1 column 10 (char 9)",
        ]
    else:  # verl: the tool receives the string itself
        mapping = "Error executing tool 'echo': tests.fixtures.parts.echo() argument after ** must be a mapping, not str"
        assert tool_messages(traj) == [mapping, mapping]


@pytest.mark.parametrize("policy", ["strict", "verl"])
async def test_error_text_truncation(tok, compile_yaml, policy):
    """A raising tool's error text is cut like a result under the strict policy; verl never cuts it."""
    reason = "x" * 40 + "END"
    _, _, (traj,) = await run_tools(
        tok,
        compile_yaml,
        f"  - function: {PARTS}:boom",
        [tool_turn(tok, ("boom", {"reason": reason}), ("long_text", {"n": 45}))],
        policy=STRICT if policy == "strict" else "",
        limits="  max_tool_response_length: 20\n          max_parallel_calls: 2",
    )
    full = f"Error executing tool 'boom': {reason}"
    unknown = "Unknown function 'long_text'. Available tools: ['boom']"  # no error text of our own is cut
    if policy == "strict":
        assert tool_messages(traj) == [full[:10] + "...(truncated)..." + full[-10:], unknown]
    else:
        assert tool_messages(traj) == [full, unknown]


async def test_results_are_truncated_under_both_policies(tok, compile_yaml):
    for policy in ("", STRICT):
        _, _, (traj,) = await run_tools(
            tok,
            compile_yaml,
            f"  - function: {PARTS}:long_text",
            [tool_turn(tok, ("long_text", {"n": 45}))],
            policy=policy,
            limits="  max_tool_response_length: 20",
        )
        assert tool_messages(traj) == ["0123456789...(truncated)...5678901234"]


@pytest.mark.parametrize("policy", ["strict", "verl"])
async def test_call_without_arguments_is_malformed(tok, compile_yaml, policy):
    """verl's hermes parser drops a call with no "arguments" (KeyError); here it is answered as malformed."""
    _, _, (traj,) = await run_tools(
        tok,
        compile_yaml,
        f"  - function: {ECHO}",
        [tool_turn(tok, '{"name": "echo"}')],
        policy=STRICT if policy == "strict" else "",
    )
    assert tool_messages(traj) == [
        'Error: a tool call must be a JSON object with a string "name" and "arguments" (or "parameters")'
    ]


async def test_list_typed_schema_never_crashes(tok, compile_yaml):
    """Item: a `int | float` parameter (schema type ["integer", "number"]) used to crash the argument check."""
    calls = [("scale", {"x": 2.5}), ("scale", {"x": 3, "factor": None}), ("scale", {"x": "3"})]
    _, _, (traj,) = await run_tools(
        tok,
        compile_yaml,
        f"  - function: {PARTS}:scale",
        [tool_turn(tok, *calls)],
        policy=STRICT,
        limits="  max_parallel_calls: 3",
    )
    assert not traj.failed and traj.termination_reason == "done"
    assert tool_messages(traj) == [
        "5.0",
        "6",
        "Error: invalid arguments for 'scale': argument 'x' should be integer or number, got str",
    ]
    schema = infer_schema(parts.scale)  # the inferred schema really has a list type
    assert schema["function"]["parameters"]["properties"]["x"]["type"] == ["integer", "number"]


# --- tool order --------------------------------------------------------------------------------------------

TWO = f"  - function: {PARTS}:long_text\n          - function: {ECHO}"  # declared out of alphabetical order


async def test_unknown_tool_lists_tools_in_declaration_order(tok, compile_yaml):
    _, _, (traj,) = await run_tools(tok, compile_yaml, TWO, [tool_turn(tok, ("search", {"q": "x"}))])
    assert tool_messages(traj) == ["Unknown function 'search'. Available tools: ['long_text', 'echo']"]


@pytest.mark.parametrize(
    "selection, names",
    [
        (["echo", "long_text"], ["echo", "long_text"]),  # the selection's order, for the prompt and the error
        (["echo", "nope", "echo"], ["echo"]),  # unknown names dropped, duplicates once
        ([], ["long_text", "echo"]),  # verl: an empty selection means every tool
        (np.array(["echo", "long_text"], dtype=object), ["echo", "long_text"]),  # as parquet hands it over
    ],
)
async def test_tool_selection_order(tok, compile_yaml, selection, names):
    row = user_row(extra_info={"tool_selection": selection})
    _, backend, (traj,) = await run_tools(
        tok, compile_yaml, TWO, [tool_turn(tok, ("search", {}))], rows=[row]
    )
    assert [s["function"]["name"] for s in traj.tool_schemas] == names
    prompt = tok.decode(backend.requests[0].prompt_ids)
    positions = [prompt.index(f'"name": "{n}"') for n in names]
    assert positions == sorted(positions) and ('"long_text"' in prompt) == ("long_text" in names)
    assert tool_messages(traj) == [f"Unknown function 'search'. Available tools: {names}"]


# --- agent_data ---------------------------------------------------------------------------------------------


async def test_tools_keep_state_in_agent_data_extra_fields(tok, compile_yaml):
    """verl documents agent_data.extra_fields as the place for tool session state; it is exported with the
    trajectory's extra fields and as a batch column, as verl exports it."""
    tools = f"""  - class: {PARTS}:TallyTool
            schema: {parts.TALLY_SCHEMA}"""
    row = user_row(tools_kwargs={"tally": {"create_kwargs": {}}})
    turns = [tool_turn(tok, ("tally", {"add": 2})), tool_turn(tok, ("tally", {"add": 0.5}))]
    agent, _, (traj,) = await run_tools(tok, compile_yaml, tools, turns, rows=[row])
    first, second = tool_messages(traj)
    last = len(tok.encode(tok.decode(turns[0]), add_special_tokens=False))
    assert first == (
        f"tally=2 request={traj.session_id} turns=1/0 messages=2 context={len(traj.prompt_ids) + last} "
        f"last={last} kwargs=['tally']"
    )
    assert second.startswith("tally=2.5 ") and " turns=2/1 messages=4 " in second
    assert traj.extra_fields == {"tally": 2.5}
    out = traj.to_output()["extra_fields"]
    assert out["tally"] == 2.5 and out["tool_rewards"] == [0.0, 0.0]
    (plain,) = await run_agent(agent, scripted([model_turn(tok, "no tools")]), tok, [user_row()])
    batch = fsm.collate([traj, plain], prompt_length=1024, response_length=512, pad_token_id=0)
    assert list(batch.non_tensor_batch["tally"]) == [2.5, None]


@pytest.mark.parametrize(
    "limit, side, expected",
    [
        (1, "middle", "...(truncated)...0123456789"),  # verl's text[:0] + marker + text[-0:]: all of it
        (2, "middle", "0...(truncated)...9"),
        (3, "middle", "0...(truncated)...9"),
        (1, "left", "(truncated)...9"),
        (2, "right", "01...(truncated)"),
    ],
)
async def test_tiny_response_limits_truncate_as_verl_does(tok, compile_yaml, limit, side, expected):
    limits = f"  max_tool_response_length: {limit}\n          tool_response_truncate_side: {side}"
    _, _, (traj,) = await run_tools(
        tok,
        compile_yaml,
        f"  - function: {ECHO}",
        [tool_turn(tok, ("echo", {"text": "0123456789"}))],
        limits=limits,
    )
    assert tool_messages(traj) == [expected]


@pytest.mark.parametrize(
    "ret, text, reward, metrics",
    [
        ("plain", "plain", 0.0, {}),
        ({"k": "ü"}, '{"k": "ü"}', 0.0, {}),
        ((("héllo", 1),), "('héllo', 1)", 0.0, {}),  # a tuple response is its repr, as verl's
        (({"k": 1}, "1.5", None), '{"k": 1}', 1.5, {}),
        (("x", 0, [("k", 1)]), "x", 0.0, {"k": 1}),
        (3.5, "3.5", 0.0, {}),
        (None, "None", 0.0, {}),
    ],
)
def test_function_returns_normalize_as_verl(ret, text, reward, metrics):
    response, got_reward, got_metrics = fsm.tools.base.normalize_return(ret)
    assert (response.text, got_reward, got_metrics) == (text, reward, metrics)


@pytest.mark.parametrize(
    "ret, error",
    [
        (
            ("a", 1.0, {}, "x"),
            "@function_tool return tuple must have length 1, 2, or 3 (got length 4: ('a', 1.0, {}, 'x'))",
        ),
        ((), "@function_tool return tuple must have length 1, 2, or 3 (got length 0: ())"),
        (("x", ""), "could not convert string to float: ''"),  # verl's error, not a reward of 0.0
        (("x", 1, 5), "'int' object is not iterable"),
    ],
)
def test_function_returns_verl_refuses_are_errors(ret, error):
    with pytest.raises((TypeError, ValueError)) as info:
        fsm.tools.base.normalize_return(ret)
    assert str(info.value).startswith(error)


# --- a schema inferred from a docstring with a Returns: section --------------------------------------------


@pytest.mark.slow
def test_an_inferred_schema_leaves_out_the_return_and_the_tiny_model_calls_the_tool(tmp_path):
    """Issue 46 §4: transformers' helper adds `"return"` from a `Returns:` section; rendered into the prompt, the
    tiny model met a tool it was never trained on and every row scored 0. The OpenAI form has no `return`."""
    from fsm import RolloutEngine
    from specs.calculator import TOOL_SCHEMA, make_prompts
    from tests.fixtures import documented_tools

    assert infer_schema(documented_tools.calculator) == TOOL_SCHEMA
    spec = tmp_path / "documented.yaml"
    spec.write_text(
        f"name: documented\nextends: {SPECS}/calculator.yaml\nsampling: {{temperature: 0}}\n"
        "tools:\n  - function: tests.fixtures.documented_tools:calculator\n"
    )
    with RolloutEngine(str(spec)) as engine:
        trajs = engine._run_sync(engine.arun(make_prompts(4, 0)))
    assert sum(t.metrics.num_tool_calls for t in trajs) >= 4
    assert sum(t.reward_score or 0 for t in trajs) >= 3, [t.reward_score for t in trajs]
