"""The context policy: where a trajectory's segments begin (fsm/run/trajectory.py `start_segment`).

`append` (the default) appends observations to the tokens so far; only an explicit rewrite
(fsm/run/rewrites.py) starts a segment. `template` (spec `context: {policy: template}`) renders the
conversation through the chat template before each model turn, as a chat server would; when that render is
not an extension of the current segment's tokens (Qwen3 and GLM drop earlier reasoning, Harmony rewrites past
answers), a new segment starts with the render as its prompt. Either way each segment's prompt is the render of
its conversation and the model's own tokens stay as sampled.
"""

from __future__ import annotations

from array import array
from typing import Any

from fsm.run.context import RunContext
from fsm.run.trajectory import Trajectory


def sync_template(ctx: RunContext, traj: Trajectory) -> bool:
    """Before a model turn under the `template` policy: the turn's prompt is the template's render of the
    conversation. If it extends the current segment's tokens, what it adds (usually nothing) is appended with
    mask 0; otherwise a new segment starts with it. False when the render does not fit in prompt_length (the
    budget then counts as spent, so `response_budget_exhausted` ends the trajectory)."""
    render = ctx.codec.encode_prompt(traj.messages, traj.tool_schemas)
    n_prompt, n = len(traj.prompt_ids), len(traj.prompt_ids) + len(traj.response_ids)
    if (
        len(render) >= n
        and array("i", render[:n_prompt]) == traj.prompt_ids
        and array("i", render[n_prompt:n]) == traj.response_ids
    ):
        traj.append_context(render[n:], "template")
        return True
    return begin(ctx, traj, render, "template")


def begin(
    ctx: RunContext, traj: Trajectory, prompt_ids: list[int], reason: str, messages: list | None = None
) -> bool:
    """Start a segment whose prompt is `prompt_ids`, the render of `messages` (None: `traj.messages` now),
    which become the conversation. False, and nothing started, when it does not fit in limits.prompt_length."""
    limit = ctx.agent.limits.prompt_length
    if len(prompt_ids) > limit:
        overflow(traj, f"a {reason} prompt of {len(prompt_ids)} tokens > prompt_length {limit}")
        return False
    traj.start_segment(prompt_ids, reason, messages)  # a traced trajectory's root span gets an event
    return True


def overflow(traj: Trajectory, why: str) -> None:
    """A new segment's prompt does not fit: none is started, and the budget counts as spent."""
    traj.observation_overflow = True
    traj.last_finish_reason = "length"
    traj.extra["context_overflow"] = why


def check_segments(codec: Any, traj: Trajectory, template: bool = False) -> str | None:
    """`--check-tokens`: each segment against the template's render of its own conversation; the first
    difference, prefixed with its segment when there are several (None: every segment is exact).

    Under the `template` policy the last segment is checked up to its last model turn: observations after it
    (a final user reply) were never part of a context the model was given, and a template that rewrites history
    renders the turns before them differently (which is why a next turn would start a new segment)."""
    # per segment where they differ (a gateway tree's nodes)
    seg_tools = getattr(traj, "extra", {}).get("segment_tools")
    if seg_tools is not None and len(seg_tools) != traj.num_segments:
        seg_tools = None
    for seg in traj.segments:
        messages, ids = seg.messages, seg.context_ids()
        last = seg.runs.last("assistant")
        if template and last is not None and last.end < len(seg.response_ids):
            ids = ids[: len(seg.prompt_ids) + last.end]
            messages = messages[: max(i for i, m in enumerate(messages) if m.get("role") == "assistant") + 1]
        ended_on_observation = last is None or len(ids) > len(seg.prompt_ids) + last.end
        tools = seg_tools[seg.index] if seg_tools else traj.tool_schemas
        found = codec.check(messages, tools, ids, ended_on_observation)
        if found is not None:
            return f"segment {seg.index}: {found}" if traj.closed else found
    return None
