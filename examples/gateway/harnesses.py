"""Calculator agents written in other harnesses, run through the gateway (docs/gateway.md).

Each is an ordinary program in its framework: it gets a `HarnessCall` (the session's base URL, key and the
row), builds its client against the gateway, runs its own tool loop with the calculator from
specs/calculator.py, and returns its final answer. The specs in this folder name them as their harness
state's action.
"""

from __future__ import annotations

import json
from typing import Any

from fsm.gateway import HarnessCall, harness
from specs.calculator import SYSTEM_PROMPT, TOOL_SCHEMA, _format, evaluate

MAX_STEPS = 8  # each harness's own loop bound; the spec's limits bound it too


def _question(call: HarnessCall) -> str:
    return next(m["content"] for m in call.messages if m["role"] == "user")


def _run_tool(name: str, arguments: dict) -> str:
    if name != "calculator":
        return f"Error: unknown tool {name!r}"
    try:
        return _format(evaluate(**arguments))
    except Exception as exc:  # the model chose the arguments: a bad one is an answer, not a crash
        return f"Error: {exc}"


# --- the openai SDK, Chat Completions, streaming ------------------------------------------------------------


async def openai_chat(call: HarnessCall, stream: bool = False) -> str:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=call.base_url, api_key=call.api_key, max_retries=0)
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": _question(call)},
    ]
    try:
        for _ in range(MAX_STEPS):
            if stream:
                content, calls = "", {}
                async for chunk in await client.chat.completions.create(
                    model=call.model, messages=messages, tools=[TOOL_SCHEMA], stream=True
                ):
                    for choice in chunk.choices:
                        content += choice.delta.content or ""
                        for tc in choice.delta.tool_calls or ():
                            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                            entry["name"] += tc.function.name or ""
                            entry["arguments"] += tc.function.arguments or ""
                tool_calls = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in calls.values()
                ]
            else:
                reply = await client.chat.completions.create(
                    model=call.model, messages=messages, tools=[TOOL_SCHEMA]
                )
                message = reply.choices[0].message
                content = message.content or ""
                tool_calls = [tc.model_dump() for tc in message.tool_calls or ()]
            messages.append(
                {
                    "role": "assistant",
                    "content": content,
                    **({"tool_calls": tool_calls} if tool_calls else {}),
                }
            )
            if not tool_calls:
                return content
            for tc in tool_calls:
                result = _run_tool(tc["function"]["name"], json.loads(tc["function"]["arguments"] or "{}"))
                messages.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
        return ""
    finally:
        await client.close()


async def openai_chat_stream(call: HarnessCall) -> str:
    return await openai_chat(call, stream=True)


# --- the OpenAI Agents SDK (openai-agents) -------------------------------------------------------------------


async def agents_sdk(call: HarnessCall) -> str:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    @function_tool(name_override="calculator")
    def calc(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return _run_tool("calculator", {"expression": expression})

    client = AsyncOpenAI(base_url=call.base_url, api_key=call.api_key, max_retries=0)
    model = OpenAIResponsesModel(model=call.model, openai_client=client)
    agent = Agent(
        name="calculator",
        instructions=SYSTEM_PROMPT,
        tools=[calc],
        model=model,
        model_settings=ModelSettings(store=False),
    )
    try:
        result = await Runner.run(
            agent, _question(call), max_turns=MAX_STEPS, run_config=RunConfig(tracing_disabled=True)
        )
        return str(result.final_output)
    finally:
        await client.close()


def agents_sdk_solver(call: HarnessCall) -> tuple[Any, list[Any]]:
    """The solver agent of the two-agent harnesses (here and tests/gateway/test_tree.py): the real calculator as
    its tool, its model a child session of the row's (`call.child`), so its calls are recorded as child nodes of
    the row's tree (docs/gateway.md, "Trees"). Returns it and the clients to close, the row's own first."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool
    from openai import AsyncOpenAI

    @function_tool(name_override="calculator")
    def calc(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return _run_tool("calculator", {"expression": expression})

    clients = [
        AsyncOpenAI(base_url=c.base_url, api_key=c.api_key, max_retries=0)
        for c in (call, call.child("solver"))
    ]
    solver = Agent(
        name="solver",
        instructions=SYSTEM_PROMPT,
        tools=[calc],
        model=OpenAIResponsesModel(model=call.model, openai_client=clients[1]),
        model_settings=ModelSettings(store=False),
    )
    return solver, clients


async def agents_sdk_tree(call: HarnessCall) -> str:
    """Sub-agents: the planner's `calculator` tool is another agent (the SDK's agents-as-tools), the solver
    (agents_sdk_solver); its final answer is the planner's tool result."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner
    from pydantic import BaseModel

    class Expression(BaseModel):
        expression: str

    solver, clients = agents_sdk_solver(call)
    planner = Agent(
        name="planner",
        instructions=SYSTEM_PROMPT,
        tools=[
            solver.as_tool(
                tool_name="calculator",
                tool_description="Evaluate an arithmetic expression.",
                parameters=Expression,
                max_turns=MAX_STEPS,
            )
        ],
        model=OpenAIResponsesModel(model=call.model, openai_client=clients[0]),
        model_settings=ModelSettings(store=False),
    )
    try:
        result = await Runner.run(
            planner, _question(call), max_turns=MAX_STEPS, run_config=RunConfig(tracing_disabled=True)
        )
        return str(result.final_output)
    finally:
        for client in clients:
            await client.close()


# --- LangGraph (langgraph + langchain-openai) ----------------------------------------------------------------


def langgraph_agent(call: HarnessCall) -> str:
    """Sync, as most LangGraph code is: the gateway runs it on its own thread."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool("calculator")
    def calc(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return _run_tool("calculator", {"expression": expression})

    llm = ChatOpenAI(
        model=call.model, base_url=call.base_url, api_key=call.api_key, max_retries=0, streaming=True
    )
    graph = create_react_agent(llm, [calc], prompt=SYSTEM_PROMPT)
    state = graph.invoke({"messages": [("user", _question(call))]}, {"recursion_limit": 2 * MAX_STEPS + 1})
    return str(state["messages"][-1].content)


# --- the anthropic SDK, Messages, streaming ------------------------------------------------------------------


async def anthropic_messages(call: HarnessCall) -> str:
    from anthropic import AsyncAnthropic

    client = AsyncAnthropic(base_url=call.anthropic_base_url, api_key=call.api_key, max_retries=0)
    fn = TOOL_SCHEMA["function"]
    tools = [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}]
    messages: list[dict] = [{"role": "user", "content": _question(call)}]
    try:
        for _ in range(MAX_STEPS):
            async with client.messages.stream(
                model=call.model, max_tokens=256, system=SYSTEM_PROMPT, messages=messages, tools=tools
            ) as stream:
                message = await stream.get_final_message()
            messages.append(
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}
            )
            uses = [b for b in message.content if b.type == "tool_use"]
            if not uses:
                return "".join(b.text for b in message.content if b.type == "text")
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": b.id,
                            "content": _run_tool(b.name, dict(b.input)),
                        }
                        for b in uses
                    ],
                }
            )
        return ""
    finally:
        await client.close()


# the actions the specs name
chat_harness = harness(openai_chat, timeout_s=120)
chat_stream_harness = harness(openai_chat_stream, timeout_s=120)
agents_harness = harness(agents_sdk, timeout_s=120)
agents_tree_harness = harness(agents_sdk_tree, timeout_s=120)
langgraph_harness = harness(langgraph_agent, timeout_s=120)
anthropic_harness = harness(anthropic_messages, timeout_s=120)
