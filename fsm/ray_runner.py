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
  replaces dead actors.
- Trajectories come back pickled (slots and arrays pickle as they are), without their input row (the driver
  has it), and are collated on the driver in input order: the batch equals a single-process run's.

`ray` is an optional extra (`pip install 'agentfsm[ray]'`) and is imported only inside this module's calls.
"""

from __future__ import annotations

import asyncio
import math
import os
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from backends.base import Backend
from fsm.api import SpecLike, _Engine, load_agent, load_tokenizer, make_backend, tiny_model_dir
from fsm.chat import ChatCodec
from fsm.context import Sampling
from fsm.trajectory import Trajectory


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError("RayRunner needs ray: pip install 'agentfsm[ray]'") from e
    return ray


class _Worker:
    """One actor: a Runner over its own backend (a Router over the shared servers, or the factory's)."""

    def __init__(self, spec: Any, tokenizer: Any, servers: Sequence[str] | None,
                 backend_factory: Callable[[], Backend] | None, rank: int, max_concurrency: int):  # fmt: skip
        from fsm.runtime import Runner

        if servers:
            k = rank % len(servers)
            backend = make_backend(servers=[*servers[k:], *servers[:k]])
        elif backend_factory is not None:
            backend = backend_factory()
        else:
            backend = make_backend()
        self.runner = Runner(
            load_agent(spec), backend, load_tokenizer(tokenizer), max_concurrency=max_concurrency
        )
        self.rank = rank
        self._gate: asyncio.Semaphore | None = None
        self._contexts: dict[str, Any] = {}  # batch key -> RunContext (a few recent batches)

    async def _start(self) -> None:
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.runner.max_concurrency)
            start = getattr(self.runner.backend, "start", None)
            if start is not None:
                await start()

    async def run(self, key: str, sampling: Sampling, rows: list[Any], row_ids: list[int],
                  n: int) -> list[Trajectory]:  # fmt: skip
        """Run a chunk of groups; trajectories come back without their rows (the driver holds them)."""
        await self._start()
        ctx = self._contexts.get(key)
        if ctx is None:
            ctx = self._contexts[key] = self.runner.make_context(sampling=sampling)
            while len(self._contexts) > 4:
                del self._contexts[next(iter(self._contexts))]
        trajs = self.runner.trajectories(rows, n)
        for t in trajs:
            t.index = row_ids[t.index // n] * n + t.sample  # the batch-wide index: per-sample seeds match

        async def one(t: Trajectory) -> None:
            assert self._gate is not None
            async with self._gate:
                await self.runner.drive(ctx, t)

        async with asyncio.TaskGroup() as tg:
            for t in trajs:
                tg.create_task(one(t))
        for t in trajs:
            t.row = None  # type: ignore[assignment]
        return trajs

    async def echo(self, payload: Any) -> Any:
        """A no-op round trip: `bench/ray.py` measures the bare Ray hop with it."""
        return payload

    async def pid(self) -> int:
        return os.getpid()

    async def control(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], required: bool
    ) -> Any:
        await self._start()
        fn = getattr(self.runner.backend, method, None)
        if fn is None:
            if required:
                raise NotImplementedError(f"backend {type(self.runner.backend).__name__} has no {method}()")
            return None
        return await fn(*args, **kwargs)

    async def close(self) -> None:
        close = getattr(self.runner.backend, "close", None)
        if close is not None and self._gate is not None:
            await close()


