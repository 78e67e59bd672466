"""Gemini's API (v1beta) as the `google-genai` SDK and Gemini CLI send it: `models/{model}:generateContent` and
`:streamGenerateContent` (`?alt=sse`: server-sent events; without it, one JSON array). A request's `contents`
(roles user and model; parts text, functionCall, functionResponse, thought text) become a canonical `Call`
(fsm/gateway/record.py) and an `Answer` becomes `candidates[0].content.parts`. Only data is read from a request:
nothing in it is executed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fsm.gateway.record import Answer, Call, GatewayError, call_arguments, unsupported_tool, with_dropped

PREFIX = "v1beta/models/"
METHODS = ("generateContent", "streamGenerateContent")
# generationConfig fields a local model does not serve: read, left out, and noted on the row (`gateway_notes`);
# sampling fields (temperature, topP, ...) are the spec's to decide, as on the other APIs, and are not noted
UNSERVED_CONFIG = (
    "thinkingConfig",
    "responseSchema",
    "responseJsonSchema",
    "stopSequences",
    "responseModalities",
)
UNSERVED = ("cachedContent", "toolConfig")
_METADATA = ("thought", "thoughtSignature", "partMetadata", "videoMetadata")  # what sits beside a part's data
# Google's error statuses by HTTP status (google.rpc.Code), as its SDKs read them
STATUSES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def split_path(tail: str) -> tuple[str, str] | None:
    """(method, model) of `v1beta/models/{model}:{method}`, or None for any other path."""
    if not tail.startswith(PREFIX):
        return None
    model, _, method = tail[len(PREFIX) :].rpartition(":")
    return (method, model) if model and method in METHODS else None


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    parts = content.get("parts") if isinstance(content, dict) else None
    if not isinstance(parts, list):
        raise GatewayError(f"{where}.parts: must be a list of parts")
    for k, part in enumerate(parts):
        if not isinstance(part, dict):
            raise GatewayError(f"{where}.parts[{k}]: must be an object")
    return parts


def _kind(part: dict[str, Any]) -> str:
    """A part's data field (text, functionCall, ...), whatever metadata sits beside it (thought, thoughtSignature)."""
    data = [key for key in part if key not in _METADATA]
    return data[0] if len(data) == 1 else ("text" if "text" in part else ",".join(data) or "empty")


def _system(instruction: Any) -> str:
    if isinstance(instruction, str):
        return instruction
    out = []
    for k, part in enumerate(_parts(instruction, "systemInstruction")):
        if _kind(part) != "text" or not isinstance(part.get("text"), str):
            raise GatewayError(f"systemInstruction.parts[{k}]: only text parts are supported")
        out.append(part["text"])
    return "".join(out)


def _result(response: Any) -> str:
    """A functionResponse's `response` as the tool result's text: the one string it wraps (Gemini CLI sends
    `{"output": ...}`, SDK examples `{"result": ...}`), else the object as JSON."""
    if isinstance(response, dict) and len(response) == 1:
        ((key, value),) = response.items()
        if key in ("output", "result", "content") and isinstance(value, str):
            return value
    return json.dumps(response, ensure_ascii=False)


def _named(part: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    """A functionCall's or functionResponse's object, which must name its function."""
    value = part[kind]
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise GatewayError(f"{where}: a {kind} needs a name")
    return value


def _model_turn(parts: list[dict[str, Any]], where: str) -> dict[str, Any]:
    text, thought, calls = [], [], []
    for k, part in enumerate(parts):
        kind = _kind(part)
        if kind == "text" and part.get("thought"):
            thought.append(str(part.get("text") or ""))
        elif kind == "text":
            text.append(str(part.get("text") or ""))
        elif kind == "functionCall":
            fc = _named(part, kind, f"{where}.parts[{k}]")
            calls.append({"id": fc.get("id"), "name": fc["name"], "arguments": fc.get("args") or {}})
        else:
            raise GatewayError(f"{where}.parts[{k}]: part {kind!r} is not supported (text, functionCall)")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text), "tool_calls": calls}
    if thought:
        message["reasoning"] = "".join(thought)
    return message


def _user_turn(parts: list[dict[str, Any]], where: str, out: list[dict[str, Any]]) -> None:
    text = []
    for k, part in enumerate(parts):
        kind = _kind(part)
        if kind == "text":
            text.append(str(part.get("text") or ""))
        elif kind == "functionResponse":
            fr = _named(part, kind, f"{where}.parts[{k}]")
            result = _result(fr.get("response"))
            out.append({"role": "tool", "content": result, "tool_call_id": fr.get("id"), "name": fr["name"]})
        else:
            raise GatewayError(f"{where}.parts[{k}]: part {kind!r} is not supported (text, functionResponse)")
    if text:
        out.append({"role": "user", "content": "".join(text)})


