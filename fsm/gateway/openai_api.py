"""The OpenAI APIs as the official SDK sends them: Chat Completions (non-streaming and SSE, `tools`,
`tool_choice`, reasoning as `reasoning_content`) and the Responses API (non-streaming and SSE). Each request
becomes a canonical `Call` (fsm/gateway/record.py) and each `Answer` the API's own answer. Only data is read
from a request: nothing in it is executed, imported or used as a path.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from fsm.gateway.record import Answer, Call, GatewayError, unsupported_tool, with_dropped

TEXT_PARTS = ("text", "input_text", "output_text")


def _assistant(content: str, calls: list[Any], reasoning: Any) -> dict[str, Any]:
    """A model turn as sent back, in either API's form (its reasoning kept only where it has some)."""
    said = {"role": "assistant", "content": content, "tool_calls": calls}
    return {**said, "reasoning": str(reasoning)} if reasoning else said


def _tool_reply(content: Any, call_id: Any, where: str) -> dict[str, Any]:
    return {"role": "tool", "content": _text(content, where), "tool_call_id": call_id}


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts. Images and audio are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif (
                isinstance(part, dict)
                and part.get("type") in TEXT_PARTS
                and isinstance(part.get("text"), str)
            ):
                out.append(part["text"])
            elif isinstance(part, dict) and part.get("type") == "refusal":
                out.append(str(part.get("refusal") or ""))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise GatewayError(f"{where}: content part of type {kind!r} is not supported (text only)")
        return "".join(out)
    raise GatewayError(f"{where}: content must be a string or a list of text parts")


def _int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value <= 0:
        raise GatewayError(f"{name} must be a positive integer", code="invalid_value")
    return value


FUNCTION_FIELDS = ("name", "description", "parameters", "strict")  # what a chat server gives the template


def _function(fn: Any, where: str, prefix: str = "") -> dict[str, Any]:
    """One function tool in Chat Completions form, its fields as sent (`strict` included, so a template that
    writes the schema as JSON writes it too); only `parameters` is filled in when absent (an empty object
    schema, which templates that read it need)."""
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise GatewayError(f"{where}: a function tool needs a name")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise GatewayError(f"{where}: strict must be true or false")
    schema = {key: fn[key] for key in fn if key in FUNCTION_FIELDS and fn[key] is not None}
    schema["name"] = prefix + fn["name"]
    if "description" in schema:
        schema["description"] = str(schema["description"])
    schema.setdefault("parameters", {"type": "object", "properties": {}})
    return {"type": "function", "function": schema}


