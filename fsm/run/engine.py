"""The engine contract's run-stage half: its refusal (`EngineRefused`), its typed control commands and `Controls`
that runs them, what code running under an engine owns (`Owned`), and `LocalEngine`, the calls the run stage makes
on an engine. The contract itself, what a trainer's code may call on any engine, is fsm/output/engine.py
`BaseEngine` (`fsm.Engine`). Where an engine cannot do a call it raises `EngineRefused`, a NotImplementedError
naming the engine, the call and what to use instead; it never silently does less.

The weight version lives at the run's gate (fsm/run/context.py `PauseGate`): a pause closes the gate first, so no
model request slips past while the servers pause, and an update counts the version the next generated tokens
record. Each control call is an event on the root span of every traced trajectory in flight. With several
policies (docs/trees.md) `policy=` pauses, resumes or updates that policy's own gate alone; without it a pause or
resume is every policy's and an update the root policy's.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, cast

from backends.base import Backend
from fsm.families import Codec
from fsm.run.agent import CompiledAgent
from fsm.run.context import PauseGate, Sampling
from fsm.run.runtime import Runner
from fsm.run.tracer import Tracer
from fsm.run.trajectory import Trajectory

T = TypeVar("T")
StalePolicy = Literal["drop", "rerun"]
PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's /pause_generation modes


class EngineRefused(NotImplementedError):
    """This engine cannot do this call (the message names both, and what can); a documented difference between
    implementations of the contract, never a silent no-op."""

    def __init__(self, engine: object, call: str, why: str):
        super().__init__(f"{type(engine).__name__}.{call}(): {why}")
        self.engine, self.call = type(engine).__name__, call


# -- the control commands: what `apause`, `aupdate_weights_from_*` ... send to every server, checked when made, in a
# form that crosses a process boundary as it is (a Ray actor's control call); `Controls` runs them


@dataclass(frozen=True)
class Call:
    """A server call that changes no count: release or take back memory, flush the cache. The answer is the
    servers'; None where the backend has no such call (an in-process model has no memory to release)."""

    method: Literal["sleep", "wake_up", "flush_cache"]
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Pause:
    """Stop generation (`mode`: one of PAUSE_MODES) for `policy`, None: every policy."""

    mode: str = "abort"
    policy: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {self.mode!r}; expected one of {', '.join(PAUSE_MODES)}")


@dataclass(frozen=True)
class Resume:
    """Continue generation for `policy`, None: every policy."""

    policy: str | None = None