def _schema(schema: Any) -> Any:
    """An OpenAPI schema of Gemini's form as JSON Schema, as a chat template reads it: the SDK writes types in
    upper case (`"OBJECT"`)."""
    if isinstance(schema, list):
        return [_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        key: value.lower() if key == "type" and isinstance(value, str) else _schema(value)
        for key, value in schema.items()
    }


def _tools(tools: Any, dropped: list[str]) -> list[dict[str, Any]] | None:
    """`tools[].functionDeclarations` as function tools; Google's own tools (googleSearch, codeExecution,
    urlContext, ...) are left out and named in `dropped` (the gateway drops or refuses them)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise GatewayError("tools: must be a list")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise GatewayError(f"tools[{k}]: must be an object")
        for key in tool:
            if key != "functionDeclarations":
                dropped.append(unsupported_tool(f"tools[{k}]", {"type": key}))
        declarations = tool.get("functionDeclarations") or []
        if not isinstance(declarations, list):
            raise GatewayError(f"tools[{k}].functionDeclarations: must be a list")
        for j, fn in enumerate(declarations):
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise GatewayError(f"tools[{k}].functionDeclarations[{j}]: a function needs a name")
            schema: dict[str, Any] = {"name": fn["name"]}
            if fn.get("description") is not None:
                schema["description"] = str(fn["description"])
            params = fn.get("parametersJsonSchema") or _schema(fn.get("parameters"))
            schema["parameters"] = params or {"type": "object", "properties": {}}
            out.append({"type": "function", "function": schema})
    return out or None


def generate_call(body: dict[str, Any], stream: bool = False) -> Call:
    out: list[dict[str, Any]] = []
    if body.get("systemInstruction") is not None:
        out.append({"role": "system", "content": _system(body["systemInstruction"])})
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        raise GatewayError("contents: must be a non-empty list")
    for i, content in enumerate(contents):
        where = f"contents[{i}]"
        role = content.get("role", "user") if isinstance(content, dict) else None
        if role not in ("user", "model", "function"):
            raise GatewayError(f"{where}: role must be 'user' or 'model'")
        parts = _parts(content, where)
        if role == "model":
            out.append(_model_turn(parts, where))
        else:
            _user_turn(parts, where, out)
    config = body.get("generationConfig") or {}
    if not isinstance(config, dict):
        raise GatewayError("generationConfig: must be an object")
    if config.get("candidateCount") not in (None, 1):
        raise GatewayError("generationConfig.candidateCount must be 1: a session is one trajectory")
    cap = config.get("maxOutputTokens")
    if cap is not None and (type(cap) is not int or cap <= 0):
        raise GatewayError("generationConfig.maxOutputTokens must be a positive integer")
    dropped: list[str] = []
    made = Call(out, _tools(body.get("tools"), dropped), cap, stream, {"model": ""})
    unserved = {k: body[k] for k in UNSERVED if k in body}
    unserved.update({f"generationConfig.{k}": config[k] for k in UNSERVED_CONFIG if k in config})
    return with_dropped(made, dropped, unserved, tuple(unserved))


def _parts_of(a: Answer) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if a.reasoning:
        parts.append({"text": a.reasoning, "thought": True})
    if a.content or not a.tool_calls:
        parts.append({"text": a.content})
    for c in a.tool_calls:
        call = {"id": c["id"], "name": c["name"], "args": call_arguments(c["arguments"])}
        parts.append({"functionCall": call})
    return parts


def _response(a: Answer, call: Call, session: str, parts: list[dict[str, Any]], last: bool) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    if last:
        candidate["finishReason"] = "MAX_TOKENS" if a.finish == "length" else "STOP"
    out: dict[str, Any] = {"candidates": [candidate]}
    if last:
        out["usageMetadata"] = {
            "promptTokenCount": a.prompt_tokens,
            "candidatesTokenCount": a.completion_tokens,
            "totalTokenCount": a.prompt_tokens + a.completion_tokens,
        }
    out["modelVersion"] = call.extra.get("model", "")
    out["responseId"] = f"{session}_{a.turn}"
    return out


def generate_answer(a: Answer, call: Call, session: str) -> dict[str, Any]:
    return _response(a, call, session, _parts_of(a), last=True)


def stream_chunks(a: Answer, call: Call, session: str) -> list[dict[str, Any]]:
    """The answer as streamed responses, one part each (the turn is generated whole, then sent in its parts);
    the last carries `finishReason` and `usageMetadata`."""
    parts = _parts_of(a)
    return [_response(a, call, session, [p], last=k == len(parts) - 1) for k, p in enumerate(parts)]


def generate_stream(a: Answer, call: Call, session: str) -> Iterator[bytes]:
    for chunk in stream_chunks(a, call, session):
        yield b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\r\n\r\n"


def gemini_error(exc: GatewayError) -> dict[str, Any]:
    return {"error": {"code": exc.status, "message": str(exc), "status": STATUSES.get(exc.status, "UNKNOWN")}}
