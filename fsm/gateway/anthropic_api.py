"""Anthropic Messages as the `anthropic` SDK sends it (non-streaming and streaming): a request becomes a
canonical `Call` (fsm/gateway/record.py), an `Answer` becomes a message with thinking, text and tool_use
blocks. Only data is read from a request: nothing in it is executed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fsm.gateway.record import Answer, Call, GatewayError, call_arguments, unsupported_tool, with_dropped

STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}
ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
# Request fields a local model does not serve: read, left out, and noted on the row (`gateway_notes`). Claude Code
# sends the first three by default: its thinking budget (reasoning is the spec's chat template's to decide),
# context editing (the harness's history is recorded as sent) and effort; `cache_control` and `metadata` change
# nothing a server does with the prompt and are not noted.
UNSERVED = ("thinking", "context_management", "output_config", "stop_sequences", "mcp_servers", "container")


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise GatewayError(f"{where}: content must be a string or a list of blocks")
    for k, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise GatewayError(f"{where}.content[{k}] must be a block with a type")
    return content


def _block_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    out = []
    for k, block in enumerate(_blocks(content, where)):
        if block["type"] != "text" or not isinstance(block.get("text"), str):
            raise GatewayError(
                f"{where}.content[{k}]: block type {block['type']!r} is not supported here (text only)"
            )
        out.append(block["text"])
    return "".join(out)


def messages_call(body: dict[str, Any]) -> Call:
    out: list[dict[str, Any]] = []
    if body.get("system"):
        out.append({"role": "system", "content": _block_text(body["system"], "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError("messages: must be a non-empty list")
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise GatewayError(f"{where}: role must be 'user', 'assistant' or 'system'")
        if m["role"] == "system":  # Claude Code sends some so: the chat template renders it where it stands
            out.append({"role": "system", "content": _block_text(m.get("content"), where)})
            continue
        blocks = _blocks(m.get("content"), where)
        if m["role"] == "assistant":
            text, calls, thought = [], [], []
            for k, b in enumerate(blocks):
                if b["type"] == "text":
                    text.append(str(b.get("text") or ""))
                elif b["type"] == "thinking":  # the model's reasoning sent back: its key compares it
                    thought.append(str(b.get("thinking") or ""))
                elif b["type"] == "tool_use":
                    if not isinstance(b.get("name"), str):
                        raise GatewayError(f"{where}.content.{k}: tool_use needs a name")
                    calls.append({"id": b.get("id"), "name": b["name"], "arguments": b.get("input")})
                elif b["type"] != "redacted_thinking":
                    raise GatewayError(f"{where}.content.{k}: block type {b['type']!r} is not supported")
            said = {"role": "assistant", "content": "".join(text), "tool_calls": calls}
            out.append({**said, "reasoning": "".join(thought)} if thought else said)
            continue
        text = []
        for k, b in enumerate(blocks):
            if b["type"] == "tool_result":
                content = b.get("content")
                result = _block_text(content, f"{where}.content.{k}") if content is not None else ""
                out.append({"role": "tool", "content": result, "tool_call_id": b.get("tool_use_id")})
            elif b["type"] == "text":
                text.append(str(b.get("text") or ""))
            else:
                raise GatewayError(f"{where}.content.{k}: block type {b['type']!r} is not supported")
        if text:
            out.append({"role": "user", "content": "".join(text)})
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int or max_tokens <= 0:
        raise GatewayError("max_tokens: a positive integer is required")
    tools: list[dict[str, Any]] | None = None
    dropped: list[str] = []
    if body.get("tools") is not None:
        if not isinstance(body["tools"], list):
            raise GatewayError("tools: must be a list")
        tools = []
        for k, t in enumerate(body["tools"]):
            # a server tool (web_search_..., bash_...)
            if isinstance(t, dict) and t.get("type") not in (None, "custom"):
                dropped.append(unsupported_tool(f"tools.{k}", t))
                continue
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise GatewayError(f"tools.{k}: a tool needs a name (custom tools only)")
            fn = {"name": t["name"]}
            if t.get("description") is not None:
                fn["description"] = str(t["description"])
            fn["parameters"] = t.get("input_schema") or {"type": "object", "properties": {}}
            tools.append({"type": "function", "function": fn})
        tools = tools or None
    extra: dict[str, Any] = {"model": str(body.get("model") or "")}
    if _title_schema(body.get("output_config")):
        extra["title_schema"] = True
    call = Call(out, tools, max_tokens, bool(body.get("stream")), extra)
    return with_dropped(call, dropped, body, UNSERVED)


def _title_schema(config: Any) -> bool:
    """Whether `output_config` asks for a JSON answer with a `title` property (Claude Code's title request)."""
    fmt = config.get("format") if isinstance(config, dict) else None
    schema = fmt.get("schema") if isinstance(fmt, dict) and fmt.get("type") == "json_schema" else None
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return isinstance(properties, dict) and "title" in properties


def _content(a: Answer) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if a.reasoning:
        blocks.append({"type": "thinking", "thinking": a.reasoning, "signature": ""})
    if a.content or not a.tool_calls:
        blocks.append({"type": "text", "text": a.content})
    for c in a.tool_calls:
        blocks.append(
            {"type": "tool_use", "id": c["id"], "name": c["name"], "input": call_arguments(c["arguments"])}
        )
    return blocks


def messages_answer(a: Answer, call: Call, session: str) -> dict[str, Any]:
    return {
        "id": f"msg_{session}_{a.turn}",
        "type": "message",
        "role": "assistant",
        "model": call.extra.get("model", ""),
        "content": _content(a),
        "stop_reason": STOP_REASONS[a.finish],
        "stop_sequence": None,
        "usage": {"input_tokens": a.prompt_tokens, "output_tokens": a.completion_tokens},
    }


def messages_stream(a: Answer, call: Call, session: str) -> Iterator[bytes]:
    final = messages_answer(a, call, session)

    def event(kind: str, **data: Any) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()

    usage = {"input_tokens": a.prompt_tokens, "output_tokens": 0}
    yield event("message_start", message={**final, "content": [], "stop_reason": None, "usage": usage})
    for k, block in enumerate(final["content"]):
        if block["type"] == "thinking":
            yield event("content_block_start", index=k, content_block={**block, "thinking": ""})
            yield event(
                "content_block_delta",
                index=k,
                delta={"type": "thinking_delta", "thinking": block["thinking"]},
            )
            yield event("content_block_delta", index=k, delta={"type": "signature_delta", "signature": ""})
        elif block["type"] == "text":
            yield event("content_block_start", index=k, content_block={"type": "text", "text": ""})
            if block["text"]:
                yield event(
                    "content_block_delta", index=k, delta={"type": "text_delta", "text": block["text"]}
                )
        else:
            yield event("content_block_start", index=k, content_block={**block, "input": {}})
            yield event(
                "content_block_delta",
                index=k,
                delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
            )
        yield event("content_block_stop", index=k)
    yield event(
        "message_delta",
        delta={"stop_reason": final["stop_reason"], "stop_sequence": None},
        usage={"output_tokens": a.completion_tokens},
    )
    yield event("message_stop")


def anthropic_error(exc: GatewayError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(exc.status, "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(exc)}}
