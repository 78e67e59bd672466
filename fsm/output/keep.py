"""A run kept in a directory: `RunDir(out)` is where `agentfsm run --out DIR` and `keep=RunDir(out)` write the
run's three files (rundir.py) and its journal (fsm/run/journal.py), from which the run goes on after a signal
or a `kill -9`.

    engine = RolloutEngine("calculator")
    batch = engine.generate_sequences(rows, n=8, keep=RunDir("out"))   # SIGTERM: RunInterrupted, out/ kept
    batch = RunDir("out").resume(engine)   # in a fresh process, after a signal or a kill -9: the whole run

`keep_rollout` runs the rows in the engine's continuous mode (fsm/run/stream.py), journaling every step, until
they finish or SIGINT/SIGTERM (fsm/run/signals.py) parks them (`_stop`); a run killed without a signal resumes
from the same journal (fsm/run/resume.py). The files, the summary and the order of the end (write, then drop a
finished run's snapshot) are here for both callers: `keep_batch`, the API's whole kept run, and the CLI, which
composes the same pieces around its own engine (fsm/cli/commands.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from backends.base import Counted
from fsm.families import Codec
from fsm.output.rundir import (
    RunDirError,
    WriteInterrupted,
    fallback_dir,
    json_text,
    locked,
    policy_batch_file,
    prepare,
    run_stats,
    trajectory_record,
    write_run,
)
from fsm.run.agent import CompiledAgent
from fsm.run.codec import SnapshotError, encode_sampling
from fsm.run.context import Sampling
from fsm.run.engine import LocalEngine
from fsm.run.journal import JOURNAL, SYNCS, JournalError, Recorder, Writer, begun, ended
from fsm.run.resume import (
    Loaded,
    changes,
    identity,
    judge,
    load,
    made_by,
    refuse_unbegun,
    served_by,
    weights_change,
    with_codec,
)
from fsm.run.signals import Interrupts, say_now, warn
from fsm.run.tracer import Tracer
from fsm.run.trajectory import Trajectory
from fsm.run.tree import nodes_of

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


async def keep_rollout(
    engine: LocalEngine,
    rows: Sequence[Any] | None,
    n: int,
    sampling: Sampling,
    keeper: RunDir,
    interrupts: Interrupts,
    progress: AbstractContextManager[Progress] | None = None,
    first_index: int | None = None,
    resumed: Loaded | None = None,
) -> Rollout:
    """Roll `rows` out `n` times each (or, `rows` None, the run in `keeper.journal` again) in `engine`'s
    continuous mode, from the caller's loop, every step journaled, until a signal from `interrupts` stops it
    (`_stop`); the finished trajectories come back. `first_index`: the rows are a slice of a larger batch
    (BaseEngine.asubmit, fsm/output/engine.py). `resumed`: the journal loaded and checked already, without the
    codec (`agentfsm run --resume`'s)."""
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
    # wall, router_stats and cpu: the caller's, who owns the clock (and the engine's close)
    return Rollout(
        engine, sampling, trajs, expected, 0.0, None, interrupted, 0.0, journal=recorder, resumed=resumed
    )


async def _reopen(engine: LocalEngine, keeper: RunDir, loaded: Loaded | None) -> tuple[Loaded, Recorder]:
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
            + (f", {loaded.nodes_restarted} start over" if loaded.nodes_restarted else "")
            if loaded.nodes_finished or loaded.nodes_in_flight or loaded.nodes_restarted
            else ""
        )
    )
    recorder = Recorder(Writer(path, keeper.sync, keep=loaded.good_bytes), loaded.tool_results, takes=False)
    try:
        recorder.resumed(now, accepted, loaded.trees_over)
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


SNAPSHOT = "snapshot.json"  # what an agentfsm before the journal left on a signal: refused by `run --resume`


class RunInterrupted(Exception):
    """A kept run was ended by SIGINT or SIGTERM: the message says what its directory holds now."""


