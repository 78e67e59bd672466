"""Engine behaviour with the real tokenizer and scripted models: every termination reason of every shipped
spec, tools and their failure modes, interactions, failures that stay inside one row, GRPO groups, custom
states/guards/actions, `extends`, the token check, sampling parameters, budgets and request ids.
"""

from __future__ import annotations

import time

import pytest

import fsm
from backends.base import BackendUnavailable
from fsm.run.trajectory import Trajectory
from tests.conftest import (
    PARTS,
    SPECS,
    model_turn,
    observation_texts,
    response_text,
    run_agent,
    scripted,
    tool_messages,
    tool_spec,
    tool_turn,
    user_row,
)
from tests.fixtures import parts

ECHO = f"{PARTS}:echo"


def assert_consistent(traj: Trajectory) -> None:
    n = len(traj.response_ids)
    assert len(traj.response_mask) == n == len(traj.response_logprobs)
    assert all(lp == 0.0 for lp, m in zip(traj.response_logprobs, traj.response_mask) if m == 0)


def assert_failed_row(traj: Trajectory, reason_part: str) -> None:
    assert traj.failed
    assert traj.termination_reason.startswith("error:"), traj.termination_reason
    assert reason_part in traj.termination_reason, traj.termination_reason
    assert len(traj.response_ids) == len(traj.response_mask) == len(traj.response_logprobs) == 0


# --- single_turn ------------------------------------------------------------------------------------------


async def test_single_turn_done(tok):
    agent = fsm.compile_spec(SPECS / "single_turn.yaml")
    backend = scripted([model_turn(tok, "The answer is 3.")])
    (traj,) = await run_agent(agent, backend, tok, [user_row()])
    assert traj.termination_reason == "done"
    assert traj.path == ["PENDING", "GENERATING", "TERMINATED"]
    assert traj.response_ids.tolist() == model_turn(tok, "The answer is 3.")
    assert set(traj.response_mask) == {1}
    assert set(traj.response_logprobs) == {-0.5}
    assert traj.num_turns == 2  # verl's SingleTurnAgentLoop
    assert traj.token_check is None
    assert traj.prompt_ids.tolist() == tok.apply_chat_template(
        user_row()["raw_prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
    )


async def test_single_turn_response_length(tok, compile_yaml):
    agent = compile_yaml("""
        name: short
        extends: {specs}/single_turn.yaml
        limits: {response_length: 16}
    """)
    backend = scripted([model_turn(tok, "a long answer that goes on and on and on past the budget")])
    (traj,) = await run_agent(agent, backend, tok, [user_row()])
    assert traj.termination_reason == "response_length"
    assert len(traj.response_ids) == 16 and set(traj.response_mask) == {1}
    assert traj.last_finish_reason == "length"
    assert backend.requests[0].sampling_params["max_new_tokens"] == 16
    assert traj.token_check is None


# --- tool_agent / calculator ------------------------------------------------------------------------------


def calculator_row(expression: str = "1 + 2", answer: str = "3") -> dict:
    from specs.calculator import SYSTEM_PROMPT

    return {
        "raw_prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"What is {expression}?"},
        ],
        "reward_model": {"ground_truth": answer},
        "data_source": "calculator",
    }


async def test_calculator_done_with_reward(tok, turn, call):
    agent = fsm.compile_spec(SPECS / "calculator.yaml")
    backend = scripted([call(("calculator", {"expression": "1 + 2"})), turn("The answer is 3.\n#### 3")])
    (traj,) = await run_agent(agent, backend, tok, [calculator_row()])
    assert traj.termination_reason == "done"
    assert traj.path == ["PENDING", "GENERATING", "PROCESSING_TOOLS", "GENERATING", "TERMINATED"]
    assert traj.reward_score == 1.0
    assert tool_messages(traj) == ["3"]
    assert traj.tool_rewards == [0.0]
    assert traj.num_turns == 4  # 1 user (tool) turn + 2 assistant turns + 1
    assert traj.token_check is None
    assert [s.role for s in traj.runs] == ["assistant", "template", "tool", "assistant"]
    # the second request is the whole context so far: prompt, the model's first turn, the observation
    second = backend.requests[1].prompt_ids
    assert second == traj.prompt_ids.tolist() + traj.response_ids.tolist()[: traj.runs[3].start]


async def test_tool_agent_response_length_after_generation(tok, compile_yaml):
    agent = compile_yaml(tool_spec(f"  - function: {ECHO}", "  max_new_tokens: 48").replace("512", "48"))
    backend = scripted([model_turn(tok, "word " * 80)])
    (traj,) = await run_agent(agent, backend, tok, [user_row()])
    assert traj.termination_reason == "response_length"
    assert traj.path == ["PENDING", "GENERATING", "TERMINATED"]
    assert len(traj.response_ids) == 48


async def test_tool_agent_response_length_after_tools_does_not_append(tok, compile_yaml):
    """verl: an observation that does not fit ends the trajectory on the unanswered call, not appended."""
    agent = compile_yaml(tool_spec(f"  - function: {PARTS}:long_text").replace("512", "100"))
    first = tool_turn(tok, ("long_text", {"n": 200}))
    backend = scripted([first, model_turn(tok, "never asked for")])
    (traj,) = await run_agent(agent, backend, tok, [user_row()])
    assert traj.termination_reason == "response_length"
    assert traj.path == ["PENDING", "GENERATING", "PROCESSING_TOOLS", "TERMINATED"]
    assert traj.response_ids.tolist() == first  # nothing after the model's turn
    assert tool_messages(traj) == []
    assert traj.user_turns == 0 and traj.observation_overflow
    assert len(backend.requests) == 1  # the model is not asked again without the tool's answer
    assert traj.token_check is None


async def test_calculator_max_assistant_turns(tok):
    agent = fsm.compile_spec(SPECS / "calculator.yaml")  # max_assistant_turns: 3
    backend = scripted([tool_turn(tok, ("calculator", {"expression": "1+2"}))] * 5)
    (traj,) = await run_agent(agent, backend, tok, [calculator_row()])
    assert traj.termination_reason == "max_assistant_turns"
    assert traj.assistant_turns == 3 and traj.user_turns == 2
    assert len(backend.requests) == 3
    assert traj.path[-2:] == ["GENERATING", "TERMINATED"]


async def test_tool_agent_max_user_turns(tok, compile_yaml):
    agent = compile_yaml(tool_spec(f"  - function: {ECHO}", "  max_user_turns: 2"))
    backend = scripted([tool_turn(tok, ("echo", {"text": "x"}))] * 5)
    (traj,) = await run_agent(agent, backend, tok, [user_row()])
    assert traj.termination_reason == "max_user_turns"
    assert traj.user_turns == 2 and traj.assistant_turns == 3
    assert traj.pending_calls  # the third turn's call is left unanswered, as in verl
    assert tool_messages(traj) == ["x", "x"]


