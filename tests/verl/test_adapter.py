"""fsm_agent's own settings against verl 0.9.1: the prompt budget it takes from verl's rollout config,
logprobs the server does not return, rm_scores of an empty response, and the entry's overrides.
"""

from __future__ import annotations

import pytest

from fsm.spec.model import SPECS_DIR
from tests.verl.harness import (
    ANSWER,
    Case,
    ReplayServer,
    assert_identical,
    assert_native_collate_matches,
    assert_same_requests,
    call,
    fsm_entry,
    instantiate,
    load_tools,
    needs_verl,
    row,
    run_both,
    trainer_config,
    verl_batch,
)

LONG_QUESTION = (
    "Please compute this, step by step: " + "37 * 12 + 5, then again; " * 60 + "What is 37 * 12 + 5?"
)


# --- the prompt: verl's rollout.prompt_length, and verl's left truncation -----------------------------------


@needs_verl
async def test_long_prompt_is_left_truncated_as_verl_does(tok, tmp_path):
    """verl's agent loop keeps the tail of a prompt longer than rollout.prompt_length; so does fsm_agent,
    whatever the spec's prompt_overflow (tool_agent.yaml keeps the default, error)."""
    pair = await run_both(
        Case(
            "long_prompt",
            [call("37 * 12 + 5"), ANSWER],
            row={"raw_prompt": [{"role": "user", "content": LONG_QUESTION}]},
        ),
        tok,
        tmp_path,
    )
    assert (
        len(pair.verl.prompt_ids)
        == 512
        < len(
            tok.apply_chat_template(
                [{"role": "user", "content": LONG_QUESTION}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
        )
    )
    assert_identical(pair)
    assert_same_requests(pair, tok.eos_token_id)
    assert pair.fsm.extra_fields["termination_reason"] == "done"


@needs_verl
async def test_entry_may_refuse_long_prompts(tok, tmp_path):
    """The entry's limits may still ask for agentfsm's prompt_overflow: error; the row then fails alone."""
    case = Case(
        "refused",
        [ANSWER],
        limits={"prompt_overflow": "error"},
        row={"raw_prompt": [{"role": "user", "content": LONG_QUESTION}]},
    )
    pair = await run_both(case, tok, tmp_path)
    assert pair.fsm.extra_fields["termination_reason"].startswith("error: prompt_too_long")
    assert pair.fsm.response_ids == [] and pair.fsm.prompt_ids == [] and pair.fsm_server.requests == []


# --- logprobs the server did not return -------------------------------------------------------------------


def _turns():
    return [call("37 * 12 + 5"), ANSWER]


@needs_verl
@pytest.mark.parametrize("server", [{"no_logprobs": frozenset({0, 1})}], ids=["none_returned"])
async def test_no_logprobs_is_none_as_in_verl(server, tok, tmp_path):
    """No turn came back with logprobs: None, as verl, never zeros (a PPO ratio reads 0 as probability 1)."""
    pair = await run_both(Case("no_logprobs", _turns(), server=server), tok, tmp_path)
    assert pair.verl.response_logprobs is None
    assert_identical(pair)


@needs_verl
async def test_logprobs_not_asked_for(tok, tmp_path):
    pair = await run_both(Case("not_asked", _turns(), sampling={"logprobs": False}), tok, tmp_path)
    assert pair.verl.response_logprobs is None
    assert_identical(pair)


@needs_verl
@pytest.mark.parametrize(
    "server, verl_outcome",
    [
        ({"no_logprobs": frozenset({1})}, "raises"),  # verl: "assistant_logprobs is required ..."
        ({"logprob_shortfall": frozenset({0})}, "raises"),  # verl: "... length must match ..."
        ({"no_logprobs": frozenset({0})}, "misaligned"),  # verl: only the second turn's, at the start
    ],
    ids=["second_turn_missing", "one_short", "first_turn_missing"],
)
async def test_partly_missing_logprobs_are_none_where_verl_breaks(server, verl_outcome, tok, tmp_path):
    """Some turns without (matching) logprobs: verl raises, failing the whole worker batch, or returns a list
    shorter than the response, misaligned with it. fsm_agent returns None and the same tokens."""
    case = Case("partial", _turns(), server=server)
    if verl_outcome == "raises":
        with pytest.raises(ValueError, match="assistant_logprobs"):
            await run_both(case, tok, tmp_path)
    else:
        pair = await run_both(case, tok, tmp_path)
        assert 0 < len(pair.verl.response_logprobs) < len(pair.verl.response_ids)
        for name in ("prompt_ids", "response_ids", "response_mask", "num_turns"):
            assert getattr(pair.fsm, name) == getattr(pair.verl, name), name
    config = trainer_config(256)
    server_ = ReplayServer(
        [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in _turns()],
        eos=tok.eos_token_id,
        prompt_length=512,
        response_length=256,
        **server,
    )
    loop = instantiate(fsm_entry(tmp_path), config, server_, tok, load_tools("base"))
    out = await loop.run({"temperature": 1.0, "logprobs": True}, **row())
    assert out.response_logprobs is None and out.extra_fields["termination_reason"] == "done"
    assert len(out.response_ids) == len(out.response_mask) > 0


# --- rm_scores of an empty response -------------------------------------------------------------------------


@needs_verl
async def test_empty_response_score_as_verl_pads_it(tok, tmp_path):
    """A row whose model said nothing: verl's postprocessing puts its reward at column R-1; fsm.collate too."""
    empty = Case("empty", [[]])  # the server returns no token at all
    pair = await run_both(empty, tok, tmp_path)
    assert pair.fsm.response_ids == [] and pair.fsm.response_logprobs == []  # verl: the prompt, and None
    assert pair.verl.response_ids == pair.verl.prompt_ids and pair.verl.response_logprobs is None
    full = await run_both(Case("full", _turns()), tok, tmp_path)
    outputs = [o.model_copy(update={"reward_score": s}) for o, s in ((full.fsm, 1.0), (pair.fsm, -1.0))]
    batch = await verl_batch(outputs, [row(), row()], prompt_length=512, response_length=256)
    assert batch.batch["rm_scores"][1].tolist() == [0.0] * 255 + [-1.0]
    assert_native_collate_matches(
        batch, outputs, prompt_length=512, response_length=256, pad_token_id=tok.pad_token_id
    )


# --- the entry ----------------------------------------------------------------------------------------------


@needs_verl
def test_entry_tool_policy_is_its_own_compiled_agent(tok, tmp_path):
    config = trainer_config(256)
    server = ReplayServer([], eos=tok.eos_token_id, prompt_length=512, response_length=256)
    tools = load_tools("base")
    plain = instantiate(fsm_entry(tmp_path), config, server, tok, tools)
    strict = instantiate(
        fsm_entry(None, tool_policy={"validate_arguments": True}), config, server, tok, tools
    )
    again = instantiate(fsm_entry(None, tool_policy={"validate_arguments": True}), config, server, tok, tools)
    assert strict.agent is again.agent and strict.agent is not plain.agent
    assert strict.agent.tools.policy.validate_arguments and not plain.agent.tools.policy.validate_arguments
    assert not strict.agent.tools.policy.parse_string_arguments  # the rest stays the spec's
    assert plain.agent.limits.prompt_overflow == "truncate_left"  # verl's prompt policy through the adapter
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match="validate_argument"):
        instantiate(fsm_entry(None, tool_policy={"validate_argument": True}), config, server, tok, tools)


@needs_verl
def test_verl_tools_run_where_verl_runs_them(tok, tmp_path):
    """An async BaseTool is awaited on the worker's loop (InlineLane, which still moves a tool that holds the
    loop to a thread of its own); a sync @function_tool runs in threads, as verl's asyncio.to_thread does."""
    from fsm.tools.isolation import InlineLane, ThreadLane

    config = trainer_config(256)
    server = ReplayServer([], eos=tok.eos_token_id, prompt_length=512, response_length=256)
    base = instantiate(fsm_entry(tmp_path), config, server, tok, load_tools("base"))
    function = instantiate(fsm_entry(tmp_path), config, server, tok, load_tools("function"))
    assert isinstance(base.agent.tools.by_name["calculator"].lane, InlineLane)
    assert isinstance(function.agent.tools.by_name["calculator"].lane, ThreadLane)


@needs_verl
def test_a_segmenting_spec_is_refused_in_one_line(tok, tmp_path):
    """verl 0.9.1's worker takes one AgentLoopOutput per input row; a spec that rewrites its context may give
    several rows (docs/contexts.md), so the entry refuses it when verl constructs it, saying why."""
    from hydra.errors import InstantiationException

    config = trainer_config(256)
    server = ReplayServer([], eos=tok.eos_token_id, prompt_length=512, response_length=256)
    with pytest.raises(InstantiationException, match="takes one output per input") as err:
        instantiate(
            fsm_entry(None, spec="specs/calculator_compact.yaml"), config, server, tok, load_tools("base")
        )
    assert "calculator_compact" in str(err.value) and "rewrites its context" in str(err.value)


@needs_verl
@pytest.mark.parametrize(
    ("spec", "why"),
    [("fork_calculator", "a fork at GENERATING"), ("planner_solver", "child machines calculator; policies")],
)
def test_a_tree_spec_is_refused_in_one_line(tok, spec, why):
    """A fork or a child machine gives several rows per input row, of several policies (docs/trees.md): verl's
    worker takes one AgentLoopOutput per row, so the entry refuses the spec when verl constructs it."""
    from hydra.errors import InstantiationException

    config = trainer_config(256)
    server = ReplayServer([], eos=tok.eos_token_id, prompt_length=512, response_length=256)
    with pytest.raises(InstantiationException) as err:
        instantiate(fsm_entry(None, spec=f"specs/{spec}.yaml"), config, server, tok, load_tools("base"))
    cause = str(err.value.__cause__ or err.value)
    assert cause.startswith(f"fsm_agent: spec {spec!r} makes trees ({why}") and cause.count("\n") == 0
    assert "takes one output per input: train trees with SkyRL" in cause


@needs_verl
def test_a_spec_that_drops_failed_rows_is_refused_in_one_line(tok, tmp_path):
    """verl's worker returns one AgentLoopOutput per input row, so `on_error: drop` cannot hold there: the entry
    refuses it as generate_sequences refuses it under a DataProto (mask and zero_reward run as specified)."""
    from hydra.errors import InstantiationException

    path = tmp_path / "dropping.yaml"
    path.write_text(f"name: dropping\nextends: {SPECS_DIR}/calculator.yaml\nfailures: {{on_error: drop}}\n")
    config = trainer_config(256)
    server = ReplayServer([], eos=tok.eos_token_id, prompt_length=512, response_length=256)
    with pytest.raises(InstantiationException) as err:
        instantiate(fsm_entry(None, spec=str(path)), config, server, tok, load_tools("base"))
    cause = str(err.value.__cause__ or err.value)
    assert cause == (
        "fsm_agent: spec 'dropping' sets on_error: drop (failures), but verl's agent-loop worker returns one "
        "output per input row: use on_error: mask or zero_reward under verl"
    )
