"""What the trainer adapters share: awaiting a trainer's engine from the RolloutEngine's own loop, and
refusing a spec whose trajectories give several rows (segments, or trees: docs/trees.md) where the trainer
takes one.

A RolloutEngine runs its backend on an event loop of its own (fsm/api.py). A trainer's inference client (an
OpenRLHF rollout actor, SkyRL's InferenceEngineClient) belongs to the trainer's loop: its futures, locks and
sessions must be awaited there. So a generate function that calls it hands the call to that loop (`on_loop`:
fsm/run/local.py `call`, the engine's own hand-off between loops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsm.run.local import call

if TYPE_CHECKING:
    from fsm.run.compile import CompiledAgent

on_loop = call  # `await on_loop(coro, loop)`: `coro` awaited on `loop` (the caller's own when None or already on it)


TREES_ELSEWHERE = (
    "train trees with SkyRL (FSMGenerator(step_wise=True)) or AReaL (FSMWorkflow), or use a spec without "
    "forks and child machines here"
)


def tree_parts(agent: CompiledAgent) -> str | None:
    """What makes `agent`'s trajectories trees (its forks, its child machines and their policies), or None."""
    parts = []
    if agent.forks:
        parts.append(f"a fork at {', '.join(sorted(agent.forks))}")
    if agent.spec.children:
        parts.append(f"child machines {', '.join(agent.spec.children)}")
    if len(agent.spec.policies) > 1:
        parts.append(f"policies {', '.join(agent.spec.policies)}")
    return "; ".join(parts) or None


SEGMENTS_ELSEWHERE = "use the append policy without rewrites here"


def one_row_per_sample(spec: Any, adapter: str, why: str, trees: str = TREES_ELSEWHERE) -> CompiledAgent:
    """The compiled spec, refused as `one_row` refuses it."""
    from fsm.api import load_agent

    return one_row(load_agent(spec), adapter, why, trees)


def one_row(
    agent: CompiledAgent,
    adapter: str,
    why: str,
    trees: str = TREES_ELSEWHERE,
    segments: str = SEGMENTS_ELSEWHERE,
) -> CompiledAgent:
    """`agent`, or ValueError in one line when it may give several rows per trajectory (a context policy or
    rewrite that makes segments, docs/contexts.md; a fork or a child machine, docs/trees.md) and `adapter`'s
    trainer takes one per sample (`why`); `trees` and `segments` say what to do instead."""
    if agent.spec.segmenting:
        raise ValueError(
            f"{adapter}: spec {agent.name!r} rewrites its context (context.policy "
            f"{agent.spec.context.policy!r} or a rewrite state), so a trajectory may give several rows "
            f"(segments); {why}: {segments}"
        )
    if (parts := tree_parts(agent)) is not None:
        raise ValueError(
            f"{adapter}: spec {agent.name!r} makes trees ({parts}), so a sample gives several rows, "
            f"each tagged with its policy (docs/trees.md); {why}: {trees}"
        )
    return agent
