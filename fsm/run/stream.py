"""The continuous mode: rows go in whenever the trainer submits them, finished GRPO groups come out as they
complete, and unfinished trajectories keep running across weight updates.

    submit(rows, n) --> one task per trajectory (the engine's gate bounds how many run) --> a group whose n
    samples have all finished joins `ready`, in completion order --> take(k) hands out the first k fresh ones

Staleness: a group's version is that of its oldest model token; `staleness = current version - version`.
At take time, groups staler than `max_staleness` are dropped or re-run (`stale="drop"|"rerun"`), and
counted. A group is always whole; each leaves `ready` exactly once.

A Stream lives on its engine's event loop and is owned by it: `serve()` is the one long task under which
every trajectory task runs, and the engine cancels it on close. A snapshot parks the trajectories at their next
state boundary (`Boundary`) and writes the groups, finished and not, as a journal compacted to one whole record
per trajectory and per tree node (fsm/run/codec.py, fsm/run/treejournal.py), with the side-effecting tool calls
of the unfinished ones; it is read back and checked as any journal is (fsm/run/resume.py `load`).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fsm.run import signals
from fsm.run.actions import BUILTIN_ACTIONS
from fsm.run.agent import CompiledAgent
from fsm.run.codec import FORMAT, SnapshotError, decode_sampling, decode_trajectory, encode_sampling
from fsm.run.context import RunContext, Sampling
from fsm.run.engine import StalePolicy
from fsm.run.journal import Recorder, group_record, node_mark, traj_record
from fsm.run.runtime import Owner, Runner
from fsm.run.trajectory import Trajectory
from fsm.run.treejournal import Agents, node_meta, restore_tree, tree_nodes
from fsm.tools.isolation import INLINE_STEPS

RECOUNT_S = 0.5  # how often a snapshot waiting at the boundary counts again without news


class Boundary:
    """Where `Runner.drive` waits before each action while a snapshot is being taken."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._moved = asyncio.Event()
        self.parked = 0

    async def __call__(self, traj: Trajectory) -> None:
        if self._open.is_set():
            return
        self.parked += 1
        self._moved.set()
        try:
            await self._open.wait()
        finally:
            self.parked -= 1

    def moved(self) -> None:
        """A trajectory started or finished: the closer re-counts."""
        self._moved.set()

    async def close(
        self, running: Callable[[], int], timeout_s: float | None = None, held: Callable[[], int] = lambda: 0
    ) -> None:
        """Hold every trajectory at its next boundary; return once the `running()` ones have all parked, here
        or (`held()` of them) waiting elsewhere while whole (a model turn at a paused engine's gate)."""
        self._open.clear()
        try:
            async with asyncio.timeout(timeout_s):
                while self.parked + held() < running():
                    self._moved.clear()
                    # `held()` also grows with time (PauseGate.waiting)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._moved.wait(), RECOUNT_S)
        except BaseException:
            self._open.set()
            raise

    def open(self) -> None:
        self._open.set()


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


