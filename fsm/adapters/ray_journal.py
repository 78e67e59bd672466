"""A Ray actor's chunk journaled as it runs, so that when the actor dies (`ray.kill`, `kill -9`, the OOM killer,
a hang the driver kills) its trajectories go on from their last state boundary on another actor instead of
from the start (docs/trainers.md, "On Ray": what goes on, what starts over, what is refused).

Each chunk (one Ray call: `chunk_rows` groups) has a journal of its own under the runner's `journal_dir`, in the
run journal's format (fsm/run/journal.py): `{key}-{gid}.a{attempt}.r{rank}.log`, `attempt` the driver's count of
the chunk's dispatches. An actor taking attempt k reads the newest earlier attempt's file (fsm/run/resume.py
`load`), writes what it found whole into its own file, removes the earlier ones, and runs only what is
unfinished (a tree's nodes likewise, fsm/run/treejournal.py). A file is removed when its chunk comes back. Like
a run's journal it records the weight versions its tokens may carry (the actor's gate's, as the driver's updates
count them), so that the next attempt does not refuse them as never served; and like a resumed run, its rows go
on only with the weights their last tokens came from (fsm/run/resume.py `weights_change`): after an update between
the attempts the chunk runs again from the start, unless the runner accepts changes (`accept_changes`, as
`--resume --accept-changes` does): then it goes on, its rows' next tokens carry the new version, and its journal
records what was accepted.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from fsm.run.codec import JournalError, decode_trajectory, encode_sampling
from fsm.run.context import Sampling
from fsm.run.journal import Recorder, Writer, records
from fsm.run.resume import judge, load, served_by, weights_change
from fsm.run.trajectory import Trajectory
from fsm.run.treejournal import Agents, restore_tree, tree_nodes

log = logging.getLogger("agentfsm.ray")

_NAME = re.compile(r"\.a(\d+)\.r\d+\.log$")


def chunk_files(root: str | Path, key: str, gid: int) -> list[tuple[int, Path]]:
    """(attempt, path) of every journal of the chunk `key`/`gid`, oldest attempt first."""
    found = []
    for p in Path(root).glob(f"{key}-{gid}.a*.r*.log"):
        m = _NAME.search(p.name)
        if m is not None:
            found.append((int(m.group(1)), p))
    return sorted(found)


def remove(paths: list[Path]) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


@dataclass
class Chunk:
    """One chunk's trajectories and its journal: `todo` runs, the rest came back finished from an earlier
    attempt's journal."""

    trajs: list[Trajectory]
    todo: list[Trajectory]
    recorder: Recorder
    path: Path
    counts: dict[str, int] = field(default_factory=dict)  # resumed, restarted, recovered, refused, bytes

    def close(self) -> None:
        """The chunk is done: its journal is closed and removed (its trajectories go back to the driver)."""
        self.recorder.writer.close(sync=False)  # removed next: no fsync
        self.counts["bytes"] = self.recorder.writer.bytes
        remove([self.path])


def _earlier(
    path: Path, runner: Any, fresh: list[Trajectory], counts: dict[str, int], accept: bool
) -> tuple[dict[int, tuple[Trajectory, bool]], dict[str, dict[str, Any]], list[str]]:
    """What the last earlier attempt journaled: index -> (trajectory, done), the tool results it recorded, and
    the changes accepted. One that cannot go on here (unreadable, forged, another spec's, or other weights' and
    `accept` false) is refused, counted, and the chunk runs again from the start."""
    try:
        loaded = load(path, runner.agent, runner.codec)
        # a resumed run's check: its rows go on only with the weights their last tokens came from
        change = weights_change(loaded, runner.gate.version, served_by(runner.backend))
        if change is not None and not accept:
            raise JournalError(f"{path}: {change.what}")
        agents = Agents()
        found: dict[int, tuple[Trajectory, bool]] = {}
        for g in loaded.data["groups"]:
            for td in g["trajectories"]:
                t = decode_trajectory(td)
                if "nodes" in td:  # a tree: its nodes as journaled (fsm/run/treejournal.py)
                    nodes = [(decode_trajectory(nd), nd["n"], nd["done"]) for nd in td["nodes"]]
                    restore_tree(t, td["n"], nodes, runner.agent, agents.child, bool(td["done"]))
                found[t.index] = (t, bool(td["done"]))
        rows = {t.index: (t.uid, t.sample) for t in fresh}
        if any(rows.get(i, (t.uid, t.sample)) != (t.uid, t.sample) for i, (t, _) in found.items()):
            raise JournalError(f"{path}: its trajectories are not this chunk's rows")
    except JournalError as exc:
        counts["refused"] = 1
        log.warning("agentfsm: %s; its chunk runs again from the start", exc)
        return {}, {}, []
    counts["restarted"] = loaded.restarted
    accepted = [] if change is None else judge(path, [change], accept=True)
    if accepted:
        log.warning(
            "agentfsm: %s: going on with changes accepted (recorded in the journal): %s", path, accepted[0]
        )
    return found, loaded.tool_results, accepted