async def test_tool_agent_with_interaction_done(tok, compile_yaml):
    agent = compile_yaml(
        tool_spec(
            f"  - function: {ECHO}",
            extra=f"interaction:\n          class: {PARTS}:EndsAfter\n          config: {{turns: 2}}",
        )
    )
    backend = scripted(
        [tool_turn(tok, ("echo", {"text": "hi"})), model_turn(tok, "first"), model_turn(tok, "second")]
    )
    (traj,) = await run_agent(agent, backend, tok, [user_row(interaction_kwargs={})])
    assert traj.termination_reason == "interaction_done"
    assert traj.path == [
        "PENDING",
        "GENERATING",
        "PROCESSING_TOOLS",
        "GENERATING",
        "INTERACTING",
        "GENERATING",
        "INTERACTING",
        "TERMINATED",
    ]
    assert traj.turn_scores == [0.1, 0.2]
    assert observation_texts(tok, traj, "user") == [
        "<|im_start|>user\nreply 1<|im_end|>\n<|im_start|>assistant\n"
    ]
    assert traj.extra["final_feedback"] == "reply 2"  # ends the conversation: never appended
    assert traj.interaction_score == 2.0
    assert traj.token_check is None


async def test_tool_agent_with_interaction_response_length(tok, compile_yaml):
    """tool_agent's INTERACTING -> TERMINATED (response_length): the user's reply does not fit."""
    agent = compile_yaml(f"""
        name: talk_with_tools
        extends: {{specs}}/tool_agent.yaml
        limits: {{response_length: 10}}
        interaction: {{class: "{PARTS}:EndsAfter"}}
    """)
    first = model_turn(tok, "hi")
    row = user_row(interaction_kwargs={})
    (traj,) = await run_agent(agent, scripted([first, model_turn(tok, "again")]), tok, [row])
    assert traj.termination_reason == "response_length"
    assert traj.path == ["PENDING", "GENERATING", "INTERACTING", "TERMINATED"]
    assert traj.response_ids.tolist() == first and traj.turn_scores == [0.1]
    assert traj.interaction_score == 1.0  # the interaction is still scored and finalized


async def test_tool_agent_interacts_only_with_rows_that_opt_in(tok, compile_yaml):
    """As in verl, a row takes part in the interaction only when it carries interaction_kwargs."""
    agent = compile_yaml(f"""
        name: talk_with_tools
        extends: {{specs}}/tool_agent.yaml
        interaction: {{class: "{PARTS}:EndsAfter"}}
    """)
    (traj,) = await run_agent(agent, scripted([model_turn(tok, "hi")]), tok, [user_row()])
    assert traj.path == ["PENDING", "GENERATING", "TERMINATED"] and traj.termination_reason == "done"


# --- interaction_agent ------------------------------------------------------------------------------------


def guess_row(secret: int = 7) -> dict:
    return user_row("Guess my number between 1 and 10.", interaction_kwargs={"secret": secret})


async def test_interaction_agent_done(tok):
    agent = fsm.compile_spec(SPECS / "interaction_agent.yaml")
    backend = scripted([model_turn(tok, "5"), model_turn(tok, "9"), model_turn(tok, "7")])
    (traj,) = await run_agent(agent, backend, tok, [guess_row(7)])
    assert traj.termination_reason == "interaction_done"
    assert traj.turn_scores == [0.0, 0.0, 1.0]
    assert [m["content"] for m in traj.messages if m["role"] == "user"][1:] == [
        "Higher.",
        "Lower.",
        "Correct!",
    ]
    assert observation_texts(tok, traj, "user")[-1].startswith(
        "<|im_start|>user\nCorrect!"
    )  # final_reply: append
    assert traj.interaction_score == pytest.approx(1 / 3)
    assert traj.user_turns == 3 and traj.assistant_turns == 3
    assert traj.token_check is None


async def test_interaction_final_reply_kept_out(tok, compile_yaml):
    agent = compile_yaml("""
        name: talk
        extends: {specs}/interaction_agent.yaml
        interaction: {final_reply: keep_out}
    """)
    backend = scripted([model_turn(tok, "5"), model_turn(tok, "7")])
    (traj,) = await run_agent(agent, backend, tok, [guess_row(7)])
    assert traj.termination_reason == "interaction_done" and traj.extra["final_feedback"] == "Correct!"
    assert traj.user_turns == 1 and observation_texts(tok, traj, "user") == [
        "<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"
    ]


async def test_interaction_agent_max_user_turns(tok):
    agent = fsm.compile_spec(SPECS / "interaction_agent.yaml")  # max_user_turns: 4
    backend = scripted([model_turn(tok, "1")] * 10)
    (traj,) = await run_agent(agent, backend, tok, [guess_row(7)])
    assert traj.termination_reason == "max_user_turns"
    assert traj.user_turns == 4 and traj.assistant_turns == 5  # checked after the model's answer (verl)
    assert traj.token_check is None


async def test_interaction_agent_response_length_after_generation(tok, compile_yaml):
    agent = compile_yaml("""
        name: short_talk
        extends: {specs}/interaction_agent.yaml
        limits: {response_length: 20}
    """)
    backend = scripted([model_turn(tok, "I think it is probably the number 3, or maybe 4")])
    (traj,) = await run_agent(agent, backend, tok, [guess_row(7)])
    assert traj.termination_reason == "response_length"
    assert traj.path == ["PENDING", "GENERATING", "TERMINATED"]
    assert len(traj.response_ids) == 20


async def test_interaction_reply_that_does_not_fit_is_cut(tok, compile_yaml):
    agent = compile_yaml("""
        name: short_talk
        extends: {specs}/interaction_agent.yaml
        limits: {response_length: 12}
    """)
    first = model_turn(tok, "5")
    backend = scripted([first, model_turn(tok, "6")])
    (traj,) = await run_agent(agent, backend, tok, [guess_row(7)])
    assert traj.termination_reason == "response_length"
    assert traj.path == ["PENDING", "GENERATING", "INTERACTING", "TERMINATED"]
    assert len(traj.response_ids) == 12 and traj.response_ids.tolist()[: len(first)] == first
    assert traj.user_turns == 1 and len(backend.requests) == 1  # no request once the budget is spent


async def test_interaction_agent_response_length_when_reply_does_not_fit(tok, compile_yaml):
    agent = compile_yaml("""
        name: short_talk
        extends: {specs}/interaction_agent.yaml
        limits: {response_length: 12}
        interaction: {reply_overflow: drop}
    """)
    first = model_turn(tok, "5")
    backend = scripted([first, model_turn(tok, "6")])
    (traj,) = await run_agent(agent, backend, tok, [guess_row(7)])
    assert traj.termination_reason == "response_length"
    assert traj.path == ["PENDING", "GENERATING", "INTERACTING", "TERMINATED"]
    assert traj.response_ids.tolist() == first and traj.user_turns == 0
    assert len(backend.requests) == 1


