"""Calls that are not the agent's own turns (issue 48 §5): Claude Code's title request (`output_config.format`, a
JSON schema with a `title` property), a compaction recognised by its system prompt, or any call a harness names
with `x-agentfsm-call: KIND`, are recorded on a node of their own, tagged with their kind, so the agent's own
conversation goes on in place (never a `history` rewrite) and GatewayLimits.auxiliary_calls keeps them, trains
them apart (their policy is their kind) or drops them. Each row passes the token check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from backends.scripted import ScriptedBackend, ToolScript
from fsm.api import RolloutEngine
from fsm.gateway import Gateway, GatewayLimits, HarnessCall, harness
from tests.gateway.conftest import row
from tests.gateway.test_hostile import _attach, spec

TOOL = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression.",
    "input_schema": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
}
USER = {"role": "user", "content": "What is 1 + 2?"}
TITLE = {  # as Claude Code 2.1.197 asks for a session title
    "system": "Generate a concise, sentence-case title for this coding session.",
    "messages": [{"role": "user", "content": "What is 1 + 2?"}],
    "output_config": {
        "format": {
            "type": "json_schema",
            "schema": {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]},
        }
    },
}
COMPACTION = {  # Claude Code's /compact: its own system prompt
    "system": "You are a helpful AI assistant tasked with summarizing conversations.",
    "messages": [{"role": "user", "content": "Summarize: What is 1 + 2?"}],
}


async def messages(call: HarnessCall, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{call.anthropic_base_url}/v1/messages",
            json={"model": "claude-opus-4-8", "max_tokens": 64, **body},
            headers={"x-api-key": call.api_key, **(headers or {})},
        ) as r:
            answer = await r.json()
            assert r.status == 200, answer
            return answer


async def agent(
    call: HarnessCall, side: dict[str, Any], first: bool, headers: dict[str, str] | None = None
) -> str:
    """The agent's two turns (a calculator call, then the answer), with a side call before or between them."""
    if first:
        await messages(call, side, headers)
    turn = await messages(call, {"messages": [USER], "tools": [TOOL]})
    if not first:
        await messages(call, side, headers)
    (use,) = [b for b in turn["content"] if b["type"] == "tool_use"]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "3"}]}
    history = [USER, {"role": "assistant", "content": turn["content"]}, result]
    return (await messages(call, {"messages": history, "tools": [TOOL]}))["content"][0]["text"]


async def title_between(call: HarnessCall) -> str:
    return await agent(call, TITLE, first=False)


async def title_first(call: HarnessCall) -> str:
    return await agent(call, TITLE, first=True)


async def compaction_between(call: HarnessCall) -> str:
    return await agent(call, COMPACTION, first=False)


async def named_between(call: HarnessCall) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{call.anthropic_base_url}/v1/messages",
            json={"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Name this."}]},
            headers={"x-api-key": call.api_key, "x-agentfsm-call": "Title Please"},
        ) as r:
            refused = (r.status, (await r.json())["error"]["message"])
    assert refused == (
        400,
        "x-agentfsm-call: 'Title Please' is not a call kind (1-32 lowercase letters, digits or '_')",
    )
    side = {"messages": [{"role": "user", "content": "Name this."}]}
    return await agent(call, side, first=False, headers={"x-agentfsm-call": "title"})


HARNESSES = {
    name: harness(fn, timeout_s=60)
    for name, fn in [
        ("title_between", title_between),
        ("title_first", title_first),
        ("compaction_between", compaction_between),
        ("named_between", named_between),
    ]
}
title_between_harness = HARNESSES["title_between"]
title_first_harness = HARNESSES["title_first"]
compaction_between_harness = HARNESSES["compaction_between"]
named_between_harness = HARNESSES["named_between"]


