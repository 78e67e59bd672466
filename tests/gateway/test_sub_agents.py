"""Sub-agents of a harness that knows nothing of the gateway's child sessions (issue 48 §3): they call on the
session's own URL, and each is recorded as a child node of the model call that started it, found from the
headers the harness sends (Claude Code's `x-claude-code-agent-id`, opencode's `x-session-id`:
GatewayLimits.child_headers) or, for a harness that sends none (qwen-code), from the content: a new conversation
whose final answer is the text of a tool result its parent then sends for the calls it was waiting on. Parallel
sub-agents are parallel children (never `session_busy`), the parent's next call extends its own row (nothing
copied), and every row passes the token check.

The harness here does what those CLIs do, over Anthropic Messages: the model (ToolScript, the tiny tokenizer's
template) answers the task with two calls of the `Agent` tool; the harness runs both sub-agents at once, each a
conversation of its own, and sends their answers back as the calls' results."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from backends.scripted import ScriptedBackend, ToolScript
from fsm.api import RolloutEngine
from fsm.gateway import Gateway, GatewayLimits, HarnessCall, harness
from tests.gateway.conftest import row
from tests.gateway.test_auxiliary import messages
from tests.gateway.test_hostile import _attach, spec

AGENT = {
    "name": "Agent",
    "description": "Start a sub-agent on a task; its final answer is the result.",
    "input_schema": {
        "type": "object",
        "properties": {"description": {"type": "string"}, "prompt": {"type": "string"}},
        "required": ["prompt"],
    },
}
SUB_AGENTS = [{"prompt": "Say pong.", "answer": "pong"}, {"prompt": "Say ping.", "answer": "ping"}]
STEPS = [{"agents": SUB_AGENTS}, {"text": "Done."}]
LIMITS = "limits: {max_assistant_turns: 8, max_new_tokens: 256, response_length: 1024, prompt_length: 1024}"
TASK = {"role": "user", "content": "Ask two sub-agents, then finish."}


def text(answer: dict[str, Any]) -> str:
    return "".join(b["text"] for b in answer["content"] if b["type"] == "text")


async def parent_and_sub_agents(
    call: HarnessCall, header: str | None, result: str, edit: bool = False
) -> str:
    """The parent's turn calls `Agent` twice; both sub-agents run at once (with their own `header` value, or
    none); the parent gets their answers as the calls' results (`result` formats them) and finishes. `edit`: a
    third conversation while the parent waits, whose answer the parent never sends (a rewritten history)."""
    first = await messages(
        call, {"messages": [TASK], "tools": [AGENT], "max_tokens": 400}, {"x-session-id": "ses_main"}
    )
    uses = [b for b in first["content"] if b["type"] == "tool_use"]
    assert [u["name"] for u in uses] == ["Agent", "Agent"], repr(first)[:3000]

    async def sub_agent(k: int, use: dict[str, Any]) -> str:
        headers = {header: f"agent{k}"} if header else {}
        prompt = {"role": "user", "content": use["input"]["prompt"]}
        return text(await messages(call, {"system": "You are a sub-agent.", "messages": [prompt]}, headers))

    answers = await asyncio.gather(*(sub_agent(k, u) for k, u in enumerate(uses)))
    if edit:
        await messages(
            call, {"messages": [{"role": "user", "content": "Say what you know."}], "tools": [AGENT]}
        )
    results = [
        {
            "type": "tool_result",
            "tool_use_id": u["id"],
            "content": [{"type": "text", "text": result.format(a)}],
        }
        for u, a in zip(uses, answers)
    ]
    done = await messages(
        call,
        {
            "messages": [
                TASK,
                {"role": "assistant", "content": first["content"]},
                {"role": "user", "content": results},
            ],
            "tools": [AGENT],
        },
        {"x-session-id": "ses_main"},
    )
    return text(done)


claude_code_like = harness(
    lambda call: parent_and_sub_agents(call, "x-claude-code-agent-id", "{}"), timeout_s=60
)
opencode_like = harness(lambda call: parent_and_sub_agents(call, "x-session-id", "{}"), timeout_s=60)
qwen_code_like = harness(
    lambda call: parent_and_sub_agents(call, None, "Subagent finished.\n{}\n(2 tool calls)"), timeout_s=60
)


async def background_sub_agents(call: HarnessCall) -> str:
    """As qwen-code 0.24 runs its `agent` tool: each call's result says the agent was launched, the parent goes on
    and ends its turn, and the answers come later in one user turn naming each call (`<task-notification>`)."""
    first = await messages(call, {"messages": [TASK], "tools": [AGENT], "max_tokens": 400})
    uses = [b for b in first["content"] if b["type"] == "tool_use"]
    launched = [
        {"type": "tool_result", "tool_use_id": u["id"], "content": "Background agent launched."} for u in uses
    ]
    history = [
        TASK,
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": launched},
    ]
    idle = await messages(call, {"messages": history, "tools": [AGENT]})
    answers = [
        text(
            await messages(
                call,
                {
                    "system": "You are a sub-agent.",
                    "messages": [{"role": "user", "content": u["input"]["prompt"]}],
                },
            )
        )
        for u in uses
    ]
    notes = "\n".join(
        f"<task-notification><tool-use-id>{u['id']}</tool-use-id><result>{a}</result></task-notification>"
        for u, a in zip(uses, answers)
    )
    history += [{"role": "assistant", "content": idle["content"]}, {"role": "user", "content": notes}]
    return text(await messages(call, {"messages": history, "tools": [AGENT]}))


background_harness = harness(background_sub_agents, timeout_s=60)
editing_parent = harness(lambda call: parent_and_sub_agents(call, None, "{}", edit=True), timeout_s=60)


def run(tmp_path: Path, tokenizer: Any, name: str) -> Any:
    backend = ScriptedBackend(ToolScript(tokenizer, STEPS))
    path = spec(tmp_path, f"tests.gateway.test_sub_agents:{name}", LIMITS)
    with RolloutEngine(str(path), tokenizer, backend=backend, check_tokens=True) as engine:
        _attach(Gateway(limits=GatewayLimits()), engine)
        (traj,) = engine._run_sync(engine.arun([row()]))
    assert traj.extra["harness"] == {"outcome": "returned", "result": "Done."}, traj.extra
    assert traj.token_check is None, traj.token_check  # every row is the template's render of its own
    return traj


def copied(traj: Any) -> int:
    """Tokens a row's prompt repeats from the start of another row of its tree's same node line: a parent's
    history copied again into a new row (the child rows' prompts are their own conversations)."""
    segs, rows = traj.segments, traj.extra["tree"]
    out = 0
    for k, (seg, r) in enumerate(zip(segs, rows)):
        if r["node_kind"] == "child":
            continue
        prompt = seg.prompt_ids.tolist()
        for other in segs[:k]:
            ctx = other.context_ids()
            n = 0
            while n < min(len(prompt), len(ctx)) and prompt[n] == ctx[n]:
                n += 1
            out = max(out, n) if n > 64 else out
    return out


@pytest.mark.parametrize("name", ["claude_code_like", "opencode_like", "qwen_code_like"])
def test_parallel_sub_agents_are_children_of_the_call_and_the_parent_goes_on_in_place(
    tmp_path: Path, tokenizer: Any, name: str
) -> None:
    traj = run(tmp_path, tokenizer, name)
    rows = {r["node"]: r for r in traj.extra["tree"]}
    assert sorted((r["node"], r["parent"], r["node_kind"]) for r in rows.values()) == [
        ("0", None, "root"),
        ("0.0", "0", "child"),
        ("0.1", "0", "child"),
    ], traj.extra["tree"]
    root = next(s for s, r in zip(traj.segments, traj.extra["tree"]) if r["node"] == "0")
    # the parent's row: its task, its two calls, their results, its answer; nothing of the children's in it
    assert root.reason == "prompt" and root.turns == 2 and "pong" not in root.messages[-3]["content"][:0]
    first_turn_end = len(root.prompt_ids) + root.runs[0].end
    for r in rows.values():
        if r["node_kind"] == "child":  # each starts where the parent's calling turn ended
            assert r["branch_offset"] == first_turn_end
    children = [s for s, r in zip(traj.segments, traj.extra["tree"]) if r["node_kind"] == "child"]
    assert sorted(s.messages[-1]["content"] for s in children) == ["ping", "pong"]
    assert all(s.reason == "child" and s.turns == 1 for s in children)
    assert copied(traj) == 0
    assert traj.extra.get("gateway_notes") is None


def test_background_sub_agents_answered_in_a_later_user_turn_are_children(
    tmp_path: Path, tokenizer: Any
) -> None:
    """qwen-code's background agents: the parent's turn has ended when they start, and their answers come back in
    a user turn that names each call: still that call's children, and the parent's row goes on in place."""
    traj = run(tmp_path, tokenizer, "background_harness")
    rows = sorted((r["node"], r["parent"], r["node_kind"]) for r in traj.extra["tree"])
    assert rows == [("0", None, "root"), ("0.0", "0", "child"), ("0.1", "0", "child")], rows
    root = traj.segments[-1]
    assert root.reason == "prompt" and root.turns == 3 and copied(traj) == 0


def test_a_new_conversation_whose_answer_the_parent_never_sends_is_a_history_of_the_parent(
    tmp_path: Path, tokenizer: Any
) -> None:
    """The content rule links only what the parent then sends: a third conversation while it waits (a rewrite,
    an edit) is recorded as before, a new segment of the parent's node."""
    traj = run(tmp_path, tokenizer, "editing_parent")
    kinds = sorted((r["node"], r["node_kind"]) for r in traj.extra["tree"])
    assert kinds == [("0", "root"), ("0", "root"), ("0.0", "child"), ("0.1", "child")], kinds
    assert sorted(s.reason for s in traj.segments) == ["child", "child", "history", "prompt"]