def _tools(
    tools: Any, dropped: list[str], namespaces: dict[str, tuple[str, str]] | None = None
) -> list[dict[str, Any]] | None:
    """Function tools in Chat Completions form (the Responses API's flat form is converted), in the order sent,
    as vLLM and SGLang hand them to the chat template. With `namespaces` (Responses), the functions of a
    `namespace` tool (Codex's sub-agent tools) are served as vLLM serves them, each named `{namespace}__{name}`,
    and `namespaces` maps that name back (the answer names the two apart, as Codex needs). Other tools (a hosted
    `web_search`, ...) are left out and named in `dropped` (the gateway drops or refuses them)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise GatewayError("tools must be a list")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise GatewayError(f"tools[{k}] must be an object")
        group, inner = tool.get("name"), tool.get("tools")
        if namespaces is not None and tool.get("type") == "namespace" and isinstance(group, str):
            for j, fn in enumerate(inner if isinstance(inner, list) else ()):
                if not isinstance(fn, dict) or fn.get("type") != "function":
                    dropped.append(
                        unsupported_tool(f"tools[{k}].tools[{j}]", fn if isinstance(fn, dict) else {})
                    )
                    continue
                out.append(_function(fn, f"tools[{k}].tools[{j}]", f"{group}__"))
                namespaces[out[-1]["function"]["name"]] = (group, fn["name"])
        elif tool.get("type") == "function":
            out.append(_function(tool.get("function", tool), f"tools[{k}]"))
        else:
            dropped.append(unsupported_tool(f"tools[{k}]", tool))
    return out or None


def _calls(calls: Any, where: str) -> list[dict[str, Any]]:
    out = []
    for k, c in enumerate(calls or ()):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise GatewayError(f"{where}.tool_calls[{k}]: needs function.name")
        out.append({"id": c.get("id"), "name": fn["name"], "arguments": fn.get("arguments")})
    return out


# --- Chat Completions -----------------------------------------------------------------------------------------


def chat_call(body: dict[str, Any]) -> Call:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError("messages must be a non-empty list", code="invalid_value")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise GatewayError(f"messages[{i}] must be an object")
        role = m.get("role")
        where = f"messages[{i}]"
        if role in ("system", "developer"):
            out.append({"role": "system", "content": _text(m.get("content"), where)})
        elif role == "user":
            out.append({"role": "user", "content": _text(m.get("content"), where)})
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning")  # as sent back (vLLM names it both)
            calls = _calls(m.get("tool_calls"), where)
            out.append(_assistant(_text(m.get("content"), where), calls, reasoning))
        elif role == "tool":
            out.append(_tool_reply(m.get("content"), m.get("tool_call_id"), where))
        else:
            raise GatewayError(f"{where}: unsupported role {role!r}")
    n = body.get("n")
    if n not in (None, 1):
        raise GatewayError("n must be 1: a session is one trajectory", code="invalid_value")
    cap = _int(body.get("max_completion_tokens"), "max_completion_tokens") or _int(
        body.get("max_tokens"), "max_tokens"
    )
    options = body.get("stream_options")
    if not isinstance(options, dict):
        options = {}
    dropped: list[str] = []
    return with_dropped(
        Call(
            out,
            _tools(body.get("tools"), dropped),
            cap,
            bool(body.get("stream")),
            {"model": str(body.get("model") or ""), "usage": bool(options.get("include_usage"))},
        ),
        dropped,
    )


def _usage(a: Answer) -> dict[str, Any]:
    return {
        "prompt_tokens": a.prompt_tokens,
        "completion_tokens": a.completion_tokens,
        "total_tokens": a.prompt_tokens + a.completion_tokens,
    }


def chat_answer(a: Answer, call: Call, session: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": a.content}
    if a.reasoning is not None:
        message["reasoning_content"] = a.reasoning
    if a.tool_calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in a.tool_calls
        ]
    return {
        "id": f"chatcmpl-{session}-{a.turn}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": call.extra.get("model", ""),
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": a.finish}],
        "usage": _usage(a),
    }


def chat_stream(a: Answer, call: Call, session: str) -> Iterator[bytes]:
    """The answer as Chat Completions chunks (the turn is generated whole, then sent in its parts)."""
    base = {
        "id": f"chatcmpl-{session}-{a.turn}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": call.extra.get("model", ""),
    }

    def chunk(delta: dict[str, Any], finish: str | None = None, **more: Any) -> bytes:
        data = {
            **base,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            **more,
        }
        return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if a.reasoning:
        yield chunk({"reasoning_content": a.reasoning})
    if a.content:
        yield chunk({"content": a.content})
    for k, c in enumerate(a.tool_calls):
        yield chunk(
            {
                "tool_calls": [
                    {
                        "index": k,
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                ]
            }
        )
    yield chunk({}, a.finish)
    if call.extra.get("usage"):
        yield b"data: " + json.dumps({**base, "choices": [], "usage": _usage(a)}).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def openai_error(exc: GatewayError) -> dict[str, Any]:
    return {"error": {"message": str(exc), "type": exc.kind, "param": None, "code": exc.code}}


# --- Responses ------------------------------------------------------------------------------------------------


def responses_call(body: dict[str, Any]) -> Call:
    if body.get("previous_response_id") or body.get("conversation"):
        raise GatewayError(
            "previous_response_id and conversation are not supported: send the whole input (store=False)",
            code="unsupported_parameter",
        )
    out: list[dict[str, Any]] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise GatewayError("input must be a string or a non-empty list of items", code="invalid_value")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise GatewayError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role in ("system", "developer"):
                role = "system"
            if role not in ("system", "user", "assistant"):
                raise GatewayError(f"{where}: unsupported role {role!r}")
            text = _text(item.get("content"), where)
            if role == "assistant" and out and out[-1]["role"] == "assistant" and not out[-1]["content"]:
                out[-1]["content"] = text  # a reasoning item then its message: one turn
            else:
                out.append(
                    {"role": role, "content": text, **({"tool_calls": []} if role == "assistant" else {})}
                )
        elif kind == "reasoning":  # its text sent back (content, else its summary): the key compares it
            parts = item.get("content") or item.get("summary") or []
            text = "".join(str(p.get("text") or "") for p in parts if isinstance(p, dict))
            out.append(_assistant("", [], text))
        elif kind == "function_call":
            name, group = item.get("name"), item.get("namespace")
            if not isinstance(name, str):
                raise GatewayError(f"{where}: a function_call needs a name")
            name = (
                f"{group}__{name}" if isinstance(group, str) and group else name
            )  # as its tool was rendered
            call = {"id": item.get("call_id"), "name": name, "arguments": item.get("arguments")}
            if out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"].append(call)  # one model turn: its message and calls
            else:
                out.append(_assistant("", [call], None))
        elif kind == "function_call_output":
            out.append(_tool_reply(item.get("output"), item.get("call_id"), where))
        else:
            raise GatewayError(f"{where}: item type {kind!r} is not supported")
    cap = _int(body.get("max_output_tokens"), "max_output_tokens")
    dropped: list[str] = []
    namespaces: dict[str, tuple[str, str]] = {}
    made = Call(
        out,
        _tools(body.get("tools"), dropped, namespaces),
        cap,
        bool(body.get("stream")),
        {"model": str(body.get("model") or ""), "namespaces": namespaces},
    )
    return with_dropped(made, dropped)


def _output_items(a: Answer, rid: str, namespaces: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if a.reasoning:
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{rid}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": a.reasoning}],
            }
        )
    if a.content or not a.tool_calls:
        items.append(
            {
                "type": "message",
                "id": f"msg_{rid}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": a.content, "annotations": [], "logprobs": []}],
            }
        )
    for k, c in enumerate(a.tool_calls):
        group, name = namespaces.get(c["name"], (None, c["name"]))
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{rid}_{k}",
                "call_id": c["id"],
                "name": name,
                **({"namespace": group} if group else {}),  # a namespace's function: its two names apart
                "arguments": c["arguments"],
                "status": "completed",
            }
        )
    return items


def responses_answer(a: Answer, call: Call, session: str) -> dict[str, Any]:
    rid = f"{session}_{a.turn}_{uuid.uuid4().hex[:6]}"
    incomplete = a.finish == "length"
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": int(time.time()),
        "model": call.extra.get("model", ""),
        "status": "incomplete" if incomplete else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": _output_items(a, rid, call.extra.get("namespaces") or {}),
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [{"type": "function", **t["function"]} for t in call.tools or ()],
        "usage": {
            "input_tokens": a.prompt_tokens,
            "output_tokens": a.completion_tokens,
            "total_tokens": a.prompt_tokens + a.completion_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def responses_stream(a: Answer, call: Call, session: str) -> Iterator[bytes]:
    """The Responses API's semantic events for one answer, ending with `response.completed`."""
    final = responses_answer(a, call, session)
    seq = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": next(seq), **data}
        return f"event: {kind}\ndata: ".encode() + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"

    yield event("response.created", response={**final, "status": "in_progress", "output": []})
    for k, item in enumerate(final["output"]):
        start = dict(item, status="in_progress")
        if item["type"] == "message":
            start["content"] = []
        yield event("response.output_item.added", output_index=k, item=start)
        where = {"item_id": item["id"], "output_index": k, "content_index": 0}
        if item["type"] == "message":
            part = item["content"][0]
            yield event("response.content_part.added", **where, part={**part, "text": ""})
            yield event("response.output_text.delta", **where, delta=part["text"], logprobs=[])
            yield event("response.output_text.done", **where, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **where, part=part)
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            yield event("response.reasoning_text.delta", **where, delta=text)
            yield event("response.reasoning_text.done", **where, text=text)
        elif item["type"] == "function_call":
            yield event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=k,
                delta=item["arguments"],
            )
            yield event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=k,
                arguments=item["arguments"],
                name=item["name"],
            )
        yield event("response.output_item.done", output_index=k, item=item)
    yield event(
        "response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final
    )