class Made(Protocol):
    """What a run's files read of what made its rows: a LocalEngine, or the gateway workers' merged run
    (fsm/gateway/workers.py `Merged`, which runs nothing)."""

    @property
    def agent(self) -> CompiledAgent: ...
    @property
    def codec(self) -> Codec: ...
    @property
    def tracer(self) -> Tracer | None: ...
    def to_batch(self, trajs: Sequence[Trajectory], sampling: Sampling, like: Any = None) -> Any: ...


@dataclass
class Rollout:
    """What a run rolled out, as its files record it: every trajectory, or (interrupted) those that finished,
    in input order."""

    engine: Made
    sampling: Sampling
    trajs: list[Trajectory]
    expected: int  # rows x n
    wall: float  # the rollout's seconds: not launching servers, imports, loading the model
    router_stats: Any
    interrupted: bool
    cpu: float  # this process's CPU seconds over the same window (all threads: the model's, the exporters')
    more: dict[str, Any] = field(default_factory=dict)  # more for the summary (gateway workers: theirs)
    journal: Any = None  # the run's journal (fsm/run/journal.py Recorder), open: `finish` ends and closes it
    resumed: Loaded | None = None  # what a resume found in the journal


def _write_rows(staging: Path, run: Rollout, files: dict[str, Any]) -> None:
    """The batch files and trajectories.jsonl (a tree's nodes follow its root, one record each: docs/trees.md)."""
    # imported here: torch stays out of the commands that never write a batch (`validate`, `show`)
    from fsm.output.batch import save_batch, tree_weights

    engine, agent, trajs = run.engine, run.engine.agent, run.trajs
    for name, one in files.items():
        try:
            # loadable with torch.load's weights_only=True (fsm/output/batch.py)
            save_batch(one, staging / name)
        except RuntimeError as exc:  # torch's writer reports a full disk as a RuntimeError
            raise OSError(f"{name}: {str(exc).splitlines()[0] if str(exc) else 'write failed'}") from exc
    weights = tree_weights(trajs, agent.spec.tree.weight, agent.spec.policy)
    with (staging / "trajectories.jsonl").open("w") as f:
        for root in trajs:
            for traj in nodes_of(root):
                record = trajectory_record(
                    traj, engine.codec, weight=weights.get(id(traj), 0.0), policy=agent.spec.policy
                )
                f.write(json_text(record, ensure_ascii=False) + "\n")


