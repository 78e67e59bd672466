"""The continuous mode: rows go in whenever the trainer submits them, finished GRPO groups come out as they
complete, and unfinished trajectories keep running across weight updates.

    submit(rows, n) --> one task per trajectory (the engine's gate bounds how many run) --> a group whose n
    samples have all finished joins `ready`, in completion order --> take(k) hands out the first k fresh ones

Staleness: a group's version is that of its oldest model token; `staleness = current version - version`.
At take time, groups staler than `max_staleness` are dropped or re-run (`stale="drop"|"rerun"`), and
counted. A group is always whole; each leaves `ready` exactly once.

A Stream lives on its engine's event loop and is owned by it: `serve()` is the one long task under which
every trajectory task runs, and the engine cancels it on close. Snapshots (fsm/run/snapshot.py) park the
trajectories at their next state boundary and write the groups, finished and not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fsm.data.rows import to_rows
from fsm.run import loopwatch
from fsm.run import snapshot as snap
from fsm.run.actions import BUILTIN_ACTIONS
from fsm.run.context import RunContext, Sampling
from fsm.run.runtime import Owner, Runner
from fsm.run.trajectory import Trajectory
from fsm.tools.isolation import INLINE_STEPS

StalePolicy = Literal["drop", "rerun"]
PAUSE_TIMEOUT_S = 10.0  # a snapshot's pause of the servers (abort mode) waits at most this long
log = logging.getLogger("agentfsm.stream")


class StreamEmpty(RuntimeError):
    """take() asked for more groups than are ready or running: submit rows first."""


def version_span(traj: Trajectory, finished_version: int) -> tuple[int, int]:
    """(oldest, newest) weight version of the trajectory's model tokens; a trajectory without any (a failed
    row, an empty response) counts as made by the version current when it finished."""
    span = traj.weight_versions()
    return span if span is not None else (finished_version, finished_version)


@dataclass
class Group:
    """One row's n samples, finished; what `take` and `stream` hand out."""

    uid: str
    trajectories: list[Trajectory]
    sampling: Sampling
    version_min: int = 0  # oldest model token's weight version, over the group
    version_max: int = 0
    reruns: int = 0  # times it was re-run for staleness
    staleness: int = 0  # at take time: current version - version_min


@dataclass
class _Running:
    group: Group
    ctx: RunContext
    done: int = 0
    versions: dict[int, int] = field(default_factory=dict)  # sample -> weight version when it finished