async def test_interaction_lifecycle(tok, compile_yaml):
    agent = compile_yaml(f"""
        name: talk
        extends: {{specs}}/interaction_agent.yaml
        interaction:
          class: {PARTS}:EndsAfter
          config: {{turns: 3}}
    """)
    backend = scripted(
        [model_turn(tok, "a"), model_turn(tok, "b"), model_turn(tok, "c"), model_turn(tok, "x")]
    )
    runner = fsm.Runner(agent, backend, tok, check_tokens=True)
    ctx = runner.make_context(None, False)
    trajs = runner.trajectories([user_row(), user_row(interaction_kwargs={"turns": 1})])
    for traj in trajs:
        await runner.drive(ctx, traj)
    inter = ctx.interaction
    assert inter.name == "talk"  # the spec's name when the interaction has none
    long, short = trajs
    assert inter.methods(long.session_id) == [
        "start",
        "generate",
        "generate",
        "generate",
        "score",
        "finalize",
    ]
    assert inter.methods(short.session_id) == ["start", "generate", "score", "finalize"]
    assert long.termination_reason == short.termination_reason == "interaction_done"
    assert long.interaction_score == 3.0 and short.interaction_score == 1.0
    assert long.extra["interaction_metrics"] == [{"k": 1}, {"k": 2}, {"k": 3}]


async def test_interaction_with_verl_0_7_base_signatures(tok, compile_yaml):
    """verl <= 0.7.1's BaseInteraction has calculate_score(self) and finalize_interaction(self): the row
    must not fail on them."""
    agent = compile_yaml(f"""
        name: talk
        extends: {{specs}}/interaction_agent.yaml
        interaction:
          class: {PARTS}:NoIdLifecycle
    """)
    (traj,) = await run_agent(agent, scripted([model_turn(tok, "a")]), tok, [user_row(interaction_kwargs={})])
    assert not traj.failed and traj.termination_reason == "interaction_done"
    assert traj.interaction_score == 0.25


# --- tools ------------------------------------------------------------------------------------------------


async def run_tools(tok, compile_yaml, tools: str, turns: list, *, limits: str = "", rows=None, **kw):
    agent = compile_yaml(tool_spec(tools, limits))
    backend = scripted(turns + [model_turn(tok, "done")])
    trajs = await run_agent(agent, backend, tok, rows or [user_row()], **kw)
    return agent, backend, trajs


async def test_tool_timeout_becomes_observation(tok, compile_yaml):
    t0 = time.perf_counter()
    _, backend, (traj,) = await run_tools(
        tok,
        compile_yaml,
        f"  - function: {PARTS}:slow\n            timeout_s: 0.05",
        [tool_turn(tok, ("slow", {"seconds": 30}))],
    )
    assert time.perf_counter() - t0 < 10
    assert tool_messages(traj) == ["Error: tool 'slow' timed out after 0.05s"]
    assert traj.metrics.tool_errors == 1
    assert traj.termination_reason == "done"
    # the model saw the error: it is in the context of the next request
    assert "timed out" in tok.decode(backend.requests[1].prompt_ids)


async def test_tool_retry_succeeds_on_third_attempt(tok, compile_yaml):
    tools = f"""  - class: {PARTS}:FlakyTool
            config: {{fail_times: 2}}
            schema: {parts.FLAKY_SCHEMA}
            retry: {{max_attempts: 3}}"""
    agent, _, (traj,) = await run_tools(tok, compile_yaml, tools, [tool_turn(tok, ("flaky", {}))])
    assert tool_messages(traj) == ["ok after 3 attempts"]
    assert traj.tool_rewards == [1.0]
    assert traj.metrics.tool_errors == 0 and traj.metrics.retries == 2
    flaky = agent.tools.by_name["flaky"].tool
    assert list(flaky.attempts.values()) == [3] and len(flaky.released) == 1


async def test_tool_retries_exhausted(tok, compile_yaml):
    tools = f"""  - class: {PARTS}:FlakyTool
            config: {{fail_times: 5}}
            schema: {parts.FLAKY_SCHEMA}
            retry: {{max_attempts: 3, backoff_s: 0.001}}"""
    agent, _, (traj,) = await run_tools(tok, compile_yaml, tools, [tool_turn(tok, ("flaky", {}))])
    assert tool_messages(traj) == ["Error executing tool 'flaky': flaky failure 3"]
    assert traj.metrics.tool_errors == 1 and traj.metrics.retries == 2
    assert len(agent.tools.by_name["flaky"].tool.released) == 1  # released even though it failed


async def test_tool_raising_becomes_observation(tok, compile_yaml):
    _, _, (traj,) = await run_tools(
        tok, compile_yaml, f"  - function: {PARTS}:boom", [tool_turn(tok, ("boom", {"reason": "kaput"}))]
    )
    assert tool_messages(traj) == ["Error executing tool 'boom': kaput"]
    assert traj.metrics.tool_errors == 1 and traj.termination_reason == "done"


async def test_malformed_call_is_answered_not_dropped(tok, compile_yaml):
    bad = '{"name": "echo", "arguments": {"text": "hi"'  # truncated JSON
    _, backend, (traj,) = await run_tools(tok, compile_yaml, f"  - function: {ECHO}", [tool_turn(tok, bad)])
    (msg,) = tool_messages(traj)
    assert msg.startswith("Error: Invalid JSON in tool call")
    assert traj.metrics.tool_errors == 1
    assert traj.path[:3] == ["PENDING", "GENERATING", "PROCESSING_TOOLS"]
    assert "Invalid JSON in tool call" in tok.decode(backend.requests[1].prompt_ids)
    assert traj.token_check is None


async def test_unterminated_call_is_answered(tok, compile_yaml):
    turn = model_turn(tok, '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}')
    _, _, (traj,) = await run_tools(tok, compile_yaml, f"  - function: {ECHO}", [turn])
    assert tool_messages(traj) == ["Error: unterminated <tool_call>: missing </tool_call>"]


async def test_unknown_tool(tok, compile_yaml):
    _, _, (traj,) = await run_tools(
        tok, compile_yaml, f"  - function: {ECHO}", [tool_turn(tok, ("search", {"q": "x"}))]
    )
    assert tool_messages(traj) == ["Unknown function 'search'. Available tools: ['echo']"]
    assert traj.metrics.tool_errors == 1


async def test_too_many_parallel_calls_error_by_default(tok, compile_yaml):
    calls = [("echo", {"text": t}) for t in ("one", "two", "three")]
    _, _, (traj,) = await run_tools(tok, compile_yaml, f"  - function: {ECHO}", [tool_turn(tok, *calls)])
    msgs = tool_messages(traj)
    assert msgs[0] == "one"
    assert len(msgs) == 3 and all("too many tool calls" in m and "at most 1" in m for m in msgs[1:])
    assert "'echo' was not executed" in msgs[1]
    assert traj.metrics.dropped_calls == 2
    assert traj.token_check is None


