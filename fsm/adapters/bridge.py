"""What the trainer adapters share: awaiting a trainer's engine from the RolloutEngine's own loop, and
refusing a spec whose trajectories give several rows where the trainer takes one.

A RolloutEngine runs its backend on an event loop of its own (fsm/api.py). A trainer's inference client (an
OpenRLHF rollout actor, SkyRL's InferenceEngineClient) belongs to the trainer's loop: its futures, locks and
sessions must be awaited there. So a generate function that calls it hands the call to that loop (`on_loop`:
fsm/tools/loopthread.py `call`, the engine's own hand-off between loops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsm.tools.loopthread import call

if TYPE_CHECKING:
    from fsm.run.compile import CompiledAgent

on_loop = call  # `await on_loop(coro, loop)`: `coro` awaited on `loop` (the caller's own when None or already on it)


def one_row_per_sample(spec: Any, adapter: str, why: str) -> CompiledAgent:
    """The compiled spec, or ValueError in one line when it may give several rows per trajectory (a context
    policy or rewrite that makes segments, docs/contexts.md) and `adapter`'s trainer takes one per sample."""
    from fsm.api import load_agent

    agent = load_agent(spec)
    if agent.spec.segmenting:
        raise ValueError(
            f"{adapter}: spec {agent.name!r} rewrites its context (context.policy "
            f"{agent.spec.context.policy!r} or a rewrite state), so a trajectory may give several rows "
            f"(segments); {why}: use the append policy without rewrites here"
        )
    return agent
