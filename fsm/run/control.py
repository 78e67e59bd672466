"""The control calls of an engine, where its runner and backend live: pause and resume generation, weight updates
(from disk, tensors or a process group), memory release and reclaim, cache flush.

`Controls` is a part an engine is composed of: RolloutEngine holds one on its loop (fsm/api.py), each Ray actor
one on its own (fsm/adapters/ray_runner.py), and the public calls over them are written once (`BaseEngine`).
The engine's weight version lives at the run's gate (fsm/run/context.py `PauseGate`): a pause closes the gate
first, so that no model request slips past while the servers pause, and a weight update counts the version that
the next generated tokens record. Each call is also an event on the root span of every trajectory in flight
(traced ones). `servers=False` does the gate's part only: a Ray actor whose servers another actor tells.

Trees with several policies (docs/trees.md): a policy given a backend of its own has its own gate, so `policy=`
pauses, resumes or updates that policy alone (its tokens record its own version); without `policy=` a pause or
resume is every policy's and an update is the root policy's, as for a spec of one policy.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from backends.base import Backend
from fsm.run.context import PauseGate
from fsm.run.engine import Call, Command, Pause, Resume, Update
from fsm.run.runtime import Runner


class Controls:
    """One runner's control calls, awaited on the loop its backend lives on; `start` starts that backend first."""

    def __init__(self, runner: Runner, start: Callable[[], Awaitable[None]]):
        self.runner = runner
        self.journal: Any = None  # a kept run's fsm/run/journal.py Recorder: each update is recorded in it
        self._start = start

    async def run(self, command: Command, servers: bool = True) -> Any:
        """`command` (fsm/run/engine.py: the form a control call takes, across a process boundary too)."""
        match command:
            case Call(method, args):
                return await self.call(method, args, servers=servers)
            case Pause(mode, policy):
                return await self.pause(mode, policy, servers=servers)
            case Resume(policy):
                return await self.resume(policy, servers=servers)
            case Update(method, args, options, weight_version, policy):
                return await self.update(method, args, dict(options), weight_version, policy, servers=servers)

    async def call(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        required: bool = False,
        *,
        servers: bool = True,
        backend: Backend | None = None,
    ) -> Any:
        """The backend's `method` (on every server); None when it has none and it is not `required` (e.g. sleep on
        an in-process model: nothing to release). `backend`: a policy's (default: the run's)."""
        await self._start()
        if not servers:
            return None
        backend = backend if backend is not None else self.runner.backend
        fn = getattr(backend, method, None)
        if fn is None:
            if required:
                raise NotImplementedError(
                    f"backend {backend.model_name!r} ({type(backend).__name__}) has no {method}()"
                )
            return None
        return await fn(*args, **(kwargs or {}))

    def targets(self, policy: str | None, every: bool) -> list[tuple[PauseGate, Backend]]:
        """The (gate, backend) pairs a call for `policy` acts on: that policy's; None: the root policy's, and with
        `every` also each policy's that has a backend of its own. ValueError for a policy the spec does not
        declare, or one that generates on the run's backend (its weights and pause are the root's)."""
        runner = self.runner
        root = runner.policies.get(runner.agent.spec.policy)
        root_pair = (runner.gate, (root.backend if root is not None else None) or runner.backend)
        if policy is None or policy == runner.agent.spec.policy:
            if policy is not None or not every:
                return [root_pair]
            own = [(p.gate, p.backend) for p in runner.policies.values() if p.gate and p.backend]
            return [root_pair, *own]
        known = runner.policies.get(policy)
        if known is None:
            names = ", ".join(sorted(runner.policies)) or runner.agent.spec.policy
            raise ValueError(f"policy={policy!r}: not a policy of spec {runner.agent.spec.name} ({names})")
        if known.gate is None or known.backend is None:
            raise ValueError(
                f"policy={policy!r} generates on the engine's own backend (none of its own), so its weights and "
                f"pause are the root's: give it one with RolloutEngine(policies={{{policy!r}: backend}})"
            )
        return [(known.gate, known.backend)]

    async def pause(self, mode: str, policy: str | None = None, *, servers: bool = True) -> None:
        """Pause `policy` (None: every policy)."""
        await self._start()
        targets = self.targets(policy, every=True)
        was_paused = [gate.paused for gate, _ in targets]
        for gate, _ in targets:
            gate.close()  # first: nothing slips past while the servers pause
        try:
            for _, backend in targets:
                await self.call("pause_generation", (mode,), {}, True, servers=servers, backend=backend)
        except BaseException:
            for (gate, _), was in zip(targets, was_paused):
                if not was:
                    gate.open()
            raise
        attrs = {"agentfsm.pause.mode": mode, "agentfsm.weight_version": targets[0][0].version}
        self.event("pause", {**attrs, **({"agentfsm.policy": policy} if policy else {})})

    async def resume(self, policy: str | None = None, *, servers: bool = True) -> None:
        """Resume `policy` (None: every policy)."""
        await self._start()
        targets = self.targets(policy, every=True)
        for _, backend in targets:
            await self.call("continue_generation", (), {}, True, servers=servers, backend=backend)
        for gate, _ in targets:
            gate.open()
        attrs = {"agentfsm.weight_version": targets[0][0].version}
        self.event("resume", {**attrs, **({"agentfsm.policy": policy} if policy else {})})

    def version(self, policy: str | None = None) -> int:
        """The weight version `policy` (None: the root policy, or one without a backend of its own) holds."""
        known = self.runner.policies.get(policy) if policy is not None else None
        if known is not None and known.gate is None:
            return self.runner.gate.version
        return self.targets(policy, every=False)[0][0].version

    async def update(
        self,
        method: str,
        args: tuple[Any, ...],
        options: dict[str, Any],
        weight_version: int | None,
        policy: str | None = None,
        *,
        servers: bool = True,
    ) -> int:
        """`method` (update_weights_from_*) as version `weight_version` (default: the current one + 1) on
        `policy`'s backend (None: the root policy's); the version, which that policy's next tokens record."""
        await self._start()
        [(gate, backend)] = self.targets(policy, every=False)
        version = gate.version + 1 if weight_version is None else weight_version
        options = {**options, "weight_version": str(version)}
        await self.call(method, args, options, True, servers=servers, backend=backend)
        gate.version = version
        if self.journal is not None:  # before a token of it is journaled (fsm/run/journal.py `weights`)
            self.journal.weights(version, policy)
        attrs = {"agentfsm.weight_version": version, "agentfsm.weight_update.method": method}
        self.event("weight_update", {**attrs, **({"agentfsm.policy": policy} if policy else {})})
        return version

    def event(self, name: str, attributes: dict[str, Any]) -> None:
        """A control event on the root span of every trajectory in flight (traced ones)."""
        for _, root in list(self.runner.live.values()):
            add = getattr(root, "add_event", None)
            if add is not None:
                add(name, attributes)
