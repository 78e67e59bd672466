"""A run that a signal keeps: rows rolled out in the engine's continuous mode (fsm/run/stream.py) until every
group has finished, or until SIGINT/SIGTERM (fsm/run/signals.py `Interrupts`) stops it; then the running
trajectories are parked at their next state boundary and written to a snapshot, and the finished ones come
back to be written with it. `agentfsm run` and a program that passes `keep=` to RolloutEngine both go
through `keep_rollout`, so a fix to one is a fix to both.

Where the snapshot goes and what it records come from a `Keeper`, which the caller passes in: the run stage
writes no run directory itself (fsm/output/keep.py's `RunDir` is the one the CLI and the API pass).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fsm.run.context import Sampling
from fsm.run.signals import Interrupts, say_now, warn
from fsm.run.snapshot import SnapshotError
from fsm.run.trajectory import Trajectory

# waiting for every running trajectory to reach a state boundary; model turns do not count (they are aborted
# and kept partial), so only a tool or user action still running can take this long
SNAPSHOT_TIMEOUT_S = 60.0

Progress = Callable[[int, int], None]  # (groups finished, groups in all)


class Keeper(Protocol):
    """Where a kept run's snapshot goes and what it records (fsm/output/keep.py `RunDir`)."""

    run_id: str
    spec: str | None  # the spec's path, stored for a resume that names none

    @property
    def snapshot(self) -> Path: ...

    def fallback(self) -> Path:
        """A fresh directory for the snapshot when `snapshot`'s refuses it (a full disk)."""
        ...


@dataclass
class KeptRollout:
    """What `keep_rollout` rolled out: every trajectory, or (interrupted) those that finished, in input order."""

    trajs: list[Trajectory]
    interrupted: bool
    expected: int  # rows x n
    sampling: Sampling


async def keep_rollout(
    engine: Any,
    rows: Sequence[Any] | None,
    n: int,
    sampling: Sampling,
    keeper: Keeper,
    interrupts: Interrupts,
    progress: AbstractContextManager[Progress] | None = None,
    first_index: int | None = None,
) -> KeptRollout:
    """Roll `rows` out `n` times each (or, `rows` None, the snapshot at `keeper.snapshot` again) in `engine`'s
    continuous mode, from the caller's loop, while `interrupts` listens: a signal then parks the running
    trajectories at their next state boundary and writes them, with the finished ones, to `keeper.snapshot`.
    `first_index`: the rows are a slice of a larger batch (see BaseEngine.asubmit, fsm/output/engine.py)."""
    out = keeper.snapshot.parent
    if rows is None:
        meta = await engine.arestore(keeper.snapshot)
        groups, expected = int(meta["groups"]), int(meta["rows_expected"])
    else:
        await engine.asubmit(rows, n=n, sampling=sampling, first_index=first_index)
        groups, expected = len(rows), len(rows) * n
    stop = interrupts.stop
    interrupts.arm(
        lambda name: (
            f"agentfsm: {name}: stopping {len(engine.runner.live)} running trajectories and "
            f"writing a snapshot to {keeper.snapshot}; Ctrl-C again to exit without a snapshot"
        )
    )
    with progress if progress is not None else contextlib.nullcontext(lambda ready, total: None) as update:
        while not stop.is_set():
            ready = engine.stream_stats.get("ready_groups", 0)
            update(ready, groups)
            if ready >= groups:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
    interrupted = stop.is_set()
    if interrupted:
        meta = {"groups": groups, "rows_expected": expected, "run_id": keeper.run_id, "spec": keeper.spec}
        taken = await _snapshot(engine, keeper, out, meta)
    else:
        taken = await engine.atake_groups(groups)
    trajs = sorted((t for g in taken for t in g.trajectories), key=lambda t: (t.index, t.sample))
    return KeptRollout(trajs, interrupted, expected, taken[0].sampling if taken else sampling)


async def _snapshot(engine: Any, keeper: Keeper, out: Path, meta: dict[str, Any]) -> list:
    """Stop the run into `keeper.snapshot` (its fallback when refused); the finished groups back. Every way
    it can fail is one warning: the finished rows are written all the same."""
    t0 = time.perf_counter()
    try:  # abort_turns: model turns in flight end at once, their partial tokens kept in the snapshot
        info = await engine.asnapshot(
            keeper.snapshot,
            meta=meta,
            stop=True,
            timeout=SNAPSHOT_TIMEOUT_S,
            abort_turns=True,
            fallback=keeper.fallback,
        )
        ready = info["ready_groups"]
        where = Path(info["path"])
        restarted = (
            f"; {info['restarted']} trajectories start over on resume (inside their interaction, a user "
            "action or the code that blocked the loop)"
            if info["restarted"]
            else ""
        )
        running = info["running_groups"]
        say_now(
            f"agentfsm: wrote the snapshot ({running} group{'s' * (running != 1)} running, {ready} finished) "
            f"in {time.perf_counter() - t0:.1f} s{restarted}"
        )
        if where.parent != out:
            warn(
                f"--out {out} refused the snapshot; it is kept in {where.parent}: resume with agentfsm run "
                f"--resume {where.parent}"
            )
        if info.get("blocked"):  # the engine's loop runs nothing more: the finished groups come with it
            warn(
                "the event loop was blocked (see the warning above): the snapshot holds each running "
                "trajectory as it was at its last state boundary"
            )
            return list(info["finished"])
    except TimeoutError:
        warn(
            f"no snapshot: some trajectories did not reach a state boundary in {SNAPSHOT_TIMEOUT_S:g} s "
            "(a tool or user action still running)"
        )
        ready = engine.stream_stats.get("ready_groups", 0)
    except OSError as exc:
        warn(
            f"no snapshot: neither --out {out} nor a temporary directory could hold it "
            f"({exc.strerror or exc}); the finished rows are written below"
        )
        ready = engine.stream_stats.get("ready_groups", 0)
    except SnapshotError as exc:
        warn(f"no snapshot: {exc}")
        ready = engine.stream_stats.get("ready_groups", 0)
    if ready and not engine.wedged:
        return await engine.atake_groups(ready)
    return []
