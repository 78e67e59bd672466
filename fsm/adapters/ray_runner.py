"""Scale-out on Ray: K actors, each an event loop running a Runner of the same spec, fed by work stealing.

    runner = RayRunner("specs/calculator.yaml", tokenizer=path, servers=[url, ...], workers=4)
    batch = runner.generate_sequences(rows, n=8)       # same contract as RolloutEngine

How work moves:
- The unit of work is a GRPO group: one row with its n samples. A group never splits, so its samples run in
  one actor, through that actor's one Router, which sends them to one server (group affinity: the shared
  prompt is prefilled once) and keeps each trajectory's turns there (sticky sessions: prefix reuse).
- The queue of groups lives in the driver. Each actor has `slots` calls in flight, each a chunk of
  `chunk_rows` groups; when a call returns, that actor's freed slot takes the next chunk. Actors that run
  faster take more chunks: work stealing, with no static split and no queue actor (one Ray hop per chunk).
- Routing stays per actor, against the one shared set of servers. A shared router actor would see global
  load, but at the price of a Ray hop per model call on the hot path; per-actor least-in-flight routers
  balance the aggregate statistically, and each actor's server list is rotated by its rank so that idle
  tie-breaks do not pile every actor onto server 0.
- An actor that dies (ActorDiedError and other RayActorErrors) loses nothing: its unfinished chunks go back
  to the front of the queue and run on the survivors; `stats["rerun_rows"]` counts them. The next batch
  replaces dead actors. With `journal_dir`, each chunk journals its state boundaries as it runs
  (fsm/adapters/ray_journal.py), and a dead actor's trajectories go on from their last boundary on a survivor:
  at most the turns in flight are redone.
- Trajectories come back pickled (slots and arrays pickle as they are), without their input row (the driver
  has it), and are collated on the driver in input order: the batch equals a single-process run's.

`ray` is an optional extra (`pip install 'agentfsm[ray]'`) and is imported only inside this module's calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from backends.base import Backend, Lifecycle
from fsm.adapters.ray_pool import Job, Pool, _ray, chunk_slots
from fsm.api import BaseEngine, SpecLike, load_agent, load_tokenizer, make_backend, tiny_model_dir
from fsm.data.rows import normalize_record
from fsm.families import Codec
from fsm.run import heap
from fsm.run.context import Sampling
from fsm.run.engine import Call, Command, Controls, EngineRefused, Pause, Resume, Take, Update
from fsm.run.journal import SYNCS
from fsm.run.local import LoopThread
from fsm.run.runtime import agent_codec
from fsm.run.stream import Group, StreamEmpty
from fsm.run.trajectory import Trajectory

T = TypeVar("T")


class _Worker:
    """One actor: a Runner over its own backend (a Router over the shared servers, or the factory's)."""

    def __init__(
        self,
        spec: Any,
        tokenizer: Any,
        servers: Sequence[str] | None,
        backend_factory: Callable[[], Backend] | None,
        rank: int,
        max_concurrency: int,
        engine: str | None = None,
        version: int = 0,
    ):
        from fsm.run.runtime import Owner, Runner

        if servers:
            k = rank % len(servers)
            backend = make_backend(servers=[*servers[k:], *servers[:k]], engine=engine)
        elif backend_factory is not None:
            backend = backend_factory()
        else:
            backend = make_backend()
        self.runner = Runner(
            load_agent(spec), backend, load_tokenizer(tokenizer), max_concurrency=max_concurrency
        )
        self.runner.gate.version = version  # the driver's: an actor replacing a dead one goes on from there
        self.controls = Controls(self.runner, self._start)  # the same control calls as RolloutEngine's
        self.rank = rank
        # state boundaries passed and trajectories finished: the driver's hang detector reads it
        self.progress = 0
        self._owner = Owner(
            self.runner
        )  # the one run path (fsm/run/runtime.py): serves while the actor lives
        self._serving: asyncio.Future[None] | None = None
        self._contexts: dict[str, Any] = {}  # batch key -> RunContext (a few recent batches)
        self._ident: dict[str, Any] | None = None  # the chunk journals' identity record
        self._heap: heap.Held | None = None  # its hold on its frozen heap, as a RolloutEngine's

    async def _start(self) -> None:
        if self._serving is None:
            self._serving = asyncio.ensure_future(self._owner.serve())
            if isinstance(self.runner.backend, Lifecycle):
                await self.runner.backend.start()

    async def run(
        self,
        key: str,
        sampling: Sampling,
        rows: list[Any],
        row_ids: list[int],
        n: int,
        journal: tuple[str, int, str, bool] | None = None,
    ) -> tuple[list[Trajectory], dict[str, int]]:
        """Run a chunk of groups; trajectories come back without their rows (the driver holds them), with the
        counts of its journal (`journal`: the directory, this dispatch's attempt, the sync mode, whether it accepts
        changes; see
        fsm/adapters/ray_journal.py)."""
        await self._start()
        trajs = self.runner.trajectories(rows, n)
        if self._heap is None and len(self.runner.live) + len(trajs) >= heap.FREEZE_AT:
            self._heap = heap.hold()
        for t in trajs:
            t.index = row_ids[t.index // n] * n + t.sample  # the batch-wide index: per-sample seeds match
        if journal is not None:
            from fsm.adapters.ray_journal import run_chunk

            chunk = (key, row_ids[0], journal)
            return await run_chunk(
                self._owner, self.rank, self._identity, self._tick, self._done, chunk, sampling, n, trajs
            )
        ctx = self._contexts.get(key)
        if ctx is None:
            ctx = self._contexts[key] = self.runner.make_context(sampling=sampling)
            while len(self._contexts) > 4:
                del self._contexts[next(iter(self._contexts))]
        await self._owner.run(trajs, ctx, on_done=self._done, boundary=self._tick)
        for t in trajs:
            t.row = None  # type: ignore[assignment]
        return trajs, {}

    def _identity(self) -> dict[str, Any]:
        """The journals' `run` record (the tokenizer's digest computed once per actor)."""
        if self._ident is None:
            from fsm.run.resume import identity

            self._ident = identity(self.runner.agent, self.runner.codec)
        return self._ident

    async def _tick(self, traj: Trajectory) -> None:
        self.progress += 1

    def _done(self, traj: Trajectory) -> None:
        self.progress += 1

    async def heartbeat(self) -> int:
        """How far this actor has got; unchanged for `hang_s` while it holds rows: hung."""
        return self.progress

    async def echo(self, payload: Any) -> Any:
        """A no-op round trip: `bench/ray.py` measures the bare Ray hop with it."""
        return payload

    async def pid(self) -> int:
        return os.getpid()

    async def control(self, command: Command, servers: bool) -> Any:
        """A control command (fsm/run/engine.py `Controls.run`); `servers=False`: this actor's gate and version
        only (another actor tells the shared servers)."""
        return await self.controls.run(command, servers)

    async def close(self) -> None:
        held, self._heap = self._heap, None
        if held is not None:
            held.release()
        serving, self._serving = self._serving, None
        if serving is not None:
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving
        if isinstance(self.runner.backend, Lifecycle) and serving is not None:
            await self.runner.backend.close()


class RayRunner(BaseEngine):
    """`workers` Ray actors rolling out one spec over one shared set of servers (or per-actor backends).

    spec, tokenizer: as for RolloutEngine (a path is best for the tokenizer: each actor loads it).
    servers: SGLang or vLLM base URLs every actor routes over (`engine`: "sglang", the default, or "vllm"); or
        `backend_factory`: a picklable callable each actor builds its own backend with; or neither: the tiny model.
    workers: actors. max_concurrency: trajectories in flight per actor. chunk_rows: groups per Ray call.
    address: a Ray cluster to join (default: the running one, else a new local instance).
    actor_options: passed to `.options()` (num_cpus, runtime_env, ...).
    hang_s: an actor holding rows whose trajectories pass no state boundary for this long is killed and its
        rows re-run elsewhere, as a dead one's (None: off; make it longer than the slowest model turn).
    journal_dir: a directory every actor sees, where each chunk in flight journals its state boundaries
        (fsm/adapters/ray_journal.py): a dead or hung actor's trajectories then go on from their last boundary
        on another actor instead of from the start. None (the default): they run again from the start.
        journal_sync: its durability, as a run's ("1s", "always", "off"; a killed process loses nothing).
        accept_changes: a chunk whose unfinished rows were generated with other weights than the survivor now
        serves goes on (their next tokens carry its version; the journal records it accepted) instead of
        running again from the start, as `agentfsm run --resume --accept-changes` (default: False).
    The engine contract (fsm/output/engine.py) as RolloutEngine's, with what it refuses (EngineRefused: the
    running groups live in the actors) in docs/trainers.md; control calls reach shared servers once, through
    actor 0, and every actor's gate. After each batch, `stats` holds per-run counters (chunks, rerun_rows...).
    """

    def __init__(
        self,
        spec: SpecLike,
        tokenizer: Any = None,
        *,
        servers: Sequence[str] | None = None,
        backend_factory: Callable[[], Backend] | None = None,
        workers: int = 2,
        address: str | None = None,
        max_concurrency: int = 128,
        chunk_rows: int = 1,
        actor_options: Mapping[str, Any] | None = None,
        hang_s: float | None = None,
        engine: str | None = None,
        journal_dir: str | Path | None = None,
        journal_sync: str = "1s",
        accept_changes: bool = False,
    ):
        if servers and backend_factory is not None:
            raise ValueError("give servers= or backend_factory=, not both")
        if workers < 1 or max_concurrency < 1 or chunk_rows < 1:
            raise ValueError("workers, max_concurrency and chunk_rows must be >= 1")
        if journal_sync not in SYNCS:
            raise ValueError(f"journal_sync must be one of {', '.join(SYNCS)}, not {journal_sync!r}")
        if tokenizer is None:
            if servers or backend_factory is not None:
                raise ValueError("a tokenizer is needed with servers= or backend_factory= (a path is best)")
            tokenizer = tiny_model_dir()
        self.agent = load_agent(spec)
        self.journal_dir = str(Path(journal_dir).resolve()) if journal_dir is not None else None
        self.journal_sync = journal_sync
        self.accept_changes = accept_changes
        if self.journal_dir is not None:
            Path(self.journal_dir).mkdir(parents=True, exist_ok=True)
        # What each actor compiles: the spec file's absolute path when there is one (workers' cwd differs).
        self._spec = str(self.agent.path.resolve()) if self.agent.path else self.agent.spec
        self._tokenizer = str(tokenizer) if isinstance(tokenizer, Path) else tokenizer
        self.codec = agent_codec(
            self.agent, tokenizer if isinstance(tokenizer, Codec) else load_tokenizer(tokenizer)
        )
        self.servers = list(servers) if servers else None
        self.engine = engine
        self.backend_factory = backend_factory
        self.workers = workers
        self.max_concurrency = max_concurrency
        self.chunk_rows = chunk_rows
        self.address = address
        self.actor_options = dict(actor_options or {})
        self.actors: list[Any] = []  # Ray actor handles, index = rank
        self._dead: set[int] = set()
        self._owns_ray = False
        self.hang_s = hang_s
        self.stats: dict[str, Any] = {}
        self._pool: Pool | None = None  # the continuous mode's
        self._version = 0  # the weights the servers hold (counted here, told to every actor)
        self._paused = False
        self._home: LoopThread | None = None  # the sync forms' loop
        self.core = self  # its own core: the driver's state is its own

    # -- actors --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Join (or start) Ray and bring the pool to `workers` live actors, replacing dead ones."""
        if len(self.actors) == self.workers and not self._dead:
            return
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
            self._owns_ray = True
        actor = ray.remote(_Worker).options(
            max_concurrency=chunk_slots(self.max_concurrency, self.chunk_rows) + 8, **self.actor_options
        )
        for rank in range(self.workers):
            if rank < len(self.actors) and rank not in self._dead:
                continue
            handle = actor.remote(
                self._spec,
                self._tokenizer,
                self.servers,
                self.backend_factory,
                rank,
                self.max_concurrency,
                self.engine,
                self._version,
            )
            if rank < len(self.actors):
                ray.kill(self.actors[rank])
                self.actors[rank] = handle
            else:
                self.actors.append(handle)
            self._dead.discard(rank)

    def ready(self) -> list[int]:
        """Block until every actor is up; their process ids."""
        self.start()
        return _ray().get([a.pid.remote() for a in self.actors])

    # -- its own core (fsm/output/engine.py `Core`): the driver's state, awaited from any loop ------------------

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return await coro  # nothing here is bound to a loop: any caller's serves

    def _run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        """The sync forms, on the driver's loop thread, the one loop its continuous mode's groups wait on (Ray is
        joined first, from the calling thread)."""
        self.start()
        if self._home is None:
            self._home = LoopThread("agentfsm ray driver")
        return self._home.run(coro)

    async def run_here(
        self, rows: Sequence[Any], n: int, sampling: Sampling, on_done: Callable[[Trajectory], None] | None
    ) -> list[Trajectory]:
        """Every row n times across the actors; trajectories in input order. The sampling is resolved once, by
        the caller, and sent to the actors; `on_done` hears each trajectory as its chunk comes back."""
        self.start()
        rows = list(rows)
        key = uuid.uuid4().hex[:8]
        # Groups need batch-wide uids before they scatter (a Runner would number them per chunk).
        sent = [
            {**r, "uid": f"{key}-{i}"} if isinstance(r, Mapping) and not r.get("uid") else r
            for i, r in enumerate(rows)
        ]
        pool = Pool(self, n)
        self.stats = stats = pool.stats
        stats.update(rows=len(rows), trajectories=len(rows) * n)
        for i in range(0, len(rows), self.chunk_rows):
            ids = list(range(i, min(i + self.chunk_rows, len(rows))))
            pool.pending.append(Job(key, sampling, n, [sent[j] for j in ids], ids))
        out: list[Trajectory | None] = [None] * (len(rows) * n)
        try:
            while stats["rows_done"] < len(rows):
                for _job, trajs in await pool.poll():
                    for t in trajs:
                        row = rows[t.index // n]  # a non-dict row is wrapped as the Runner wraps it
                        t.row = (
                            cast(dict[str, Any], row) if isinstance(row, Mapping) else {"__bad_row__": row}
                        )
                        out[t.index] = t
                        if on_done is not None:
                            on_done(t)
        finally:
            pool.cancel()
            if self.journal_dir is not None:  # a batch that failed leaves its chunks' journals: not kept
                from fsm.adapters.ray_journal import remove

                remove(list(Path(self.journal_dir).glob(f"{key}-*.log")))
        assert all(t is not None for t in out)
        return out  # type: ignore[return-value]

    # -- continuous mode -------------------------------------------------------------------------------------

    async def submit_here(
        self, rows: Sequence[Any], n: int, sampling: Sampling, first_index: int | None
    ) -> list[str]:
        """Start rolling out every row `n` times; groups stream back from the actors as they finish."""
        if first_index is not None:
            raise EngineRefused(
                self,
                "asubmit",
                "first_index= (a slice of a batch run in several processes) is "
                "RolloutEngine's; the Ray runner numbers its groups itself",
            )
        self.start()
        if self._pool is None:
            self._pool = Pool(self, n)
        pool, key = self._pool, uuid.uuid4().hex[:8]
        pool.refresh()
        uids = []
        for row in rows:
            gid = len(pool.rows)
            row = normalize_record(dict(row)) if isinstance(row, Mapping) else {"__bad_row__": row}
            row["uid"] = str(row.get("uid") or f"{key}-{gid}")
            pool.rows.append(row)
            uids.append(row["uid"])
            pool.pending.append(Job(key, sampling, n, [row], [gid]))
        pool.stats["submitted_groups"] += len(rows)
        return uids

    async def take_here(self, ask: Take) -> list[Group]:
        pool = self._pool
        if pool is None:
            raise StreamEmpty(f"take({ask.num_groups}): nothing submitted; submit rows first")
        async with asyncio.timeout(ask.timeout):
            return await pool.groups.take(
                ask.num_groups, ask.max_staleness, ask.stale, ask.exhausted_ok, pool.running, pool.deliver
            )

    @property
    def stream_stats(self) -> dict[str, Any]:
        return {} if self._pool is None else self._pool.groups.counters()

    # -- control calls (fsm/run/engine.py, in every actor) -----------------------------------------------------

    async def control_here(self, command: Command) -> Any:
        """Shared servers hear it once (through the first live actor); per-actor backends each hear it. Every
        actor's gate pauses first and opens last, and every actor counts the version."""
        self.start()
        ranks = [r for r in range(len(self.actors)) if r not in self._dead]
        told = ranks[:1] if self.servers else ranks
        rest = [r for r in ranks if r not in told] if not isinstance(command, Call) else []

        async def send(
            to: list[int], servers: bool, what: Command = command, quiet: bool = False
        ) -> list[Any]:
            refs = [self.actors[r].control.remote(what, servers) for r in to]
            futures = (asyncio.wrap_future(ref.future()) for ref in refs)
            return list(await asyncio.gather(*futures, return_exceptions=quiet))

        if isinstance(command, Pause):
            await send(rest, False)  # first: no actor issues a request while the servers pause
            try:
                answers = await send(told, True)
            except BaseException:
                if not self._paused:  # the other actors' gates open again
                    await send(rest, False, Resume(), quiet=True)
                raise
        else:
            answers = await send(told, True)
            await send(rest, False)
        if isinstance(command, (Pause, Resume)):
            self._paused = isinstance(command, Pause)
        if isinstance(command, Update):
            self._version = answers[0]
            return answers[0]
        return answers[0] if self.servers else answers

    backend = None  # each actor's own
    policies: dict[str, Any] = {}  # the spec's policies live in the actors

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    # -- lifecycle -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the actors' backends, kill the actors, and shut Ray down if this runner started it."""
        ray = _ray()
        if self._pool is not None:
            self._pool.cancel()
            self._pool = None
        live = [a for r, a in enumerate(self.actors) if r not in self._dead]
        if live:
            try:
                ray.get([a.close.remote() for a in live], timeout=30)
            except Exception:  # a dying actor must not keep the rest from being killed
                pass
        for a in self.actors:
            ray.kill(a)
        self.actors, self._dead = [], set()
        if self._home is not None:
            self._home.close()
            self._home = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    async def __aenter__(self) -> RayRunner:
        return self

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)