@dataclass(frozen=True)
class Update:
    """New weights through `method` as version `weight_version` (None: the current one + 1) for `policy`'s backend
    (None: the root policy's); `options` go to the server's endpoint as they are."""

    method: Literal[
        "update_weights_from_disk", "update_weights_from_tensor", "update_weights_from_distributed"
    ]
    args: tuple[Any, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    weight_version: int | None = None
    policy: str | None = None

    def __post_init__(self) -> None:
        version = self.weight_version
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise TypeError(f"weight_version must be an int (the engine counts versions), got {version!r}")


Command = Call | Pause | Resume | Update


class Controls:
    """One runner's control calls, awaited on the loop its backend lives on (RolloutEngine's, fsm/api.py; each Ray
    actor's); `start` starts that backend first. `servers=False` does the gate's part only (a Ray actor whose
    servers another actor tells)."""

    def __init__(self, runner: Runner, start: Callable[[], Awaitable[None]]):
        self.runner = runner
        self.journal: Any = None  # a kept run's fsm/run/journal.py Recorder: each update is recorded in it
        self._start = start

    async def run(self, command: Command, servers: bool = True) -> Any:
        """`command` (the form a control call takes, above: across a process boundary too)."""
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


@dataclass(frozen=True)
class Take:
    """`atake_groups`'s question to an engine's core, passed down as one value (its parameters: there)."""

    num_groups: int
    max_staleness: int | None
    stale: StalePolicy
    timeout: float | None
    exhausted_ok: bool


@dataclass(frozen=True)
class SnapshotAsk:
    """`asnapshot`'s request to an engine's core, passed down as one value (its parameters: there)."""

    path: str | Path | None
    meta: Mapping[str, Any] | None
    stop: bool
    timeout: float | None
    abort_turns: bool
    fallback: Callable[[], Path] | None


class LocalEngine(Protocol):
    """An engine whose rows run in this process, on its own loop (fsm.api.RolloutEngine): what a kept run
    (fsm/output/keep.py), its journal's provenance and the gateway reach of it. The whole contract is
    fsm/output/engine.py `BaseEngine` (`fsm.Engine`); this stage names only the calls it makes."""

    agent: CompiledAgent
    codec: Codec
    tracer: Tracer | None
    runner: Runner

    @property
    def wedged(self) -> bool: ...  # a snapshot was taken while code blocked its loop: it runs nothing more
    @property
    def backend(self) -> Backend: ...
    @property
    def owned(self) -> Owned: ...
    @property
    def weight_version(self) -> int: ...
    @property
    def stream_stats(self) -> dict[str, Any]: ...
    async def start(self) -> None: ...
    def sampling(
        self, sampling_params: Mapping[str, Any] | None = None, validate: bool = False
    ) -> Sampling: ...
    def to_batch(
        self,
        trajs: Sequence[Trajectory],
        sampling: Sampling,
        like: Any = None,
        meta: Any = None,
        wall_s: Any = None,
    ) -> Any: ...
    async def asubmit(
        self, rows: Any, n: int = 1, *, sampling: Sampling | None = None, first_index: int | None = None
    ) -> list[str]: ...
    async def atake_groups(self, num_groups: int) -> list[Any]: ...  # fsm.run.stream.Group
    async def asnapshot(
        self,
        path: str | Path | None,
        *,
        stop: bool = False,
        timeout: float | None = None,
        abort_turns: bool = False,
    ) -> dict[str, Any]: ...
    async def arestore(self, path: str | Path | Mapping[str, Any]) -> dict[str, Any]: ...
    async def ajournal(self, journal: Any) -> None: ...


class Owned:
    """What an engine owns beyond its backend and closes with it: services that code running under the engine
    starts on first use (the gateway of harness states, its sessions and threads, fsm/gateway/harness.py), found
    through `owned()`. Two engines in one process share none of it."""

    def __init__(self) -> None:
        self._items: dict[str, Any] = {}

    def get(self, key: str, make: Callable[[], T]) -> T:
        """The engine's `key`, made by `make()` on first use."""
        if key not in self._items:
            self._items[key] = make()
        return cast(T, self._items[key])

    async def aclose(self) -> None:
        """Close everything owned (each item's `aclose()`), newest first; the first error is raised at the end."""
        items, self._items = list(self._items.values()), {}
        failed: BaseException | None = None
        for item in reversed(items):
            try:
                await item.aclose()
            except Exception as exc:
                failed = failed or exc
        if failed is not None:
            raise failed


_OWNED: contextvars.ContextVar[Owned | None] = contextvars.ContextVar("agentfsm_owned", default=None)
# event loop -> the services of code run outside any engine (a bare Runner) on it
_UNOWNED: dict[Any, Owned] = {}


def owned() -> Owned:
    """The services of the engine whose work is running now (every task an engine starts carries it); outside
    any engine, those of the running event loop (a service bound to a loop is never reached from another)."""
    mine = _OWNED.get()
    if mine is not None:
        return mine
    try:
        loop: Any = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop not in _UNOWNED:
        for old in [k for k in _UNOWNED if k is not None and k.is_closed()]:
            del _UNOWNED[old]
        _UNOWNED[loop] = Owned()
    return _UNOWNED[loop]


async def under(owner: Owned, coro: Coroutine[Any, Any, T]) -> T:
    """Await `coro` with `owner` as the running engine's services (tasks it starts inherit them)."""
    token = _OWNED.set(owner)
    try:
        return await coro
    finally:
        _OWNED.reset(token)
