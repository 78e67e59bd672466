"""The rollout API a trainer embeds: rows in, verl's padded batch out.

    engine = RolloutEngine("specs/calculator.yaml")                    # the embedded tiny model (backends.hf)
    engine = RolloutEngine(spec, tokenizer=path, servers=[url, ...])   # SGLang or vLLM servers, a Router
    batch = engine.generate_sequences(rows, n=8)          # sync: blocks until the batch is back
    batch = await engine.agenerate_sequences(rows, n=8)   # async: from any event loop, the same engine
    engine.submit(rows, n=8); batch = engine.take(16, max_staleness=1)   # continuous mode (fsm/run/stream.py)

`rows` is what a verl dataset yields (row dicts, a dict of columns, or a `DataProto`, which then comes back);
the result has one row per (input row, sample) in verl's `repeat(n, interleave=True)` layout. The contract is
`BaseEngine` (fsm/output/engine.py); a RolloutEngine composes fsm/run/local.py's `Local`, whose own loop thread
serves sync and async calls alike, and picks concrete backends lazily (as fsm/cli and the trainer adapters do):
a Router over `servers=`, else `HFBackend` over a model.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from backends.base import Backend
from fsm.output.batch import FaultDelta
from fsm.output.engine import BaseEngine, Rows, batch_of
from fsm.run.agent import CompiledAgent
from fsm.run.compile import compile_spec
from fsm.run.context import PauseGate, Policy
from fsm.run.engine import Owned
from fsm.run.local import Local
from fsm.run.runtime import WATCHDOG_S, Runner
from fsm.run.tracer import Tracer
from fsm.spec.loader import LoadedSpec
from fsm.spec.model import SPECS_DIR, AgentSpec

DETECT_TIMEOUT_S = 5.0  # servers= without engine=: how long each server is asked which engine it runs
SpecLike = CompiledAgent | AgentSpec | LoadedSpec | str | Path
__all__ = [
    "BaseEngine",
    "Rows",
    "RolloutEngine",
    "SpecLike",
    "batch_of",
    "load_agent",
    "load_tokenizer",
    "make_backend",
    "model_tokenizer",
    "probe_servers",
    "tiny_model_dir",
]


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
            raise FileNotFoundError(
                f"the model object {type(model).__name__} was not loaded from a directory "
                "that could hold its tokenizer; pass tokenizer= (an object or a path)"
            )
        where = Path(source)
    if not any((where / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in {where} (none of {', '.join(TOKENIZER_FILES)}); pass tokenizer= "
            "(an object or a path, e.g. backends/tiny/assets for the tiny model's checkpoints)"
        )
    return where


def make_backend(
    *,
    servers: Sequence[str] | None = None,
    model: str | Path | Any = None,
    group_affinity: bool = True,
    request_timeout_s: float | None = None,
    retry_window_s: float = 60.0,
    engine: str | None = None,
    **hf_options: Any,
) -> Backend:
    """`Router` over SGLang or vLLM servers (`engine`, else SGLang's clients), or the in-process `HFBackend` over
    a model directory (default: tiny) or a transformers model object; `hf_options` go to HFBackend.
    `request_timeout_s` (each server request's deadline) and `retry_window_s` (how long a request fails over
    while the whole fleet fails) are for servers only."""
    if servers:
        from backends.engines import client
        from backends.router import Router

        clients = [client(engine or "sglang", url, request_timeout_s=request_timeout_s) for url in servers]
        return Router(clients, group_affinity=group_affinity, retry_window_s=retry_window_s)
    import torch

    from backends.hf import HFBackend

    if isinstance(model, torch.nn.Module):
        if not callable(getattr(model, "forward", None)) or getattr(model, "config", None) is None:
            raise TypeError(
                f"model={type(model).__name__} is not a transformers causal LM (it has no .config); "
                "pass a PreTrainedModel, a model directory, servers= or backend="
            )
        return HFBackend(model, **hf_options)
    if not isinstance(model, (str, Path, type(None))):
        raise TypeError(f"model= takes a model directory or a torch module, got {type(model).__name__}")
    model_dir = Path(model) if model is not None else tiny_model_dir()
    if not (model_dir / "config.json").exists():
        hint = " (train it: python -m backends.tiny.train)" if model is None else ""
        raise FileNotFoundError(f"no model in {model_dir}{hint}; or pass servers=[...] or backend=...")
    return HFBackend(model_dir, **hf_options)


def policy_runtimes(
    agent: CompiledAgent, given: Mapping[str, Backend | Mapping[str, Any]], codec: Any
) -> dict[str, Policy]:
    """The spec's policies at run time (docs/trees.md): each one's backend is the one `given` for its name (a
    Backend, or {"backend": ..., "tokenizer": ...} when its model has a tokenizer of its own), else its spec's
    `servers` (a Router; the engine's tokenizer), else its `checkpoint` (the embedded model, its own tokenizer),
    else None: the engine's backend and codec."""
    from fsm.families import codec_for

    spec = agent.spec
    unknown = sorted(set(given) - (set(spec.policies) or {"default"}))
    if unknown:
        raise ValueError(
            f"policies={unknown}: not policies of spec {spec.name} ({', '.join(spec.policies) or 'default'})"
        )
    out: dict[str, Policy] = {}
    for name in set(spec.policies) | set(given):
        pspec = spec.policies.get(name)
        entry = given.get(name)
        backend: Backend | None = None
        tokenizer = None
        if isinstance(entry, Mapping):
            backend, tokenizer = entry.get("backend"), entry.get("tokenizer")
        elif entry is not None:
            backend = entry
        elif pspec is not None and pspec.servers:
            backend = make_backend(servers=pspec.servers, engine="sglang")
        elif pspec is not None and pspec.checkpoint:
            where = Path(pspec.checkpoint)
            if not where.is_absolute() and agent.path is not None:
                where = Path(agent.path).resolve().parent / where
            backend, tokenizer = make_backend(model=where), model_tokenizer(where)
        model = (pspec.model if pspec is not None else None) or spec.model
        policy_codec = None
        if tokenizer is not None or (pspec is not None and pspec.model is not None):
            policy_codec = codec_for(
                load_tokenizer(tokenizer) if tokenizer is not None else codec.tokenizer,
                model.family,
                model.chat_template_kwargs,
                model.special_tokens_in_observations,
            )
        out[name] = Policy(
            name,
            backend,
            policy_codec,
            pspec.sampling if pspec is not None else None,
            PauseGate() if backend is not None and name != spec.policy else None,  # the root's: the run's
        )
    return out


class ServerNotReady(Exception):
    """No server given by URL can serve (or, strict, one cannot): the message names each and why."""


@dataclass
class Probe:
    servers: list[str]  # the servers that answered, in the order given
    tokenizer: str | None  # the tokenizer path the first of them serves, when it reports one
    left_out: dict[str, str]  # url -> why it was left out
    engine: str = "sglang"  # what they run: "sglang" (SGLang or the dev server) or "vllm"


async def probe_servers(
    urls: Sequence[str], *, strict: bool = False, timeout_s: float = 10.0, engine: str | None = None
) -> Probe:
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
                    if not await c.ready(timeout_s=timeout_s):
                        return "does not answer /ready (starting, paused or down)"
                    await c._ensure_info(timeout_s)
                    return kind, await c.model_info()
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


class RolloutEngine(BaseEngine):
    """One spec, one backend (or fleet), one event loop: the single-process rollout engine (docs/trainers.md).

    spec: a spec path, a shipped spec's name ("calculator"), an AgentSpec or a CompiledAgent.
    tokenizer: a tokenizer object or a path; default: the embedded model's.
    backend: any `backends.base.Backend`; or `servers`: SGLang or vLLM base URLs (their engine asked at start
        unless `engine=` says), behind a sticky Router; or neither: `HFBackend` in this process over `model`
        (default the tiny model), a directory or a transformers model object (decoded with that very module).
    tracer: e.g. `fsm.telemetry.Telemetry(...)`, closed with the engine. watchdog_s: stuck rows are logged
        after this long without a state change (None: never). freeze_heap: `gc.freeze()` while hundreds of
        trajectories are in flight (fsm/run/heap.py). backend_options: for the backend it builds.
    The engine owns its backend and its loop thread: `close()` / `aclose()` / `with` / `async with` closes both.
    """

    def __init__(
        self,
        spec: SpecLike,
        tokenizer: Any = None,
        *,
        backend: Backend | None = None,
        servers: Sequence[str] | None = None,
        model: str | Path | None = None,
        max_concurrency: int = 512,
        tracer: Tracer | None = None,
        check_tokens: bool = False,
        watchdog_s: float | None = WATCHDOG_S,
        policies: Mapping[str, Backend | Mapping[str, Any]] | None = None,
        freeze_heap: bool = True,
        **backend_options: Any,
    ):
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
            raise ValueError(
                f"backend options {sorted(backend_options)} go with servers= or model=, not backend="
            )
        # With `build`, the runner's backend arrives at start (Local builds it on the engine's loop, first thing).
        self.runner = Runner(
            self.agent,
            cast(Backend, backend),
            load_tokenizer(tokenizer),
            max_concurrency=max_concurrency,
            tracer=tracer,
            check_tokens=check_tokens,
            watchdog_s=watchdog_s,
        )
        self.runner.policies = policy_runtimes(self.agent, policies or {}, self.runner.codec)
        self.codec = self.runner.codec
        self.tracer = tracer
        # the fault counters start with the backend: a batch made after the run (the CLI's) still has its faults
        self.core = self._local = Local(
            self.runner,
            tracer,
            self.agent.name,
            build,
            on_started=self._fault_counters,
            freeze_heap=freeze_heap,
        )

    async def _fleet(self, urls: list[str], options: dict[str, Any]) -> Backend:
        """servers= without engine=: at start, the servers are asked which engine they run (backends/engines.py
        `detect_fleet`), then the Router is built once, with that engine's clients."""
        from backends.engines import detect_fleet

        backend = make_backend(
            servers=urls, **{**options, "engine": await detect_fleet(urls, DETECT_TIMEOUT_S)}
        )
        self._faults = FaultDelta(backend)  # counted from its start: every count of it is this engine's
        return backend

    @property
    def backend(self) -> Backend:
        """The engine's backend (servers= without engine=: built at start, once they have said what they run)."""
        return self.runner.backend

    @property
    def owned(self) -> Owned:
        """What the engine owns beyond its backend and closes with it: services its runs start on first use (a
        harness's gateway, its sessions and threads) or that are attached to it (fsm/gateway/serve.py `serve`)."""
        return self._local.owned

    @property
    def wedged(self) -> bool:
        """A snapshot was taken while code blocked the engine's loop: that loop runs nothing more."""
        return self._local.wedged

    def policy_version(self, policy: str) -> int:
        """The weight version `policy` holds (a policy without a backend of its own: the root's); ValueError for
        a policy the spec does not declare."""
        return self._local.controls.version(policy)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the backend (connections, health checks) on the engine's loop. Called by the first use."""
        await self.core.call(self._local.start_here())

    async def __aenter__(self) -> RolloutEngine:
        await self.start()
        return self
