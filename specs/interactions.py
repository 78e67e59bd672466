"""An example user simulator for specs/interaction_agent.yaml (verl's BaseInteraction protocol).

The user thinks of a number; the model guesses; the user answers "higher"/"lower" and scores each turn.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

from fsm.run.interaction import BaseInteraction


class GuessNumber(BaseInteraction):
    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self.low, self.high = config.get("secret_range", [1, 10])
        self._secret: dict[str, int] = {}
        self._guesses: dict[str, int] = {}

    async def start_interaction(
        self, instance_id: str | None = None, secret: int | None = None, **kwargs
    ) -> str:
        # A stable secret per instance unless the row gives one (interaction_kwargs.secret).
        span = self.high - self.low + 1
        self._secret[instance_id] = (
            secret if secret is not None else self.low + zlib.crc32(instance_id.encode()) % span
        )
        self._guesses[instance_id] = 0
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs):
        reply = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        found = re.findall(r"-?\d+", reply)
        self._guesses[instance_id] += 1
        if not found:
            return False, "Please answer with a number.", 0.0, {}
        guess, secret = int(found[-1]), self._secret[instance_id]
        if guess == secret:
            return True, "Correct!", 1.0, {"guesses": self._guesses[instance_id]}
        return False, "Higher." if guess < secret else "Lower.", 0.0, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs) -> float:
        return 1.0 / self._guesses[instance_id] if self._guesses.get(instance_id) else 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        self._secret.pop(instance_id, None)
        self._guesses.pop(instance_id, None)