@dataclass
class RunDir:
    """The directory a run is kept in (see the module docstring); `run_id` names the run in its summary and
    snapshot, `spec` (the spec's path) lets a resume name none."""

    out: Path
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    spec: str | None = None
    sync: str = (
        "1s"  # the journal's durability: "1s" (a power cut loses at most the last second), "always", "off"
    )
    data: str | None = None  # the data file, recorded in the journal
    # a resume goes on although what makes the rows changed (the model's weights or the servers' model and weight
    # version, the code the spec names, the engine's options: fsm/run/resume.py), the changes recorded in
    # the journal; refused in one line otherwise
    accept_changes: bool = False
    other_weights: bool = False  # the older name of accept_changes (it covered only the weight version)
    resumed: Any = field(default=None, init=False)  # after `resume`: what it found (fsm/run/resume.py Loaded)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.sync not in SYNCS:
            raise ValueError(f"RunDir sync must be one of {', '.join(SYNCS)}, not {self.sync!r}")
        self.accept_changes = self.accept_changes or self.other_weights

    @property
    def journal(self) -> Path:
        return self.out / JOURNAL

    @property
    def snapshot(self) -> Path:
        return self.out / SNAPSHOT

    def unfinished(self) -> bool:
        """The directory holds a run that did not finish: its journal has begun (a run killed before its first
        group was recorded did nothing) and has no `end`, or an old snapshot. RunDirError for a journal that is
        not a regular file (a FIFO, a directory), named."""
        if self.snapshot.exists():
            return True
        if not self.journal.exists():
            return False
        try:
            return ended(self.journal) is None and begun(self.journal)
        except JournalError as exc:
            raise RunDirError(str(exc)) from None

    def refuse_a_snapshot(self) -> None:
        """A new run does not write over an unfinished one's journal (RunDirError, naming both ways on)."""
        if self.unfinished():
            held = self.snapshot if self.snapshot.exists() else self.journal
            raise RunDirError(
                f"{self.out} holds an unfinished run ({held.name}); resume it with `agentfsm run "
                f"--resume {self.out}`, or remove {held} to start a new run there"
            )

    def resume(self, engine: LocalEngine) -> Any:
        """Go on with the run kept here (stopped by a signal or killed) on `engine`, a RolloutEngine of the spec
        and tokenizer it was written with, from a loop of the calling thread (the main one: signals reach it);
        verl's batch of the whole run back, written here as `agentfsm run --resume` writes it."""
        return asyncio.run(self.aresume(engine))

    async def aresume(self, engine: LocalEngine) -> Any:
        """`resume` from the caller's loop."""
        if not self.unfinished():
            raise RunDirError(f"{self.out}: no unfinished run to resume there (no {JOURNAL} without an end)")
        return await keep_batch(engine, None, 1, engine.sampling(), self)

    def resume_hint(self, run: Rollout) -> str:
        return f"; resume with: agentfsm run --resume {self.out}" if run.interrupted else ""

    def nothing_finished(self, run: Rollout) -> RunInterrupted:
        return RunInterrupted(
            f"interrupted before any trajectory finished; {self.out} holds what it held before"
            f"{self.resume_hint(run)}"
        )

    def write(self, run: Rollout, batch: Any) -> dict[str, Any]:
        """The run's three files into the directory, its summary saying how the run ended and how many rows
        each file holds. When the directory refuses them (a full disk...), they go to a fallback directory,
        named in the error (RunDirError): a finished rollout is never lost to a write. RunInterrupted when
        Ctrl-C lands while they are written."""
        out = self.out
        files = (
            {policy_batch_file(p): b for p, b in batch.items()}
            if isinstance(batch, dict)
            else {"batch.pt": batch}
        )

        def write(staging: Path) -> dict[str, Any]:
            _write_rows(staging, run, files)
            summary = self._summary(run, files)
            (staging / "summary.json").write_text(json_text(summary, indent=2, default=str) + "\n")
            return summary

        try:
            return write_run(out, write)
        except WriteInterrupted as exc:
            if exc.committed:
                raise RunInterrupted(f"interrupted; the run had finished and is written to {out}") from None
            raise RunInterrupted(
                f"interrupted while writing; {out} holds what it held before this run"
            ) from None
        except OSError as exc:
            reason = exc.strerror or exc
        try:
            kept = fallback_dir()
            write_run(kept, write)
        except (OSError, WriteInterrupted) as exc2:
            raise RunDirError(
                f"{out}: cannot write the run's outputs ({reason}); nor to a temporary directory "
                f"({getattr(exc2, 'strerror', None) or exc2}): the run is lost"
            ) from None
        raise RunDirError(f"{out}: cannot write the run's outputs ({reason}); they are kept in {kept}")

    def _summary(self, run: Rollout, files: dict[str, Any]) -> dict[str, Any]:
        """summary.json: how the run ended, how many rows each file holds, and the run's counts."""
        from fsm.output.batch import fault_summary, summarize

        engine, agent, trajs = run.engine, run.engine.agent, run.trajs
        counts = summarize(trajs)
        counts.update(
            spec=str(agent.path),
            agent=agent.name,
            spec_hash=agent.hash,
            wall_s=round(run.wall, 3),
            timing=next(iter(files.values())).meta_info["timing"],  # the root policy's batch
            router=run.router_stats,
        )
        counts["server_faults"] = fault_summary(trajs, run.router_stats)
        counts["fsm"] = run_stats(agent, trajs)
        if (contained := containment(trajs)) is not None:
            counts["containment"] = contained
        if (tracer := cast(Any, engine.tracer)) is not None:  # Telemetry's counts (fsm/telemetry)
            counts["tracing"] = tracer.stats()
        return {
            "status": "interrupted" if run.interrupted else "completed",
            "run_id": self.run_id,
            "rows_expected": run.expected,
            "files": {
                **{name: {"rows": len(b)} for name, b in files.items()},
                "trajectories.jsonl": {"rows": sum(len(nodes_of(t)) for t in trajs)},
            },
            "error_rate": round(sum(t.failed for t in trajs) / len(trajs), 4),
            "rollout_cpu_s": round(run.cpu, 3),
            **counts,
            **run.more,
        }

    def finish(self, run: Rollout) -> RunInterrupted | None:
        """After `write`: a finished run's journal ends (kept, for `agentfsm replay`: nothing to resume); an
        interrupted one's stays open-ended, and what to raise comes back."""
        close_journal(run, "completed" if not run.interrupted else None)
        if not run.interrupted:
            return None
        return RunInterrupted(
            f"interrupted: {len(run.trajs)} of {run.expected} trajectories finished and are written "
            f'to {self.out} (summary.json: "status": "interrupted"){self.resume_hint(run)}'
        )


