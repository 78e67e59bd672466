"""Opt-in content capture: a trajectory's conversation and a model call's token ids decoded into GenAI JSON
messages (`gen_ai.input.messages`, `gen_ai.output.messages`), one per prompt message and trajectory segment.

It runs only with capture on, when the call ends, on the event loop: the engine's tokenizer is not shared
across threads. Special tokens are kept: the text is what the model saw.
"""

from __future__ import annotations

import json
from typing import Any

from fsm.families.pieces import decode


def _parts(messages: list[dict[str, Any]]) -> str:
    """Chat messages in the GenAI JSON shape (`_message`)."""
    return json.dumps(
        [_message(m.get("role"), m.get("content")) for m in messages], ensure_ascii=False, default=str
    )


_NO_CONTENT = (None, None, None)
_ROLES = ("system", "user", "assistant", "tool")


def _roles(root: Any) -> list[tuple[str, int]]:
    """Where each message of the model's context ends, as (role, end) in the request's prompt ids: the
    prompt's messages (found once per trajectory, `_prompt_roles`), then the trajectory's token runs (template
    scaffolding joins the message before it, as turns of the same role join)."""
    traj = root.traj
    roles = root.prompt_roles
    if roles is None:
        roles = root.prompt_roles = _prompt_roles(traj, root.shapes.codec)
    roles, base = list(roles), len(traj.prompt_ids)
    for seg in traj.runs:
        role = seg.role if seg.role in _ROLES else roles[-1][0]
        if role == roles[-1][0]:
            roles[-1] = (role, base + seg.end)
        else:
            roles.append((role, base + seg.end))
    return roles


def _prompt_roles(traj: Any, codec: Any) -> list[tuple[str, int]]:
    """(role, end) of each message of the row's prompt in the prompt ids, from renderings of its first k
    messages; one user message (as rendered, system turns included) where those are not prefixes."""
    ids, messages = traj.prompt_ids, traj.row.get("raw_prompt")
    whole = [("user", len(ids))]
    if codec is None or not isinstance(messages, list) or not messages:
        return whole
    roles: list[tuple[str, int]] = []
    try:
        for k in range(1, len(messages)):
            prefix = codec.render(messages[:k], tools=traj.tool_schemas, add_generation_prompt=False)
            if ids[: len(prefix)].tolist() != list(prefix):
                return whole
            roles.append((str(messages[k - 1].get("role") or "user"), len(prefix)))
    except Exception:  # a template that cannot render a part of the prompt
        return whole
    roles.append((str(messages[-1].get("role") or "user"), len(ids)))  # with the generation prompt
    return roles


def _message(role: str | None, text: Any, **more: Any) -> dict[str, Any]:
    """A GenAI JSON message: {"role", "parts": [{"type": "text", "content"}]}."""
    return {"role": role, "parts": [{"type": "text", "content": text}], **more}


def _input_messages(request: Any, tokenizer: Any, roles: list[tuple[str, int]]) -> str | None:
    """gen_ai.input.messages: the request's prompt ids decoded, message by message."""
    if tokenizer is None:
        return None
    ids, start, messages = request.prompt_ids, 0, []
    for role, end in roles:
        if end > start:
            messages.append(_message(role, decode(tokenizer, ids[start:end], skip_special_tokens=False)))
            start = end
    if start < len(ids):  # tokens the trajectory has not recorded (a custom action's request)
        messages.append(_message("user", decode(tokenizer, ids[start:], skip_special_tokens=False)))
    return json.dumps(messages, ensure_ascii=False)


def _output_messages(result: Any, tokenizer: Any) -> str | None:
    """gen_ai.output.messages: the generated ids decoded, one assistant message with its finish reason."""
    if tokenizer is None:
        return None
    text = decode(tokenizer, result.token_ids, skip_special_tokens=False)
    return json.dumps([_message("assistant", text, finish_reason=result.finish_reason)], ensure_ascii=False)


def _conversation(traj: Any) -> tuple[str, str, str | None]:
    """(input messages, output messages, tool definitions) as GenAI JSON: opt-in content."""
    prompt = traj.row.get("raw_prompt") or []
    n = len(prompt) if isinstance(prompt, list) else 0
    tools = json.dumps(traj.tool_schemas, ensure_ascii=False) if traj.tool_schemas else None
    return (_parts(prompt) if n else "[]"), _parts(traj.messages[n:]), tools
