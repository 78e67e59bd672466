"""A reasoning model's thinking through the gateway (issue 48 §4), with the real Qwen3 tokenizer and its chat
template: each API returns it in its own form (Chat Completions `reasoning_content`, a Responses reasoning item,
an Anthropic `thinking` block, a Gemini thought part); a harness that sends it back goes on in the same segment,
token-exact; one that drops it gets a new segment, rendered by the template from what it sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backends.scripted import ScriptedBackend
from fsm.api import RolloutEngine
from fsm.gateway import HarnessCall, harness
from fsm.run.policy import check_segments
from specs.calculator import TOOL_SCHEMA
from tests.conftest import extra
from tests.gateway.conftest import row
from tests.gateway.test_hostile import post, spec
from tests.gateway.test_segments import assert_segments_exact

THINK1, THINK2 = "I should use the calculator.", "The tool said 3."
QWEN3 = [  # each turn ends with the tokenizer's eos (<|im_end|>)
    f'<think>\n{THINK1}\n</think>\n\n<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "1 + 2"}}}}'
    "\n</tool_call>",
    f"<think>\n{THINK2}\n</think>\n\nThe answer is 3.\n#### 3",
]
HARMONY = [  # gpt-oss: the analysis channel, then a call (<|call|>) or the final (<|return|>)
    f"<|channel|>analysis<|message|>{THINK1}<|end|><|start|>assistant to=functions.calculator<|channel|>"
    'commentary json<|message|>{"expression": "1 + 2"}<|call|>',
    f"<|channel|>analysis<|message|>{THINK2}<|end|><|start|>assistant<|channel|>final<|message|>"
    "The answer is 3.\n#### 3<|return|>",
]
# (package, chat template from tests/fixtures/chat_templates, turns, how the first turn's thinking starts, a call
# as the template renders it)
MODELS = {
    "qwen3": ("qwen3", None, QWEN3, f"<think>\n{THINK1}\n</think>", "<tool_call>"),
    "gpt_oss": (
        "gptoss",
        "gpt_oss.jinja",
        HARMONY,
        f"<|channel|>analysis<|message|>{THINK1}<|end|>",
        "to=functions",
    ),
}
TOOL = TOOL_SCHEMA
QUESTION = "What is 1 + 2?"


class Thinking(ScriptedBackend):
    """A reasoning model, scripted: it thinks, calls the calculator, thinks, answers; each request's prompt and
    answer kept per session (as tests/gateway/test_segments.py's Recording)."""

    def __init__(self, tokenizer: Any, turns: list[str] = QWEN3):
        eos = [tokenizer.eos_token_id] if turns is QWEN3 else []
        ids = [tokenizer.encode(t, add_special_tokens=False) + eos for t in turns]
        self.seen: list[tuple[str, list[int], list[int]]] = []

        def turn(session: str, k: int, prompt: list[int]) -> list[int]:
            self.seen.append((session, list(prompt), ids[k % 2]))
            return ids[k % 2]

        super().__init__(turn)


SEEN: dict[str, Any] = {}


async def _post(
    call: HarnessCall, path: str, body: dict[str, Any], base: str | None = None
) -> dict[str, Any]:
    status, answer = await post(call, path, body, base=base)
    assert status == 200, answer
    return answer


async def chat(call: HarnessCall, keep: bool) -> tuple[str | None, str]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [TOOL],
    }
    first = (await _post(call, "chat/completions", body))["choices"][0]["message"]
    back = first if keep else {k: v for k, v in first.items() if k != "reasoning_content"}
    result = {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "3"}
    body["messages"] += [back, result]
    last = (await _post(call, "chat/completions", body))["choices"][0]["message"]
    return first.get("reasoning_content"), last["content"]


