"""Gemini's API through the gateway, driven by the real `google-genai` SDK: a calculator loop of
`generate_content` then `generate_content_stream` on one session, token-exact; Google's error shape and key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsm.gateway import HarnessCall, harness
from tests.conftest import extra
from tests.gateway.conftest import ANSWER, assert_token_exact, row
from tests.gateway.test_hostile import post, run, spec

SEEN: dict[str, Any] = {}


def _client(call: HarnessCall) -> Any:
    genai = extra("google.genai", "gateway")
    from google.genai import types

    # the SDK posts to {base_url}/v1beta/models/{model}:generateContent with the key in x-goog-api-key
    options = types.HttpOptions(base_url=call.anthropic_base_url, api_version="v1beta")
    return genai.Client(api_key=call.api_key, http_options=options)


async def sdk_loop(call: HarnessCall) -> Any:
    """The SDK's own loop: the model's content sent back as the SDK parsed it, the function's result beside."""
    from google.genai import types

    client = _client(call)
    calculator = types.FunctionDeclaration(
        name="calculator",
        description="Evaluate an arithmetic expression.",
        parameters=types.Schema(
            type="OBJECT", properties={"expression": types.Schema(type="STRING")}, required=["expression"]
        ),
    )
    config = types.GenerateContentConfig(
        system_instruction="You are a calculator agent.",
        tools=[types.Tool(function_declarations=[calculator])],
        max_output_tokens=64,
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    contents = [types.Content(role="user", parts=[types.Part(text=call.messages[0]["content"])])]
    first = await client.aio.models.generate_content(
        model="gemini-2.5-flash", contents=contents, config=config
    )
    (fc,) = first.function_calls
    SEEN["first"] = (first.candidates[0].finish_reason, fc.name, dict(fc.args), first.usage_metadata)
    contents.append(first.candidates[0].content)
    result = types.FunctionResponse(id=fc.id, name=fc.name, response={"result": "3"})
    contents.append(types.Content(role="user", parts=[types.Part(function_response=result)]))
    chunks = [
        c
        async for c in await client.aio.models.generate_content_stream(
            model="gemini-2.5-flash", contents=contents, config=config
        )
    ]
    SEEN["last"] = chunks[-1].candidates[0].finish_reason, chunks[-1].usage_metadata
    return "".join(c.text or "" for c in chunks)


async def errors(call: HarnessCall) -> Any:
    """Refusals in Google's shape, read by the SDK as its own `APIError`; the key as `?key=` too."""
    from google.genai import errors as genai_errors

    client = _client(call)
    out: dict[str, Any] = {}
    try:  # an image part: refused in one line naming the part
        await client.aio.models.generate_content(
            model="m",
            contents=[{"role": "user", "parts": [{"inline_data": {"mime_type": "image/png", "data": b"x"}}]}],
        )
    except genai_errors.APIError as exc:
        out["image"] = exc.code, exc.status, exc.message
    base = call.anthropic_base_url
    body = {"contents": [{"parts": [{"text": "hi"}]}]}
    out["no_key"] = await post(call, "v1beta/models/m:generateContent", body, key="", base=base)
    out["unknown"] = await post(call, "v1beta/models/m:countTokens", body, base=base)
    out["query_key"] = await post(
        call, f"v1beta/models/m:generateContent?key={call.api_key}", body, key="", base=base
    )
    return out


async def bounded(call: HarnessCall) -> Any:
    """Google's own tools and a thinking budget (left out, noted), a cap of 8 tokens (the turn is cut there)."""
    declaration = {"name": "calculator", "parameters": {"type": "OBJECT", "properties": {}}}
    body = {
        "contents": [{"role": "user", "parts": [{"text": "What is 1 + 2?"}]}],
        "tools": [{"googleSearch": {}}, {"functionDeclarations": [declaration]}],
        "generationConfig": {"maxOutputTokens": 8, "thinkingConfig": {"thinkingBudget": 1024}},
    }
    return await post(call, "v1beta/models/m:streamGenerateContent", body, base=call.anthropic_base_url)


sdk_harness = harness(sdk_loop, timeout_s=120)
errors_harness = harness(errors, timeout_s=120)
bounded_harness = harness(bounded, timeout_s=120)


def test_the_google_genai_sdk_loop_is_token_exact(tmp_path: Path, tokenizer: Any) -> None:
    extra("google.genai", "gateway")
    trajs, backend = run(spec(tmp_path, "tests.gateway.test_gemini:sdk_harness"), tokenizer, [row()])
    (traj,) = trajs
    assert traj.error is None, traj.error
    assert traj.extra["harness"]["outcome"] == "returned", traj.extra["harness"]
    assert traj.extra["harness"]["result"] == ANSWER
    finish, name, args, usage = SEEN["first"]
    assert (str(finish), name, args) == ("FinishReason.STOP", "calculator", {"expression": "1 + 2"})
    assert usage.prompt_token_count == len(traj.prompt_ids)
    assert str(SEEN["last"][0]) == "FinishReason.STOP" and SEEN["last"][1].candidates_token_count > 0
    assert traj.assistant_turns == 2 and traj.user_turns == 1
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["3"]
    assert [m["content"] for m in traj.messages if m["role"] == "system"] == ["You are a calculator agent."]
    assert "gateway_notes" not in traj.extra  # nothing the SDK sent by default was left out
    assert_token_exact(traj, backend)  # one segment: the second call extended the first
    # the tool was rendered as JSON Schema (the SDK writes "OBJECT"), as a chat server renders it
    assert traj.tool_schemas[0]["function"]["parameters"]["type"] == "object"
    assert traj.reward_score == 1.0


def test_gemini_refusals_are_in_googles_shape(tmp_path: Path, tokenizer: Any) -> None:
    extra("google.genai", "gateway")
    trajs, _ = run(spec(tmp_path, "tests.gateway.test_gemini:errors_harness"), tokenizer, [row()])
    out = trajs[0].extra["harness"]["result"]
    code, status, message = out["image"]
    assert (code, status) == (400, "INVALID_ARGUMENT")
    assert message == "contents[0].parts[0]: part 'inlineData' is not supported (text, functionResponse)"
    assert out["no_key"] == (
        401,
        {"error": {"code": 401, "message": "unknown session, or not its key", "status": "UNAUTHENTICATED"}},
    )
    status, body = out["unknown"]
    assert status == 404 and body["error"]["status"] == "NOT_FOUND"
    assert "POST /sessions/{id}/v1beta/models/{model}:streamGenerateContent" in body["error"]["message"]
    status, body = out["query_key"]
    assert status == 200 and body["candidates"][0]["content"]["role"] == "model", body


def test_gemini_tools_it_cannot_serve_are_noted_and_its_cap_holds(tmp_path: Path, tokenizer: Any) -> None:
    trajs, _ = run(spec(tmp_path, "tests.gateway.test_gemini:bounded_harness"), tokenizer, [row()])
    (traj,) = trajs
    status, chunks = traj.extra["harness"]["result"]  # streamed without alt=sse: one JSON array
    assert status == 200 and isinstance(chunks, list), chunks
    last = chunks[-1]
    assert last["candidates"][0]["finishReason"] == "MAX_TOKENS"
    assert last["usageMetadata"]["candidatesTokenCount"] == 8 == len(traj.response_ids)
    assert traj.extra["gateway_notes"] == [
        "tools left out (a local model serves function tools only): tools[0] (type 'googleSearch')",
        "request fields left out (a local model does not serve them): generationConfig.thinkingConfig "
        '{"thinkingBudget": 1024}',
    ]