def close_journal(run: Rollout, status: str | None) -> None:
    """The run's journal, closed (once): with its `end` record when the run's files are written."""
    journal, run.journal = run.journal, None
    if journal is None:
        return
    try:
        if status is not None:
            journal.end(status)
    finally:
        journal.writer.close()


def containment(trajs: list) -> dict[str, Any] | None:
    """Whether the run's command harnesses were contained (fsm/gateway/reaper.py: each in a PID namespace with its
    own /proc, its row's `extra.harness.contained`); None without command harnesses. A run with one that was not is
    not isolated (a harness could read another's session key in /proc and outlive its row): the summary and the run
    table say so, never a clean run."""
    said = [
        h["contained"] for t in trajs if isinstance(h := t.extra.get("harness"), dict) and "contained" in h
    ]
    if not said:
        return None
    why = [s.removeprefix("no: ") for s in said if s != "pid+proc"]  # the reaper's word for contained
    return {
        "rows": len(said),
        "contained": len(said) - len(why),
        "uncontained": len(why),
        "why": sorted(set(why)),
    }


async def keep_batch(
    engine: LocalEngine,
    rows: Sequence[Any] | None,
    n: int,
    sampling: Sampling,
    keep: RunDir,
    *,
    like: Any = None,
    meta: Mapping[str, Any] | None = None,
) -> Any:
    """RolloutEngine's `keep=` path (from the caller's loop, which must be the main thread's for signals to
    reach it): roll `rows` out as `agentfsm run` does (`rows` None: the unfinished run in `keep` goes on), write
    the directory, and return verl's batch; on SIGINT or SIGTERM, flush the journal, write the finished rows
    and raise RunInterrupted."""
    if keep.spec is None and engine.agent.path is not None:  # one built in memory: the resume names it
        keep.spec = str(Path(engine.agent.path).resolve())
    keep.out = prepare(keep.out)
    with locked(keep.out):
        if rows is not None:
            keep.refuse_a_snapshot()
        interrupts = Interrupts()
        t_start, c_start = time.perf_counter(), time.process_time()
        with interrupts.listening(asyncio.current_task()):
            run = await keep_rollout(engine, rows, n, sampling, keep, interrupts)
            tracer = engine.tracer
            if tracer is not None:  # as every run's owner does (fsm/run/runtime.py): the summary counts them
                await asyncio.to_thread(tracer.flush)
        backend, run.wall = engine.backend, time.perf_counter() - t_start
        run.router_stats = backend.stats() if isinstance(backend, Counted) else None
        run.cpu, keep.resumed = time.process_time() - c_start, run.resumed
        try:
            if not run.trajs:
                raise keep.nothing_finished(run)
            batch = engine.to_batch(run.trajs, run.sampling, like=like, meta=meta, wall_s=run.wall)
            keep.write(run, batch)
            stopped = keep.finish(run)
        finally:
            close_journal(run, None)
    if stopped is not None:
        raise stopped
    return batch
