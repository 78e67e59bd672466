"""Parity with verl 0.9.1's own ToolAgentLoop on hand-picked scripts, through fsm.adapters.verl running
specs/tool_agent.yaml (the harness: tests/verl/harness.py; tools, adapter options and generated scripts:
tests/verl/).

For each script the fields verl trains on must be identical: prompt_ids, response_ids, response_mask,
response_logprobs and num_turns (and the server-provided extra_fields, tool_rewards and turn_scores). Where
verl has a bug agentfsm deliberately does not copy (each one documented in specs/tool_agent.yaml), the test
asserts the exact difference instead:

  - malformed calls: verl's hermes parser logs and drops a call whose JSON does not parse, or that has no
    "name" or "arguments" (KeyError), and the loop ends as if the model had answered. agentfsm answers it
    with an error observation and the model goes on.
  - parallel_calls: verl silently drops calls beyond max_parallel_calls; agentfsm answers each with an error
    observation (`limits.extra_calls: error`, the default; `drop` restores verl's behaviour, also tested).
  - cut_turn_then_tool: after a turn that stopped without eos (a per-turn cap), verl appends the tool turn
    right after the cut text; agentfsm first appends the template's `<|im_end|>\\n` (mask 0) so the tokens
    match a re-render of the conversation.
  - calc_reward: verl never calls BaseTool.calc_reward; agentfsm calls it after each successful execute and
    reports the values as extra_fields["tool_scores"].
  - requests: agentfsm sends an explicit per-turn max_new_tokens (the budget left) and eos in
    stop_token_ids; verl leaves both to the server. The prompts sent each turn are identical.
  - logprobs: agentfsm keeps them as float32 (4 bytes a token). Engines compute float32 logprobs, so the
    values are unchanged (the fake server returns float32 values too), and verl's batch is float32 anyway.

Run it with verl installed: `bash .ci/verl_env.sh && .venv-verl/bin/python -m pytest tests/test_verl_parity.py
tests/verl`. Without verl every test but the import check is skipped.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.verl.harness import (
    ANSWER,
    PROMPT_LENGTH,
    REPO,
    RESPONSE_LENGTH,
    Case,
    ReplayServer,
    assert_identical,
    assert_same_requests,
    call,
    entry_file,
    fsm_entry,
    generated,
    instantiate,
    load_tools,
    model_dir,
    needs_verl,
    observations,
    run_both,
    tool_dir,
    trainer_config,
)


def test_importing_fsm_never_imports_verl():
    code = "import sys, fsm; bad = sorted(m for m in sys.modules if m == 'verl' or m.startswith(('verl.', 'fsm.verl'))); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --- the scripts -----------------------------------------------------------------------------------------


def _obs_overflow_budget(tok) -> int:
    """A response budget that holds the first call but not the tool turn that answers it."""
    return len(tok.encode(call("37 * 12 + 5"), add_special_tokens=False)) + 1 + 6


def _cut_mid_call_budget(tok) -> int:
    """A budget that holds call 1 and its tool turn (~20 tokens) but ends inside the second call."""
    return len(tok.encode(call("37 * 12"), add_special_tokens=False)) + 1 + 40


LONG_CALL = call("1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 + 9 + 10 + 11 + 12 + 13 + 14 + 15 + 16 + 17")

IDENTICAL = [
    Case("tool_then_answer", [call("37 * 12 + 5"), ANSWER]),
    Case("function_tool", [call("37 * 12 + 5"), ANSWER], tools="function"),
    Case("two_tool_rounds", [call("37 * 12"), call("444 + 5"), ANSWER]),
    Case("unknown_tool", [call("37 * 12 + 5", name="calc"), call("37 * 12 + 5"), ANSWER]),
    Case("tool_raises", [call("1 / 0"), ANSWER]),
    Case(
        "budget_cut_before_tool_turn",
        [call("37 * 12 + 5"), ANSWER],
        response_length=_obs_overflow_budget,
        reason="response_length",
    ),
    Case(
        "budget_cut_mid_call",
        [call("37 * 12"), LONG_CALL, ANSWER],
        response_length=_cut_mid_call_budget,
        reason="response_length",
    ),
    Case(
        "max_assistant_turns",
        [call("1 + 1"), call("2 + 2"), call("3 + 3"), ANSWER],
        multi_turn={"max_assistant_turns": 2},
        limits={"max_assistant_turns": 2},
        reason="max_assistant_turns",
    ),
    Case(
        "max_user_turns",
        [call("1 + 1"), call("2 + 2"), call("3 + 3"), ANSWER],
        multi_turn={"max_user_turns": 1},
        limits={"max_user_turns": 1},
        reason="max_user_turns",
    ),
    Case(
        "parallel_calls_dropped",
        [call("37 * 12") + "\n" + call("444 + 5"), ANSWER],
        limits={"extra_calls": "drop"},
    ),
    Case(
        "truncated_tool_output",
        [call("7 ** 400"), ANSWER],
        multi_turn={"max_tool_response_length": 40, "tool_response_truncate_side": "left"},
        limits={"max_tool_response_length": 40, "tool_response_truncate_side": "left"},
    ),
]


@needs_verl
@pytest.mark.parametrize("case", IDENTICAL, ids=[c.name for c in IDENTICAL])
async def test_identical_to_verl_tool_agent_loop(case: Case, tok, tmp_path):
    pair = await run_both(case, tok, tmp_path)
    assert_identical(pair)
    assert pair.verl.response_logprobs is not None and len(pair.verl.response_logprobs) == len(
        pair.verl.response_ids
    )
    assert pair.fsm.reward_score is None  # the spec has no reward
    assert pair.fsm.extra_fields["termination_reason"] == case.reason  # verl records none
    assert_same_requests(pair, tok.eos_token_id)
    assert len(pair.fsm.response_ids) <= pair.R
    if case.reason == "response_length":
        R, ids = pair.R, pair.verl.response_ids
        if case.name == "budget_cut_mid_call":  # the cut lands inside the second call: it never runs
            assert len(ids) == R and pair.verl.response_mask[-1] == 1 and len(pair.verl_server.requests) == 2
        else:  # the tool turn did not fit, so neither loop appended it
            assert pair.verl.response_mask[-1] == 1 and pair.verl.num_turns == 2
    if case.tools == "base":
        verl_calls, fsm_calls = pair.verl_tools[0].calls, pair.fsm_tools[0].calls
        for step in ("create", "execute", "release"):  # verl's per-call lifecycle, on both sides
            assert fsm_calls[step] == verl_calls[step], step
        # Documented difference: verl never calls calc_reward; agentfsm calls it after each successful execute.
        assert verl_calls["calc_reward"] == 0
        executed_ok = len(pair.fsm.extra_fields["tool_scores"])
        assert (
            fsm_calls["calc_reward"] == executed_ok
            and pair.fsm.extra_fields["tool_scores"] == [1.0] * executed_ok
        )


@needs_verl
@pytest.mark.parametrize(
    "bad",
    [
        '{"name": "calculator", "arguments": {"expression": "37 *}',
        '{"name": "calculator", "expression": "37 * 12 + 5"}',
        '{"arguments": {"expression": "37 * 12 + 5"}}',
    ],
    ids=["malformed_json", "missing_arguments", "missing_name"],
)
async def test_malformed_call_is_answered_not_dropped(bad: str, tok, tmp_path):
    """verl drops the call and ends the trajectory as if the model had answered; agentfsm tells the model."""
    case = Case("malformed", ["<tool_call>\n" + bad + "\n</tool_call>", ANSWER])
    pair = await run_both(case, tok, tmp_path)
    first = tok.encode(case.turns[0], add_special_tokens=False) + [tok.eos_token_id]
    # verl: one turn, ended; no tool ran, no observation.
    assert (
        pair.verl.response_ids == first and pair.verl.num_turns == 2 and len(pair.verl_server.requests) == 1
    )
    # agentfsm: the same first turn, then an error observation (mask 0), then the model's next turn.
    assert pair.fsm.prompt_ids == pair.verl.prompt_ids
    assert pair.fsm.response_ids[: len(first)] == pair.verl.response_ids
    assert pair.fsm.response_logprobs[: len(first)] == pair.verl.response_logprobs
    assert generated(pair.fsm) == [first, tok.encode(ANSWER, add_special_tokens=False) + [tok.eos_token_id]]
    (obs,) = observations(tok, pair.fsm)
    expected = (
        "Invalid JSON in tool call"
        if "37 *}" in bad
        else 'a JSON object with a string "name" and "arguments"'
    )
    assert obs.startswith("\n<|im_start|>user\n<tool_response>\nError") and expected in obs
    assert pair.fsm.num_turns == 4 and pair.fsm.extra_fields["termination_reason"] == "done"
    assert pair.fsm_tools[0].calls["execute"] == 0  # a malformed call never reaches the tool


@needs_verl
async def test_extra_parallel_calls_are_answered_not_dropped(tok, tmp_path):
    """max_parallel_calls=1 and two calls in a turn: verl runs the first and silently drops the second."""
    case = Case("parallel_calls", [call("37 * 12") + "\n" + call("444 + 5"), ANSWER])
    pair = await run_both(case, tok, tmp_path)
    assert pair.fsm.prompt_ids == pair.verl.prompt_ids and pair.fsm.num_turns == pair.verl.num_turns == 4
    # The model's tokens agree; only the observation differs.
    assert generated(pair.fsm) == generated(pair.verl)
    (verl_obs,) = observations(tok, pair.verl)
    (fsm_obs,) = observations(tok, pair.fsm)
    assert "<tool_response>\n444\n</tool_response>" in verl_obs and "449" not in verl_obs
    first_result = verl_obs.split("<|im_end|>\n<|im_start|>assistant")[0]
    assert fsm_obs.startswith(first_result)  # the first call's result, as in verl, then the second's answer:
    assert (
        "Error: too many tool calls in one turn; at most 1 run per turn, so the call to 'calculator' "
        "was not executed." in fsm_obs
    )
    assert pair.verl_tools[0].calls["execute"] == pair.fsm_tools[0].calls["execute"] == 1


@needs_verl
async def test_turn_cut_before_a_tool_round_gets_its_closer(tok, tmp_path):
    """A turn that stops without eos (here at a per-turn max_tokens, after a complete call), then a tool round:
    verl appends the tool turn straight after the cut text; agentfsm first appends `<|im_end|>\\n` (mask 0),
    the tokens a re-render of the conversation has there."""
    first = call("37 * 12 + 5")
    cap = len(tok.encode(first, add_special_tokens=False)) + 3
    case = Case(
        "cut_turn_then_tool",
        [first + " and then some more words that get cut", ANSWER],
        sampling={"max_tokens": cap},
    )
    pair = await run_both(case, tok, tmp_path)
    closer = [tok.eos_token_id] + tok.encode("\n", add_special_tokens=False)
    n = cap  # the cut first turn, identical on both sides
    assert (
        pair.fsm.response_ids[:n] == pair.verl.response_ids[:n]
        and pair.verl.response_ids[n - 1] != tok.eos_token_id
    )
    assert pair.fsm.response_ids[n : n + 2] == closer and pair.fsm.response_mask[n : n + 2] == [0, 0]
    assert pair.fsm.response_logprobs[n : n + 2] == [0.0, 0.0]
    # Everything after the inserted closer is verl's trajectory shifted by two tokens.
    for name in ("response_ids", "response_mask", "response_logprobs"):
        ours, theirs = getattr(pair.fsm, name), getattr(pair.verl, name)
        assert ours[:n] + ours[n + 2 :] == theirs, name
    assert pair.fsm.num_turns == pair.verl.num_turns == 4
    # The model saw the closer too: agentfsm's second request is verl's plus the two template tokens.
    verl_second, fsm_second = (
        pair.verl_server.requests[1]["prompt_ids"],
        pair.fsm_server.requests[1]["prompt_ids"],
    )
    k = len(pair.verl.prompt_ids) + n
    assert fsm_second[:k] + fsm_second[k + 2 :] == verl_second and fsm_second[k : k + 2] == closer


class RoutingServer:
    """One server manager for a whole worker batch: each trajectory (request_id) replays the script of the
    question in its prompt."""

    def __init__(self, tok, scripts: dict[str, list[str]], *, response_length: int):
        self.tok, self.R = tok, response_length
        self.scripts = {
            q: [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns]
            for q, turns in scripts.items()
        }
        self.sessions: dict[str, ReplayServer] = {}

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        if request_id not in self.sessions:
            text = self.tok.decode(prompt_ids)
            (question,) = [q for q in self.scripts if q in text]
            self.sessions[request_id] = ReplayServer(
                self.scripts[question],
                eos=self.tok.eos_token_id,
                prompt_length=PROMPT_LENGTH,
                response_length=self.R,
            )
        return await self.sessions[request_id].generate(
            request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs
        )


@needs_verl
async def test_verl_worker_batch_has_identical_rows(tok, tmp_path):
    """verl's own AgentLoopWorker (agent_loop_config_path, tool_config_path, per-sample hydra instantiate,
    padding) over a batch that mixes agent_name tool_agent and fsm_agent rows: each fsm_agent row of the
    padded batch equals its tool_agent twin."""
    import numpy as np
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto

    config = trainer_config(RESPONSE_LENGTH, {"tool_config_path": str(tool_dir() / "tools.yaml")})
    config.actor_rollout_ref.model.path = str(model_dir())  # the worker loads tokenizer and hf_config there
    config.actor_rollout_ref.rollout.agent.agent_loop_config_path = str(entry_file(tmp_path, {}))
    scripts = {
        f"What is {q}?": turns
        for q, turns in [
            ("37 * 12 + 5", [call("37 * 12 + 5"), ANSWER]),
            ("444 + 5", [call("37 * 12"), call("444 + 5"), ANSWER]),
            ("7 - 7", [call("7 - 7", name="calc"), call("1 / 0"), ANSWER]),
            ("1 + 1", [ANSWER]),
        ]
    }
    server = RoutingServer(tok, scripts, response_length=RESPONSE_LENGTH)
    worker = AgentLoopWorker(config, llm_client=server)
    questions = list(scripts) * 2
    agents = ["tool_agent"] * len(scripts) + ["fsm_agent"] * len(scripts)

    def column(values):
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    batch = DataProto(
        non_tensor_batch={
            "raw_prompt": column([[{"role": "user", "content": q}] for q in questions]),
            "agent_name": column(agents),
            "tools_kwargs": column([{} for _ in questions]),
            "extra_info": column([{"index": i % len(scripts)} for i in range(len(questions))]),
            "index": np.arange(len(questions)) % len(scripts),
            "uid": column([f"u{i % len(scripts)}" for i in range(len(questions))]),
        },
        meta_info={"global_steps": 1},
    )
    out = await worker.generate_sequences(batch)
    n = len(scripts)
    for key, value in out.batch.items():
        assert (value[:n] == value[n:]).all(), key
    assert value.shape[0] == 2 * n
    assert (
        out.batch["responses"].shape[1] == RESPONSE_LENGTH and out.batch["prompts"].shape[1] == PROMPT_LENGTH
    )
    assert set(out.batch.keys()) >= {
        "prompts",
        "responses",
        "response_mask",
        "input_ids",
        "attention_mask",
        "position_ids",
        "rollout_log_probs",
    }
    turns = out.non_tensor_batch["__num_turns__"]
    assert list(turns[:n]) == list(turns[n:]) == [4, 6, 6, 2]
    assert list(out.non_tensor_batch["termination_reason"]) == [None] * n + ["done"] * n
    assert list(out.non_tensor_batch["tool_rewards"][n:]) == list(out.non_tensor_batch["tool_rewards"][:n])


@needs_verl
def test_config_entry_errors_and_caching(tok, tmp_path):
    """The spec is compiled once per process; batch shapes belong to verl's rollout config."""
    from fsm.adapters import verl as verl_adapter

    config = trainer_config(RESPONSE_LENGTH, {})
    server = ReplayServer(
        [], eos=tok.eos_token_id, prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH
    )
    tools = load_tools("base")
    a = instantiate(fsm_entry(tmp_path, {}), config, server, tok, tools)
    b = instantiate(fsm_entry(tmp_path, {}), config, server, tok, tools)
    assert a.agent is b.agent  # compiled once per (spec, overrides, P, R), tools bound once per worker list
    assert a.agent.limits.response_length == RESPONSE_LENGTH and a.agent.limits.prompt_length == PROMPT_LENGTH
    assert list(a.agent.tools.by_name) == ["calculator"] and a.codec is b.codec
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match=r"set actor_rollout_ref\.rollout\.response_length"):
        instantiate(fsm_entry(tmp_path, {"response_length": 64}), config, server, tok, [])
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        verl_adapter.resolve_spec_path("nope.yaml")
