"""The rollout API a trainer embeds: rows in, verl's padded batch out.

    engine = RolloutEngine("specs/calculator.yaml")                    # the embedded tiny model (backends.hf)
    engine = RolloutEngine(spec, tokenizer=path, servers=[url, ...])   # SGLang servers behind a Router
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

A RolloutEngine's backend lives on one event loop that the engine owns, running in a daemon thread it
starts on first use and stops on `close()`/`aclose()`: sync calls block on that loop, and async calls from
any loop are bridged to it, so one engine serves both forms in any order (aiohttp sessions and the
in-process model's batching task never see a second loop).

This is the one `fsm` module (with cli.py) that may import concrete backends, lazily, to compose them:
`servers=` builds `Router([SGLangBackend(url), ...])`, no backend at all builds `HFBackend` over a model
directory (by default the tiny model in backends/tiny/assets) or a model object (`model=<torch module>`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

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
from fsm.run.control import ControlCalls
from fsm.run.loopthread import LoopThread as _LoopThread
from fsm.run.runtime import WATCHDOG_S, Runner
from fsm.run.stream import ContinuousMode
from fsm.run.tracer import Tracer
from fsm.run.trajectory import Trajectory
from fsm.spec.loader import LoadedSpec
from fsm.spec.model import SPECS_DIR, AgentSpec

T = TypeVar("T")
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


class _Engine:
    """The `generate_sequences` contract over `arun` (trajectories), shared by RolloutEngine and RayRunner."""

    agent: CompiledAgent
    codec: Codec
    _own_loop: asyncio.AbstractEventLoop | None = None
    _faults: FaultDelta | None = None

    async def arun(self, rows: Sequence[Any], *, n: int = 1, sampling_params: Mapping[str, Any] | None = None,
                   validate: bool = False, sampling: Sampling | None = None) -> list[Trajectory]:  # fmt: skip
        raise NotImplementedError

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
            if not hasattr(self, "asnapshot"):
                raise TypeError(f"keep=: {type(self).__name__} cannot snapshot a run; use RolloutEngine")
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
        """Finished trajectories -> verl's padded batch (see the module-level `to_batch`), with the sampling
        that produced its logprobs (meta_info["sampling"]) and its metrics (meta_info["rollout_metrics"],
        fsm/output/metrics.py), which survive a DataProto's round trip."""
        out = to_batch(trajs, self.agent, self.codec, logprobs=sampling.logprobs, like=like, meta=meta)
        out.meta_info["sampling"] = sampling.describe(self.codec.vocab_size)
        out.meta_info["rollout_metrics"] = rollout_metrics(trajs, faults=self._fault_counters().take(),
                                                           wall_s=wall_s)  # fmt: skip
        return out

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

    def _run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        # RayRunner's: its arun keeps nothing bound to a loop, so a private loop in this thread serves the sync
        # forms and any caller's loop the async ones. RolloutEngine overrides this (its backend has one home).
        if self._own_loop is None or self._own_loop.is_closed():
            self._own_loop = asyncio.new_event_loop()
        return self._own_loop.run_until_complete(coro)