class Groups:
    """Finished groups waiting to be taken, in completion order, and the staleness rule applied at take time: the
    continuous mode's bookkeeping, the same for the local Stream and the Ray runner's pool of actors. `rerun`
    starts a stale group again (`stale="rerun"`)."""

    def __init__(self, version: Callable[[], int], rerun: Callable[[Group], None]):
        self.version = version  # the engine's current weight version
        self._rerun = rerun
        self.ready: deque[Group] = deque()
        self.news = asyncio.Event()  # a group finished (or nothing can finish any more)
        self.stats: dict[str, Any] = {
            "submitted_groups": 0,
            "finished_groups": 0,
            "taken_groups": 0,
            "stale_dropped": 0,
            "stale_rerun": 0,
            "ready_groups": 0,
            "staleness": {},
        }

    def finished(self, group: Group) -> None:
        self.ready.append(group)
        self.stats["finished_groups"] += 1
        self.stats["ready_groups"] = len(self.ready)
        self.news.set()

    def sweep(self, max_staleness: int | None, stale: StalePolicy) -> None:
        """Take the groups staler than `max_staleness` out of `ready`: dropped, or started again."""
        if max_staleness is None:
            return
        now = self.version()
        keep: deque[Group] = deque()
        for g in self.ready:
            if now - g.version_min <= max_staleness:
                keep.append(g)
            elif stale == "rerun":
                self.stats["stale_rerun"] += 1
                self._rerun(g)
            else:
                self.stats["stale_dropped"] += 1
        self.ready = keep
        self.stats["ready_groups"] = len(self.ready)

    async def take(
        self,
        num_groups: int,
        max_staleness: int | None,
        stale: StalePolicy,
        exhausted_ok: bool,
        running: Callable[[], bool],
        wait: Callable[[], Awaitable[None]],
    ) -> list[Group]:
        """The first `num_groups` fresh finished groups, in completion order, awaiting `wait()` until they are
        there. StreamEmpty when fewer can ever come (nothing `running`); with `exhausted_ok`, what there is."""
        if stale not in ("drop", "rerun"):
            raise ValueError(f"stale must be 'drop' or 'rerun', not {stale!r}")
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        while True:
            self.sweep(max_staleness, stale)
            if len(self.ready) >= num_groups or (not running() and exhausted_ok):
                out = [self.ready.popleft() for _ in range(min(num_groups, len(self.ready)))]
                now = self.version()
                hist = self.stats["staleness"]
                for g in out:
                    g.staleness = now - g.version_min
                    hist[g.staleness] = hist.get(g.staleness, 0) + 1
                self.stats["taken_groups"] += len(out)
                self.stats["ready_groups"] = len(self.ready)
                return out
            if not running():
                raise StreamEmpty(
                    f"take({num_groups}): {len(self.ready)} group(s) ready and none running; "
                    "submit rows first"
                )
            await wait()

    def counters(self) -> dict[str, Any]:
        """A copy of the counters (`stream_stats`)."""
        stats = dict(self.stats)
        stats["staleness"] = dict(stats["staleness"])
        return stats


class ToolMemory:
    """What a kept run's Recorder (fsm/run/journal.py) keeps of side-effecting tools, for a stream no journal
    keeps: each successful call's result while its row runs, so that a snapshot carries the calls a step had
    finished (the step runs again on restore, or its row starts over) and the restored row answers them from `tool_results` rather than
    run them again (fsm/run/context.py `run_tool` reads and writes it as it does the Recorder). A live run's
    calls are answered only from what a snapshot brought back, so a state's retry still runs them."""

    def __init__(self) -> None:
        self.tool_results: dict[str, dict[str, Any]] = {}  # restored: answered without running the tool
        self.kept: dict[str, dict[str, dict[str, Any]]] = {}  # root session id -> key -> outcome

    def tool(self, key: str, outcome: dict[str, Any]) -> None:
        if outcome.get("error") is None:
            self.kept.setdefault(root_of(key), {})[key] = outcome

    def step(self, traj: Trajectory, agent: CompiledAgent | None = None, done: bool = False) -> None:
        """A journal's step (fsm/run/runtime.py `_finish` calls it): nothing is kept of it here."""

    def forget(self, root: str) -> None:
        """A row ended: its calls are never asked for again."""
        self.kept.pop(root, None)
        for key in [k for k in self.tool_results if root_of(k) == root] if self.tool_results else ():
            del self.tool_results[key]


