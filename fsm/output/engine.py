"""The engine contract: what a trainer's code may call on any rollout engine (`fsm.Engine`), written once as
`BaseEngine` over the engine's `Core` (where its work runs, its rows, its control calls, its weight version).

    batch = engine.generate_sequences(rows, n=8)                  # a batch: rows in, verl's padded batch out
    engine.submit(rows, n=8); batch = engine.take(4, max_staleness=1)   # continuous: groups as they finish
    engine.pause(); engine.update_weights_from_disk(path); engine.resume()   # control: every server hears it
    engine.snapshot(path); engine.restore(path)                   # the running groups, written and put back
    engine.close()

RolloutEngine (fsm/api.py) composes fsm/run/local.py's `Local` as its core, and RayRunner
(fsm/adapters/ray_runner.py) is its own; the gateway's workers each run a RolloutEngine. A batch goes down the
layers: this module calls its core and the output stage, never back up. It sits in the output stage because what
it adds to the run stage's half (fsm/run/engine.py: refusals, commands, services) is the output: batches,
samples and the run directory (`keep=`). Every async call has a sync form without the `a` (`sync_form`), which
refuses inside a running event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, Protocol, Self, TypeVar, cast, runtime_checkable

import numpy as np

from backends.base import Backend
from fsm.data.rows import to_rows
from fsm.families import Codec
from fsm.output.batch import FaultDelta, policies_of, rollout_metrics, to_batch
from fsm.output.keep import RunDir, keep_batch
from fsm.output.sample import SampleBatch, to_samples
from fsm.run.agent import CompiledAgent
from fsm.run.context import Policy, Sampling, node_sampling
from fsm.run.engine import (
    Call,
    Command,
    EngineRefused,
    LocalEngine,
    Pause,
    Resume,
    SnapshotAsk,
    StalePolicy,
    Take,
    Update,
)
from fsm.run.stream import Group
from fsm.run.tracer import Tracer
from fsm.run.trajectory import Trajectory
from fsm.run.tree import row_nodes

T = TypeVar("T")
P = ParamSpec("P")
E = TypeVar("E", bound="BaseEngine")
Rows = Sequence[Mapping[str, Any]] | Mapping[str, Sequence[Any] | np.ndarray] | Any  # Any: a verl DataProto


def sync_form(afn: Callable[Concatenate[E, P], Coroutine[Any, Any, T]]) -> Callable[Concatenate[E, P], T]:
    """The sync form of an engine's async call (`asubmit` -> `submit`), made here for every one so that none
    drifts from its async form: it runs the call to its end from the calling thread (`BaseEngine._run_sync`).
    Inside a running event loop, which it would block, it refuses in one line naming the async form to await."""
    name = afn.__name__.removeprefix("a")

    def sync(self: E, /, *args: P.args, **kwargs: P.kwargs) -> T:
        refuse_in_loop(self, name, afn.__name__)
        return self._run_sync(afn(self, *args, **kwargs))

    sync.__name__ = sync.__qualname__ = name
    sync.__doc__ = f"Sync form of `{afn.__name__}`: blocks until it is done."
    return sync


def refuse_in_loop(engine: object, name: str, async_name: str) -> None:
    """RuntimeError when called inside a running event loop (a sync form there would block it)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        f"{type(engine).__name__}.{name}() was called inside a running event loop, which it "
        f"would block; use `await {async_name}(...)` there"
    )


class SyncLoop:
    """The loop a thread's sync forms run their async forms on, kept from call to call: `asyncio.run` made and
    closed one per call, most of a control call's CPU. As there, each call runs in a copy of the caller's context
    and what it leaves running is cancelled at its end; unlike it, the thread's current loop is left as it is.
    Closed by an engine's `close()` in its thread, or when the thread ends (its `_sync_loop` goes)."""

    __slots__ = ("runner", "loop", "pid")

    def __init__(self) -> None:
        self.runner = asyncio.Runner(loop_factory=asyncio.new_event_loop)
        self.loop, self.pid = self.runner.get_loop(), os.getpid()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return self.runner.run(coro, context=contextvars.copy_context())
        finally:
            if left := asyncio.all_tasks(self.loop):
                for task in left:
                    task.cancel()
                self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))

    def __del__(self) -> None:  # its thread ended: nothing runs on it
        if not self.loop.is_closed() and not self.loop.is_running():
            self.loop.close()