def run(tmp_path: Path, tokenizer: Any, name: str, auxiliary: str) -> Any:
    gateway = Gateway(limits=GatewayLimits(auxiliary_calls=auxiliary))
    # the model calls the calculator where the prompt offers it, then answers: a side call (no tools) gets text
    steps = [
        {"call": "calculator", "arguments": {"expression": "1 + 2"}},
        {"text": "The answer is 3.\n#### 3"},
    ]
    backend = ScriptedBackend(ToolScript(tokenizer, steps))
    path = spec(tmp_path, f"tests.gateway.test_auxiliary:{name}_harness")
    with RolloutEngine(str(path), tokenizer, backend=backend, check_tokens=True) as engine:
        _attach(gateway, engine)
        (traj,) = engine._run_sync(engine.arun([row()]))
    assert traj.extra["harness"]["outcome"] == "returned", traj.extra["harness"]
    assert traj.token_check is None, traj.token_check  # every row is the template's render of its own
    return traj


@pytest.mark.parametrize(
    ("name", "kind"),
    [("title_between", "title"), ("title_first", "title"), ("compaction_between", "compaction")],
)
def test_a_side_call_is_a_row_of_its_own_trained_apart_and_the_agent_goes_on_in_place(
    tmp_path: Path, tokenizer: Any, name: str, kind: str
) -> None:
    traj = run(tmp_path, tokenizer, name, "separate")
    rows = traj.extra["tree"]
    assert [r["node_kind"] for r in rows] == [kind, "root"], rows  # the session's own row last
    assert [r["policy"] for r in rows] == [kind, "default"]
    (side,) = traj.closed
    assert side.reason == "child" and side.turns == 1
    # the agent's own conversation is one segment: its call, the tool result, its answer; never rewritten
    assert traj.segment_start[0] == "prompt" and traj.assistant_turns - side.turns == 2
    assert "tool_call" in traj.messages[1]["content"] or traj.messages[1].get("tool_calls")


@pytest.mark.parametrize("auxiliary", ["keep", "drop"])
def test_auxiliary_calls_are_kept_or_dropped_as_the_gateway_is_told(
    tmp_path: Path, tokenizer: Any, auxiliary: str
) -> None:
    traj = run(tmp_path, tokenizer, "title_between", auxiliary)
    rows = traj.extra["tree"]
    if auxiliary == "keep":
        assert [(r["node_kind"], r["policy"]) for r in rows] == [("title", "default"), ("root", "default")]
    else:  # answered, and left out of the rows: the agent's own row alone
        assert [r["node_kind"] for r in rows] == ["root"] and not traj.closed


def test_a_harness_names_a_side_call_with_a_header(tmp_path: Path, tokenizer: Any) -> None:
    traj = run(tmp_path, tokenizer, "named_between", "separate")
    assert [(r["node_kind"], r["policy"]) for r in traj.extra["tree"]] == [
        ("title", "title"),
        ("root", "default"),
    ]


def test_an_unknown_disposition_is_refused() -> None:
    with pytest.raises(ValueError, match="auxiliary_calls 'train': keep, separate or drop"):
        GatewayLimits(auxiliary_calls="train")
    assert json.dumps(TITLE)  # (the title request above is plain JSON, as Claude Code sends it)


def test_a_sessions_system_prompt_kind_follows_the_prompt_each_call_sends() -> None:
    """A session keeps the kind of the system prompt its last call sent (finding a prompt in a long one is
    O(its length)); a call with another system prompt is looked at again, whichever came before it."""
    from fsm.gateway.record import AUX_PROMPTS

    session = Gateway().open("t")
    agent, compaction = ["You are a coding agent."], [f"You are a helpful AI assistant {AUX_PROMPTS[1][1]}."]
    kinds = [session.system_kind(system, AUX_PROMPTS) for system in (agent, agent, compaction, agent, [])]
    assert kinds == [None, None, "compaction", None, None]
    assert session.system_kind(list(compaction), AUX_PROMPTS) == "compaction"  # equal, another list: the same
