"""Tools as a harness sends them: each function tool rendered as a chat server renders it (vLLM and SGLang hand
the template the function's fields as sent, `strict` included), and tools a local model cannot serve."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from fsm.gateway import HarnessCall, harness
from tests.gateway.conftest import row
from tests.gateway.test_hostile import USER, chat, post, run, spec

# the tool exactly as the real pydantic-ai (pydantic-ai-slim[openai] 2.68.0, OpenAIChatModel) sent it for a
# `@agent.tool_plain def calculator(expression: str)`, captured from its request body
PYDANTIC_AI_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"additionalProperties": False, "properties": {"expression": {"type": "string"}},
                   "required": ["expression"], "type": "object"},
    "strict": True}}  # fmt: skip
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
    expected = tokenizer.apply_chat_template([USER], tools=[copy.deepcopy(PYDANTIC_AI_TOOL)], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)  # fmt: skip
    assert "strict" in tokenizer.decode(expected)  # the tiny model's template writes each tool as JSON
    for name in ("strict_chat_harness", "strict_responses_harness"):
        trajs, backend = run(spec(tmp_path, f"tests.gateway.test_tools:{name}"), tokenizer, [row()])
        assert trajs[0].extra["harness"]["outcome"] == "returned", trajs[0].extra["harness"]
        assert trajs[0].prompt_ids.tolist() == list(expected), name
        assert backend.requests[0].prompt_ids == list(expected), name
