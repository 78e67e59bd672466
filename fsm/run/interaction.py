"""The user/environment side of INTERACTING, with verl's BaseInteraction protocol (<= v0.7.1).

Unlike verl's loop, all four lifecycle methods are called: `start_interaction` on the first visit,
`generate_response` on every visit, and `calculate_score` + `finalize_interaction` when the trajectory ends.
"""

from __future__ import annotations

import inspect
from typing import Any


class BaseInteraction:
    """Subclass and override `generate_response`."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        return instance_id or ""

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """Returns (should_terminate_sequence, response_content, turn_score, metrics)."""
        raise NotImplementedError

    async def calculate_score(self, instance_id: str | None = None, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        return None


REQUIRED_METHODS = ("start_interaction", "generate_response", "calculate_score", "finalize_interaction")


async def call_lifecycle(method: Any, instance_id: str) -> Any:
    """`calculate_score` / `finalize_interaction` with the instance id, or without it for a verl <= 0.7.1
    interaction that kept the base class's `(self)` signature (its methods then cover all instances)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: assume the documented form
        return await method(instance_id)
    takes_id = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)
    return await (method(instance_id) if takes_id else method())
