"""A kept run: rows rolled out in the engine's continuous mode (fsm/run/stream.py), every step appended to the
run's journal as it happens (fsm/run/journal.py), until every group has finished, or until SIGINT/SIGTERM
(fsm/run/signals.py `Interrupts`) stops it: then the running trajectories are parked at their next state
boundary (recorded there), the journal is flushed to disk, and the finished ones come back to be written. A
run that died without a signal (`kill -9`) resumes from the same journal (fsm/run/resume.py). `agentfsm run` and a program that passes `keep=` to RolloutEngine both go
through `keep_rollout`, so a fix to one is a fix to both.

Where the journal goes and what it records come from a `Keeper`, which the caller passes in: the run stage
writes no run directory itself (fsm/output/keep.py's `RunDir` is the one the CLI and the API pass).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fsm.run.context import Sampling
from fsm.run.engine import LocalEngine
from fsm.run.provenance import changes, judge, made_by
from fsm.run.recorder import Recorder, Writer
from fsm.run.resume import Loaded, identity, load, refuse_unbegun, served_by, weights_change, with_codec
from fsm.run.signals import Interrupts, say_now, warn
from fsm.run.snapshot import SnapshotError, encode_sampling
from fsm.run.trajectory import Trajectory

# waiting for every running trajectory to reach a state boundary; model turns do not count (they are aborted
# and kept partial), so only a tool or user action still running can take this long
SNAPSHOT_TIMEOUT_S = 60.0
STOP_TIMEOUT_ENV = "AGENTFSM_STOP_TIMEOUT_S"  # a stop's wait in seconds, where SNAPSHOT_TIMEOUT_S is too long


def stop_timeout_s() -> float:
    """How long a stop waits for running rows to reach a state boundary: $AGENTFSM_STOP_TIMEOUT_S, else
    SNAPSHOT_TIMEOUT_S (a value that is not a positive number is named in a warning and ignored)."""
    raw = os.environ.get(STOP_TIMEOUT_ENV)
    if raw is None:
        return SNAPSHOT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        warn(
            f"${STOP_TIMEOUT_ENV}={raw!r} is not a positive number of seconds; waiting {SNAPSHOT_TIMEOUT_S:g} s"
        )
        return SNAPSHOT_TIMEOUT_S
    return value


Progress = Callable[[int, int], None]  # (groups finished, groups in all)


class Keeper(Protocol):
    """Where a kept run's journal goes and what it records (fsm/output/keep.py `RunDir`)."""

    run_id: str
    spec: str | None  # the spec's path, stored for a resume that names none
    data: str | None  # the data file's path, recorded in the journal's identity
    sync: str  # the journal's durability (fsm/run/journal.py SYNCS)
    accept_changes: bool  # a resume goes on despite changes in what makes the rows (fsm/run/provenance.py)

    @property
    def journal(self) -> Path: ...

    @property
    def snapshot(self) -> Path: ...


@dataclass
class KeptRollout:
    """What `keep_rollout` rolled out: every trajectory, or (interrupted) those that finished, in input order."""

    trajs: list[Trajectory]
    interrupted: bool
    expected: int  # rows x n
    sampling: Sampling
    journal: Recorder | None = None  # open: the caller writes its `end` once the files are written
    resumed: Loaded | None = None  # what a resume found in the journal


async def keep_rollout(
    engine: LocalEngine,
    rows: Sequence[Any] | None,
    n: int,
    sampling: Sampling,
    keeper: Keeper,
    interrupts: Interrupts,
    progress: AbstractContextManager[Progress] | None = None,
    first_index: int | None = None,
    resumed: Loaded | None = None,
) -> KeptRollout:
    """Roll `rows` out `n` times each (or, `rows` None, the run in `keeper.journal` again) in `engine`'s
    continuous mode, from the caller's loop, every step appended to the journal as it happens, while
    `interrupts` listens: a signal then parks the running trajectories at their next state boundary (the
    journal records each there), flushes the journal to disk and stops; the finished ones come back.
    `first_index`: the rows are a slice of a larger batch (see BaseEngine.asubmit, fsm/output/engine.py).
    `resumed`: the journal loaded and checked already, without the codec (`agentfsm run --resume`'s)."""
    path = keeper.journal

    def notice(name: str) -> str:
        return (
            f"agentfsm: {name}: stopping {len(engine.runner.live)} running trajectories at their next state "
            f"and flushing the journal {path}; Ctrl-C again to exit at once (the journal keeps all but the "
            "steps in flight)"
        )

    # armed before a row can start: a signal while rows run stops them, never cancels the run as not begun
    if rows is None:
        resumed, recorder = await _reopen(engine, keeper, resumed)
        interrupts.arm(notice)
        meta = await engine.arestore(resumed.data)
        groups, expected = int(meta["groups"]), int(meta["rows_expected"])
    else:
        made = await made_by(engine)  # before the journal exists: servers that cannot start leave none
        recorder = Recorder(Writer(path, keeper.sync), takes=False)  # its rows are its files (`end`)
        try:
            recorder.header(
                identity(
                    engine.agent,
                    engine.codec,
                    made_by=made,
                    run_id=keeper.run_id,
                    data=keeper.data,
                    sampling=encode_sampling(sampling),
                    groups=len(rows),
                    rows_expected=len(rows) * n,
                    n=n,
                    weight_version=engine.weight_version,
                    spec=keeper.spec or (str(engine.agent.path) if engine.agent.path else None),
                )
            )
            await engine.ajournal(recorder)
            interrupts.arm(notice)
            await engine.asubmit(rows, n=n, sampling=sampling, first_index=first_index)
        except BaseException:
            recorder.writer.close()
            raise
        groups, expected = len(rows), len(rows) * n
    stop = interrupts.stop
    with progress if progress is not None else contextlib.nullcontext(lambda ready, total: None) as update:
        while not stop.is_set() and recorder.writer.failed is None:  # a journal the disk refuses: stop
            ready = engine.stream_stats.get("ready_groups", 0)
            update(ready, groups)
            if ready >= groups:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
    interrupted = stop.is_set() or recorder.writer.failed is not None
    if interrupted:
        taken = await _stop(engine, recorder)
    else:
        taken = await engine.atake_groups(groups)
    trajs = sorted((t for g in taken for t in g.trajectories), key=lambda t: (t.index, t.sample))
    sampling = taken[0].sampling if taken else sampling
    return KeptRollout(trajs, interrupted, expected, sampling, recorder, resumed)


