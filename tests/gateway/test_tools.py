"""Tools as a harness sends them: each function tool rendered as a chat server renders it (vLLM and SGLang hand
the template the function's fields as sent, `strict` included), and tools a local model cannot serve."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from fsm.gateway import Gateway, GatewayLimits, HarnessCall, harness
from fsm.gateway.openai_api import chat_call, responses_answer, responses_call
from fsm.gateway.record import Answer
from tests.gateway.conftest import row
from tests.gateway.test_hostile import USER, chat, post, run, spec

# the tool exactly as the real pydantic-ai (pydantic-ai-slim[openai] 2.68.0, OpenAIChatModel) sent it for a
# `@agent.tool_plain def calculator(expression: str)`, captured from its request body
PYDANTIC_AI_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "additionalProperties": False,
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
            "type": "object",
        },
        "strict": True,
    },
}
SENT: dict[str, Any] = {}


async def strict_chat(call: HarnessCall) -> Any:
    status, answer = await post(call, "chat/completions", chat(USER, tools=[PYDANTIC_AI_TOOL]))
    assert status == 200, answer
    return answer["choices"][0]["finish_reason"]


async def strict_responses(call: HarnessCall) -> Any:
    flat = {"type": "function", **PYDANTIC_AI_TOOL["function"]}
    status, answer = await post(call, "responses", {"model": "m", "input": "What is 1 + 2?", "tools": [flat]})
    assert status == 200, answer
    return answer["status"]


strict_chat_harness = harness(strict_chat, timeout_s=60)
strict_responses_harness = harness(strict_responses, timeout_s=60)


def test_strict_tools_are_rendered_as_sent(tmp_path: Path, tokenizer: Any) -> None:
    expected = tokenizer.apply_chat_template(
        [USER],
        tools=[copy.deepcopy(PYDANTIC_AI_TOOL)],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert "strict" in tokenizer.decode(expected)  # the tiny model's template writes each tool as JSON
    for name in ("strict_chat_harness", "strict_responses_harness"):
        trajs, backend = run(spec(tmp_path, f"tests.gateway.test_tools:{name}"), tokenizer, [row()])
        assert trajs[0].extra["harness"]["outcome"] == "returned", trajs[0].extra["harness"]
        assert trajs[0].prompt_ids.tolist() == list(expected), name
        assert backend.requests[0].prompt_ids == list(expected), name


# the tools the real Codex CLI 0.171 sends that are not functions (captured from its Responses request)
CODEX_NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [
        {"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}}
    ],
}
CODEX_WEB_SEARCH = {"type": "web_search", "external_web_access": False}
FLAT_TOOL = {"type": "function", **PYDANTIC_AI_TOOL["function"]}
# the namespace's function as vLLM renders it (vllm#47024): `{namespace}__{name}`
FLAT_SPAWN = {
    "type": "function",
    "function": {"name": "multi_agent_v1__spawn_agent", "parameters": {"type": "object", "properties": {}}},
}


def test_a_namespace_tools_functions_are_served_and_answered_with_their_namespace() -> None:
    """Codex calls a function of a `namespace` tool only when the answer names the two apart (`unsupported call:
    multi_agent_v1spawn_agent` otherwise, measured with Codex 0.171.0), and sends the call back so."""
    sent = {"type": "function_call", "call_id": "c1", "name": "spawn_agent", "namespace": "multi_agent_v1"}
    body = {"model": "m", "input": [USER, {**sent, "arguments": "{}"}], "tools": [CODEX_NAMESPACE]}
    call = responses_call(body)
    assert (
        call.tools == [FLAT_SPAWN]
        and call.messages[-1]["tool_calls"][0]["name"] == FLAT_SPAWN["function"]["name"]
    )
    answer = Answer(
        "",
        None,
        [{"id": "c2", "name": "multi_agent_v1__spawn_agent", "arguments": "{}"}],
        "tool_calls",
        1,
        1,
        1,
    )
    (item,) = responses_answer(answer, call, "s")["output"]
    assert (item["name"], item["namespace"]) == ("spawn_agent", "multi_agent_v1")
    chat = chat_call(
        {"messages": [USER], "tools": [CODEX_NAMESPACE]}
    )  # a namespace is the Responses API's own
    assert chat.tools is None and chat.extra["dropped_tools"] == [
        "tools[0] (type 'namespace', 'multi_agent_v1')"
    ]


async def codex_tools(call: HarnessCall) -> Any:
    body = {"model": "m", "input": "What is 1 + 2?", "tools": [FLAT_TOOL, CODEX_NAMESPACE, CODEX_WEB_SEARCH]}
    first = await post(call, "responses", body)
    second = await post(
        call,
        "messages",
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [USER],
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        },
    )
    return [first[0], first[1].get("error", {}).get("message") if first[0] != 200 else None, second[0]]


codex_tools_harness = harness(codex_tools, timeout_s=60)


def test_tools_a_local_model_cannot_serve_are_dropped_and_noted(tmp_path: Path, tokenizer: Any) -> None:
    trajs, _ = run(spec(tmp_path, "tests.gateway.test_tools:codex_tools_harness"), tokenizer, [row()])
    assert trajs[0].extra["harness"]["result"][0] == 200
    expected = tokenizer.apply_chat_template(
        [USER],
        tools=[copy.deepcopy(PYDANTIC_AI_TOOL), FLAT_SPAWN],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert trajs[0].segments[0].prompt_ids.tolist() == list(expected)  # the function tools alone
    assert "web_search" not in tokenizer.decode(
        trajs[0].prompt_ids.tolist()
    )  # the second call: no tools at all
    assert trajs[0].extra["gateway_notes"] == [
        "tools left out (a local model serves function tools only): tools[2] (type 'web_search')",
        "tools left out (a local model serves function tools only): tools.0 (type 'web_search_20250305', 'web_search')",
    ]


def test_tools_a_local_model_cannot_serve_can_be_refused(tmp_path: Path, tokenizer: Any) -> None:
    gateway = Gateway(limits=GatewayLimits(unsupported_tools="refuse"))
    trajs, backend = run(
        spec(tmp_path, "tests.gateway.test_tools:codex_tools_harness"), tokenizer, [row()], gateway
    )
    assert trajs[0].extra["harness"]["result"] == [
        400,
        "tools[2] (type 'web_search'): only function tools are supported (the gateway's "
        "unsupported_tools is 'refuse')",
        400,
    ]
    assert not backend.requests and "gateway_notes" not in trajs[0].extra


# Claude Code 2.1.197's main request ends with a system message after the user's turn (its beta
# `mid-conversation-system`), beside its top-level `system`, with cache_control on its blocks (captured)
CLAUDE_CODE_MESSAGES = [
    USER,
    {
        "role": "system",
        "content": [{"type": "text", "text": "Reminder: be brief.", "cache_control": {"type": "ephemeral"}}],
    },
]


async def system_in_messages(call: HarnessCall) -> Any:
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 8,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": CLAUDE_CODE_MESSAGES,
    }
    status, answer = await post(call, "messages", body)
    return status if status == 200 else answer


system_in_messages_harness = harness(system_in_messages, timeout_s=60)


def test_a_system_message_inside_messages_is_rendered_where_it_stands(tmp_path: Path, tokenizer: Any) -> None:
    trajs, backend = run(
        spec(tmp_path, "tests.gateway.test_tools:system_in_messages_harness"), tokenizer, [row()]
    )
    assert trajs[0].extra["harness"]["result"] == 200, trajs[0].extra["harness"]
    expected = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "You are Claude Code."},
            USER,
            {"role": "system", "content": "Reminder: be brief."},
        ],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert backend.requests[0].prompt_ids == list(expected)


def test_claude_codes_real_first_request_is_read() -> None:
    """The request the real Claude Code 2.1.197 (npm) sent with its defaults (`claude -p`, captured; ids zeroed):
    its mid-conversation system message, adaptive thinking, context management and cache fields are read,
    not refused, and its 25 tools are function tools."""
    import json

    from fsm.gateway.anthropic_api import messages_call
    from fsm.gateway.record import ends_on_observation

    captured = json.loads(
        (Path(__file__).parent.parent / "fixtures" / "claude_code_request.json").read_text()
    )
    body = captured["body"]
    assert body["thinking"] == {"type": "adaptive"} and body["stream"] is True
    call = messages_call(body)
    assert [m["role"] for m in call.messages] == ["system", "user", "system"]
    assert call.messages[1]["content"].endswith("Write hello.txt containing hi")
    assert len(call.tools or []) == 25 and call.stream
    ends_on_observation(call.messages)  # answered: the user's turn, then the system message