class RayRunner(_Engine):
    """`workers` Ray actors rolling out one spec over one shared set of servers (or per-actor backends).

    spec, tokenizer: as for RolloutEngine (a path is best for the tokenizer: each actor loads it).
    servers: SGLang base URLs every actor routes over; or `backend_factory`: a picklable callable each
        actor calls to build its own backend; or neither: each actor embeds the tiny model (backends.hf).
    workers: actors. max_concurrency: trajectories in flight per actor. chunk_rows: groups per Ray call.
    address: a Ray cluster to join (default: the running one, else a new local instance).
    actor_options: passed to `.options()` (num_cpus, runtime_env, ...).
    After each batch, `stats` holds per-run counters: chunks, rerun_rows, actor_deaths, rows per actor.
    """

    def __init__(self, spec: SpecLike, tokenizer: Any = None, *, servers: Sequence[str] | None = None,
                 backend_factory: Callable[[], Backend] | None = None, workers: int = 2, address: str | None = None,
                 max_concurrency: int = 128, chunk_rows: int = 1, actor_options: Mapping[str, Any] | None = None):  # fmt: skip
        if servers and backend_factory is not None:
            raise ValueError("give servers= or backend_factory=, not both")
        if workers < 1 or max_concurrency < 1 or chunk_rows < 1:
            raise ValueError("workers, max_concurrency and chunk_rows must be >= 1")
        if tokenizer is None:
            if servers or backend_factory is not None:
                raise ValueError("a tokenizer is needed with servers= or backend_factory= (a path is best)")
            tokenizer = tiny_model_dir()
        self.agent = load_agent(spec)
        # What each actor compiles: the spec file's absolute path when there is one (workers' cwd differs).
        self._spec = str(self.agent.path.resolve()) if self.agent.path else self.agent.spec
        self._tokenizer = str(tokenizer) if isinstance(tokenizer, Path) else tokenizer
        self.codec = (
            ChatCodec(load_tokenizer(tokenizer)) if not isinstance(tokenizer, ChatCodec) else tokenizer
        )
        self.servers = list(servers) if servers else None
        self.backend_factory = backend_factory
        self.workers = workers
        self.max_concurrency = max_concurrency
        self.chunk_rows = chunk_rows
        self.address = address
        self.actor_options = dict(actor_options or {})
        self.actors: list[Any] = []  # Ray actor handles, index = rank
        self._dead: set[int] = set()
        self._owns_ray = False
        self.stats: dict[str, Any] = {}

    # -- actors --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Join (or start) Ray and bring the pool to `workers` live actors, replacing dead ones."""
        if len(self.actors) == self.workers and not self._dead:
            return
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
            self._owns_ray = True
        actor = ray.remote(_Worker).options(max_concurrency=self._slots() + 8, **self.actor_options)
        for rank in range(self.workers):
            if rank < len(self.actors) and rank not in self._dead:
                continue
            handle = actor.remote(self._spec, self._tokenizer, self.servers, self.backend_factory, rank,
                                  self.max_concurrency)  # fmt: skip
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

    def _slots(self) -> int:
        """Chunks in flight per actor: enough to keep `max_concurrency` trajectories busy."""
        return max(1, math.ceil(self.max_concurrency / self.chunk_rows))

    # -- the batch -----------------------------------------------------------------------------------------

    async def arun(self, rows: Sequence[Any], *, n: int = 1, sampling_params: Mapping[str, Any] | None = None,
                   validate: bool = False, sampling: Sampling | None = None,
                   on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:  # fmt: skip
        """Every row n times across the actors; trajectories in input order. The sampling is resolved here,
        once, and sent to the actors; `on_done` hears each trajectory as its chunk comes back."""
        from ray.exceptions import RayActorError

        if sampling is None:
            sampling = Sampling.resolve(self.agent, self.codec, sampling_params, validate=validate)
        self.start()
        rows = list(rows)
        key = uuid.uuid4().hex[:8]
        # Groups need batch-wide uids before they scatter (a Runner would number them per chunk).
        sent = [{**r, "uid": f"{key}-{i}"} if isinstance(r, Mapping) and not r.get("uid") else r
                for i, r in enumerate(rows)]  # fmt: skip
        ids = list(range(len(rows)))
        pending = deque(ids[i : i + self.chunk_rows] for i in range(0, len(ids), self.chunk_rows))
        slots = max(1, math.ceil(self.max_concurrency / (n * self.chunk_rows)))
        alive = [r for r in range(len(self.actors)) if r not in self._dead]
        busy = dict.fromkeys(alive, 0)
        out: list[Trajectory | None] = [None] * (len(rows) * n)
        done: asyncio.Queue[tuple[int, list[int], asyncio.Future[Any]]] = asyncio.Queue()
        inflight: dict[Any, tuple[int, list[int]]] = {}  # ObjectRef -> (rank, chunk)
        stats = {"rows": len(rows), "trajectories": len(out), "chunks": 0, "rerun_rows": 0, "actor_deaths": 0,
                 "rows_per_actor": dict.fromkeys(alive, 0), "rows_done": 0}  # fmt: skip
        self.stats = stats

        def submit(rank: int, chunk: list[int]) -> None:
            ref = self.actors[rank].run.remote(key, sampling, [sent[i] for i in chunk], chunk, n)
            inflight[ref] = (rank, chunk)
            busy[rank] += 1
            fut = asyncio.wrap_future(ref.future())
            fut.add_done_callback(lambda f, ref=ref: done.put_nowait((*inflight.pop(ref), f)))

        def fill() -> None:
            while pending and any(busy[r] < slots for r in alive):
                for rank in alive:  # round robin over actors with a free slot
                    if pending and busy[rank] < slots:
                        submit(rank, pending.popleft())

        try:
            fill()
            while stats["rows_done"] < len(rows):
                rank, chunk, fut = await done.get()
                busy[rank] -= 1
                exc = fut.exception()
                if isinstance(exc, RayActorError):
                    if rank in alive:
                        alive.remove(rank)
                        self._dead.add(rank)
                        stats["actor_deaths"] += 1
                    pending.appendleft(chunk)
                    stats["rerun_rows"] += len(chunk)
                    if not alive:
                        raise RuntimeError(f"all {len(self.actors)} Ray actors died; {len(rows) - stats['rows_done']} "
                                           f"rows unfinished (last error: {exc})") from exc  # fmt: skip
                elif exc is not None:
                    raise exc
                else:
                    for t in fut.result():
                        row = rows[t.index // n]  # a non-dict row is wrapped as the Runner wraps it
                        t.row = row if isinstance(row, Mapping) else {"__bad_row__": row}
                        out[t.index] = t
                        if on_done is not None:
                            on_done(t)
                    stats["chunks"] += 1
                    stats["rows_done"] += len(chunk)
                    stats["rows_per_actor"][rank] += len(chunk)
                fill()
        finally:
            for ref in list(inflight):  # cancelled or failed: stop what still runs
                _ray().cancel(ref)
        assert all(t is not None for t in out)
        return out  # type: ignore[return-value]

    # -- control calls -------------------------------------------------------------------------------------

    async def _control(self, method: str, *args: Any, required: bool = False, **kwargs: Any) -> list[Any]:
        """Shared servers hear it once (through one actor's router); per-actor backends each hear it."""
        self.start()
        ranks = [r for r in range(len(self.actors)) if r not in self._dead]
        if self.servers:
            ranks = ranks[:1]
        refs = [self.actors[r].control.remote(method, args, kwargs, required) for r in ranks]
        return list(await asyncio.gather(*(asyncio.wrap_future(ref.future()) for ref in refs)))

    async def asleep(self, tags: list[str] | None = None) -> list[Any]:
        return await self._control("sleep", tags)

    async def awake_up(self, tags: list[str] | None = None) -> list[Any]:
        return await self._control("wake_up", tags)

    async def aupdate_weights_from_disk(
        self, path: str | Path, weight_version: str | None = None
    ) -> list[Any]:
        return await self._control("update_weights_from_disk", str(path), weight_version=weight_version,
                                   required=True)  # fmt: skip

    async def aflush_cache(self) -> list[Any]:
        return await self._control("flush_cache")

    def sleep(self, tags: list[str] | None = None) -> list[Any]:
        self._refuse_in_loop("sleep", "asleep")
        return self._run_sync(self.asleep(tags))

    def wake_up(self, tags: list[str] | None = None) -> list[Any]:
        self._refuse_in_loop("wake_up", "awake_up")
        return self._run_sync(self.awake_up(tags))

    def update_weights_from_disk(self, path: str | Path, weight_version: str | None = None) -> list[Any]:
        self._refuse_in_loop("update_weights_from_disk", "aupdate_weights_from_disk")
        return self._run_sync(self.aupdate_weights_from_disk(path, weight_version))

    def flush_cache(self) -> list[Any]:
        self._refuse_in_loop("flush_cache", "aflush_cache")
        return self._run_sync(self.aflush_cache())

    # -- lifecycle -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the actors' backends, kill the actors, and shut Ray down if this runner started it."""
        ray = _ray()
        live = [a for r, a in enumerate(self.actors) if r not in self._dead]
        if live:
            try:
                ray.get([a.close.remote() for a in live], timeout=30)
            except Exception:  # a dying actor must not keep the rest from being killed
                pass
        for a in self.actors:
            ray.kill(a)
        self.actors, self._dead = [], set()
        if self._own_loop is not None:
            self._own_loop.close()
            self._own_loop = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> RayRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> RayRunner:
        return self

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