_sync_loop = threading.local()  # .loop: the calling thread's SyncLoop


class Core(Protocol):
    """An engine's working parts, which the shared logic (`BaseEngine`) calls down into: where its state lives, how
    its rows run, its control calls. fsm/run/local.py `Local` (one process: its loop thread, stream and backend)
    and fsm/adapters/ray_runner.py `RayRunner` (Ray actors) are the two. The `_here` calls run where the state
    lives: awaited through `call`."""

    @property
    def backend(self) -> Backend | None: ...  # None: the backends live elsewhere (Ray actors)
    @property
    def policies(self) -> Mapping[str, Policy]: ...  # the spec's policies at run time, by name
    # the servers': 0 at first (or the int they report), then each update's
    @property
    def weight_version(self) -> int: ...
    @property
    def paused(self) -> bool: ...  # between a pause and a resume: no model request is issued meanwhile
    @property
    def stream_stats(self) -> dict[str, Any]: ...  # the continuous mode's counters (`Groups.counters`)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T: ...  # await `coro` where the state lives
    async def run_here(
        self, rows: Sequence[Any], n: int, sampling: Sampling, on_done: Callable[[Trajectory], None] | None
    ) -> list[Trajectory]: ...  # every row n times; the trajectories in input order
    async def submit_here(
        self, rows: Sequence[Any], n: int, sampling: Sampling, first_index: int | None
    ) -> list[str]: ...  # start every row n times (the continuous mode); the groups' uids
    async def take_here(self, ask: Take) -> list[Group]: ...  # the first finished groups (`Groups.take`)
    # on every server (fsm/run/engine.py `Controls`)
    async def control_here(self, command: Command) -> Any: ...
    async def aclose(self) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class Snapshotting(Protocol):
    """A core that snapshots, restores and journals its running groups (`Local`); EngineRefused on any other."""

    # from any loop: it waits for the state's loop, or snapshots from outside it
    async def take_snapshot(self, ask: SnapshotAsk) -> dict[str, Any]: ...
    async def restore_here(self, path: str | Path | Mapping[str, Any]) -> dict[str, Any]: ...
    async def journal_here(self, journal: Any) -> None: ...


