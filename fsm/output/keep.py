"""A run kept in a directory: `RunDir(out)` is where `agentfsm run --out DIR` and a program that passes
`keep=RunDir(out)` to RolloutEngine write the run's three files (fsm/output/rundir.py replaces them together)
and the run's journal (fsm/run/journal.py), from which `agentfsm run --resume DIR` goes on after a signal
or a `kill -9`.

    engine = RolloutEngine("calculator")
    batch = engine.generate_sequences(rows, n=8, keep=RunDir("out"))   # SIGTERM: RunInterrupted, out/ kept
    batch = RunDir("out").resume(engine)   # in a fresh process, after a signal or a kill -9: the whole run

The roll-out and the snapshot are fsm/run/interruptible.py's (`RunDir` is its `Keeper`: the run stage cannot import
this one); the files, the summary and the order of the end (write, then drop the snapshot of a finished run)
are here, for both callers. `keep_batch` is the API's whole kept run; the CLI composes the same pieces around
its own engine's close, progress bar and exit codes (fsm/cli/commands.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

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
    write_outputs,
    write_run,
)
from fsm.run.agent import CompiledAgent
from fsm.run.context import Sampling
from fsm.run.engine import LocalEngine
from fsm.run.interruptible import keep_rollout
from fsm.run.journal import JOURNAL, SYNCS, JournalError, begun, ended
from fsm.run.signals import Interrupts
from fsm.run.tracer import Tracer
from fsm.run.trajectory import Trajectory
from fsm.run.tree import nodes_of

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
    # version, the code the spec names, the engine's options: fsm/run/provenance.py), the changes recorded in
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
        engine, out = run.engine, self.out

        def write(staging: Path) -> dict[str, Any]:
            summary = write_outputs(
                staging,
                engine.agent,
                run.trajs,
                batch,
                engine.codec,
                run.wall,
                run.router_stats,
                engine.tracer,
            )
            failed = sum(t.failed for t in run.trajs)
            summary = {
                "status": "interrupted" if run.interrupted else "completed",
                "run_id": self.run_id,
                "rows_expected": run.expected,
                "files": {
                    **(
                        {policy_batch_file(p): {"rows": len(b)} for p, b in batch.items()}
                        if isinstance(batch, dict)
                        else {"batch.pt": {"rows": len(batch)}}
                    ),
                    "trajectories.jsonl": {"rows": sum(len(nodes_of(t)) for t in run.trajs)},
                },
                "error_rate": round(failed / len(run.trajs), 4),
                "rollout_cpu_s": round(run.cpu, 3),
                **summary,
                **run.more,
            }
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
            kept = await keep_rollout(engine, rows, n, sampling, keep, interrupts)
            tracer = engine.tracer
            if tracer is not None:  # as every run's owner does (fsm/run/runtime.py): the summary counts them
                await asyncio.to_thread(tracer.flush)
        backend = engine.backend
        run = Rollout(
            engine,
            kept.sampling,
            kept.trajs,
            kept.expected,
            time.perf_counter() - t_start,
            backend.stats() if isinstance(backend, Counted) else None,
            kept.interrupted,
            time.process_time() - c_start,
        )
        run.journal, keep.resumed = kept.journal, kept.resumed
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