async def responses(call: HarnessCall, keep: bool) -> tuple[str | None, str]:
    tools = [{"type": "function", **TOOL["function"]}]
    items: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    first = (await _post(call, "responses", {"model": "m", "input": items, "tools": tools}))["output"]
    thought = next((i["content"][0]["text"] for i in first if i["type"] == "reasoning"), None)
    (fc,) = [i for i in first if i["type"] == "function_call"]
    items += [i for i in first if keep or i["type"] != "reasoning"]
    items.append({"type": "function_call_output", "call_id": fc["call_id"], "output": "3"})
    last = (await _post(call, "responses", {"model": "m", "input": items, "tools": tools}))["output"]
    return thought, next(i for i in last if i["type"] == "message")["content"][0]["text"]


async def messages(call: HarnessCall, keep: bool) -> tuple[str | None, str]:
    tools = [
        {"name": "calculator", "description": "Evaluate.", "input_schema": TOOL["function"]["parameters"]}
    ]
    sent: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    body = {"model": "m", "max_tokens": 64, "messages": sent, "tools": tools}
    first = (await _post(call, "messages", body))["content"]
    thought = next((b["thinking"] for b in first if b["type"] == "thinking"), None)
    (use,) = [b for b in first if b["type"] == "tool_use"]
    sent.append({"role": "assistant", "content": [b for b in first if keep or b["type"] != "thinking"]})
    sent.append(
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "3"}]}
    )
    last = (await _post(call, "messages", body))["content"]
    return thought, next(b["text"] for b in last if b["type"] == "text")


async def gemini(call: HarnessCall, keep: bool) -> tuple[str | None, str]:
    declaration = {k: TOOL["function"][k] for k in ("name", "description", "parameters")}
    contents: list[dict[str, Any]] = [{"role": "user", "parts": [{"text": QUESTION}]}]
    body = {"contents": contents, "tools": [{"functionDeclarations": [declaration]}]}
    path, base = "v1beta/models/m:generateContent", call.anthropic_base_url
    first = (await _post(call, path, body, base))["candidates"][0]["content"]
    thought = next((p["text"] for p in first["parts"] if p.get("thought")), None)
    (fc,) = [p["functionCall"] for p in first["parts"] if "functionCall" in p]
    contents.append({**first, "parts": [p for p in first["parts"] if keep or not p.get("thought")]})
    result = {"functionResponse": {"id": fc["id"], "name": fc["name"], "response": {"result": "3"}}}
    contents.append({"role": "user", "parts": [result]})
    last = (await _post(call, path, body, base))["candidates"][0]["content"]["parts"]
    return thought, next(p["text"] for p in last if not p.get("thought"))


def ids_before_last_turn(traj: Any) -> list[int]:
    run = [r for r in traj.runs if r.role == "assistant"][-1]
    return traj.prompt_ids.tolist() + traj.response_ids[: run.start].tolist()


APIS = {"chat": chat, "responses": responses, "messages": messages, "gemini": gemini}


async def loop(call: HarnessCall) -> Any:
    api, keep = call.row["extra_info"]["api"], call.row["extra_info"]["keep"]
    return await APIS[api](call, keep)


reasoning_harness = harness(loop, timeout_s=120)