class BaseEngine:
    """The engine contract (`fsm.Engine`), written once over an engine's `core`: batches shaped into verl's padded
    batch, the continuous mode's batches, the control calls, and every sync form. RolloutEngine and RayRunner
    only compose their core, as httpx's Client composes its transport."""

    agent: CompiledAgent
    codec: Codec
    core: Core
    tracer: Tracer | None = None
    _faults: FaultDelta | None = None

    def _run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` to its end from a thread that runs no event loop (the sync forms): on this thread's `SyncLoop`,
        where signals arrive (a kept run's, fsm/output/keep.py), and whose calls into the core hop to the core's
        loop, so that loop only ever runs the core's own coroutines. A core whose state is bound to a loop of its
        own for good (RayRunner's) runs them there instead."""
        held = getattr(_sync_loop, "loop", None)
        if held is None or held.pid != os.getpid() or held.loop.is_closed():  # a forked child makes its own
            held = _sync_loop.loop = SyncLoop()
        return held.run(coro)

    @property
    def weight_version(self) -> int:
        """The weights the servers hold: 0 at first (or the int they report), then each update's version."""
        return self.core.weight_version

    @property
    def paused(self) -> bool:
        """True between `pause()` and `resume()`: no model request is issued meanwhile."""
        return self.core.paused

    @property
    def stream_stats(self) -> dict[str, Any]:
        """Counters of the continuous mode: groups submitted, finished, taken, dropped or re-run for staleness,
        running and ready now; `staleness`: {staleness: groups taken}."""
        return self.core.stream_stats

    @property
    def snapshots(self) -> bool:
        """Whether `asnapshot` / `arestore` (and `keep=`) work; EngineRefused otherwise."""
        return isinstance(self.core, Snapshotting)

    def _snapshotting(
        self, call: str, why: str = "cannot snapshot, restore or journal its running groups"
    ) -> Snapshotting:
        if not isinstance(self.core, Snapshotting):
            raise EngineRefused(self, call, f"this engine {why}; use RolloutEngine")
        return self.core

    async def aclose(self) -> None:
        await self.core.aclose()

    def close(self) -> None:
        refuse_in_loop(self, "close", "aclose")
        self.core.close()
        held = getattr(_sync_loop, "loop", None)
        if held is not None:  # this thread's sync forms' loop, as asyncio.run closes its own
            del _sync_loop.loop
            held.runner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- a batch -----------------------------------------------------------------------------------------------

    async def arun(
        self,
        rows: Sequence[Any],
        *,
        n: int = 1,
        sampling_params: Mapping[str, Any] | None = None,
        validate: bool = False,
        sampling: Sampling | None = None,
        on_done: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        """The finished trajectories themselves (transcripts, segments, state paths), in input order.
        `on_done` hears each trajectory as it finishes (RolloutEngine: on the engine's thread)."""
        if sampling is None:
            sampling = self.sampling(sampling_params, validate)
        return await self.core.call(self.core.run_here(rows, n, sampling, on_done))

    async def agenerate_sequences(
        self,
        batch: Rows,
        sampling_params: Mapping[str, Any] | None = None,
        validate: bool = False,
        n: int = 1,
        *,
        keep: RunDir | None = None,
    ) -> Any:
        """Roll out every row `n` times; verl's padded batch back (a DataProto when given one).

        `validate=True` (or a DataProto's `meta_info["validate"]`) samples with the spec's `val_sampling`;
        `sampling_params` override either (SGLang names, plus `seed` and `logprobs`).
        `keep=RunDir(out)` runs the rows as `agentfsm run --out out` does (fsm/output/keep.py): the files are
        written there, and SIGINT or SIGTERM (to a caller on the main thread) snapshots the rows still running
        and writes the finished ones, then raises RunInterrupted; `agentfsm run --resume out` goes on.
        """
        rows, meta, sampling = self._rows(batch, n, sampling_params, validate)
        self._fault_counters()
        if keep is not None:
            self._snapshotting("agenerate_sequences", "cannot snapshot a run, which keep= needs")
            local = cast(LocalEngine, self)  # one that snapshots (RolloutEngine)
            return await keep_batch(local, rows, n, sampling, keep, like=batch, meta=meta)
        t0 = time.perf_counter()
        trajs = await self.arun(rows, n=n, sampling=sampling)
        return self.to_batch(trajs, sampling, like=batch, meta=meta, wall_s=time.perf_counter() - t0)

    async def agenerate_samples(
        self,
        batch: Rows,
        sampling_params: Mapping[str, Any] | None = None,
        validate: bool = False,
        n: int = 1,
    ) -> SampleBatch:
        """As `agenerate_sequences`, unpadded: one flat `Sample` per trajectory (the form trainer adapters
        map from, fsm/output/sample.py), with the same meta_info."""
        rows, meta, sampling = self._rows(batch, n, sampling_params, validate)
        faults = self._fault_counters()
        t0 = time.perf_counter()
        trajs = await self.arun(rows, n=n, sampling=sampling)
        info = {
            **meta,
            "sampling": sampling.describe(self.codec.vocab_size),
            "rollout_metrics": rollout_metrics(trajs, faults=faults.take(), wall_s=time.perf_counter() - t0),
        }
        spec = self.agent.spec  # one sample per segment of every row node of each tree
        return SampleBatch(
            to_samples(trajs, spec.context.reward_placement, spec.policy, spec.tree.weight), info
        )

    generate_samples = sync_form(agenerate_samples)

    def to_batch(
        self,
        trajs: Sequence[Trajectory],
        sampling: Sampling,
        like: Any = None,
        meta: Mapping[str, Any] | None = None,
        wall_s: float | None = None,
    ) -> Any:
        """Finished trajectories -> verl's padded batch (`batch_of`), with this engine's backend counters. A spec
        whose trees generate with several policies gets one batch per policy: {policy: batch} (docs/trees.md)."""
        policies = policies_of(trajs, self.agent.spec.policy)
        if len(policies) > 1:
            faults = self._fault_counters()
            out = {}
            for p in policies:  # each with the codec and sampling its rows were made with
                codec, drawn = self._policy_sampling(trajs, sampling, p)
                out[p] = batch_of(self.agent, codec, trajs, drawn, faults, like, meta, wall_s, policy=p)
            return out
        return batch_of(self.agent, self.codec, trajs, sampling, self._fault_counters(), like, meta, wall_s)

    def _policy_sampling(
        self, trajs: Sequence[Trajectory], sampling: Sampling, policy: str
    ) -> tuple[Codec, Sampling]:
        """The codec and sampling `policy`'s rows were made with, for its batch (a trainer recomputes logprobs
        from meta_info["sampling"]): the run's for the root's policy, else what its nodes generated with
        (fsm/run/context.py `node_sampling`: its own `sampling:`, else its spec's)."""
        known = self.core.policies.get(policy)
        nodes = [n.node for t in trajs for n in row_nodes(t) if n.node.kind != "root"]
        node = next((n for n in nodes if n.policy == policy), None)
        if policy == self.agent.spec.policy or node is None:
            return self.codec, sampling
        return node_sampling(known or Policy(policy, None, None), self.codec, sampling, node.agent)

    def _fault_counters(self) -> FaultDelta:
        """The backend's fault counters, read per batch (first read: when the backend starts, or before the first
        batch runs). A backend built at start (servers= without engine=) gets its own counters from there."""
        backend = self.core.backend
        if self._faults is None or self._faults.backend is not backend:
            self._faults = FaultDelta(backend)
        return self._faults

    def sampling(self, sampling_params: Mapping[str, Any] | None = None, validate: bool = False) -> Sampling:
        """The run's sampling, resolved once (pass it to `arun` and `to_batch`)."""
        policy = self.core.policies.get(self.agent.spec.policy)
        base = policy.sampling if policy is not None and not validate else None  # the root policy's own
        return Sampling.resolve(self.agent, self.codec, sampling_params, validate=validate, base_spec=base)

    def _rows(
        self,
        batch: Rows,
        n: int,
        sampling_params: Mapping[str, Any] | None,
        validate: bool,
        sampling: Sampling | None = None,
    ) -> tuple[Sequence[Any], dict[str, Any], Sampling]:
        """A call's rows, meta_info and sampling (a DataProto's meta_info["validate"] counts), checked once."""
        rows, meta = to_rows(batch)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        validate = bool(validate or meta.get("validate", False))
        return rows, meta, sampling if sampling is not None else self.sampling(sampling_params, validate)

    generate_sequences = sync_form(agenerate_sequences)

    # -- continuous mode (fsm/run/stream.py) -------------------------------------------------------------------

    async def asubmit(
        self,
        rows: Any,
        n: int = 1,
        sampling_params: Mapping[str, Any] | None = None,
        validate: bool = False,
        sampling: Sampling | None = None,
        first_index: int | None = None,
    ) -> list[str]:
        """Start rolling out every row `n` times in the continuous mode; returns at once with the groups' uids.
        Their groups come back from `atake` / `stream` as they finish. `first_index`: the batch-wide index of
        the first row's first sample, when these rows are a slice of a batch run in several processes (the
        trajectories' `index`, and so their per-sample seeds, are then the whole batch's; default: next on)."""
        rows, _, sampling = self._rows(rows, n, sampling_params, validate, sampling)
        return await self.core.call(self.core.submit_here(rows, n, sampling, first_index))

    async def atake_groups(
        self,
        num_groups: int,
        *,
        max_staleness: int | None = None,
        stale: StalePolicy = "drop",
        timeout: float | None = None,
        exhausted_ok: bool = False,
    ) -> list[Group]:
        """The first `num_groups` finished groups (see `atake`), as `Group`s of trajectories."""
        return await self.core.call(
            self.core.take_here(Take(num_groups, max_staleness, stale, timeout, exhausted_ok))
        )

    async def atake(
        self,
        num_groups: int,
        *,
        max_staleness: int | None = None,
        stale: StalePolicy = "drop",
        timeout: float | None = None,
    ) -> Any:
        """verl's padded batch of exactly `num_groups` whole groups, in completion order, waiting for them
        (TimeoutError after `timeout` s; StreamEmpty when too few are running). A group whose oldest model
        token is more than `max_staleness` weight versions old is dropped or re-run (`stale`), and counted in
        `stream_stats`. meta_info["staleness"]: each group's, in batch order."""
        groups = await self.atake_groups(
            num_groups, max_staleness=max_staleness, stale=stale, timeout=timeout
        )
        trajs = [t for g in groups for t in g.trajectories]
        sampling = groups[0].sampling
        if not all(g.sampling.logprobs for g in groups):
            sampling = dataclasses.replace(sampling, logprobs=False)
        batch = self.to_batch(trajs, sampling)
        for one in batch.values() if isinstance(batch, dict) else (batch,):  # a batch per policy (trees)
            one.meta_info["staleness"] = [g.staleness for g in groups]
        return batch

    async def stream(
        self, *, max_staleness: int | None = None, stale: StalePolicy = "drop"
    ) -> AsyncIterator[Group]:
        """`async for group in engine.stream():` each finished group as it completes, until none is left."""
        while True:
            groups = await self.atake_groups(1, max_staleness=max_staleness, stale=stale, exhausted_ok=True)
            if not groups:
                return
            yield groups[0]

    submit = sync_form(asubmit)
    take = sync_form(atake)

    # -- snapshots ---------------------------------------------------------------------------------------------

    async def asnapshot(
        self,
        path: str | Path | None,
        *,
        meta: Mapping[str, Any] | None = None,
        stop: bool = False,
        timeout: float | None = None,
        abort_turns: bool = False,
        fallback: Callable[[], Path] | None = None,
    ) -> dict[str, Any]:
        """Write the continuous mode's groups (finished but not taken, and running) to `path` as JSON, taken
        at state boundaries (docs/trainers.md). `stop=True` then cancels the running ones (their groups live on
        in the file), also when it cannot be written; `abort_turns=True` pauses in abort mode first, so no model
        turn is waited for; a trajectory inside its interaction is written as at its start ("restarted").
        `fallback()`: the directory for a file `path` cannot hold (a full disk). A blocked loop is snapshotted
        from outside (`Stream.snapshot_blocked`, "blocked": True) and leaves the engine `wedged`. `path=None`:
        no file; running trajectories park where the journal records them, and (`stop`) the run stops.
        Returns counts (ready, running, restarted) and the path written."""
        return await self._snapshotting("asnapshot").take_snapshot(
            SnapshotAsk(path, meta, stop, timeout, abort_turns, fallback)
        )

    async def arestore(self, path: str | Path | Mapping[str, Any]) -> dict[str, Any]:
        """Put a snapshot's groups back into the continuous mode (same spec, checked by hash: SnapshotError
        otherwise); ready groups can be taken, running ones run on. Returns the snapshot's `meta`. A mapping
        is a snapshot read and checked already (a journal's, fsm/run/resume.py `load`)."""
        return await self.core.call(self._snapshotting("arestore").restore_here(path))

    async def ajournal(self, journal: Any) -> None:
        """Record every step of the continuous mode in `journal` (fsm/run/journal.py `Recorder`) from now on."""
        await self.core.call(self._snapshotting("ajournal").journal_here(journal))

    snapshot = sync_form(asnapshot)
    restore = sync_form(arestore)

    # -- control calls (fsm/run/engine.py) ---------------------------------------------------------------------

    async def asleep(self, tags: list[str] | None = None) -> Any:
        """Release server memory (SGLang release_memory_occupation; tags "weights", "kv_cache")."""
        return await self.core.call(self.core.control_here(Call("sleep", (tags,))))

    async def awake_up(self, tags: list[str] | None = None) -> Any:
        """Take the memory back (SGLang resume_memory_occupation)."""
        return await self.core.call(self.core.control_here(Call("wake_up", (tags,))))

    async def aflush_cache(self) -> Any:
        return await self.core.call(self.core.control_here(Call("flush_cache")))

    async def apause(self, mode: str = "abort", *, policy: str | None = None) -> None:
        """Stop generation: no new model request (turns wait at the gate) and every server pauses in `mode`
        (SGLang's abort, retract, in_place: docs/trainers.md). `policy`: that policy alone, when it has a
        backend of its own (docs/trees.md); default: every policy."""
        await self.core.call(self.core.control_here(Pause(mode, policy)))

    async def aresume(self, *, policy: str | None = None) -> None:
        """Continue: every server continues (`/continue_generation`), then the gate opens and paused
        trajectories go on, on whatever weights the servers now hold. `policy`: as for `apause`."""
        await self.core.call(self.core.control_here(Resume(policy)))

    async def aupdate_weights_from_disk(
        self,
        /,
        path: str | Path,
        weight_version: int | None = None,
        *,
        policy: str | None = None,
        **options: Any,
    ) -> int:
        """Reload weights on every server (or the in-process model) from a checkpoint directory, as version
        `weight_version` (default: the current one + 1), which is returned. `options` go to SGLang's
        endpoint (load_format, abort_all_requests, flush_cache). `policy`: that policy's backend, when it has one
        of its own (docs/trees.md), and its version (its tokens record it); default: the root policy's."""
        return await self._update(
            Update("update_weights_from_disk", (str(path),), options, weight_version, policy)
        )

    async def aupdate_weights_from_tensor(
        self, /, weight_version: int | None = None, *, policy: str | None = None, **payload: Any
    ) -> int:
        """SGLang's `/update_weights_from_tensor` on every server (payload passed through:
        serialized_named_tensors, load_format, flush_cache...); the new version is returned. `policy`: as for
        `aupdate_weights_from_disk`."""
        return await self._update(Update("update_weights_from_tensor", (), payload, weight_version, policy))

    async def aupdate_weights_from_distributed(
        self, /, weight_version: int | None = None, *, policy: str | None = None, **payload: Any
    ) -> int:
        """SGLang's `/update_weights_from_distributed` on every server (payload passed through: names, dtypes,
        shapes, group_name...); the new version is returned."""
        return await self._update(
            Update("update_weights_from_distributed", (), payload, weight_version, policy)
        )

    async def _update(self, update: Update) -> int:
        return cast(int, await self.core.call(self.core.control_here(update)))

    sleep = sync_form(asleep)
    wake_up = sync_form(awake_up)
    flush_cache = sync_form(aflush_cache)
    pause = sync_form(apause)
    resume = sync_form(aresume)
    update_weights_from_disk = sync_form(aupdate_weights_from_disk)
    update_weights_from_tensor = sync_form(aupdate_weights_from_tensor)
    update_weights_from_distributed = sync_form(aupdate_weights_from_distributed)


Engine = BaseEngine  # the contract's public name: code written against any engine takes an `Engine`


def batch_of(
    agent: CompiledAgent,
    codec: Codec,
    trajs: Sequence[Trajectory],
    sampling: Sampling,
    faults: FaultDelta | None = None,
    like: Any = None,
    meta: Mapping[str, Any] | None = None,
    wall_s: float | None = None,
    policy: str | None = None,
) -> Any:
    """Finished trajectories -> verl's padded batch (`policy`: that policy's rows only), with the sampling that
    made its logprobs and its metrics (with the backend counters moved since the last batch) in meta_info."""
    out = to_batch(trajs, agent, codec, logprobs=sampling.logprobs, like=like, meta=meta, policy=policy)
    out.meta_info["sampling"] = sampling.describe(codec.vocab_size)
    out.meta_info["rollout_metrics"] = rollout_metrics(
        trajs, faults=faults.take() if faults else None, wall_s=wall_s
    )
    return out