async def test_too_many_parallel_calls_drop(tok, compile_yaml):
    calls = [("echo", {"text": t}) for t in ("one", "two", "three")]
    _, _, (traj,) = await run_tools(
        tok, compile_yaml, f"  - function: {ECHO}", [tool_turn(tok, *calls)], limits="  extra_calls: drop"
    )
    assert tool_messages(traj) == ["one"]
    assert traj.metrics.dropped_calls == 2 and traj.metrics.tool_errors == 0


@pytest.mark.parametrize("extra_calls", ["error", "drop"])
async def test_malformed_calls_take_no_parallel_slot(tok, compile_yaml, extra_calls):
    """verl drops malformed calls before taking the first max_parallel_calls: [ok, bad, ok, ok, ok] with
    limit 3 runs three calls; the fourth well-formed one is the extra."""
    bad = '{"name": "echo", "arguments": {"text": "hi"'
    calls = [
        ("echo", {"text": "one"}),
        bad,
        ("echo", {"text": "two"}),
        ("echo", {"text": "three"}),
        ("echo", {"text": "four"}),
    ]
    _, _, (traj,) = await run_tools(
        tok,
        compile_yaml,
        f"  - function: {ECHO}",
        [tool_turn(tok, *calls)],
        limits=f"  max_parallel_calls: 3\n          extra_calls: {extra_calls}",
    )
    msgs = tool_messages(traj)
    assert msgs[0] == "one" and msgs[1].startswith("Error: Invalid JSON") and msgs[2:4] == ["two", "three"]
    if extra_calls == "error":
        assert len(msgs) == 5 and "call to 'echo' was not executed" in msgs[4]
    else:
        assert len(msgs) == 4
    assert traj.metrics.dropped_calls == 1


async def test_parallel_calls_run_concurrently_in_order(tok, compile_yaml):
    tools = f"  - function: {PARTS}:slow"
    calls = [("slow", {"seconds": 0.3})] * 3
    _, _, (traj,) = await run_tools(
        tok, compile_yaml, tools, [tool_turn(tok, *calls)], limits="  max_parallel_calls: 3"
    )
    assert tool_messages(traj) == ["woke up"] * 3
    assert traj.metrics.tool_calls < 0.85  # three 0.3 s calls, concurrently
    assert traj.token_check is None  # consecutive tool messages render as one user turn


@pytest.mark.parametrize("side", ["left", "right", "middle"])
async def test_tool_response_truncation(tok, compile_yaml, side):
    _, _, (traj,) = await run_tools(
        tok,
        compile_yaml,
        f"  - function: {PARTS}:long_text",
        [tool_turn(tok, ("long_text", {"n": 45}))],
        limits=f"  max_tool_response_length: 20\n          tool_response_truncate_side: {side}",
    )
    # long_text(45) is "0123456789" * 4 + "01234"; verl >= 0.8 (#6313): left keeps the tail, right keeps
    # the head, middle keeps both ends
    expected = {
        "left": "(truncated)..." + "56789012345678901234",
        "right": "01234567890123456789" + "...(truncated)",
        "middle": "0123456789" + "...(truncated)..." + "5678901234",
    }[side]
    assert parts.long_text(45) == "0123456789" * 4 + "01234"
    assert tool_messages(traj) == [expected]


async def test_short_tool_response_is_not_truncated(tok, compile_yaml):
    _, _, (traj,) = await run_tools(
        tok,
        compile_yaml,
        f"  - function: {PARTS}:long_text",
        [tool_turn(tok, ("long_text", {"n": 20}))],
        limits="  max_tool_response_length: 20",
    )
    assert tool_messages(traj) == ["01234567890123456789"]


async def test_base_tool_lifecycle(tok, compile_yaml):
    tools = f"""  - class: {PARTS}:RecordingTool
            config: {{reward: 0.5, score: 0.75}}
            schema: {parts.ECHO_SCHEMA}"""
    row = user_row(tools_kwargs={"recorder": {"create_kwargs": {"ground_truth": 42}}})
    turns = [tool_turn(tok, ("recorder", {"text": "a"})), tool_turn(tok, ("recorder", {"text": "b"}))]
    agent, _, (traj,) = await run_tools(tok, compile_yaml, tools, turns, rows=[row])
    tool = agent.tools.by_name["recorder"].tool
    assert tool.methods() == ["create", "execute", "calc_reward", "release"] * 2  # per call, as in verl
    first, second = tool.events[:4], tool.events[4:]
    assert len({e[1] for e in first}) == 1 and len({e[1] for e in second}) == 1
    assert first[0][1] != second[0][1]  # a fresh instance per call
    assert first[0][2] == {"ground_truth": 42}  # create_kwargs from the row's tools_kwargs
    assert first[1][2] == {"text": "a"}
    assert traj.tool_rewards == [0.5, 0.5] and traj.tool_scores == [0.75, 0.75]
    assert tool_messages(traj) == ["recorded a", "recorded b"]
    assert traj.to_output()["extra_fields"]["tool_scores"] == [0.75, 0.75]


async def test_tool_create_raising_is_an_observation(tok, compile_yaml):
    tools = f"""  - class: {PARTS}:BrokenCreateTool
            schema: {parts.ECHO_SCHEMA}"""
    agent, _, (traj,) = await run_tools(
        tok, compile_yaml, tools, [tool_turn(tok, ("recorder", {"text": "a"}))]
    )
    assert traj.termination_reason == "done" and not traj.failed
    assert tool_messages(traj) == ["Error executing tool 'recorder': sandbox unavailable"]
    assert traj.metrics.tool_errors == 1
    assert agent.tools.by_name["recorder"].tool.methods() == ["create"]  # nothing created, nothing released


async def test_tool_empty_instance_id_is_passed_on_and_never_released(tok, compile_yaml):
    tools = f"""  - class: {PARTS}:EmptyIdTool
            schema: {parts.ECHO_SCHEMA}"""
    agent, _, (traj,) = await run_tools(
        tok, compile_yaml, tools, [tool_turn(tok, ("recorder", {"text": "a"}))]
    )
    assert tool_messages(traj) == ["recorded a"]
    events = agent.tools.by_name["recorder"].tool.events
    assert [(m, i) for m, i, _ in events[1:]] == [("execute", ""), ("calc_reward", "")]  # as verl: no release


async def test_tool_calc_reward_raising_keeps_the_observation(tok, compile_yaml):
    tools = f"""  - class: {PARTS}:BrokenRewardTool
            schema: {parts.ECHO_SCHEMA}"""
    agent, _, (traj,) = await run_tools(
        tok, compile_yaml, tools, [tool_turn(tok, ("recorder", {"text": "a"}))]
    )
    assert traj.termination_reason == "done" and not traj.failed
    assert tool_messages(traj) == ["recorded a"]
    assert traj.tool_scores == [] and traj.metrics.tool_errors == 1
    assert agent.tools.by_name["recorder"].tool.methods() == ["create", "execute", "calc_reward", "release"]


