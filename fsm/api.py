"""The rollout API a trainer embeds: rows in, verl's padded batch out.

    engine = RolloutEngine("specs/calculator.yaml")                    # the embedded tiny model (backends.hf)
    engine = RolloutEngine(spec, tokenizer=path, servers=[url, ...])   # SGLang or vLLM servers, a Router
    batch = engine.generate_sequences(rows, n=8)          # sync: blocks until the batch is back
    batch = await engine.agenerate_sequences(rows, n=8)   # async: from any event loop, the same engine
    engine.submit(rows, n=8); batch = engine.take(16, max_staleness=1)   # continuous mode (fsm/run/stream.py)

`rows` is what a verl dataset yields: a list of row dicts, a dict of columns (`non_tensor_batch`:
{"raw_prompt": array([...]), "uid": ...}), or a verl `DataProto` (then a `DataProto` comes back). The result
is one row per (input row, sample), samples of a row contiguous and in input order (verl's `repeat(n,
interleave=True)` layout); `uid` marks the GRPO group. Control calls (`sleep`, `wake_up`, `pause`, `resume`,
`update_weights_from_disk` / `_from_tensor` / `_from_distributed`, `flush_cache`) reach every server; the
engine counts weight versions (`weight_version`) and records on each generated token the one that made it. Each has an `a`-prefixed async form, as
`generate_sequences` has; the sync forms refuse to run inside a running event loop (they would block it).

The engine contract these implement is fsm/run/engine.py's `Engine`; `BaseEngine` below holds its shared logic
over each engine's primitives, and code written against one engine (RolloutEngine, RayRunner) works against the
other or gets `EngineRefused`. A RolloutEngine's backend lives on one event loop that the engine owns, running in
a daemon thread it starts on first use and stops on `close()`/`aclose()` (fsm/run/local.py): sync calls block
on that loop, and async calls from any loop are bridged to it, so one engine serves both forms in any order.

This is the one `fsm` module (with fsm/cli/commands.py and the trainer adapters) that may import concrete
backends, lazily, to compose them: `servers=` builds `Router([SGLangBackend(url), ...])` (or vLLM's clients;
without `engine=`, once the servers have said at start which engine they run), no backend at all builds
`HFBackend` over a model directory (by default the tiny model in backends/tiny/assets) or a model object
(`model=<torch module>`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np

from backends.base import Backend
from fsm.data.rows import to_rows
from fsm.families import Codec
from fsm.output.batch import to_batch
from fsm.output.keep import RunDir, keep_batch
from fsm.output.metrics import FaultDelta, rollout_metrics
from fsm.output.sample import SampleBatch, to_samples
from fsm.run.compile import CompiledAgent, compile_spec
from fsm.run.context import Sampling
from fsm.run.engine import PAUSE_MODES, EngineRefused, StalePolicy, weight_version_of
from fsm.run.local import Local
from fsm.run.runtime import WATCHDOG_S, Runner
from fsm.run.stream import Group
from fsm.run.tracer import Tracer
from fsm.run.trajectory import Trajectory
from fsm.spec.loader import LoadedSpec
from fsm.spec.model import SPECS_DIR, AgentSpec

T = TypeVar("T")
DETECT_TIMEOUT_S = 5.0  # servers= without engine=: how long each server is asked which engine it runs
SpecLike = CompiledAgent | AgentSpec | LoadedSpec | str | Path
Rows = Sequence[Mapping[str, Any]] | Mapping[str, Sequence[Any] | np.ndarray] | Any  # Any: a verl DataProto


# --- inputs ------------------------------------------------------------------------------------------------


# --- composition ---------------------------------------------------------------------------------------


def load_agent(spec: SpecLike) -> CompiledAgent:
    """A compiled agent from a path, a shipped spec's name ("calculator"), an AgentSpec or a compiled one."""
    if isinstance(spec, CompiledAgent):
        return spec
    if isinstance(spec, str) and not Path(spec).exists() and (SPECS_DIR / f"{spec}.yaml").exists():
        spec = SPECS_DIR / f"{spec}.yaml"
    return compile_spec(spec)


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object as given, or `AutoTokenizer.from_pretrained(path)`."""
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer))
    return tokenizer


def tiny_model_dir() -> Path:
    from backends.tiny import ASSET_DIR

    return ASSET_DIR


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def model_tokenizer(model: Any) -> Path:
    """The tokenizer directory of the embedded model: the model directory itself, or for a model object the
    directory it was loaded from. One clear line (FileNotFoundError) when it holds no tokenizer."""
    if isinstance(model, (str, Path)):
        where = Path(model)
    else:
        source = getattr(getattr(model, "config", None), "name_or_path", "") or ""
        if not source or not Path(source).is_dir():
            raise FileNotFoundError(f"the model object {type(model).__name__} was not loaded from a directory "
                                    "that could hold its tokenizer; pass tokenizer= (an object or a path)")  # fmt: skip
        where = Path(source)
    if not any((where / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {where} (none of {', '.join(TOKENIZER_FILES)}); pass tokenizer= "
                                "(an object or a path, e.g. backends/tiny/assets for the tiny model's checkpoints)")  # fmt: skip
    return where


def make_backend(*, servers: Sequence[str] | None = None, model: str | Path | Any = None,
                 group_affinity: bool = True, request_timeout_s: float | None = None,
                 retry_window_s: float = 60.0, engine: str | None = None, **hf_options: Any) -> Backend:  # fmt: skip
    """`Router` over SGLang or vLLM servers, or the in-process `HFBackend` over a model directory (default: tiny) or
    a model object in memory (a transformers causal LM, e.g. the one a trainer trains); `hf_options` go to HFBackend (torch_threads, max_batch_size...). `request_timeout_s` is each server
    request's deadline (overriding the spec's limits.request_timeout_s; default 300 s) and `retry_window_s`
    how long a request keeps failing over while the whole fleet fails (a restart); servers only. `engine`:
    "sglang" or "vllm" (None: SGLang clients until `RolloutEngine` starts and asks the servers which they run,
    backends/engines.py)."""
    if servers:
        from backends.engines import client
        from backends.router import Router

        clients = [client(engine or "sglang", url, request_timeout_s=request_timeout_s) for url in servers]
        return Router(clients, group_affinity=group_affinity, retry_window_s=retry_window_s)
    import torch

    from backends.hf import HFBackend

    if isinstance(model, torch.nn.Module):
        if not callable(getattr(model, "forward", None)) or getattr(model, "config", None) is None:
            raise TypeError(f"model={type(model).__name__} is not a transformers causal LM (it has no .config); "
                            "pass a PreTrainedModel, a model directory, servers= or backend=")  # fmt: skip
        return HFBackend(model, **hf_options)
    if not isinstance(model, (str, Path, type(None))):
        raise TypeError(f"model= takes a model directory or a torch module, got {type(model).__name__}")
    model_dir = Path(model) if model is not None else tiny_model_dir()
    if not (model_dir / "config.json").exists():
        hint = " (train it: python -m backends.tiny.train)" if model is None else ""
        raise FileNotFoundError(f"no model in {model_dir}{hint}; or pass servers=[...] or backend=...")
    return HFBackend(model_dir, **hf_options)


class ServerNotReady(Exception):
    """No server given by URL can serve (or, strict, one cannot): the message names each and why."""


@dataclass
class Probe:
    servers: list[str]  # the servers that answered, in the order given
    tokenizer: str | None  # the tokenizer path the first of them serves, when it reports one
    left_out: dict[str, str]  # url -> why it was left out
    engine: str = "sglang"  # what they run: "sglang" (SGLang or the dev server) or "vllm"


async def probe_servers(urls: Sequence[str], *, strict: bool = False, timeout_s: float = 10.0,
                        engine: str | None = None) -> Probe:  # fmt: skip
    """Ask every server at once which engine it runs (unless `engine` says), whether it is ready and its info,
    each within `timeout_s`. A server that does not answer (down, hung, a black hole that accepts and never
    reads) or answers malformed info is left out while another one serves; with `strict`, any such server is
    an error (ServerNotReady). The servers that answered must run one engine (ServerNotReady otherwise)."""
    from backends.base import BackendError
    from backends.engines import client, detect_engine, one_kind

    async def probe(url: str) -> tuple[str, dict[str, Any]] | str:
        try:
            async with asyncio.timeout(timeout_s):
                kind = engine or await detect_engine(url, timeout_s)
                async with client(kind, url, request_timeout_s=timeout_s) as c:
                    if not await c.ready(timeout_s=timeout_s):  # type: ignore[attr-defined]
                        return "does not answer /ready (starting, paused or down)"
                    await c._ensure_info(timeout_s)  # type: ignore[attr-defined]
                    return kind, await c.model_info()  # type: ignore[attr-defined]
        except TimeoutError:
            return f"no answer within {timeout_s:g} s"
        except BackendError as e:
            return str(e).removeprefix(url.rstrip("/") + ": ")

    answers = await asyncio.gather(*(probe(url) for url in urls))
    good = [(url, a) for url, a in zip(urls, answers) if isinstance(a, tuple)]
    bad = {url: a for url, a in zip(urls, answers) if isinstance(a, str)}
    if not good or (strict and bad):
        raise ServerNotReady("; ".join(f"{url}: {why}" for url, why in bad.items()))
    try:
        kind = one_kind([u for u, _ in good], [a[0] for _, a in good])
    except ValueError as e:
        raise ServerNotReady(str(e)) from None
    info = good[0][1][1]
    served = info.get("tokenizer_path") or info.get("model_path")
    return Probe([url for url, _ in good], served if isinstance(served, str) else None, bad, kind)


# --- engines -------------------------------------------------------------------------------------------


class BaseEngine(ABC):
    """The engine contract's shared logic (fsm/run/engine.py `Engine`), written once over the primitives each
    engine provides (the abstract methods below): batches shaped into verl's padded batch, the continuous mode's
    batches, the control calls' checks, and every sync form. RolloutEngine and RayRunner add only their I/O, as
    httpx's Client adds it to BaseClient."""

    agent: CompiledAgent
    codec: Codec
    tracer: Tracer | None = None
    _faults: FaultDelta | None = None

    # -- the primitives ----------------------------------------------------------------------------------------

    @abstractmethod
    async def _on_home(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` where the engine's state lives, from whichever loop the caller runs."""

    @abstractmethod
    def _run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` to its end from a thread that runs no event loop (the sync forms)."""

    @abstractmethod
    async def _arun(self, rows: Sequence[Any], n: int, sampling: Sampling,
                    on_done: Callable[[Trajectory], None] | None) -> list[Trajectory]:  # fmt: skip
        """Every row n times; the trajectories in input order."""

    @abstractmethod
    async def _submit(self, rows: Sequence[Any], n: int, sampling: Sampling, first_index: int | None) -> list[str]:
        """Start every row n times (the continuous mode); the groups' uids."""

    @abstractmethod
    async def _take(self, num_groups: int, max_staleness: int | None, stale: StalePolicy, timeout: float | None,
                    exhausted_ok: bool) -> list[Group]:  # fmt: skip
        """The first `num_groups` finished groups (fsm/run/stream.py `Groups.take`)."""

    @abstractmethod
    async def _control(self, op: str, args: tuple[Any, ...]) -> Any:
        """A control op of fsm/run/control.py `Controls` ("call", "pause", "resume", "update") on every server."""

    @property
    @abstractmethod
    def weight_version(self) -> int:
        """The weights the servers hold: 0 at first (or the int they report), then each update's version."""

    @property
    @abstractmethod
    def paused(self) -> bool:
        """True between `pause()` and `resume()`: no model request is issued meanwhile."""

    @property
    @abstractmethod
    def stream_stats(self) -> dict[str, Any]:
        """Counters of the continuous mode: groups submitted, finished, taken, dropped or re-run for staleness,
        running and ready now; `staleness`: {staleness: groups taken}."""

    @abstractmethod
    async def aclose(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    snapshots = False  # whether `asnapshot` / `arestore` (and `keep=`) work; EngineRefused otherwise

    async def _snapshot(self, path: str | Path, meta: Mapping[str, Any] | None, stop: bool, timeout: float | None,
                        abort_turns: bool, fallback: Callable[[], Path] | None) -> dict[str, Any]:  # fmt: skip
        raise EngineRefused(self, "asnapshot", "this engine cannot snapshot its running groups; use RolloutEngine")

    async def _restore(self, path: str | Path) -> dict[str, Any]:
        raise EngineRefused(self, "arestore", "this engine cannot restore a snapshot; use RolloutEngine")

    # -- a batch -----------------------------------------------------------------------------------------------

    async def arun(self, rows: Sequence[Any], *, n: int = 1, sampling_params: Mapping[str, Any] | None = None,
                   validate: bool = False, sampling: Sampling | None = None,
                   on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:  # fmt: skip
        """The finished trajectories themselves (transcripts, segments, state paths), in input order.
        `on_done` hears each trajectory as it finishes (RolloutEngine: on the engine's thread)."""
        if sampling is None:
            sampling = self.sampling(sampling_params, validate)
        return await self._on_home(self._arun(rows, n, sampling, on_done))

    async def agenerate_sequences(self, batch: Rows, sampling_params: Mapping[str, Any] | None = None,
                                  validate: bool = False, n: int = 1, *, keep: RunDir | None = None) -> Any:  # fmt: skip
        """Roll out every row `n` times; verl's padded batch back (a DataProto when given one).

        `validate=True` (or a DataProto's `meta_info["validate"]`) samples with the spec's `val_sampling`;
        `sampling_params` override either (SGLang names, plus `seed` and `logprobs`).
        `keep=RunDir(out)` runs the rows as `agentfsm run --out out` does (fsm/output/keep.py): the files are
        written there, and SIGINT or SIGTERM (to a caller on the main thread) snapshots the rows still running
        and writes the finished ones, then raises RunInterrupted; `agentfsm run --resume out` goes on.
        """
        rows, meta = to_rows(batch)
        validate = bool(validate or meta.get("validate", False))
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        sampling = self.sampling(sampling_params, validate)
        self._fault_counters()
        if keep is not None:
            if not self.snapshots:
                raise EngineRefused(self, "agenerate_sequences", "keep= needs an engine that snapshots a run; "
                                    "use RolloutEngine")  # fmt: skip
            return await keep_batch(self, rows, n, sampling, keep, like=batch, meta=meta)
        t0 = time.perf_counter()
        trajs = await self.arun(rows, n=n, sampling=sampling)
        return self.to_batch(trajs, sampling, like=batch, meta=meta, wall_s=time.perf_counter() - t0)

    async def agenerate_samples(self, batch: Rows, sampling_params: Mapping[str, Any] | None = None,
                                validate: bool = False, n: int = 1) -> SampleBatch:  # fmt: skip
        """As `agenerate_sequences`, unpadded: one flat `Sample` per trajectory (the form trainer adapters
        map from, fsm/output/sample.py), with the same meta_info."""
        rows, meta = to_rows(batch)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        sampling = self.sampling(sampling_params, bool(validate or meta.get("validate", False)))
        faults = self._fault_counters()
        t0 = time.perf_counter()
        trajs = await self.arun(rows, n=n, sampling=sampling)
        info = {**meta, "sampling": sampling.describe(self.codec.vocab_size),
                "rollout_metrics": rollout_metrics(trajs, faults=faults.take(), wall_s=time.perf_counter() - t0)}
        return SampleBatch(to_samples(trajs, self.agent.spec.context.reward_placement), info)  # one per segment

    def generate_samples(self, batch: Rows, sampling_params: Mapping[str, Any] | None = None,
                         validate: bool = False, n: int = 1) -> SampleBatch:  # fmt: skip
        """Sync form of `agenerate_samples`."""
        self._refuse_in_loop("generate_samples", "agenerate_samples")
        return self._run_sync(self.agenerate_samples(batch, sampling_params, validate, n))

    def to_batch(self, trajs: Sequence[Trajectory], sampling: Sampling, like: Any = None,
                 meta: Mapping[str, Any] | None = None, wall_s: float | None = None) -> Any:  # fmt: skip
        """Finished trajectories -> verl's padded batch (`batch_of`), with this engine's backend counters."""
        return batch_of(self.agent, self.codec, trajs, sampling, self._fault_counters(), like, meta, wall_s)

    def _fault_counters(self) -> FaultDelta:
        """The backend's fault counters, read per batch (first read: before the first batch runs)."""
        if self._faults is None:
            self._faults = FaultDelta(getattr(self, "backend", None))
        return self._faults

    def sampling(self, sampling_params: Mapping[str, Any] | None = None, validate: bool = False) -> Sampling:
        """The run's sampling, resolved once (pass it to `arun` and `to_batch`)."""
        return Sampling.resolve(self.agent, self.codec, sampling_params, validate=validate)

    def generate_sequences(self, batch: Rows, sampling_params: Mapping[str, Any] | None = None,
                           validate: bool = False, n: int = 1, *, keep: RunDir | None = None) -> Any:  # fmt: skip
        """Sync form of `agenerate_sequences`, on the engine's own event loop; blocks until the batch is back.
        With `keep`, the run is watched from a loop of the calling thread, where signals arrive."""
        self._refuse_in_loop("generate_sequences", "agenerate_sequences")
        if keep is not None:
            return asyncio.run(self.agenerate_sequences(batch, sampling_params, validate, n, keep=keep))
        return self._run_sync(self.agenerate_sequences(batch, sampling_params, validate, n))

    def _refuse_in_loop(self, name: str, async_name: str) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        raise RuntimeError(f"{type(self).__name__}.{name}() was called inside a running event loop, which it "
                           f"would block; use `await {async_name}(...)` there")  # fmt: skip

    # -- continuous mode (fsm/run/stream.py) -------------------------------------------------------------------

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
        return await self._on_home(self._submit(rows, n, sampling, first_index))

    async def atake_groups(self, num_groups: int, *, max_staleness: int | None = None, stale: StalePolicy = "drop",
                           timeout: float | None = None, exhausted_ok: bool = False) -> list[Group]:  # fmt: skip
        """The first `num_groups` finished groups (see `atake`), as `Group`s of trajectories."""
        return await self._on_home(self._take(num_groups, max_staleness, stale, timeout, exhausted_ok))

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

    def submit(self, rows: Any, n: int = 1, sampling_params: Mapping[str, Any] | None = None,
               validate: bool = False) -> list[str]:  # fmt: skip
        self._refuse_in_loop("submit", "asubmit")
        return self._run_sync(self.asubmit(rows, n, sampling_params, validate))

    def take(self, num_groups: int, *, max_staleness: int | None = None, stale: StalePolicy = "drop",
             timeout: float | None = None) -> Any:  # fmt: skip
        self._refuse_in_loop("take", "atake")
        return self._run_sync(self.atake(num_groups, max_staleness=max_staleness, stale=stale, timeout=timeout))

    # -- snapshots ---------------------------------------------------------------------------------------------

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
        is left `wedged`; "blocked" is then True and "finished" holds the finished groups, not taken.
        EngineRefused on an engine that cannot snapshot (`snapshots` is False: RayRunner)."""
        return await self._snapshot(path, meta, stop, timeout, abort_turns, fallback)

    async def arestore(self, path: str | Path) -> dict[str, Any]:
        """Put a snapshot's groups back into the continuous mode (same spec, checked by hash: SnapshotError
        otherwise); ready groups can be taken, running ones run on. Returns the snapshot's `meta`."""
        return await self._restore(path)

    def snapshot(self, path: str | Path, *, meta: Mapping[str, Any] | None = None, stop: bool = False) -> dict[str, int]:
        self._refuse_in_loop("snapshot", "asnapshot")
        return self._run_sync(self.asnapshot(path, meta=meta, stop=stop))

    def restore(self, path: str | Path) -> dict[str, Any]:
        self._refuse_in_loop("restore", "arestore")
        return self._run_sync(self.arestore(path))

    # -- control calls (fsm/run/control.py) --------------------------------------------------------------------

    async def asleep(self, tags: list[str] | None = None) -> Any:
        """Release server memory (SGLang release_memory_occupation; tags "weights", "kv_cache")."""
        return await self._control("call", ("sleep", (tags,)))

    async def awake_up(self, tags: list[str] | None = None) -> Any:
        """Take the memory back (SGLang resume_memory_occupation)."""
        return await self._control("call", ("wake_up", (tags,)))

    async def aflush_cache(self) -> Any:
        return await self._control("call", ("flush_cache",))

    async def apause(self, mode: str = "abort") -> None:
        """Stop generation: the engine issues no new model request (turns wait at its gate) and every server
        pauses (`/pause_generation`; the in-process model the same). `mode`: "abort" ends running requests
        with their partial output, which the engine keeps and resumes after `resume()`; "retract" requeues
        them at the server (recomputed after continue); "in_place" holds them mid-generation. Trajectories stay
        alive with their partial turns; new runs may start meanwhile and wait at the gate."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; expected one of {', '.join(PAUSE_MODES)}")
        await self._control("pause", (mode,))

    async def aresume(self) -> None:
        """Continue: every server continues (`/continue_generation`), then the gate opens and paused
        trajectories go on, on whatever weights the servers now hold."""
        await self._control("resume", ())

    async def aupdate_weights_from_disk(self, path: str | Path, weight_version: int | None = None,
                                        **options: Any) -> int:  # fmt: skip
        """Reload weights on every server (or the in-process model) from a checkpoint directory, as version
        `weight_version` (default: the current one + 1), which is returned. `options` go to SGLang's
        endpoint (load_format, abort_all_requests, flush_cache)."""
        return await self._update("update_weights_from_disk", (str(path),), options, weight_version)

    async def aupdate_weights_from_tensor(self, weight_version: int | None = None, **payload: Any) -> int:
        """SGLang's `/update_weights_from_tensor` on every server (payload passed through:
        serialized_named_tensors, load_format, flush_cache...); the new version is returned."""
        return await self._update("update_weights_from_tensor", (), payload, weight_version)

    async def aupdate_weights_from_distributed(self, weight_version: int | None = None, **payload: Any) -> int:
        """SGLang's `/update_weights_from_distributed` on every server (payload passed through: names, dtypes,
        shapes, group_name...); the new version is returned."""
        return await self._update("update_weights_from_distributed", (), payload, weight_version)

    async def _update(self, method: str, args: tuple[Any, ...], options: dict[str, Any],
                      weight_version: int | None) -> int:  # fmt: skip
        return await self._control("update", (method, args, options, weight_version_of(weight_version)))

    def sleep(self, tags: list[str] | None = None) -> Any:
        self._refuse_in_loop("sleep", "asleep")
        return self._run_sync(self.asleep(tags))

    def wake_up(self, tags: list[str] | None = None) -> Any:
        self._refuse_in_loop("wake_up", "awake_up")
        return self._run_sync(self.awake_up(tags))

    def update_weights_from_disk(self, path: str | Path, weight_version: int | None = None, **options: Any) -> int:
        self._refuse_in_loop("update_weights_from_disk", "aupdate_weights_from_disk")
        return self._run_sync(self.aupdate_weights_from_disk(path, weight_version, **options))

    def update_weights_from_tensor(self, weight_version: int | None = None, **payload: Any) -> int:
        self._refuse_in_loop("update_weights_from_tensor", "aupdate_weights_from_tensor")
        return self._run_sync(self.aupdate_weights_from_tensor(weight_version, **payload))

    def update_weights_from_distributed(self, weight_version: int | None = None, **payload: Any) -> int:
        self._refuse_in_loop("update_weights_from_distributed", "aupdate_weights_from_distributed")
        return self._run_sync(self.aupdate_weights_from_distributed(weight_version, **payload))

    def pause(self, mode: str = "abort") -> None:
        self._refuse_in_loop("pause", "apause")
        self._run_sync(self.apause(mode))

    def resume(self) -> None:
        self._refuse_in_loop("resume", "aresume")
        self._run_sync(self.aresume())

    def flush_cache(self) -> Any:
        self._refuse_in_loop("flush_cache", "aflush_cache")
        return self._run_sync(self.aflush_cache())


def batch_of(agent: CompiledAgent, codec: Codec, trajs: Sequence[Trajectory], sampling: Sampling,
             faults: FaultDelta | None = None, like: Any = None, meta: Mapping[str, Any] | None = None,
             wall_s: float | None = None) -> Any:  # fmt: skip
    """Finished trajectories -> verl's padded batch (fsm/output/batch.py `to_batch`), with the sampling that
    produced its logprobs (meta_info["sampling"]) and its metrics (meta_info["rollout_metrics"],
    fsm/output/metrics.py, with the backend counters `faults` moved since the last batch), which survive a
    DataProto's round trip."""
    out = to_batch(trajs, agent, codec, logprobs=sampling.logprobs, like=like, meta=meta)
    out.meta_info["sampling"] = sampling.describe(codec.vocab_size)
    out.meta_info["rollout_metrics"] = rollout_metrics(trajs, faults=faults.take() if faults else None, wall_s=wall_s)
    return out