class RolloutEngine(ContinuousMode, ControlCalls, _Engine):
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
    """

    def __init__(self, spec: SpecLike, tokenizer: Any = None, *, backend: Backend | None = None,
                 servers: Sequence[str] | None = None, model: str | Path | None = None, max_concurrency: int = 512,
                 tracer: Tracer | None = None, check_tokens: bool = False, watchdog_s: float | None = WATCHDOG_S,
                 **backend_options: Any):  # fmt: skip
        if backend is not None and servers:
            raise ValueError("give backend= or servers=, not both")
        self.agent = load_agent(spec)
        if tokenizer is None and (backend is not None or servers):
            raise ValueError("a tokenizer is needed with backend= or servers= (a tokenizer object or a path)")
        self._detect_engine: tuple[list[str], dict[str, Any]] | None = None
        if backend is None:
            backend = make_backend(servers=servers, model=model, **backend_options)
            if servers and backend_options.get("engine") is None:
                timeout = backend_options.get("request_timeout_s")
                self._detect_engine = (list(servers), {"request_timeout_s": timeout})
            if tokenizer is None:  # the embedded model's own
                tokenizer = model_tokenizer(model if model is not None else tiny_model_dir())
        elif backend_options:
            raise ValueError(f"backend options {sorted(backend_options)} go with servers= or model=, not backend=")
        self.backend: Backend = backend
        self.runner = Runner(self.agent, self.backend, load_tokenizer(tokenizer), max_concurrency=max_concurrency,
                             tracer=tracer, check_tokens=check_tokens, watchdog_s=watchdog_s)  # fmt: skip
        self.codec = self.runner.codec
        self.tracer = tracer
        self._home: _LoopThread | None = None  # started by the first call; the backend lives on its loop
        self._started: asyncio.Future[None] | None = None  # the backend's start(), on the home loop
        self._closed = False

    def _home_loop(self) -> _LoopThread:
        if self._closed:
            raise RuntimeError("this RolloutEngine is closed")
        if self._home is None:
            self._home = home = _LoopThread(f"agentfsm engine ({self.agent.name})")
            weakref.finalize(self, home.close).atexit = False  # an engine dropped unclosed stops its thread
        return self._home

    async def _on_home(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the engine's loop, from whichever loop the caller runs."""
        try:
            home = self._home_loop()
        except RuntimeError:
            coro.close()
            raise
        if home.current():
            return await coro
        return await home.call(coro)

    def _run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            home = self._home_loop()
        except RuntimeError:
            coro.close()
            raise
        return home.run(coro)

    async def start(self) -> None:
        """Start the backend (connections, health checks) on the engine's loop. Called by the first use."""
        await self._on_home(self._start())

    async def _start(self) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self._start_backend())
        await asyncio.shield(self._started)

    async def _start_backend(self) -> None:
        if self._detect_engine is not None:  # servers= without engine=: ask them which they run
            from backends.engines import client, detect_engine, one_kind

            urls, options = self._detect_engine
            self._detect_engine = None
            found = await asyncio.gather(*(detect_engine(u, 5.0) for u in urls), return_exceptions=True)
            told = [(u, e) for u, e in zip(urls, found) if isinstance(e, str)]  # a server down now: not told
            engine = one_kind([u for u, _ in told], [e for _, e in told]) if told else "sglang"
            if engine != "sglang":  # the clients were SGLang's until now: nothing was sent through them
                for s, url in zip(self.backend.servers, urls):  # type: ignore[attr-defined]
                    s.backend = client(engine, url, **options)
                self.backend.provider = engine
        start = getattr(self.backend, "start", None)
        if start is not None:
            await start()
        # The servers' weight version, when they report an int: the counter goes on from there.
        reported = await self._reported_version()
        if reported is not None and reported > self.runner.gate.version:
            self.runner.gate.version = reported
        self._fault_counters()  # counted from the backend's start: a batch made after the run still has its faults

    async def _reported_version(self) -> int | None:
        version = getattr(self.backend, "weight_version", None)
        info = getattr(self.backend, "model_info", None)
        if version is None and info is not None:
            with contextlib.suppress(Exception):  # a server that cannot say (soon): keep counting from 0
                info = await asyncio.wait_for(info(), 5.0)
                version = (info[0] if isinstance(info, list) and info else info or {}).get("weight_version")
        try:
            return int(version) if version is not None else None
        except (TypeError, ValueError):
            return None

    async def arun(self, rows: Sequence[Any], *, n: int = 1, sampling_params: Mapping[str, Any] | None = None,
                   validate: bool = False, sampling: Sampling | None = None,
                   on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:  # fmt: skip
        """The finished trajectories themselves (transcripts, segments, state paths), in input order.
        `on_done` hears each trajectory as it finishes, on the engine's thread."""
        return await self._on_home(self._arun(rows, n, sampling_params, validate, sampling, on_done))

    async def _arun(self, rows: Sequence[Any], n: int, sampling_params: Mapping[str, Any] | None, validate: bool,
                    sampling: Sampling | None, on_done: Callable[[Trajectory], None] | None) -> list[Trajectory]:  # fmt: skip
        ctx, trajs = self.runner.prepare(rows, n, sampling_params, validate, sampling)
        owner = await self._stream_here()  # the engine's one owner, the continuous mode's too
        await owner.run(trajs, ctx, on_done)
        return trajs

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def _close_backend(self) -> None:
        try:
            await self._stop_stream()
            close = getattr(self.backend, "close", None)
            if close is not None and self._started is not None:
                await close()
            self.agent.tools.close()  # idle tool threads, loops and worker processes (tools restart on use)
        finally:  # the run's owner closes its tracer: every span ended is exported or counted as dropped
            close_tracer = getattr(self.tracer, "close", None)
            if close_tracer is not None:
                await asyncio.to_thread(close_tracer)

    async def aclose(self) -> None:
        """Close the backend, then stop the engine's thread."""
        if self._closed:
            return
        if self.wedged:  # code blocks its loop for good (ContinuousMode.asnapshot): the process exits around it
            self._closed, self._home = True, None
            return
        if self._home is not None:
            try:
                await self._on_home(self._close_backend())
            finally:
                home, self._home, self._closed = self._home, None, True
                if home.current():  # e.g. from an on_done callback: the loop stops after this task
                    home.close()
                else:
                    await asyncio.to_thread(home.close)
        self._closed = True

    def close(self) -> None:
        """Close the backend, then stop the engine's thread."""
        self._refuse_in_loop("close", "aclose")
        if self._closed:
            return
        if self._home is not None:
            try:
                self._home.run(self._close_backend())
            finally:
                home, self._home, self._closed = self._home, None, True
                home.close()
        self._closed = True

    async def __aenter__(self) -> RolloutEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