class Stream(Owner):
    """Submitted groups in flight and finished ones waiting to be taken, on one engine's loop. The engine's
    one owner (fsm/run/runtime.py `Owner`): its `generate_sequences` runs go through `run` beside the groups."""

    def __init__(self, runner: Runner, version: Callable[[], int]):
        super().__init__(runner)
        self.version = version  # the engine's current weight version
        self.boundary = snap.Boundary()
        self._ready: deque[Group] = deque()
        self._running: dict[str, _Running] = {}  # uid -> group in flight
        self._news = asyncio.Event()  # a group finished
        self._active = 0  # trajectories past the gate, not finished
        self._next_index = 0
        self.stats: dict[str, Any] = {"submitted_groups": 0, "finished_groups": 0, "taken_groups": 0,
                                      "stale_dropped": 0, "stale_rerun": 0, "finished_trajectories": 0,
                                      "running_groups": 0, "ready_groups": 0, "staleness": {}}  # fmt: skip

    # -- ownership: `serve` (Owner's) runs every trajectory task ------------------------------------------------

    def _stopped(self) -> None:
        """Cancelled, it has cancelled every running trajectory; ready groups stay, to be taken."""
        self._running.clear()
        self.stats["running_groups"] = 0
        self._news.set()

    # -- in ----------------------------------------------------------------------------------------------------

    async def submit(self, rows: Sequence[Any], n: int, sampling: Sampling, first_index: int | None = None) -> list[str]:
        """Start every row n times; the groups' uids. `first_index`: see ContinuousMode.asubmit."""
        await self._serving.wait()
        trajs = self.runner.trajectories(rows, n)
        ctx = self.runner.make_context(sampling=sampling)
        ctx.group_size = n
        base = self._next_index if first_index is None else first_index
        self._next_index = max(self._next_index, base + len(trajs))
        uids = []
        waiting = {g.uid for g in self._ready}
        for i in range(0, len(trajs), n):
            members = trajs[i : i + n]
            for t in members:
                t.index += base  # stream-wide: per-sample seeds differ across submissions
            uid = members[0].uid
            while uid in self._running or uid in waiting:  # the same row again (another epoch): its own uid
                uid += "+"
            for t in members:
                t.uid = uid
            self._start(_Running(Group(uid, members, sampling), ctx), members)
            uids.append(uid)
        return uids

    def _start(self, run: _Running, trajs: Sequence[Trajectory]) -> None:
        self._running[run.group.uid] = run
        self.stats["submitted_groups"] += 1
        self.stats["running_groups"] = len(self._running)
        for t in trajs:
            self._spawn(self._one(run, t))

    async def _one(self, run: _Running, traj: Trajectory) -> None:
        async with self._gate:
            self._active += 1
            self.boundary.moved()
            try:
                await self.runner.drive(run.ctx, traj, self.boundary)
            finally:
                self._active -= 1
                self.boundary.moved()
        self._finished(run, traj)

    def _finished(self, run: _Running, traj: Trajectory) -> None:
        run.done += 1
        run.versions[traj.sample] = self.version()
        self.stats["finished_trajectories"] += 1
        if run.done < len(run.group.trajectories):
            return
        group = run.group
        spans = [version_span(t, run.versions[t.sample]) for t in group.trajectories]
        group.version_min = min(s[0] for s in spans)
        group.version_max = max(s[1] for s in spans)
        del self._running[group.uid]
        self._ready.append(group)
        self.stats["finished_groups"] += 1
        self.stats["running_groups"] = len(self._running)
        self.stats["ready_groups"] = len(self._ready)
        self._news.set()

    # -- out ---------------------------------------------------------------------------------------------------

    def _sweep(self, max_staleness: int | None, stale: StalePolicy) -> None:
        """Take the groups staler than `max_staleness` out of `ready`: dropped, or started again."""
        if max_staleness is None:
            return
        now = self.version()
        keep: deque[Group] = deque()
        for g in self._ready:
            if now - g.version_min <= max_staleness:
                keep.append(g)
            elif stale == "rerun":
                self.stats["stale_rerun"] += 1
                self._rerun(g)
            else:
                self.stats["stale_dropped"] += 1
        self._ready = keep
        self.stats["ready_groups"] = len(self._ready)

    def _rerun(self, g: Group) -> None:
        fresh = self.runner.trajectories([g.trajectories[0].row], len(g.trajectories))
        for new, old in zip(fresh, g.trajectories):
            new.index, new.uid = old.index, g.uid
        group = Group(g.uid, fresh, g.sampling, reruns=g.reruns + 1)
        self._start(_Running(group, self.runner.make_context(sampling=g.sampling)), fresh)

    async def take(self, num_groups: int, max_staleness: int | None = None, stale: StalePolicy = "drop",
                   exhausted_ok: bool = False) -> list[Group]:  # fmt: skip
        """The first `num_groups` fresh finished groups, in completion order, waiting for them. StreamEmpty
        when fewer can ever come (nothing left running); with `exhausted_ok`, what there is instead."""
        if stale not in ("drop", "rerun"):
            raise ValueError(f"stale must be 'drop' or 'rerun', not {stale!r}")
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        while True:
            self._sweep(max_staleness, stale)
            if len(self._ready) >= num_groups or (not self._running and exhausted_ok):
                out = [self._ready.popleft() for _ in range(min(num_groups, len(self._ready)))]
                now = self.version()
                hist = self.stats["staleness"]
                for g in out:
                    g.staleness = now - g.version_min
                    hist[g.staleness] = hist.get(g.staleness, 0) + 1
                self.stats["taken_groups"] += len(out)
                self.stats["ready_groups"] = len(self._ready)
                return out
            if not self._running:
                raise StreamEmpty(f"take({num_groups}): {len(self._ready)} group(s) ready and none running; "
                                  "submit rows first")  # fmt: skip
            self._news.clear()
            await self._news.wait()

    # -- snapshots ---------------------------------------------------------------------------------------------

    async def snapshot(self, header: Mapping[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Park every running trajectory at a state boundary and write down every group, ready or running.
        The trajectories stay parked until `boundary.open()` (the caller's, once written or stopped)."""
        gate = self.runner.gate
        gate.on_wait = self.boundary.moved
        try:
            await self.boundary.close(lambda: self._active, timeout_s, lambda: gate.waiting)
        finally:
            gate.on_wait = None
        restarted = 0
        try:
            groups = []
            for status, g, done in ([("ready", g, None) for g in self._ready] +
                                    [("running", r.group, r) for r in self._running.values()]):  # fmt: skip
                trajs = []
                for t in g.trajectories:
                    finished = status == "ready" or (done is not None and _is_done(t, done))
                    if not finished and t.interaction_started:  # its user simulator's state is not ours to write
                        t = self._fresh(t)
                        restarted += 1
                    trajs.append({"done": finished, **snap.encode_trajectory(t)})
                groups.append(_group_record(status, g, trajs))
        except BaseException:
            self.boundary.open()
            raise
        return {**header, "weight_version": self.version(), "next_index": self._next_index, "groups": groups,
                "stats": {k: v for k, v in self.stats.items() if k != "staleness"}, "restarted": restarted}  # fmt: skip

    def snapshot_blocked(self, header: Mapping[str, Any], thread: int) -> tuple[dict[str, Any], list[Group]]:
        """`snapshot` for a loop that code blocks (an `isolation: none` tool that never returns): called from
        another thread, it cannot park anyone, so it writes each trajectory as it was at its last state boundary
        without the loop's help. While the loop is blocked, every other trajectory waits at an `await` inside a
        built-in action, which before its last await changes it only in ways that running it again repeats
        exactly (a template render; `call_tools` keeps its pending calls until they are answered), so as it
        stands it is as it was before that action, which runs again on resume; so is the blocked one inside
        its tool (its calls run again). One inside a user action, or
        blocked anywhere else (a guard, a parser), starts over, as one inside its interaction does. Finished
        groups come back too, for the caller to write. SnapshotError when the loop turned meanwhile (it was not
        blocked after all): the caller snapshots through the loop then."""
        agent = self.runner.agent
        final, actions, safe = agent.final_states, agent.actions, set(BUILTIN_ACTIONS.values())
        frame = sys._current_frames().get(thread)
        before = (INLINE_STEPS.get(thread), frame, frame.f_lasti if frame is not None else None)
        step, blocked = before[0], None
        if step is None:  # not a tool's step: whichever trajectory's task runs now is the one blocked
            loop = loopwatch.loop_of(thread)
            blocked = self.runner.driving.get(asyncio.current_task(loop)) if loop is not None else None  # type: ignore[arg-type]
        restarted, groups = 0, []
        ready = list(self._ready)
        for status, g, run in ([("ready", g, None) for g in ready] +
                               [("running", r.group, r) for r in list(self._running.values())]):  # fmt: skip
            trajs = []
            for t in g.trajectories:
                finished = run is None or t.sample in run.versions
                if not finished:
                    begun = len(t.path_times) > 0
                    inside = begun and t.state not in final and not t.failed  # in the action of t.state
                    fresh = t.interaction_started or t is blocked or (inside and actions.get(t.state) not in safe)
                    if fresh:
                        t = self._fresh(t)
                        restarted += 1
                trajs.append({"done": finished, **snap.encode_trajectory(t)})
            groups.append(_group_record(status, g, trajs))
        frame = sys._current_frames().get(thread)
        after = (INLINE_STEPS.get(thread), frame, frame.f_lasti if frame is not None else None)
        if after[0] is not before[0] or after[1] is not before[1] or after[2] != before[2]:
            raise snap.SnapshotError("the event loop moved while the snapshot was taken from outside it")
        data = {**header, "weight_version": self.version(), "next_index": self._next_index, "groups": groups,
                "stats": {k: v for k, v in self.stats.items() if k != "staleness"}, "restarted": restarted}  # fmt: skip
        return data, ready

    def _fresh(self, traj: Trajectory) -> Trajectory:
        """The trajectory as it was before its first action: same row, sample, index and ids."""
        (fresh,) = self.runner.trajectories([traj.row], 1)
        fresh.index, fresh.sample, fresh.uid, fresh.session_id = traj.index, traj.sample, traj.uid, traj.session_id
        return fresh

    async def restore(self, data: Mapping[str, Any]) -> int:
        """Put a snapshot's groups back: ready ones to be taken, running ones running again. Groups restored."""
        await self._serving.wait()
        self._next_index = max(self._next_index, int(data.get("next_index", 0)))
        for gd in data["groups"]:
            sampling = snap.decode_sampling(gd["sampling"])
            trajs = [snap.decode_trajectory(td) for td in gd["trajectories"]]
            done = [bool(td["done"]) for td in gd["trajectories"]]
            group = Group(gd["uid"], trajs, sampling, gd["version_min"], gd["version_max"], gd["reruns"])
            if gd["status"] == "ready":
                self._ready.append(group)
                self.stats["finished_groups"] += 1
                continue
            run = _Running(group, self.runner.make_context(sampling=sampling))
            run.done = sum(done)
            run.versions = {t.sample: self.version() for t, d in zip(trajs, done) if d}
            self._running[group.uid] = run
            self.stats["submitted_groups"] += 1
            for t, d in zip(trajs, done):
                if not d:
                    self._spawn(self._one(run, t))
        self.stats["running_groups"] = len(self._running)
        self.stats["ready_groups"] = len(self._ready)
        self._news.set()
        return len(data["groups"])


def _group_record(status: str, g: Any, trajs: list[dict[str, Any]]) -> dict[str, Any]:
    """One group as a snapshot holds it (the loop's snapshot and the blocked-loop one write the same)."""
    return {"status": status, "uid": g.uid, "reruns": g.reruns, "version_min": g.version_min,
            "version_max": g.version_max, "sampling": snap.encode_sampling(g.sampling), "trajectories": trajs}


def _is_done(traj: Trajectory, run: _Running) -> bool:
    """Whether a trajectory of a running group has finished (its driver returned): parked and queued ones
    are in a state that is not final; a finished one is in a final state, or failed."""
    return traj.state in run.ctx.agent.final_states or traj.failed


class GroupTaking:
    """`atake`, `stream` and the sync `submit`/`take` over an engine's `asubmit`, `atake_groups` and
    `to_batch`: shared by RolloutEngine's continuous mode (below) and RayRunner's."""

    def submit(self, rows: Any, n: int = 1, sampling_params: Mapping[str, Any] | None = None,
               validate: bool = False) -> list[str]:  # fmt: skip
        self._refuse_in_loop("submit", "asubmit")
        return self._run_sync(self.asubmit(rows, n, sampling_params, validate))

    def take(self, num_groups: int, *, max_staleness: int | None = None, stale: StalePolicy = "drop",
             timeout: float | None = None) -> Any:  # fmt: skip
        self._refuse_in_loop("take", "atake")
        return self._run_sync(self.atake(num_groups, max_staleness=max_staleness, stale=stale, timeout=timeout))

    async def atake(self, num_groups: int, *, max_staleness: int | None = None, stale: StalePolicy = "drop",
                    timeout: float | None = None) -> Any:  # fmt: skip
        """verl's padded batch of exactly `num_groups` whole groups, in completion order, waiting for them
        (TimeoutError after `timeout` s; StreamEmpty when too few are running). A group whose oldest model
        token is more than `max_staleness` weight versions old is dropped or re-run (`stale`), and counted in
        `stream_stats`. meta_info["staleness"]: each group's, in batch order."""
        groups = await self.atake_groups(num_groups, max_staleness=max_staleness, stale=stale, timeout=timeout)
        trajs = [t for g in groups for t in g.trajectories]
        sampling = groups[0].sampling
        if not all(g.sampling.logprobs for g in groups):
            sampling = dataclasses.replace(sampling, logprobs=False)
        batch = self.to_batch(trajs, sampling)
        batch.meta_info["staleness"] = [g.staleness for g in groups]
        return batch

    async def stream(self, *, max_staleness: int | None = None, stale: StalePolicy = "drop") -> AsyncIterator[Group]:
        """`async for group in engine.stream():` each finished group as it completes, until none is left."""
        while True:
            groups = await self.atake_groups(1, max_staleness=max_staleness, stale=stale, exhausted_ok=True)
            if not groups:
                return
            yield groups[0]



class ContinuousMode(GroupTaking):
    """RolloutEngine's continuous-mode methods (a mixin: the engine provides its loop, runner and batch).

    Each call runs on the engine's loop; sync forms block on it, as the engine's other calls do."""

    runner: Runner
    agent: Any
    _stream: Stream | None = None  # started by the first call
    _stream_task: asyncio.Future[None] | None = None
    wedged = False  # a snapshot was taken while code blocked the engine's loop: that loop runs nothing more

    def _version(self) -> int:
        return self.weight_version

    async def _stream_here(self) -> Stream:
        await self._start()
        if self._stream is None:
            self._stream = Stream(self.runner, self._version)
        if self._stream_task is None:
            self._stream_task = asyncio.ensure_future(self._stream.serve())
        return self._stream

    async def asubmit(self, rows: Any, n: int = 1, sampling_params: Mapping[str, Any] | None = None,
                      validate: bool = False, sampling: Sampling | None = None,
                      first_index: int | None = None) -> list[str]:  # fmt: skip
        """Start rolling out every row `n` times in the continuous mode; returns at once with the groups' uids.
        Their groups come back from `atake` / `stream` as they finish. `first_index`: the batch-wide index of
        the first row's first sample, when these rows are a slice of a batch run in several processes (the
        trajectories' `index`, and so their per-sample seeds, are then the whole batch's; default: next on)."""
        rows, meta = to_rows(rows)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if sampling is None:
            sampling = self.sampling(sampling_params, bool(validate or meta.get("validate", False)))

        async def here() -> list[str]:
            return await (await self._stream_here()).submit(rows, n, sampling, first_index)

        return await self._on_home(here())

    async def atake_groups(self, num_groups: int, *, max_staleness: int | None = None, stale: StalePolicy = "drop",
                           timeout: float | None = None, exhausted_ok: bool = False) -> list[Group]:  # fmt: skip
        """The first `num_groups` finished groups (see `atake`), as `Group`s of trajectories."""

        async def here() -> list[Group]:
            stream = await self._stream_here()
            async with asyncio.timeout(timeout):
                return await stream.take(num_groups, max_staleness, stale, exhausted_ok)

        return await self._on_home(here())

    @property
    def stream_stats(self) -> dict[str, Any]:
        """Counters of the continuous mode: groups submitted, finished, taken, dropped or re-run for staleness,
        running and ready now; `staleness`: {staleness: groups taken}."""
        if self._stream is None:
            return {}
        stats = dict(self._stream.stats)
        stats["staleness"] = dict(stats["staleness"])
        return stats

    async def asnapshot(self, path: str | Path, *, meta: Mapping[str, Any] | None = None, stop: bool = False,
                        timeout: float | None = None, abort_turns: bool = False,
                        fallback: Callable[[], Path] | None = None) -> dict[str, Any]:  # fmt: skip
        """Write the continuous mode's groups (finished but not taken, and running) to `path` as JSON, taken
        at state boundaries: running trajectories pause at their next one while it is written. `stop=True`
        then cancels the running ones (their groups live on in the file) instead of letting them go on, also
        when the file cannot be written. `abort_turns=True` never waits for a model turn: the engine pauses
        in abort mode first (`apause`), so turns in flight end with their partial output, which the snapshot
        keeps and a restore goes on from; a server that cannot pause has its requests aborted one by one
        (SGLang's /abort_request) instead. A trajectory inside its interaction (whose state the file cannot
        hold) is written as it was at its start, to run again on restore (counted in "restarted").
        When `path` cannot be written (a full disk) and `fallback` is given, the file goes into the
        directory `fallback()` makes ("path" says where). `meta` is stored as is (JSON). Returns counts:
        groups ready and running, trajectories restarted; and the path written. When code blocks the engine's
        loop (the loop watch sees it not turning, fsm/run/loopwatch.py), the snapshot is taken from outside
        it, each trajectory as it was at its last state boundary (`Stream.snapshot_blocked`), and the engine
        is left `wedged`; "blocked" is then True and "finished" holds the finished groups, not taken."""

        async def here() -> dict[str, Any]:
            stream = await self._stream_here()
            gate = self.runner.gate
            paused = abort_turns and not gate.paused
            if paused:
                gate.close()  # first: no new turn starts while the servers abort the running ones
                await self._pause_or_abort()
            written = Path(path)
            try:
                data = await stream.snapshot({**snap.header(self.agent, self.codec), "meta": dict(meta or {})}, timeout)
                restarted = data.pop("restarted")
                try:
                    try:
                        await asyncio.to_thread(snap.write, written, data)
                    except OSError as exc:
                        if fallback is None:
                            raise
                        log.warning("snapshot: cannot write %s (%s); writing it to a fallback directory",
                                    written, exc.strerror or exc)  # fmt: skip
                        written = fallback() / written.name
                        await asyncio.to_thread(snap.write, written, data)
                finally:
                    try:
                        if stop:
                            await self._stop_stream()
                    finally:
                        stream.boundary.open()
            finally:  # stopped or going on: the servers serve again (a stop has cancelled our turns by now)
                if paused:
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(PAUSE_TIMEOUT_S):
                            await self._control_here("continue_generation", (), {}, False)
                    gate.open()
            running = sum(g["status"] == "running" for g in data["groups"])
            return {"ready_groups": len(data["groups"]) - running, "running_groups": running,
                    "restarted": restarted, "path": str(written)}  # fmt: skip

        home = self._home_loop()
        if home.current():
            return await here()
        done, cancel = home.submit(here())
        waiter = asyncio.wrap_future(done)
        while True:  # a loop that code blocks runs nothing we send it: snapshot from outside it then
            try:
                return await asyncio.wait_for(asyncio.shield(waiter), loopwatch.TICK_S)
            except TimeoutError:
                pass
            except asyncio.CancelledError:
                cancel()
                raise
            thread = loopwatch.blocked(home.loop)
            if thread is not None and self._stream is not None:
                try:
                    return await asyncio.to_thread(self._snapshot_blocked, thread, Path(path), meta, fallback)
                except snap.SnapshotError:  # it turned meanwhile: the loop takes the snapshot after all
                    continue

    def _snapshot_blocked(self, thread: int, path: Path, meta: Mapping[str, Any] | None,
                          fallback: Callable[[], Path] | None) -> dict[str, Any]:  # fmt: skip
        """`asnapshot` while the engine's loop is blocked (see `Stream.snapshot_blocked`), on a thread of the
        caller's. The engine is left `wedged`: nothing more can run on its loop, and closing it skips the loop."""
        assert self._stream is not None
        data, ready = self._stream.snapshot_blocked({**snap.header(self.agent, self.codec), "meta": dict(meta or {})},
                                                     thread)  # fmt: skip
        restarted = data.pop("restarted")
        self.wedged = True
        written = path
        try:
            snap.write(written, data)
        except OSError as exc:
            if fallback is None:
                raise
            log.warning("snapshot: cannot write %s (%s); writing it to a fallback directory", written,
                        exc.strerror or exc)  # fmt: skip
            written = fallback() / written.name
            snap.write(written, data)
        running = sum(g["status"] == "running" for g in data["groups"])
        return {"ready_groups": len(ready), "running_groups": running, "restarted": restarted, "path": str(written),
                "blocked": True, "finished": ready}  # fmt: skip

    async def _pause_or_abort(self) -> None:
        """Every model turn in flight ends with its partial output: the servers pause in abort mode, or, where
        they cannot (no /pause_generation), each trajectory's request in flight is aborted."""
        try:
            async with asyncio.timeout(PAUSE_TIMEOUT_S):
                done = await self._control_here("pause_generation", ("abort",), {}, False)
            if done is not None or getattr(self.backend, "pause_generation", None) is not None:
                return
            why = "the backend has no pause_generation"
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        abort = getattr(self.backend, "abort", None)
        if abort is None:
            log.warning("snapshot: pausing the servers failed (%s) and the backend cannot abort; waiting for "
                        "turns in flight", why)  # fmt: skip
            return
        log.warning("snapshot: pausing the servers failed (%s); aborting the requests in flight instead", why)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PAUSE_TIMEOUT_S):
                await asyncio.gather(*(abort(sid) for sid in list(self.runner.live)), return_exceptions=True)

    async def arestore(self, path: str | Path) -> dict[str, Any]:
        """Put a snapshot's groups back into the continuous mode (same spec, checked by hash: SnapshotError
        otherwise); ready groups can be taken, running ones run on. Returns the snapshot's `meta`."""

        async def here() -> dict[str, Any]:
            data = await asyncio.to_thread(snap.read, path, self.agent, len(self.codec.tokenizer), self.codec)
            await (await self._stream_here()).restore(data)
            return dict(data.get("meta") or {})

        return await self._on_home(here())

    async def _stop_stream(self) -> None:
        task, self._stream_task = self._stream_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def snapshot(self, path: str | Path, *, meta: Mapping[str, Any] | None = None, stop: bool = False) -> dict[str, int]:
        self._refuse_in_loop("snapshot", "asnapshot")
        return self._run_sync(self.asnapshot(path, meta=meta, stop=stop))

    def restore(self, path: str | Path) -> dict[str, Any]:
        self._refuse_in_loop("restore", "arestore")
        return self._run_sync(self.arestore(path))
