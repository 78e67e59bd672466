"""The control calls of an engine, where its runner and backend live: pause and resume generation, weight updates
(from disk, tensors or a process group), memory release and reclaim, cache flush.

`Controls` is a part an engine is composed of: RolloutEngine holds one on its loop (fsm/api.py), each Ray actor
one on its own (fsm/adapters/ray_runner.py), and the public calls over them are written once (`BaseEngine`).
The engine's weight version lives at the run's gate (fsm/run/context.py `PauseGate`): a pause closes the gate
first, so that no model request slips past while the servers pause, and a weight update counts the version that
the next generated tokens record. Each call is also an event on the root span of every trajectory in flight
(traced ones). `servers=False` does the gate's part only: a Ray actor whose servers another actor tells.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fsm.run.engine import PAUSE_MODES
from fsm.run.runtime import Runner

OPS = ("call", "pause", "resume", "update")  # what `run` dispatches (a Ray actor's control call names one)
__all__ = ["OPS", "PAUSE_MODES", "Controls"]


class Controls:
    """One runner's control calls, awaited on the loop its backend lives on; `start` starts that backend first."""

    def __init__(self, runner: Runner, start: Callable[[], Awaitable[None]]):
        self.runner = runner
        self._start = start

    async def run(self, op: str, args: tuple[Any, ...], servers: bool = True) -> Any:
        """`op` (one of OPS) with its arguments: the form a call takes across a process boundary."""
        if op not in OPS:
            raise ValueError(f"unknown control op {op!r}; expected one of {', '.join(OPS)}")
        return await getattr(self, op)(*args, servers=servers)

    async def call(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        required: bool = False,
        *,
        servers: bool = True,
    ) -> Any:
        """The backend's `method` (on every server); None when it has none and it is not `required` (e.g. sleep on
        an in-process model: nothing to release)."""
        await self._start()
        if not servers:
            return None
        backend = self.runner.backend
        fn = getattr(backend, method, None)
        if fn is None:
            if required:
                raise NotImplementedError(
                    f"backend {backend.model_name!r} ({type(backend).__name__}) has no {method}()"
                )
            return None
        return await fn(*args, **(kwargs or {}))

    async def pause(self, mode: str, *, servers: bool = True) -> None:
        await self._start()
        gate = self.runner.gate
        was_paused = gate.paused
        gate.close()  # first: nothing slips past while the servers pause
        try:
            await self.call("pause_generation", (mode,), {}, True, servers=servers)
        except BaseException:
            if not was_paused:
                gate.open()
            raise
        self.event("pause", {"agentfsm.pause.mode": mode, "agentfsm.weight_version": gate.version})

    async def resume(self, *, servers: bool = True) -> None:
        await self._start()
        await self.call("continue_generation", (), {}, True, servers=servers)
        self.runner.gate.open()
        self.event("resume", {"agentfsm.weight_version": self.runner.gate.version})

    async def update(
        self,
        method: str,
        args: tuple[Any, ...],
        options: dict[str, Any],
        weight_version: int | None,
        *,
        servers: bool = True,
    ) -> int:
        """`method` (update_weights_from_*) as version `weight_version` (default: the current one + 1); the version."""
        await self._start()
        gate = self.runner.gate
        version = gate.version + 1 if weight_version is None else weight_version
        await self.call(method, args, {**options, "weight_version": str(version)}, True, servers=servers)
        gate.version = version
        self.event(
            "weight_update", {"agentfsm.weight_version": version, "agentfsm.weight_update.method": method}
        )
        return version

    def event(self, name: str, attributes: dict[str, Any]) -> None:
        """A control event on the root span of every trajectory in flight (traced ones)."""
        for _, root in list(self.runner.live.values()):
            add = getattr(root, "add_event", None)
            if add is not None:
                add(name, attributes)