@pytest.mark.parametrize("keep", [True, False], ids=["sent_back", "dropped"])
@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize("model", list(MODELS))
def test_thinking_reaches_the_harness_and_the_row_stays_exact(
    tmp_path: Path, real_tokenizer: Any, model: str, api: str, keep: bool
) -> None:
    package, template, turns, thinking, call_markup = MODELS[model]
    tok = real_tokenizer(package, template)
    backend = Thinking(tok, turns)
    limits = "limits: {max_assistant_turns: 4, response_length: 1024, prompt_length: 1024}"
    path = spec(tmp_path, "tests.gateway.test_reasoning:reasoning_harness", limits)
    with RolloutEngine(str(path), tok, backend=backend) as engine:
        (traj,) = engine._run_sync(engine.arun([{**row(), "extra_info": {"api": api, "keep": keep}}]))
        assert traj.error is None, traj.error
        thought, answer = traj.extra["harness"]["result"]
        assert (thought.strip(), answer) == (THINK1, "The answer is 3.\n#### 3")  # each API's own form
        if model == "qwen3" or not keep:  # each segment is the template's render of its conversation
            assert check_segments(engine.codec, traj) is None, check_segments(engine.codec, traj)
        else:  # gpt-oss's template drops a call's analysis once a final follows: exact as each turn saw it
            second = backend.seen[1][1]
            assert THINK1 in tok.decode(second) and second == ids_before_last_turn(traj)
    assert_segments_exact(traj, backend)
    think = tok.encode(thinking, add_special_tokens=False)
    first = traj.segments[0]
    assert first.response_ids[: len(think)].tolist() == think  # the thinking was trained (mask 1)
    assert set(first.response_mask[: len(think)].tolist()) == {1}
    if keep:  # sent back: the second call extended the first's segment
        assert [s.reason for s in traj.segments] == ["prompt"] and first.turns == 2
    else:  # dropped: the conversation the harness holds is rendered as a new segment
        assert [s.reason for s in traj.segments] == ["prompt", "history"]
        prompt = tok.decode(traj.segments[1].prompt_ids.tolist())
        assert THINK1 not in prompt and call_markup in prompt


async def streamed(call: HarnessCall) -> dict[str, Any]:
    """Each API streamed through its own SDK (openai, anthropic, google-genai): the thinking as each SDK
    assembles it from the events."""
    import anthropic
    import openai
    from google import genai
    from google.genai import types

    user = [{"role": "user", "content": QUESTION}]
    out: dict[str, Any] = {}
    client = openai.AsyncOpenAI(base_url=call.base_url, api_key=call.api_key)
    chunks = await client.chat.completions.create(model="m", messages=user, tools=[TOOL], stream=True)  # type: ignore[arg-type,list-item]
    out["chat"] = "".join(
        [getattr(c.choices[0].delta, "reasoning_content", None) or "" async for c in chunks if c.choices]
    )
    async with client.responses.stream(model="m", input=QUESTION) as stream:
        final = await stream.get_final_response()
    out["responses"] = next(i.content[0].text for i in final.output if i.type == "reasoning")  # type: ignore[union-attr,index]
    claude = anthropic.AsyncAnthropic(base_url=call.anthropic_base_url, api_key=call.api_key)
    async with claude.messages.stream(model="m", max_tokens=64, messages=user) as stream:  # type: ignore[arg-type]
        message = await stream.get_final_message()
    out["messages"] = next(b.thinking for b in message.content if b.type == "thinking")
    options = types.HttpOptions(base_url=call.anthropic_base_url, api_version="v1beta")
    gem = genai.Client(api_key=call.api_key, http_options=options)
    parts = [
        p
        async for c in await gem.aio.models.generate_content_stream(model="m", contents=QUESTION)
        for p in c.candidates[0].content.parts
    ]  # type: ignore[union-attr,index]
    out["gemini"] = next(p.text for p in parts if p.thought)
    return out


streamed_harness = harness(streamed, timeout_s=120)


def test_thinking_streams_in_each_sdks_form(tmp_path: Path, real_tokenizer: Any) -> None:
    for module in ("openai", "anthropic", "google.genai"):
        extra(module, "gateway")
    tok = real_tokenizer("qwen3")
    limits = "limits: {max_assistant_turns: 8, response_length: 2048, prompt_length: 1024}"
    path = spec(tmp_path, "tests.gateway.test_reasoning:streamed_harness", limits)
    with RolloutEngine(str(path), tok, backend=Thinking(tok)) as engine:
        (traj,) = engine._run_sync(engine.arun([row()]))
    assert traj.error is None, traj.error
    got = {api: text.strip() for api, text in traj.extra["harness"]["result"].items()}
    assert got == {"chat": THINK1, "responses": THINK2, "messages": THINK1, "gemini": THINK2}