class RolloutEngine(BaseEngine):
    """One spec, one backend (or fleet), one event loop: the single-process rollout engine.

    spec: a spec path, a shipped spec's name ("calculator"), an AgentSpec or a CompiledAgent.
    tokenizer: a tokenizer object or a path to load one from; default: the model's (embedded backend only).
    backend: any `backends.base.Backend`; or `servers`: SGLang or vLLM base URLs (one engine per fleet, asked
        at start unless `engine="sglang"|"vllm"` says), routed by a sticky Router with group affinity; or neither: `HFBackend` in this process over `model` (default the tiny model): a
        directory, or a transformers model object in memory (the engine decodes with that very module; a
        trainer syncs its own copy with `update_weights_from_tensor(named_tensors=...)`).
    max_concurrency: trajectories in flight at once. tracer: e.g. `fsm.telemetry.Telemetry(...)`; the engine
        closes it when it closes (every span ended is then exported or counted as dropped).
    watchdog_s: when no trajectory has changed state for this long, the stuck rows are logged (None: never).
    backend_options: for the backend it builds (`group_affinity`, `engine` for servers; `torch_threads`,
        `max_batch_size` for the in-process model).
    The engine owns its backend, given or built, and the thread whose event loop runs it (see the module
    docstring): `close()` / `aclose()` / `with` / `async with` closes both. Sync and async forms mix freely.
    Its working parts are fsm/run/local.py's `Local` (the loop thread, the stream, the control calls).
    """

    snapshots = True

    def __init__(self, spec: SpecLike, tokenizer: Any = None, *, backend: Backend | None = None,
                 servers: Sequence[str] | None = None, model: str | Path | None = None, max_concurrency: int = 512,
                 tracer: Tracer | None = None, check_tokens: bool = False, watchdog_s: float | None = WATCHDOG_S,
                 **backend_options: Any):  # fmt: skip
        if backend is not None and servers:
            raise ValueError("give backend= or servers=, not both")
        self.agent = load_agent(spec)
        if tokenizer is None and (backend is not None or servers):
            raise ValueError("a tokenizer is needed with backend= or servers= (a tokenizer object or a path)")
        build: Callable[[], Awaitable[Backend]] | None = None
        if backend is None:
            if servers and backend_options.get("engine") is None:  # ask them at start, then build the Router
                build = functools.partial(self._fleet, list(servers), backend_options)
            else:
                backend = make_backend(servers=servers, model=model, **backend_options)
            if tokenizer is None:  # the embedded model's own
                tokenizer = model_tokenizer(model if model is not None else tiny_model_dir())
        elif backend_options:
            raise ValueError(f"backend options {sorted(backend_options)} go with servers= or model=, not backend=")
        # With `build`, the runner's backend arrives at start (Local builds it on the engine's loop, first thing).
        self.runner = Runner(self.agent, cast(Backend, backend), load_tokenizer(tokenizer),
                             max_concurrency=max_concurrency, tracer=tracer, check_tokens=check_tokens,
                             watchdog_s=watchdog_s)  # fmt: skip
        self.codec = self.runner.codec
        self.tracer = tracer
        self._local = Local(self.runner, tracer, self.agent.name, build)

    async def _fleet(self, urls: list[str], options: dict[str, Any]) -> Backend:
        """servers= without engine=: at start, the servers are asked which engine they run (backends/engines.py
        `detect_fleet`), then the Router is built once, with that engine's clients."""
        from backends.engines import detect_fleet

        backend = make_backend(servers=urls, **{**options, "engine": await detect_fleet(urls, DETECT_TIMEOUT_S)})
        self._faults = FaultDelta(backend)  # counted from its start: every count of it is this engine's
        return backend

    @property
    def backend(self) -> Backend:
        """The engine's backend (servers= without engine=: built at start, once they have said what they run)."""
        return self.runner.backend

    @property
    def wedged(self) -> bool:
        """A snapshot was taken while code blocked the engine's loop: that loop runs nothing more."""
        return self._local.wedged

    # -- the primitives: everything runs on the loop thread of `Local` -----------------------------------------

    async def _on_home(self, coro: Coroutine[Any, Any, T]) -> T:
        return await self._local.call(coro)

    def _run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._local.run_sync(coro)

    async def _arun(self, rows: Sequence[Any], n: int, sampling: Sampling,
                    on_done: Callable[[Trajectory], None] | None) -> list[Trajectory]:  # fmt: skip
        return await self._local.run_here(rows, n, sampling, on_done)

    async def _submit(self, rows: Sequence[Any], n: int, sampling: Sampling, first_index: int | None) -> list[str]:
        return await self._local.submit_here(rows, n, sampling, first_index)

    async def _take(self, num_groups: int, max_staleness: int | None, stale: StalePolicy, timeout: float | None,
                    exhausted_ok: bool) -> list[Group]:  # fmt: skip
        return await self._local.take_here(num_groups, max_staleness, stale, timeout, exhausted_ok)

    async def _control(self, op: str, args: tuple[Any, ...]) -> Any:
        return await self._on_home(self._local.controls.run(op, args))

    async def _snapshot(self, path: str | Path, meta: Mapping[str, Any] | None, stop: bool, timeout: float | None,
                        abort_turns: bool, fallback: Callable[[], Path] | None) -> dict[str, Any]:  # fmt: skip
        return await self._local.snapshot(path, meta, stop, timeout, abort_turns, fallback)

    async def _restore(self, path: str | Path) -> dict[str, Any]:
        return await self._on_home(self._local.restore_here(path))

    @property
    def weight_version(self) -> int:
        return self.runner.gate.version

    @property
    def paused(self) -> bool:
        return self.runner.gate.paused

    @property
    def stream_stats(self) -> dict[str, Any]:
        return self._local.stream_stats()

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the backend (connections, health checks) on the engine's loop. Called by the first use."""
        await self._on_home(self._local.start_here())

    async def aclose(self) -> None:
        """Close the backend, then stop the engine's thread."""
        await self._local.aclose()

    def close(self) -> None:
        """Close the backend, then stop the engine's thread."""
        self._refuse_in_loop("close", "aclose")
        self._local.close()

    async def __aenter__(self) -> RolloutEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