def open_chunk(
    root: str | Path,
    key: str,
    gid: int,
    attempt: int,
    rank: int,
    runner: Any,
    identity: Callable[[], dict[str, Any]],
    sampling: Sampling,
    fresh: list[Trajectory],
    n: int,
    sync: str,
    accept: bool = False,
) -> Chunk:
    """The chunk's journal for this attempt, with what earlier attempts journaled put back in `fresh`'s
    place (matched by batch-wide index); `accept`: go on under other weights (`_earlier`)."""
    path = Path(root) / f"{key}-{gid}.a{attempt}.r{rank}.log"
    earlier = [p for a, p in chunk_files(root, key, gid) if a < attempt]
    with contextlib.suppress(JournalError):  # a damaged one is refused below
        if earlier and not records(earlier[-1]).records:  # its actor died before a first record reached it:
            earlier = []  # nothing was journaled, nothing refused
    counts = {"resumed": 0, "restarted": 0, "recovered": 0, "refused": 0}
    found, tools, accepted = _earlier(earlier[-1], runner, fresh, counts, accept) if earlier else ({}, {}, [])
    # what each trajectory's first record holds: the fresh one (a restart inside an interaction starts over
    # from it, whichever attempt it is in), then, for one that has begun, where it got to
    trajs, firsts, done = [], [], set()
    for t in fresh:
        old = found.get(t.index)
        firsts.append(t)
        if old is None:
            trajs.append(t)
            continue
        t.session_id = old[0].session_id
        trajs.append(old[0])
        if old[1]:
            done.add(t.index)
            counts["recovered"] += 1
        elif len(old[0].path_times) > 0:
            counts["resumed"] += 1
    # the versions its tokens may carry: the actor's now, and the older ones of the trajectories it carries on
    version = runner.gate.version
    carried = [x for t, first in zip(trajs, firsts) if t is not first for x in (t, *tree_nodes(t))]
    older = {v for t in carried for v in t._version_runs[1::2] if 0 <= v != version}
    recorder = Recorder(Writer(path, sync))
    chunk = {"chunk": f"{key}-{gid}", "attempt": attempt, "weight_version": version}
    recorder.header({**identity(), "rows_expected": len(trajs), **chunk})
    if accepted:  # as a resumed run records them (fsm/output/keep.py)
        recorder.resumed({"weight_version": version}, accepted)
    for v in sorted(older):
        recorder.weights(v)
    sampled = encode_sampling(sampling)
    for i in range(0, len(trajs), n):
        recorder.group(firsts[i].uid, sampled, firsts[i : i + n])
        for t, first in zip(trajs[i : i + n], firsts[i : i + n]):
            if t is not first:
                recorder.whole(t, "resume", done=t.index in done)
                for node in tree_nodes(t):  # a tree's nodes, each as journaled
                    recorder.whole(node, "resume", done=node.node.finished)
    for k, outcome in tools.items():
        recorder.tool(k, outcome)
    recorder.writer.flush()  # on disk (the OS's) before the earlier attempts go
    remove(earlier)
    todo = [t for t in trajs if t.index not in done]
    return Chunk(trajs, todo, recorder, path, counts)


async def run_chunk(
    owner: Any,
    rank: int,
    identity: Callable[[], dict[str, Any]],
    tick: Callable[[Trajectory], Awaitable[None]],
    finished: Callable[[Trajectory], None],
    chunk: tuple[str, int, tuple[str, int, str, bool]],
    sampling: Sampling,
    n: int,
    fresh: list[Trajectory],
) -> tuple[list[Trajectory], dict[str, int]]:
    """An actor's chunk (`chunk`: the batch key, its first group id, and (directory, attempt, sync, whether it
    accepts changes)) run under
    `owner` (fsm/run/runtime.py Owner) with every state boundary journaled, going on from an earlier
    attempt's journal if any; `tick` hears each boundary and `finished` each finished trajectory (the hang
    detector's progress). Its trajectories come back without their rows, and the journal's counts."""
    key, gid, (root, attempt, sync, accept) = chunk
    runner = owner.runner
    opened = open_chunk(root, key, gid, attempt, rank, runner, identity, sampling, fresh, n, sync, accept)
    ctx = runner.make_context(sampling=sampling)  # its own: side-effecting tools read this chunk's journal
    ctx.journal = recorder = opened.recorder
    served = {runner.gate.version}  # the weight versions the journal says its tokens may carry

    def weights() -> None:
        if (version := runner.gate.version) not in served:  # new weights while the chunk runs
            served.add(version)
            recorder.weights(version)

    async def boundary(traj: Trajectory, agent: Any = runner.agent) -> None:
        weights()
        recorder.step(traj, agent)
        await tick(traj)

    async def node(node_ctx: Any, traj: Trajectory) -> None:  # a tree's child or branch (fsm/run/tree.py)
        await runner.drive(node_ctx, traj, partial(boundary, agent=node_ctx.agent))
        weights()
        recorder.step(traj, done=True)

    ctx.drive = node

    def done(traj: Trajectory) -> None:
        weights()  # its last model turn's too (recorded as finishing began, fsm/run/runtime.py `_finish`)
        recorder.step(traj, done=True)
        finished(traj)

    try:
        await owner.run(opened.todo, ctx, on_done=done, boundary=boundary)
    except BaseException:
        recorder.writer.close()  # kept: the chunk's next attempt goes on from it
        raise
    opened.close()
    for t in opened.trajs:
        t.row = None  # type: ignore[assignment]
    return opened.trajs, opened.counts
