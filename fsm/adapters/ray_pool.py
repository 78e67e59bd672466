"""The Ray runner's queue of chunks, on the driver (how work moves: fsm/adapters/ray_runner.py)."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from fsm.run.context import Sampling
from fsm.run.stream import Group, Groups, version_span
from fsm.run.trajectory import Trajectory


def chunk_slots(max_concurrency: int, chunk_rows: int, n: int = 1) -> int:
    """Chunks in flight per actor: enough to keep `max_concurrency` trajectories busy, a chunk holding `chunk_rows`
    groups of `n`. An actor is made before any batch's `n` is known, so its own concurrency takes n = 1, the most
    chunks any batch puts on it (fsm/adapters/ray_runner.py); a batch's pool takes its `n`."""
    return max(1, math.ceil(max_concurrency / (n * chunk_rows)))


class Driver(Protocol):
    """What the pool reads of its RayRunner (typed here: the runner imports the pool)."""

    actors: list[Any]  # Ray actor handles, index = rank
    _dead: set[int]
    journal_dir: str | None
    journal_sync: str
    accept_changes: bool
    hang_s: float | None
    max_concurrency: int
    chunk_rows: int

    @property
    def weight_version(self) -> int: ...


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError("RayRunner needs ray: pip install 'agentfsm[ray]'") from e
    return ray


@dataclass
class Job:
    """A chunk of groups for one actor call: rows as sent, their group ids (a batch's row numbers)."""

    key: str  # the actor's RunContext cache key
    sampling: Sampling
    n: int
    rows: list[Any]
    ids: list[int]
    attempt: int = 0  # dispatches before this one (a dead actor's chunk goes on from its journal)