async def _reopen(engine: LocalEngine, keeper: Keeper, loaded: Loaded | None) -> tuple[Loaded, Recorder]:
    """The journal read back (unless `loaded`) and checked, and its writer going on after its last whole record."""
    path = keeper.journal
    if not path.exists() and keeper.snapshot.exists():
        raise SnapshotError(
            f"{keeper.snapshot}: a snapshot of an agentfsm before the journal ({path.name}); it cannot be "
            "resumed by this version: resume it with the version that wrote it, or start the run again"
        )
    if loaded is None:
        loaded = await asyncio.to_thread(load, path, engine.agent, engine.codec)
    else:
        await asyncio.to_thread(with_codec, loaded, path, engine.agent, engine.codec)
    if loaded.ended is not None:
        raise SnapshotError(f"{path}: the run there has {loaded.ended}: nothing to resume")
    refuse_unbegun(loaded, path)
    if loaded.torn:
        warn(loaded.torn)
    now = await made_by(engine)  # started: the servers' model and weight version, which the rows go on with
    found = changes(loaded.made_by, now)
    if (weights := weights_change(loaded, engine.weight_version, served_by(engine.backend))) is not None:
        found.append(weights)
    accepted = judge(path, found, keeper.accept_changes)
    if accepted:
        warn(f"{path}: going on with changes accepted (recorded in the journal): {'; '.join(accepted)}")
    say_now(
        f"agentfsm: resuming {path}: {loaded.finished} trajectories finished, {loaded.in_flight} go on from "
        f"their last state (the step in flight runs again), {loaded.restarted} start over"
        + (
            f"; tree nodes: {loaded.nodes_finished} finished (taken back as journaled), "
            f"{loaded.nodes_in_flight} go on from their last state"
            if loaded.nodes_finished or loaded.nodes_in_flight
            else ""
        )
    )
    recorder = Recorder(Writer(path, keeper.sync, keep=loaded.good_bytes), loaded.tool_results, takes=False)
    try:
        recorder.resumed(now, accepted)
        recorder.weights(engine.weight_version)  # the version its new tokens carry
        await engine.ajournal(recorder)
    except BaseException:
        recorder.writer.close()
        raise
    return loaded, recorder


async def _stop(engine: LocalEngine, recorder: Recorder) -> list[Any]:
    """Flush the journal, pause, exit: every running trajectory parks at its next state boundary (model turns
    in flight end at once, their partial tokens kept), where the journal records it; the journal goes to disk
    and the run stops. The finished groups back. Every way it can fail is one warning: the journal holds every
    step up to then all the same, and the finished rows are written."""
    t0 = time.perf_counter()
    wait_s = stop_timeout_s()
    try:
        info = await engine.asnapshot(None, stop=True, timeout=wait_s, abort_turns=True)
        ready, running = info["ready_groups"], info["running_groups"]
        say_now(
            f"agentfsm: flushed the journal ({running} group{'s' * (running != 1)} running, {ready} finished) "
            f"in {time.perf_counter() - t0:.1f} s"
        )
        if info.get("blocked"):  # the engine's loop runs nothing more: the finished groups come with it
            warn(
                "the event loop was blocked (see the warning above): the journal holds each running "
                "trajectory as it was at its last state boundary"
            )
            return list(info["finished"])
    except TimeoutError:
        warn(
            f"some trajectories did not reach a state boundary in {wait_s:g} s (a tool or user "
            "action still running): they go on from their last one on resume"
        )
        ready = engine.stream_stats.get("ready_groups", 0)
    except OSError as exc:
        warn(f"the journal could not be flushed ({exc.strerror or exc}); the finished rows are written below")
        ready = engine.stream_stats.get("ready_groups", 0)
    with contextlib.suppress(OSError):
        await asyncio.to_thread(recorder.writer.sync)
    if ready and not engine.wedged:
        return list(await engine.atake_groups(ready))
    return []
