"""One model call of a session, recorded on its node of the session's tree (fsm/gateway/tree.py): the request's
new messages are appended as the family codec's observation suffix (or start the node's segment), the model's
turn is generated through the engine's own `generate` action, and the answer comes back parsed. How a request
is matched against what was recorded is fsm/gateway/record.py.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from typing import Any

from fsm.gateway.record import Answer, Call, LimitReached, Plan, template_message
from fsm.gateway.tree import SessionNode, Tree
from fsm.run.actions import generate
from fsm.run.context import RunContext
from fsm.run.trajectory import Trajectory, first_segment

DROPPED = {  # what a call left out (record.with_dropped), as its note on the row says it
    "dropped_tools": "tools left out (a local model serves function tools only)",
    "dropped_fields": "request fields left out (a local model does not serve them)",
}


# a request of at least this many tokens (Codec.fewest_tokens) is rendered and tokenized in a thread, so that a
# long one does not stall every session on the loop (docs/gateway.md, "Cost")
OFF_LOOP_TOKENS = 256


async def _tokenized(floor: int, fn: Any, *args: Any) -> Any:
    """`fn(*args)`, the codec rendering and tokenizing messages of `floor` tokens at least: on the loop when small, in
    a thread when large (the codec serves several threads, fsm/families/pieces.py; the session waits for it)."""
    if floor < OFF_LOOP_TOKENS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _too_long(tokens: int | str, limit: int) -> LimitReached:
    message = f"the prompt is {tokens} tokens, past the spec's limits.prompt_length {limit}"
    return LimitReached(message, code="context_length_exceeded")


async def _start(
    ctx: RunContext, traj: Trajectory, tree: Tree, node: SessionNode, call: Call, plan: Plan
) -> list[dict[str, Any]]:
    """Record the request's messages before the model's turn on `node` (fsm/gateway/tree.py); the messages
    appended as observations."""
    limit = ctx.agent.limits.prompt_length
    recorder = node.recorder
    if plan.kind in ("first", "history"):
        templ = [template_message(m) for m in plan.new]
        if (floor := ctx.codec.fewest_tokens(templ)) > limit:  # refused before the whole text is tokenized
            raise _too_long(f"at least {floor}", limit)
        ids = await _tokenized(floor, ctx.codec.encode_prompt, templ, call.tools)
        if len(ids) > limit:
            raise _too_long(len(ids), limit)
        if plan.kind == "first" and node.kind == "root" and tree.live < 0:  # the trajectory's own segment
            traj.messages = templ
            traj.set_prompt(ids)
            traj.segment_start = first_segment(len(templ))
            traj.tool_schemas = call.tools
            seq = tree.register(node, call.tools)
        else:
            # (the root's first call after an auxiliary call's began the trajectory: its prompt, a segment of its own)
            reason = ("prompt" if node.kind == "root" else "child") if plan.kind == "first" else "history"
            if plan.kind == "history":
                tree.switch(traj, node)
            seq = tree.begin(traj, node, ids, reason, templ, call.tools)
        recorder.begin(plan.keys, call.tools, plan.new, seq)
        return []
    if plan.kind == "branch":
        seq, nk, n_messages, n_tokens = plan.mark  # type: ignore[misc]
        seg = tree.segment(traj, seq)
        ids = seg.context_ids()[:n_tokens]  # the earlier turn's context, token for token
        if len(ids) > limit:
            raise _too_long(len(ids), limit)
        seg_keys, seg_tools = node.up.recorder.segments[seq]  # type: ignore[union-attr]
        new = tree.begin(traj, node, ids, "branch", list(seg.messages[:n_messages]), seg_tools)
        traj.needs_tail = True  # the context ends with that model turn: its template closer is owed
        recorder.begin(seg_keys[:nk], seg_tools, call.messages[:nk], new)  # the request's: keys seg_keys[:nk]
    else:
        tree.switch(traj, node)
    return [template_message(m) for m in plan.new]


async def _observe(ctx: RunContext, traj: Trajectory, templ: list[dict[str, Any]]) -> bool:
    """Append `templ` (tool results or user turns) as the codec's observation suffix, mask 0: the template's
    closer owed after the model turn the context ends with first (as RunContext.add_observation does, with that
    turn's last token read from the context, which after a branch is the segment's prompt). False when they do
    not fit in what is left of the response budget."""
    role = "tool" if any(m["role"] == "tool" for m in templ) else "user"
    owed = traj.needs_tail and ctx.agent.spec.turn_closer == "template"
    context_end = traj.response_ids if len(traj.response_ids) else traj.prompt_ids
    last = context_end[-1:].tolist() if owed else None
    floor, left = ctx.codec.fewest_tokens(templ), ctx.agent.limits.response_length - len(traj.response_mask)
    if floor >= left:
        return False  # far past what is left: not tokenized
    closer, ids = await _tokenized(floor, ctx.codec.observation, templ, last, traj.messages)
    if len(closer) + len(ids) >= left:
        return False
    traj.append_context(closer, "template")
    traj.append_context(ids, role)
    traj.needs_tail = False
    traj.messages.extend(templ)
    if role == "tool":
        traj.user_turns += 1
    return True


async def record_call(ctx: RunContext, traj: Trajectory, tree: Tree, call: Call, call_prefix: str) -> Answer:
    """Append the call's new messages to `traj`, generate the model's turn, and return it parsed.

    The first call encodes the prompt (the codec's render, tools included); later ones append only their new
    messages' observation suffix. The turn itself is the engine's `generate` action: budgets, pause/resume,
    per-token weight versions, the span and the parser are the same as a spec's GENERATING state."""
    limits = ctx.agent.limits
    node, plan = tree.plan(traj, call)
    recorder = node.recorder
    if node.seqs and limits.max_assistant_turns is not None and recorder.turns >= limits.max_assistant_turns:
        raise LimitReached(  # per node: a sub-agent or a branch has the spec's limits of its own
            f"node {node.node} has made its limits.max_assistant_turns ({limits.max_assistant_turns}) model calls"
        )
    for key, why in DROPPED.items():  # noted once per distinct set (a harness sends the same with every call)
        if call.extra.get(key):
            note = f"{why}: {', '.join(call.extra[key])}"
            notes = traj.extra.setdefault("gateway_notes", [])
            if note not in notes:
                notes.append(note)
    templ = await _start(ctx, traj, tree, node, call, plan)
    if templ and not await _observe(ctx, traj, templ):
        raise LimitReached(
            f"the new messages do not fit in what is left of limits.response_length {limits.response_length}",
            code="context_length_exceeded",
        )
    if plan.kind == "extend":
        recorder.extend(plan.keys, plan.new)
    elif plan.kind == "branch":
        recorder.extend(plan.keys[plan.mark[1] :], plan.new)  # type: ignore[index]
    if len(traj.response_mask) >= limits.response_length:
        raise LimitReached(f"the session has used its limits.response_length {limits.response_length} tokens")
    sub = ctx
    if call.max_tokens is not None:  # the request's own cap, within the spec's
        cap = ctx.sampling.max_new_tokens
        sub = copy.copy(ctx)
        sub.sampling = dataclasses.replace(
            ctx.sampling, max_new_tokens=call.max_tokens if cap is None else min(cap, call.max_tokens)
        )
    prompt_tokens = len(traj.prompt_ids) + len(traj.response_ids)
    before = len(traj.response_ids)
    await generate(sub, traj)
    ids = traj.response_ids[before:].tolist()
    # the codec has split the turn already (fsm/families/codec.py assistant_message): the answer as `content`,
    # the reasoning beside it (`reasoning_content`, Harmony's `thinking`); it is returned in each API's form
    said = traj.messages[-1] if traj.messages and traj.messages[-1]["role"] == "assistant" else {}
    rest = said.get("content") or ""
    reasoning = said.get("reasoning_content") or said.get("thinking") or None
    calls, traj.pending_calls = traj.pending_calls, []
    valid = [c for c in calls if c.error is None and c.name]
    family = getattr(ctx.codec, "family", None)
    harmony = family is not None and family.reasoning == "harmony"  # its message holds the final channel only
    content = rest if harmony or len(valid) < len(calls) else ctx.parser.content(rest)
    if valid:
        content = content.strip()
    turn = recorder.turns
    if node.kind != "root":  # call ids stay distinct over the tree's nodes
        call_prefix = f"{call_prefix}_n{node.node.replace('.', '_')}"
    tool_calls = [
        {
            "id": c.id or f"{call_prefix}_{turn}_{k}",
            "name": c.name,
            "arguments": json.dumps(c.arguments if c.arguments is not None else {}, ensure_ascii=False),
        }
        for k, c in enumerate(valid)
    ]
    finish = "tool_calls" if tool_calls else ("length" if traj.last_finish_reason == "length" else "stop")
    message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    # recorded: a harness that sends it back goes on in this segment, one that drops it does not
    if reasoning:
        message["reasoning"] = reasoning
    recorder.turn(traj, message)
    return Answer(content, reasoning, tool_calls, finish, prompt_tokens, len(ids), turn)