class Pool:
    """Chunks dispatched to the live actors by work stealing and collected as they come back, whatever loop
    polls (ray.wait in a thread). A dead actor's chunks, and a hung one's (no progress for `hang_s` while it
    holds chunks: it is killed), go back to the front of the queue and run on the survivors."""

    def __init__(self, runner: Driver, n: int):
        self.runner, self.slots = runner, chunk_slots(runner.max_concurrency, runner.chunk_rows, n)
        self.pending: deque[Job] = deque()
        self.inflight: dict[Any, tuple[int, Job]] = {}  # ObjectRef -> (rank, job)
        self.alive = [r for r in range(len(runner.actors)) if r not in runner._dead]
        self.busy = dict.fromkeys(self.alive, 0)
        self.moved: dict[int, tuple[int, float]] = {}  # rank -> (its progress counter, when it last changed)
        self.probes: dict[Any, int] = {}  # heartbeat ObjectRef -> rank
        self.rows: list[dict[str, Any]] = []  # continuous mode: group id -> its row
        # continuous mode: finished ones, taken
        self.groups = Groups(lambda: runner.weight_version, self._rerun)
        self.stats = self.groups.stats
        self.stats.update(
            chunks=0,
            rerun_rows=0,
            actor_deaths=0,
            hung_actors=0,
            rows_per_actor=dict.fromkeys(self.alive, 0),
            rows_done=0,
            journal_resumed=0,  # trajectories that went on from their last journaled boundary
            journal_restarted=0,  # ... that started over (inside their interaction)
            journal_recovered=0,  # ... that had finished: came back as journaled, not run again
            journal_refused=0,  # chunk journals that could not be read or were refused: run from the start
            journal_bytes=0,  # written by the chunks that came back
        )

    def running(self) -> bool:
        return bool(self.pending or self.inflight)

    def fill(self) -> None:
        while self.pending and any(self.busy[r] < self.slots for r in self.alive):
            for rank in self.alive:  # round robin over actors with a free slot
                if self.pending and self.busy[rank] < self.slots:
                    job = self.pending.popleft()
                    root, driver = self.runner.journal_dir, self.runner
                    journal = (
                        None
                        if root is None
                        else (root, job.attempt, driver.journal_sync, driver.accept_changes)
                    )
                    ref = self.runner.actors[rank].run.remote(
                        job.key, job.sampling, job.rows, job.ids, job.n, journal
                    )
                    self.inflight[ref] = (rank, job)
                    if self.busy[rank] == 0 and rank in self.moved:
                        self.moved[rank] = (self.moved[rank][0], time.monotonic())
                    self.busy[rank] += 1

    async def poll(self, wait_s: float = 0.05) -> list[tuple[Job, list[Trajectory]]]:
        """Dispatch what can go, wait up to `wait_s` for chunks, return those that came back."""
        from ray.exceptions import RayActorError

        ray = _ray()
        self.fill()
        self._check_hangs()
        refs = list(self.inflight)
        if not refs:
            return []
        ready, _ = await asyncio.to_thread(ray.wait, refs, num_returns=1, timeout=wait_s)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for ref in ready:
            if ref not in self.inflight:  # its actor was found dead meanwhile: requeued already
                continue
            rank, job = self.inflight.pop(ref)
            self.busy[rank] -= 1
            try:
                trajs, counts = ray.get(ref)
            except RayActorError as exc:
                self._lost(rank, exc)
                job.attempt += 1
                self.pending.appendleft(job)
                self.stats["rerun_rows"] += len(job.ids)
                continue
            for name, count in counts.items():
                self.stats[f"journal_{name}"] += count
            if rank in self.moved:
                self.moved[rank] = (self.moved[rank][0], time.monotonic())
            self.stats["chunks"] += 1
            self.stats["rows_done"] += len(job.ids)
            self.stats["rows_per_actor"][rank] = self.stats["rows_per_actor"].get(rank, 0) + len(job.ids)
            out.append((job, trajs))
        self.fill()
        return out

    def refresh(self) -> None:
        """Take in actors that `RayRunner.start()` has put in place of dead ones."""
        for rank in range(len(self.runner.actors)):
            if rank not in self.runner._dead and rank not in self.alive:
                self.alive.append(rank)
                self.busy[rank] = 0

    def _lost(self, rank: int, exc: BaseException | None) -> None:
        """`rank` is dead or hung: every chunk it holds goes back to the front of the queue."""
        if rank in self.alive:
            self.alive.remove(rank)
            self.runner._dead.add(rank)
            self.stats["actor_deaths"] += 1
        for ref, (r, job) in list(self.inflight.items()):
            if r == rank:
                del self.inflight[ref]
                _ray().cancel(ref)
                job.attempt += 1
                self.pending.appendleft(job)
                self.stats["rerun_rows"] += len(job.ids)
        self.busy[rank] = 0
        if not self.alive:
            raise RuntimeError(
                f"all {len(self.runner.actors)} Ray actors died or hung; {len(self.inflight) + len(self.pending)} "
                f"chunks unfinished (last error: {exc})"
            ) from exc

    def _check_hangs(self) -> None:
        """Probe busy actors' progress; kill one that has not moved for `hang_s` since it first answered (its
        chunks then fail over)."""
        hang_s = self.runner.hang_s
        if not hang_s:
            return
        ray, now = _ray(), time.monotonic()
        if self.probes:
            answered, _ = ray.wait(list(self.probes), num_returns=len(self.probes), timeout=0)
            for ref in answered:
                rank = self.probes.pop(ref)
                try:
                    count = ray.get(ref)
                except Exception:
                    continue
                if count != self.moved.get(rank, (-1, 0.0))[0]:
                    self.moved[rank] = (count, now)
        probing = set(self.probes.values())
        for rank in list(self.alive):
            if self.busy[rank] == 0:
                continue
            # its clock starts at its first answer: an actor still starting up is not hung
            if rank in self.moved and now - self.moved[rank][1] > hang_s:
                self.stats["hung_actors"] += 1
                ray.kill(self.runner.actors[rank])  # its calls now fail with RayActorError: rerun elsewhere
                self._lost(rank, TimeoutError(f"actor {rank} made no progress for {hang_s:g} s"))
            elif rank not in probing:
                self.probes[self.runner.actors[rank].heartbeat.remote()] = rank

    async def deliver(self) -> None:
        """Poll the actors (continuous mode): each chunk back is one finished group."""
        for job, trajs in await self.poll():
            gid = job.ids[0]
            for t in trajs:
                t.row = self.rows[gid]
            v = self.runner.weight_version
            spans = [version_span(t, v) for t in trajs]
            self.groups.finished(
                Group(
                    trajs[0].uid,
                    sorted(trajs, key=lambda t: t.sample),
                    job.sampling,
                    min(a for a, _ in spans),
                    max(b for _, b in spans),
                )
            )

    def _rerun(self, g: Group) -> None:
        gid = g.trajectories[0].index // len(g.trajectories)
        self.pending.append(
            Job(uuid.uuid4().hex[:8], g.sampling, len(g.trajectories), [self.rows[gid]], [gid])
        )

    def cancel(self) -> None:
        for ref in list(self.inflight):  # cancelled or failed: stop what still runs
            _ray().cancel(ref)