def root_of(key: str) -> str:
    """The root session id of a tool call's key, `<session id>_c<turn>_<call>` (fsm/run/actions.py), where a tree
    node's session id is `<root's>:<path>`."""
    return key.rsplit("_c", 1)[0].split(":", 1)[0]


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
        self.boundary = Boundary()
        self.groups = Groups(version, self._rerun)
        self._running: dict[str, _Running] = {}  # uid -> group in flight
        self._active = 0  # trajectories past the gate, not finished, not waiting on their tree nodes
        self._waiting: dict[str, int] = {}  # session id -> its tree nodes running (fsm/run/tree.py)
        self._next_index = 0
        self.journal: Recorder | None = None  # the run's journal (fsm/run/journal.py), for a kept run
        self.tools = ToolMemory()  # side-effecting tools' results where no journal keeps them
        agent = runner.agent
        self._trees = bool(agent.forks or agent.spec.children)  # its rows may grow tree nodes
        self._marks: dict[str, Any] = {}  # session id -> its node's `node_mark` at its last boundary (trees)
        self.stats = self.groups.stats
        self.stats.update(finished_trajectories=0, running_groups=0)

    # -- ownership: `serve` (Owner's) runs every trajectory task ------------------------------------------------

    def _stopped(self) -> None:
        """Cancelled, it has cancelled every running trajectory; ready groups stay, to be taken."""
        self._running.clear()
        self._marks.clear()
        self.tools.kept.clear()
        self.stats["running_groups"] = 0
        self.groups.news.set()

    # -- in ----------------------------------------------------------------------------------------------------

    async def submit(
        self, rows: Sequence[Any], n: int, sampling: Sampling, first_index: int | None = None
    ) -> list[str]:
        """Start every row n times; the groups' uids. `first_index`: see BaseEngine.asubmit, fsm/output/engine.py."""
        await self._serving.wait()
        trajs = self.runner.trajectories(rows, n)
        ctx = self._context(sampling)
        ctx.group_size = n
        base = self._next_index if first_index is None else first_index
        self._next_index = max(self._next_index, base + len(trajs))
        uids = []
        waiting = {g.uid for g in self.groups.ready}
        for i in range(0, len(trajs), n):
            members = trajs[i : i + n]
            for t in members:
                t.index += base  # stream-wide: per-sample seeds differ across submissions
            uid = members[0].uid
            while uid in self._running or uid in waiting:  # the same row again (another epoch): its own uid
                uid += "+"
            for t in members:
                t.uid = uid
            if self.journal is not None:
                self.journal.group(uid, encode_sampling(sampling), members)
            self._start(_Running(Group(uid, members, sampling), ctx), members)
            uids.append(uid)
        return uids

    def _context(self, sampling: Sampling) -> RunContext:
        """A run's context: journaled, and its tree nodes driven by `_node`."""
        ctx = self.runner.make_context(sampling=sampling)
        ctx.journal = self.journal if self.journal is not None else self.tools
        ctx.drive = self._node
        return ctx

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
                await self.runner.drive(run.ctx, traj, self._boundary)
            finally:
                self._active -= 1
                self.boundary.moved()
        if self.journal is not None:
            self.journal.step(traj, done=True)
        self._marks.pop(traj.session_id, None)
        self.tools.forget(traj.session_id)
        self._finished(run, traj)

    async def _node(self, ctx: RunContext, traj: Trajectory) -> None:
        """A tree node's run (a child machine's, a branch's: fsm/run/tree.py), journaled and parked at its
        boundaries as a root is; while a parent waits on its nodes they count as running in its stead."""
        parent = traj.session_id.rpartition(":")[0]  # a node's id is its parent's, ":", its path
        self._waits(parent, 1)
        try:
            await self.runner.drive(ctx, traj, partial(self._boundary, agent=ctx.agent))
        finally:
            self._waits(parent, -1)
        traj.node.finished = True  # a snapshot writes it as ended (`_record`)
        self._marks.pop(traj.session_id, None)
        if self.journal is not None:
            self.journal.step(traj, done=True)

    def _waits(self, parent: str, delta: int) -> None:
        """A node of `parent` started (+1) or ended (-1): each node counts as active, and a parent counts as
        active only while it waits on none (it is parked in its action until they end)."""
        before = self._waiting.get(parent, 0)
        after = before + delta
        if after:
            self._waiting[parent] = after
        else:
            self._waiting.pop(parent, None)
        self._active += delta + (before > 0) - (after > 0)
        self.boundary.moved()

    async def _boundary(self, traj: Trajectory, agent: CompiledAgent | None = None) -> None:
        """Between two states: the journal records the last action's event (of `agent`, a tree node's; else the
        runner's), then a snapshot may park."""
        if self.journal is not None:
            self.journal.step(traj, agent or self.runner.agent)
        if self._trees:  # where its tree stood, for a snapshot taken while it waits on nodes made after
            self._marks[traj.session_id] = node_mark(traj.node)
        await self.boundary(traj)

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
        self.stats["running_groups"] = len(self._running)
        self.groups.finished(group)

    # -- out ---------------------------------------------------------------------------------------------------

    def _rerun(self, g: Group) -> None:
        fresh = self.runner.trajectories([g.trajectories[0].row], len(g.trajectories))
        for new, old in zip(fresh, g.trajectories):
            new.index, new.uid = old.index, g.uid
        group = Group(g.uid, fresh, g.sampling, reruns=g.reruns + 1)
        ctx = self._context(g.sampling)
        ctx.group_size = len(fresh)
        if self.journal is not None:  # the new trajectories replace the stale ones on resume
            self.journal.group(g.uid, encode_sampling(g.sampling), fresh, reruns=group.reruns)
        self._start(_Running(group, ctx), fresh)

    async def take(
        self,
        num_groups: int,
        max_staleness: int | None = None,
        stale: StalePolicy = "drop",
        exhausted_ok: bool = False,
    ) -> list[Group]:
        """The first `num_groups` fresh finished groups (`Groups.take`), waiting for running ones to finish."""

        async def wait() -> None:
            self.groups.news.clear()
            await self.groups.news.wait()

        out = await self.groups.take(
            num_groups, max_staleness, stale, exhausted_ok, lambda: bool(self._running), wait
        )
        if self.journal is not None:  # handed out: a resume does not hand them out again
            self.journal.taken([g.trajectories[0].session_id for g in out if g.trajectories])
        return out

    # -- snapshots ---------------------------------------------------------------------------------------------

    async def park(self, timeout_s: float | None = None) -> tuple[int, int]:
        """Park every running trajectory at its next state boundary (each recorded there by the journal);
        (ready groups, running groups). They stay parked until `boundary.open()`."""
        gate = self.runner.gate
        gate.on_wait = self.boundary.moved
        try:
            await self.boundary.close(lambda: self._active, timeout_s, lambda: gate.waiting)
        finally:
            gate.on_wait = None
        return len(self.groups.ready), len(self._running)

    async def snapshot(self, identity: Mapping[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Park every running trajectory at a state boundary and write down every group, ready or running, as a
        compacted journal (`_compacted`). The trajectories stay parked until `boundary.open()` (the caller's,
        once written or stopped)."""
        await self.park(timeout_s)
        restarted = 0
        try:
            groups = []
            for _, g, run in self._held(list(self.groups.ready)):
                trajs = []
                for t in g.trajectories:
                    finished = run is None or t.sample in run.versions
                    # its user simulator's state is not ours (a node's: its tree starts over from its root)
                    if not finished and any(n.interaction_started for n in _going(t)):
                        t = self._fresh(t)
                        restarted += 1
                    trajs.append((t, finished))
                groups.append((g, trajs))
        except BaseException:
            self.boundary.open()
            raise
        return self._compacted(identity, groups, restarted)

    def _held(self, ready: list[Group]) -> list[tuple[str, Group, Any]]:
        """(status, group, its run: None when ready) of every group a snapshot writes down."""
        return [("ready", g, None) for g in ready] + [
            ("running", r.group, r) for r in list(self._running.values())
        ]

    def _compacted(
        self,
        identity: Mapping[str, Any],
        groups: list[tuple[Group, list[tuple[Trajectory, bool]]]],
        restarted: int,
    ) -> dict[str, Any]:
        """A snapshot: the journal records of a run that holds these groups (`run`, then per group its `group`
        record, with what the stream knows of it in `held`, each trajectory whole, each node of its tree whole,
        and the `tool` records of side-effecting calls its unfinished rows made: those of a step in flight, or of
        a row that starts over, are answered from them by their key when they run again, as a journal's resume
        answers them), and its counts."""
        run = {"t": "run", "format": FORMAT, **identity, "compacted": True, "weight_version": self.version()}
        run.update(next_index=self._next_index, rows_expected=sum(len(trajs) for _, trajs in groups))
        records: list[dict[str, Any]] = [run]
        going: set[str] = set()  # the unfinished roots, going on or starting over: their calls are answered
        for g, trajs in groups:
            held = {"reruns": g.reruns, "version_min": g.version_min, "version_max": g.version_max}
            records.append(
                group_record(g.uid, encode_sampling(g.sampling), [t for t, _ in trajs]) | {"held": held}
            )
            for t, done in trajs:
                records.append(self._record(t, done))
                records.extend(self._record(n, n.node.finished) for n in tree_nodes(t))
                if not done:
                    going.add(t.session_id)
        kept = self.journal.tool_results if self.journal is not None else self.tools.tool_results
        calls = [*kept.items(), *(c for r in going for c in self.tools.kept.get(r, {}).items())]
        records.extend({"t": "tool", "k": k, "o": o} for k, o in calls if root_of(k) in going)
        ready = sum(all(done for _, done in trajs) for _, trajs in groups)
        return {"records": records, "ready": ready, "running": len(groups) - ready, "restarted": restarted}

    def _record(self, traj: Trajectory, done: bool) -> dict[str, Any]:
        """A trajectory's or tree node's record, its place in its tree as the journal wrote it last: for one
        waiting on its nodes, at its last boundary, so that the nodes made since are pending on restore, taken
        back by its action when that runs again (fsm/run/treejournal.py)."""
        record = traj_record(traj, "snapshot", done)
        if traj.session_id not in self._waiting or not traj.path_times:  # (one started over: not begun)
            return record
        mark = self._marks.get(traj.session_id)
        if mark is None:  # a root alone at its last boundary
            record.pop("n", None)
        else:
            k, forks, forked, fresh = mark
            record["n"] = {**node_meta(traj.node), "k": k, "forks": forks, "forked": forked, "fresh": fresh}
        return record

    def snapshot_blocked(
        self, identity: Mapping[str, Any], thread: int
    ) -> tuple[dict[str, Any], list[Group]]:
        """`snapshot` for a loop that code blocks (an `isolation: none` tool that never returns): called from
        another thread, it cannot park anyone, so it writes each trajectory as it was at its last state boundary
        without the loop's help. While the loop is blocked, every other trajectory waits at an `await` inside a
        built-in action, which before its last await changes it only in ways that running it again repeats
        exactly (a template render; `call_tools` keeps its pending calls until they are answered), so as it
        stands it is as it was before that action, which runs again on resume; so is the blocked one inside
        its tool (its calls run again, but those of side-effecting tools that had answered: `_compacted` keeps
        their results). Trees are written node by node, as `snapshot` writes them. One inside a user action, or
        blocked anywhere else (a guard, a parser), starts over, as one inside its interaction does (a tree with
        such a node: from its root), its side-effecting calls answered from the snapshot as well. Finished
        groups come back too, for the caller to write. SnapshotError when the loop turned meanwhile (it was not
        blocked after all): the caller snapshots through the loop then."""
        safe = set(BUILTIN_ACTIONS.values())
        frame = sys._current_frames().get(thread)
        before = (INLINE_STEPS.get(thread), frame, frame.f_lasti if frame is not None else None)
        step, blocked = before[0], None
        if step is None:  # not a tool's step: whichever trajectory's task runs now is the one blocked
            loop = signals.loop_of(thread)
            blocked = self.runner.driving.get(asyncio.current_task(loop)) if loop is not None else None  # type: ignore[arg-type]
        restarted, groups = 0, []
        ready = list(self.groups.ready)
        for _, g, run in self._held(ready):
            trajs = []
            for t in g.trajectories:
                finished = run is None or t.sample in run.versions
                if not finished and any(self._unsafe(n, blocked, safe) for n in _going(t)):
                    t = self._fresh(t)  # a tree: from its root, all of it again
                    restarted += 1
                trajs.append((t, finished))
            groups.append((g, trajs))
        frame = sys._current_frames().get(thread)
        after = (INLINE_STEPS.get(thread), frame, frame.f_lasti if frame is not None else None)
        if after[0] is not before[0] or after[1] is not before[1] or after[2] != before[2]:
            raise SnapshotError("the event loop moved while the snapshot was taken from outside it")
        return self._compacted(identity, groups, restarted), ready

    def _unsafe(self, traj: Trajectory, blocked: Trajectory | None, safe: set[Any]) -> bool:
        """Whether a trajectory (or tree node) cannot be written as it was at its last boundary while the loop
        is blocked (`snapshot_blocked`): inside its interaction, the blocked one, or inside a user action."""
        agent = traj.node.agent or self.runner.agent  # a node's own; a root's is bound once its tree grows
        inside = len(traj.path_times) > 0 and traj.state not in agent.final_states and not traj.failed
        return (
            traj.interaction_started
            or traj is blocked
            or (inside and agent.actions.get(traj.state) not in safe)
        )

    def _fresh(self, traj: Trajectory) -> Trajectory:
        """The trajectory as it was before its first action: same row, sample, index and ids."""
        (fresh,) = self.runner.trajectories([traj.row], 1)
        fresh.index, fresh.sample = traj.index, traj.sample
        fresh.uid, fresh.session_id = traj.uid, traj.session_id
        return fresh

    async def restore(self, data: Mapping[str, Any], tool_results: Mapping[str, Any] | None = None) -> int:
        """Put a snapshot's groups back: ready ones to be taken, running ones running again, their side-effecting
        calls' `tool_results` answered as kept. Groups restored."""
        await self._serving.wait()
        (self.journal or self.tools).tool_results.update(tool_results or {})
        self._next_index = max(self._next_index, int(data.get("next_index", 0)))
        agents = Agents()
        for gd in data["groups"]:
            sampling = decode_sampling(gd["sampling"])
            trajs = [decode_trajectory(td) for td in gd["trajectories"]]
            done = [bool(td["done"]) for td in gd["trajectories"]]
            for t, td in zip(trajs, gd["trajectories"]):
                if "nodes" in td:  # a journal's tree (fsm/run/treejournal.py)
                    nodes = [(decode_trajectory(nd), nd["n"], nd["done"]) for nd in td["nodes"]]
                    restore_tree(t, td["n"], nodes, self.runner.agent, agents.child, td["done"])
            group = Group(gd["uid"], trajs, sampling, gd["version_min"], gd["version_max"], gd["reruns"])
            if gd["status"] == "ready":
                self.groups.finished(group)
                continue
            run = _Running(group, self._context(sampling))
            run.done = sum(done)
            run.versions = {t.sample: self.version() for t, d in zip(trajs, done) if d}
            self._running[group.uid] = run
            self.stats["submitted_groups"] += 1
            for t, d in zip(trajs, done):
                if not d:
                    self._spawn(self._one(run, t))
        self.stats["running_groups"] = len(self._running)
        self.groups.news.set()
        return len(data["groups"])


def _going(root: Trajectory) -> list[Trajectory]:
    """An unfinished root and the nodes of its tree that have not ended."""
    return [root, *(n for n in tree_nodes(root) if not n.node.finished)]