async def test_tool_raising_its_own_timeout_without_timeout_s(tok, compile_yaml):
    _, _, (traj,) = await run_tools(
        tok,
        compile_yaml,
        f"  - function: {PARTS}:own_timeout",
        [tool_turn(tok, ("own_timeout", {"url": "http://x"}))],
    )
    assert not traj.failed
    assert tool_messages(traj) == ["Error executing tool 'own_timeout': GET http://x timed out"]
    assert traj.metrics.tool_errors == 1


async def test_tool_selection_limits_the_tools(tok, compile_yaml):
    tools = f"  - function: {ECHO}\n          - function: {PARTS}:add"
    row = user_row(extra_info={"tool_selection": ["echo"]})
    _, backend, (traj,) = await run_tools(
        tok, compile_yaml, tools, [tool_turn(tok, ("add", {"a": 1, "b": 2}))], rows=[row]
    )
    assert traj.tool_schemas == [s for s in traj.tool_schemas if s["function"]["name"] == "echo"]
    assert len(traj.tool_schemas) == 1
    assert tool_messages(traj) == ["Unknown function 'add'. Available tools: ['echo']"]
    assert '"add"' not in tok.decode(backend.requests[0].prompt_ids)


# --- failures stay in their row ---------------------------------------------------------------------------


async def test_failures_are_per_row(tok, compile_yaml):
    agent = compile_yaml(tool_spec(f"  - function: {ECHO}").replace("1024", "300"))
    rows = [
        user_row("fine"),
        {"extra_info": {"no": "raw_prompt"}},
        user_row("word " * 400),  # longer than prompt_length 300
        user_row("the backend dies on this one"),
        user_row("fine too"),
    ]

    def script(row, sample, turn, prompt_ids):
        if row == 3:
            raise BackendUnavailable("connection refused")
        return model_turn(tok, "ok")

    trajs = await run_agent(agent, scripted(script), tok, rows)
    ok0, missing, too_long, dead, ok4 = trajs
    for traj in (ok0, ok4):
        assert traj.termination_reason == "done" and not traj.failed and traj.token_check is None
    assert_failed_row(missing, "raw_prompt")
    assert_failed_row(too_long, "prompt_too_long")
    assert_failed_row(dead, "backend")
    assert "connection refused" in dead.termination_reason
    assert missing.prompt_ids.tolist() == [] and too_long.prompt_ids.tolist() == []

    batch = fsm.collate(trajs, prompt_length=300, response_length=512, pad_token_id=0)
    assert len(batch) == 5
    for i in (1, 2, 3):
        assert batch.batch["response_mask"][i].sum() == 0
        assert batch.batch["attention_mask"][i, 300:].sum() == 0
    for i in (0, 4):
        n = len(trajs[i].response_ids)
        assert batch.batch["responses"][i, :n].tolist() == trajs[i].response_ids.tolist()
    assert list(batch.non_tensor_batch["termination_reason"][[0, 4]]) == ["done", "done"]
    assert fsm.summarize(trajs)["failed"] == 3


async def test_prompt_truncate_left(tok, compile_yaml):
    agent = compile_yaml("""
        name: truncating
        extends: {specs}/single_turn.yaml
        limits: {prompt_length: 40, prompt_overflow: truncate_left}
    """)
    row = user_row("word " * 100)
    (traj,) = await run_agent(agent, scripted([model_turn(tok, "ok")]), tok, [row], check_tokens=False)
    full = tok.apply_chat_template(
        row["raw_prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert traj.termination_reason == "done"
    assert traj.prompt_ids.tolist() == full[-40:]
    assert traj.extra["prompt_truncated"] is True


async def test_user_action_raising_fails_only_its_row(tok, compile_yaml):
    agent = compile_yaml(f"""
        name: checked
        extends: {{specs}}/single_turn.yaml
        states:
          PENDING:
            action: encode_prompt
            next:
              - to: CHECKING
          CHECKING:
            action: {PARTS}:explode_if_asked
            next:
              - to: GENERATING
    """)
    rows = [user_row("a"), user_row("b", extra_info={"explode": True}), user_row("c")]
    trajs = await run_agent(agent, scripted([model_turn(tok, "ok")]), tok, rows)
    assert [t.termination_reason for t in trajs][::2] == ["done", "done"]
    assert_failed_row(trajs[1], "exploded on purpose")
    assert "RuntimeError" in trajs[1].termination_reason and "CHECKING" in trajs[1].termination_reason
    assert trajs[1].path == ["PENDING", "CHECKING"]


async def test_action_timeout_fails_the_row(tok, compile_yaml):
    agent = compile_yaml(tool_spec(f"  - function: {PARTS}:slow", "  action_timeout_s: 0.1"))
    (traj,) = await run_agent(agent, scripted([tool_turn(tok, ("slow", {"seconds": 30}))]), tok, [user_row()])
    assert_failed_row(traj, "timeout")


async def test_script_running_out_is_a_backend_failure(tok):
    agent = fsm.compile_spec(SPECS / "single_turn.yaml")
    (traj,) = await run_agent(agent, scripted([]), tok, [user_row()])
    assert_failed_row(traj, "backend")


async def test_failed_rows_score_zero_and_rm_scores(tok, compile_yaml):
    agent = compile_yaml(f"""
        name: scored
        extends: {{specs}}/single_turn.yaml
        reward: {{function: "{PARTS}:reward_len"}}
    """)
    rows = [user_row(reward_model={"ground_truth": "42"}), {"no": "prompt"}]
    trajs = await run_agent(agent, scripted([model_turn(tok, "it is 42")]), tok, rows)
    assert [t.reward_score for t in trajs] == [1.0, 0.0]
    batch = fsm.collate(trajs, prompt_length=1024, response_length=1024, pad_token_id=0)
    rm = batch.batch["rm_scores"]
    n = len(trajs[0].response_ids)
    assert rm[0, n - 1] == 1.0 and rm[0].sum() == 1.0 and rm[1].sum() == 0.0


def test_empty_response_score_sits_in_the_last_column():
    """verl writes rm_scores at attention_mask[:, P:].sum(1) - 1: -1, the last column, for an empty response.
    The score still counts where a trainer sums a row's scores (GRPO), as in verl."""
    rows = []
    for ids, score in (([5, 6, 7], 1.0), ([], -1.0)):
        traj = Trajectory(len(rows), 0, "s", "u", {"raw_prompt": []}, "PENDING")
        traj.prompt_ids.extend([1, 2])
        traj.append_generated(ids, [-0.5] * len(ids))
        traj.reward_score = score
        rows.append(traj)
    rm = fsm.collate(rows, prompt_length=4, response_length=6, pad_token_id=0).batch["rm_scores"]
    assert rm.tolist() == [[0, 0, 1.0, 0, 0, 0], [0, 0, 0, 0, 0, -1.0]]


# --- GRPO groups ------------------------------------------------------------------------------------------


async def test_grpo_samples_are_contiguous_groups(tok):
    agent = fsm.compile_spec(SPECS / "single_turn.yaml")
    rows = [user_row(f"question {i}") for i in range(3)] + [user_row("given uid", uid="my-uid")]
    backend = scripted(lambda row, sample, turn, prompt: model_turn(tok, f"row {row} sample {sample}"))
    trajs = await run_agent(agent, backend, tok, rows, n=4)
    assert len(trajs) == 16
    for i in range(4):
        group = trajs[4 * i : 4 * i + 4]
        assert len({t.uid for t in group}) == 1
        assert [t.sample for t in group] == [0, 1, 2, 3]
        assert len({t.session_id for t in group}) == 4
        assert len({tuple(t.prompt_ids) for t in group}) == 1
        assert [response_text(tok, t, skip_special_tokens=True) for t in group] == [
            f"row {i} sample {k}" for k in range(4)
        ]
    assert len({t.uid for t in trajs}) == 4 and trajs[-1].uid == "my-uid"
    assert [t.index for t in trajs] == list(range(16))
    assert {r.group_id for r in backend.requests} == {t.uid for t in trajs}
    batch = fsm.collate(trajs, prompt_length=1024, response_length=1024, pad_token_id=0)
    assert list(batch.non_tensor_batch["uid"]) == [t.uid for t in trajs]


async def test_reused_uid_does_not_share_a_different_prompt(tok):
    """Samples of a group share one prompt encoding, but a uid reused by different rows must not."""
    agent = fsm.compile_spec(SPECS / "single_turn.yaml")
    rows = [user_row("first question", uid="same"), user_row("another question", uid="same")]
    first, second = (await run_agent(agent, scripted([model_turn(tok, "ok")]), tok, rows, n=2))[::2]
    assert tok.decode(first.prompt_ids.tolist()).count("first question") == 1
    assert tok.decode(second.prompt_ids.tolist()).count("another question") == 1
    assert first.token_check is None and second.token_check is None


@pytest.mark.parametrize("n", [1, 3])
async def test_prompt_cache_encodes_a_group_once_and_keeps_nothing(tok, n):
    """A group's samples share one encoding, held only until the group's last sample has it; with one sample
    per row nothing is held at all (10,000 prompts in flight would otherwise all stay in memory)."""
    from fsm.run.actions import encode_prompt

    agent = fsm.compile_spec(SPECS / "single_turn.yaml")
    runner = fsm.Runner(agent, scripted([model_turn(tok, "ok")]), tok)
    ctx = runner.make_context()
    ctx.group_size = n
    encoded = []
    encode = ctx.codec.encode_prompt
    ctx.codec.encode_prompt = lambda *args: encoded.append(1) or encode(*args)
    trajs = runner.trajectories([user_row("first"), user_row("second")], n)
    for traj in trajs:
        await encode_prompt(ctx, traj)
        assert len(ctx.prompt_cache) <= 1
    assert len(encoded) == 2 and ctx.prompt_cache == {}
    assert [t.prompt_ids for t in trajs[:n]] == [trajs[0].prompt_ids] * n != [trajs[-1].prompt_ids] * n


# --- the machine without a backend ------------------------------------------------------------------------


def test_advance_answers_without_a_backend():
    agent = fsm.compile_spec(SPECS / "tool_agent.yaml")
    traj = Trajectory(0, 0, "s", "u", {}, agent.initial)
    assert agent.advance(traj, "PENDING").dest == "GENERATING"
    assert agent.advance(traj, "GENERATING").reason == "done"
    traj.pending_calls = [fsm.ToolCall("echo", {}, "{}")]
    edge = agent.advance(traj, "GENERATING")
    assert (edge.dest, edge.label) == ("PROCESSING_TOOLS", "has_tool_calls")
    traj.interaction_kwargs = {}
    traj.pending_calls = []
    assert agent.advance(traj, "GENERATING").dest == "INTERACTING"
    traj.response_mask.extend(b"\x01" * agent.limits.response_length)
    assert agent.advance(traj, "GENERATING").reason == "response_length"
    traj.should_terminate = True
    assert agent.advance(traj, "INTERACTING").reason == "interaction_done"
    # a pure query: nothing changed
    assert traj.state == "PENDING" and traj.transitions_fired == [] and traj.path == ["PENDING"]


def test_advance_with_turn_limits():
    agent = fsm.compile_spec(SPECS / "calculator.yaml")  # max_assistant_turns: 3, no user-turn limit
    traj = Trajectory(0, 0, "s", "u", {}, agent.initial)
    traj.assistant_turns = 2
    assert agent.advance(traj, "GENERATING").reason == "done"
    traj.assistant_turns = 3
    assert agent.advance(traj, "GENERATING").reason == "max_assistant_turns"
    traj.assistant_turns, traj.user_turns = 0, 100  # unset max_user_turns never stops (verl)
    assert agent.advance(traj, "GENERATING").reason == "done"


# --- custom states, actions and guards --------------------------------------------------------------------

SUMMARIZING_SPEC = """
    name: summarizer
    imports: [{parts}]
    limits: {{prompt_length: 1024, response_length: 1024}}
    states:
      PENDING:
        action: encode_prompt
        next:
          - to: GENERATING
      GENERATING:
        action: generate
        next:
          - to: TERMINATED
            when: {guard}
            reason: stopped
          - to: TERMINATED
            when: {{max_assistant_turns: 3}}
            reason: max_assistant_turns
          - to: SUMMARIZING
      SUMMARIZING:
        action: {action}
        next:
          - to: TERMINATED
            when: response_budget_exhausted
            reason: response_length
          - to: GENERATING
      TERMINATED:
        final: true
"""


@pytest.mark.parametrize("action", ["summarize", f"{PARTS}:summarize"])
async def test_custom_state_with_custom_action(tok, compile_yaml, action):
    agent = compile_yaml(SUMMARIZING_SPEC.format(parts=PARTS, guard="said_stop", action=action))
    backend = scripted([model_turn(tok, "Thinking."), model_turn(tok, "Summary: thinking. STOP")])
    (traj,) = await run_agent(agent, backend, tok, [user_row()])
    assert traj.path == ["PENDING", "GENERATING", "SUMMARIZING", "GENERATING", "TERMINATED"]
    assert traj.termination_reason == "stopped"
    assert traj.extra["summarize_calls"] == 1
    assert [m["content"] for m in traj.messages if m["role"] == "user"][-1] == parts.SUMMARY_REQUEST
    assert [s.role for s in traj.runs] == ["assistant", "template", "user", "assistant"]
    assert traj.token_check is None


@pytest.mark.parametrize(
    "guard",
    [
        "said_stop",
        f"{PARTS}:said_stop",
        f'{{"{PARTS}:contains": STOP}}',
        f"{{any: [has_tool_calls, {PARTS}:said_stop]}}",
    ],
    ids=["registered", "import-path", "import-path-with-param", "inside-any"],
)
async def test_user_guards(tok, compile_yaml, guard):
    agent = compile_yaml(SUMMARIZING_SPEC.format(parts=PARTS, guard=guard, action="summarize"))
    turns = [model_turn(tok, "go on"), model_turn(tok, "STOP here"), model_turn(tok, "never")]
    (traj,) = await run_agent(agent, scripted(turns), tok, [user_row()])
    assert traj.termination_reason == "stopped" and traj.assistant_turns == 2
    (never,) = await run_agent(agent, scripted([model_turn(tok, "go on")] * 3), tok, [user_row()])
    assert never.termination_reason == "max_assistant_turns"


async def test_custom_action_overflow_ends_through_budget_guard(tok, compile_yaml):
    """A user action's observation that does not fit ends the trajectory through the budget guard."""
    text = SUMMARIZING_SPEC.format(parts=PARTS, guard="said_stop", action="summarize")
    agent = compile_yaml(text.replace("response_length: 1024", "response_length: 30"))
    (traj,) = await run_agent(agent, scripted([model_turn(tok, "go on and on")] * 3), tok, [user_row()])
    assert traj.termination_reason == "response_length"
    assert traj.path == ["PENDING", "GENERATING", "SUMMARIZING", "TERMINATED"]


# --- extends ----------------------------------------------------------------------------------------------


def test_extends_overrides(compile_yaml):
    agent = compile_yaml(f"""
        name: child
        extends: {{specs}}/calculator.yaml
        limits:
          response_length: 200
        sampling:
          top_p: 0.9
        tools:
          - function: {ECHO}
        states:
          PROCESSING_TOOLS:
            action: call_tools
            next:
              - to: GENERATING
    """)
    spec = agent.spec
    assert agent.name == "child"
    assert spec.limits.response_length == 200  # child
    assert spec.limits.prompt_length == 320 and spec.limits.max_assistant_turns == 3  # calculator
    assert (
        spec.limits.max_parallel_calls == 1 and spec.limits.tool_response_truncate_side == "middle"
    )  # tool_agent
    assert spec.sampling.top_p == 0.9 and spec.sampling.temperature == 1.0
    assert list(agent.tools.by_name) == ["echo"]  # lists replace
    assert spec.reward.function == "specs.calculator:compute_score"
    assert [t.to for t in spec.states["PROCESSING_TOOLS"].next] == [
        "GENERATING"
    ]  # the state's edges replaced
    assert [t.to for t in spec.states["GENERATING"].next][:1] == ["TERMINATED"]  # other states inherited
    assert set(spec.states) == {"PENDING", "GENERATING", "PROCESSING_TOOLS", "INTERACTING", "TERMINATED"}


def test_calculator_extends_tool_agent():
    tool_agent = fsm.compile_spec(SPECS / "tool_agent.yaml")
    calc = fsm.compile_spec(SPECS / "calculator.yaml")
    assert calc.name == "calculator" and tool_agent.name == "tool_agent"
    assert calc.spec.states == tool_agent.spec.states
    assert list(calc.tools.by_name) == ["calculator"] and not tool_agent.tools.by_name
    assert calc.hash != tool_agent.hash


# --- token check ------------------------------------------------------------------------------------------


async def test_token_check_passes_for_normal_runs(tok):
    agent = fsm.compile_spec(SPECS / "calculator.yaml")
    turns = [
        tool_turn(tok, ("calculator", {"expression": "2*3"}), prefix="Let me compute."),
        model_turn(tok, "#### 6"),
    ]
    trajs = await run_agent(agent, scripted(turns), tok, [calculator_row("2*3", "6")], n=2)
    assert [t.token_check for t in trajs] == [None, None]
    assert fsm.summarize(trajs)["token_check_failures"] == 0


async def test_token_check_reports_a_non_canonical_tokenization(tok):
    """The model emitted "hello world" one character per token: a re-render would merge them."""
    agent = fsm.compile_spec(SPECS / "single_turn.yaml")
    chars = [i for c in "hello world" for i in tok.encode(c, add_special_tokens=False)] + [tok.eos_token_id]
    assert chars != model_turn(tok, "hello world")
    (traj,) = await run_agent(agent, scripted([chars]), tok, [user_row()])
    assert traj.token_check is not None and traj.token_check.startswith("token ")
    assert traj.termination_reason == "done"  # the check reports; it does not fail the row
    assert fsm.summarize([traj])["token_check_failures"] == 1


async def test_token_check_detects_a_corrupted_trajectory(tok, compile_yaml):
    agent = compile_yaml(tool_spec(f"  - function: {ECHO}"))
    turns = [tool_turn(tok, ("echo", {"text": "hello"})), model_turn(tok, "bye")]
    runner = fsm.Runner(agent, scripted(turns), tok, check_tokens=True)
    (traj,) = await runner.run([user_row()])
    assert traj.token_check is None
    tool_seg = next(s for s in traj.runs if s.role == "tool")
    ids = traj.context_ids()
    k = len(traj.prompt_ids) + tool_seg.start + 3
    assert runner.codec.check(traj.messages, traj.tool_schemas, ids, False) is None
    corrupted = ids[:k] + [ids[k] + 1] + ids[k + 1 :]
    problem = runner.codec.check(traj.messages, traj.tool_schemas, corrupted, False)
    assert problem is not None and problem.startswith(f"token {k}:")
    # a message that does not match its tokens is caught too
    messages = [dict(m) for m in traj.messages]
    next(m for m in messages if m["role"] == "tool")["content"] = "HELLO"
    assert runner.codec.check(messages, traj.tool_schemas, ids, False) is not None
    # and a missing token (e.g. the newline after <|im_end|>)
    closer = next(s for s in traj.runs if s.role == "template")
    dropped = ids[: len(traj.prompt_ids) + closer.start] + ids[len(traj.prompt_ids) + closer.end :]
    assert runner.codec.check(traj.messages, traj.tool_schemas, dropped, False) is not None


# --- sampling parameters ----------------------------------------------------------------------------------


async def test_sampling_train_and_validate(tok):
    agent = fsm.compile_spec(SPECS / "single_turn.yaml")
    backend = scripted([model_turn(tok, "ok")])
    await run_agent(agent, backend, tok, [user_row()])
    await run_agent(agent, backend, tok, [user_row()], validate=True)
    train, val = (r.sampling_params for r in backend.requests)
    assert train["temperature"] == 1.0 and val["temperature"] == 0.0  # val_sampling (verl val_kwargs)
    for params in (train, val):
        assert tok.eos_token_id in params["stop_token_ids"]
        assert "logprobs" not in params and "seed" not in params


async def test_sampling_overrides_and_seed(tok, compile_yaml):
    agent = compile_yaml("""
        name: seeded
        extends: {specs}/single_turn.yaml
        sampling: {temperature: 0.7, top_k: 20, seed: 100, stop_token_ids: [5]}
    """)
    backend = scripted([model_turn(tok, "ok")])
    trajs = await run_agent(
        agent,
        backend,
        tok,
        [user_row(), user_row()],
        n=2,
        sampling_params={"top_p": 0.5, "stop_token_ids": [7]},
    )
    by_session = {r.session_id: r.sampling_params for r in backend.requests}
    for traj in trajs:
        params = by_session[traj.session_id]
        assert params["temperature"] == 0.7 and params["top_k"] == 20 and params["top_p"] == 0.5
        assert params["sampling_seed"] == 100 + traj.index * 1000 + traj.sample
        assert set(params["stop_token_ids"]) == {tok.eos_token_id, 5, 7}
    assert len({p["sampling_seed"] for p in by_session.values()}) == 4


async def test_unknown_sampling_key_raises(tok):
    agent = fsm.compile_spec(SPECS / "single_turn.yaml")
    runner = fsm.Runner(agent, scripted([model_turn(tok, "ok")]), tok)
    with pytest.raises(ValueError, match="max_tokens"):
        await runner.run([user_row()], sampling_params={"max_tokens": 10})


async def test_logprobs_off(tok):
    agent = fsm.compile_spec(SPECS / "single_turn.yaml")
    backend = scripted([model_turn(tok, "ok")])
    (traj,) = await run_agent(agent, backend, tok, [user_row()], sampling_params={"logprobs": False})
    assert backend.requests[0].return_logprob is False
    assert set(traj.response_logprobs) == {0.0} and set(traj.response_mask) == {1}


# --- budgets ----------------------------------------------------------------------------------------------


async def test_max_new_tokens_is_clamped_to_the_remaining_budget(tok, compile_yaml):
    agent = compile_yaml(tool_spec(f"  - function: {ECHO}", "  max_new_tokens: 60").replace("512", "80"))
    first = tool_turn(tok, ("echo", {"text": "hi"}))
    backend = scripted([first, model_turn(tok, "x " * 200)])
    (traj,) = await run_agent(agent, backend, tok, [user_row()])
    r0, r1 = (r.sampling_params["max_new_tokens"] for r in backend.requests)
    after_tools = traj.runs[-1].start  # response length when the second turn was requested
    assert r0 == 60  # the per-turn cap
    assert 0 < 80 - after_tools < 60 and r1 == 80 - after_tools  # the remaining budget
    assert len(traj.response_ids) == 80 and traj.termination_reason == "response_length"


async def test_default_max_new_tokens_is_the_remaining_budget(tok, compile_yaml):
    agent = compile_yaml(tool_spec(f"  - function: {ECHO}"))
    backend = scripted([tool_turn(tok, ("echo", {"text": "hi"})), model_turn(tok, "ok")])
    (traj,) = await run_agent(agent, backend, tok, [user_row()])
    assert [r.sampling_params["max_new_tokens"] for r in backend.requests] == [
        512,
        512 - traj.runs[-1].start,
    ]


async def test_call_site_max_new_tokens_overrides_the_spec_cap(tok, compile_yaml):
    agent = compile_yaml(tool_spec(f"  - function: {ECHO}", "  max_new_tokens: 60").replace("512", "80"))
    backend = scripted([model_turn(tok, "x " * 100)])
    (traj,) = await run_agent(agent, backend, tok, [user_row()], sampling_params={"max_new_tokens": 7})
    assert backend.requests[0].sampling_params["max_new_tokens"] == 7
    assert len(traj.response_ids) == 7 and traj.last_finish_reason == "length"
    assert traj.termination_reason == "done"  # a per-turn cap is not the trajectory's budget
    backend = scripted([model_turn(tok, "x " * 100)])
    (traj,) = await run_agent(agent, backend, tok, [user_row()], sampling_params={"max_new_tokens": 500})
    assert backend.requests[0].sampling_params["max_new_tokens"] == 80  # still clamped to the budget


# --- request ids ------------------------------------------------------------------------------------------


async def test_rids_are_per_turn_and_never_prefixes(tok, compile_yaml):
    agent = compile_yaml(tool_spec(f"  - function: {ECHO}"))
    backend = scripted([tool_turn(tok, ("echo", {"text": "x"}))] * 11 + [model_turn(tok, "ok")])
    trajs = await run_agent(agent, backend, tok, [user_row()] * 12, n=2, check_tokens=False)
    assert all(t.termination_reason == "done" and t.assistant_turns == 12 for t in trajs)
    rids = [r.rid for r in backend.requests]
    assert len(rids) == len(set(rids)) == 24 * 12
    for r in backend.requests:
        assert r.rid.rsplit("_t", 1)[0] == r.session_id
    for t in trajs:
        mine = [r.rid for r in backend.requests if r.session_id == t.session_id]
        assert mine == [f"{t.session_id}_t{k:02d}" for k in range(12)]
    ordered = sorted(rids)
    assert not any(b.startswith(a) for a, b in zip(ordered, ordered[1:]))  # a prefix sorts right before


# --- output -----------------------------------------------------------------------------------------------


async def test_to_output_is_agent_loop_output_shaped(tok):
    agent = fsm.compile_spec(SPECS / "calculator.yaml")
    turns = [tool_turn(tok, ("calculator", {"expression": "1 + 2"})), model_turn(tok, "#### 3")]
    (traj,) = await run_agent(agent, scripted(turns), tok, [calculator_row()])
    out = traj.to_output()
    assert {
        "prompt_ids",
        "response_ids",
        "response_mask",
        "response_logprobs",
        "reward_score",
        "num_turns",
        "metrics",
        "extra_fields",
    } <= set(out)
    assert out["response_ids"] == traj.response_ids.tolist() and out["num_turns"] == 4
    assert {"turn_scores", "tool_rewards"} <= set(out["extra_fields"])
    assert set(out["metrics"]) >= {"generate_sequences", "tool_calls", "compute_score", "num_preempted"}
    assert out["extra_fields"]["termination_reason"] == "done"
    assert_consistent(traj)


async def test_on_done_and_bounded_concurrency(tok):
    agent = fsm.compile_spec(SPECS / "single_turn.yaml")

    class Counting(type(scripted([]))):
        in_flight = peak = 0

        async def generate(self, request):
            Counting.in_flight += 1
            Counting.peak = max(Counting.peak, Counting.in_flight)
            try:
                return await super().generate(request)
            finally:
                Counting.in_flight -= 1

    backend = Counting(lambda session, turn, prompt: model_turn(tok, "ok"), latency_s=0.02)
    done: list[int] = []
    runner = fsm.Runner(agent, backend, tok, max_concurrency=3)
    trajs = await runner.run([user_row()] * 10, on_done=lambda t: done.append(t.index))
    assert sorted(done) == list(range(10)) and all(t.termination_reason == "done" for t in trajs)
    assert Counting.peak == 3
