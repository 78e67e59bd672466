"""An SGLang-protocol HTTP server over any in-process Backend: for laptops, CI and router tests.

It answers SGLang's HTTP endpoints with the same JSON shapes and status codes as SGLang 0.5.23 under
`--skip-tokenizer-init` (no `text`), so `SGLangBackend` and the router run unchanged against it. Each
server keeps a prefix cache of what it has served (a radix tree bounded by an LRU token budget) and reports
`cached_tokens` as SGLang does, which makes routing quality measurable without a GPU.

    async with DevServer(backend, port=0) as srv: ...srv.url...
    with scripted_servers(2) as urls: ...                      # scripted servers in subprocesses
    python -m backends.devserver --model DIR --port 30000      # the embedded transformers model
    python -m backends.devserver --scripted --port 30000       # a deterministic echo "model", no weights
    python -m backends.devserver --scripted-tools --tokenizer DIR --context-length 65536
                                                               # a scripted tool-calling model (ToolScript)
    python -m backends.devserver --scripted-calculator         # the calculator's turns, answered at once

Aborts on demand: a /generate carrying the header `X-Agentfsm-Fault: abort_waiting` is aborted in the waiting
queue (SGLang's shape: no prompt_tokens, no cached_tokens); `abort_running[:K]` is aborted mid-generation
after K tokens (default a quarter of max_new_tokens) and answers with those partial output_ids and their
logprobs, `finish_reason {"type": "abort", "message": "Aborted", ...}`, as SGLang does for a running request.
backends/faults.py's proxy sets the header; /abort_request and a weight update with abort_all_requests abort
for real (with no partial output). /pause_generation follows SGLang's three modes (abort with partial output,
retract, in_place) over a backend that can pause mid-generation (HFBackend), and /update_weights_from_disk
really reloads its weights and bumps the `weight_version` every response and /model_info report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import re
import signal
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web

from backends.base import Backend, BackendRequestError, BackendUnavailable, GenerateRequest, GenerateResult
from backends.contract import (
    INPUT_MARGIN,
    VERSION,
    Live,
    Refused,
    admit_lengths,
    contract_error,
    generate_answer,
    loads,
    model_info,
)
from backends.devflags import Help, dev_server_flags
from backends.prefix_cache import PrefixCache
from backends.scripted import HashLM, ScriptedBackend, ToolScript, calculator_backend, echo_backend
from backends.tiny import ASSET_DIR

log = logging.getLogger("agentfsm.devserver")

FAULT_HEADER = "X-Agentfsm-Fault"  # abort_waiting | abort_running[:K]: an abort on demand (module docstring)
_TURN_SUFFIX = re.compile(r"_t\d+(_r\d+)?$")  # a turn, and a resume of it


# -- the server ------------------------------------------------------------------------------------


class DevServer:
    """SGLang's HTTP surface over one in-process backend. The caller owns the backend's lifecycle."""

    def __init__(
        self,
        backend: Backend,
        *,
        host: str = "127.0.0.1",
        port: int = 0,  # 0: any free port (read `url` after start)
        context_length: int | None = None,  # default: the backend's, else 4096
        cache_tokens: int = 1 << 20,  # prefix cache budget (SGLang: max_total_num_tokens)
        max_running_requests: int | None = None,  # beyond it requests wait (and can be aborted while waiting)
        model_path: str | None = None,
    ):
        self.backend = backend
        self.host, self.port = host, port
        self.context_length = context_length or backend.context_length or 4096
        self.context_length_set = context_length  # /server_info reports it only when given, as SGLang does
        self.cache = PrefixCache(cache_tokens)
        self.model_path = model_path or backend.model_name  # SGLang: the last weights loaded
        self.tokenizer_path = self.model_path
        self.served_model_name = backend.model_name  # (SGLang's default is the model path)
        self.pause_mode: str | None = None
        self.weight_version = str(getattr(backend, "weight_version", "default"))
        self.failing = False  # fault injection: /health and /generate answer 503
        self.paused = False
        self.memory_released: set[str] = set()
        self.log: deque[dict[str, Any]] = deque(maxlen=100_000)  # one entry per finished /generate
        self.prompt_tokens = self.cached_tokens = 0
        self._live: dict[str, Live] = {}
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._slots = asyncio.Semaphore(max_running_requests) if max_running_requests else None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._runner is not None:
            return
        app = web.Application(client_max_size=64 << 20)
        routes: list[tuple[str, str, Any]] = [
            ("*", "/generate", self._generate),
            ("GET", "/health", self._health),
            ("GET", "/health_generate", self._health),
            ("GET", "/ready", self._ready),
            ("GET", "/model_info", self._model_info),
            ("GET", "/get_model_info", self._model_info),
            ("GET", "/server_info", self._server_info),
            ("GET", "/get_server_info", self._server_info),
            ("GET", "/v1/loads", self._loads),
            ("*", "/flush_cache", self._flush_cache),
            ("POST", "/abort_request", self._abort_request),
            ("POST", "/pause_generation", self._pause),
            ("POST", "/continue_generation", self._continue),
            ("*", "/release_memory_occupation", self._release_memory),
            ("*", "/resume_memory_occupation", self._resume_memory),
            ("POST", "/update_weights_from_disk", self._update_weights),
            ("POST", "/update_weights_from_tensor", self._unsupported_update),
            ("POST", "/update_weights_from_distributed", self._unsupported_update),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        start = getattr(self.backend, "start", None)
        if start is not None:
            await start()
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        for rec in list(self._live.values()):
            if rec.task is not None:
                rec.task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> DevServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- /generate -------------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError as e:
            return _error(Refused.http(400, f"JSON decode error: {e}", "Bad Request"))
        if not isinstance(body, dict):
            return _error(Refused.http(400, "request body must be a JSON object", "Bad Request"))
        if self.failing:
            return _error(Refused.http(503, "dev server is failing (fault injection)"))
        params = body.get("sampling_params") or {}
        contract = contract_error(params)
        if contract is not None:
            return web.json_response({"error": contract}, status=400)
        if body.get("stream"):
            return await self._stream(request, body, params)
        try:
            rec, ids, res = await self._run(body, params, request.headers.get(FAULT_HEADER))
        except Refused as r:
            return _error(r)
        logprob = bool(body.get("return_logprob"))
        return web.json_response(generate_answer(rec, len(ids), res, self.weight_version, logprob))

    async def _stream(
        self, request: web.Request, body: dict[str, Any], params: dict[str, Any]
    ) -> web.StreamResponse:
        """Cumulative SSE chunks, then `data: [DONE]`; a refusal becomes an in-stream error event."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            rec, ids, res = await self._run(body, params)
        except Refused as r:
            await resp.write(b"data: " + json.dumps(r.event()).encode() + b"\n\n")
        else:
            logprob = bool(body.get("return_logprob"))
            n = len(res.token_ids) if res is not None else 0
            every = max(1, int(params.get("stream_interval") or 1))
            for upto in [i for i in range(1, n) if i % every == 0] + [n]:
                chunk = generate_answer(
                    rec, len(ids), res, self.weight_version, logprob, upto if upto < n else None
                )
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _admit(self, body: dict[str, Any], params: dict[str, Any]) -> tuple[str, list[int], int]:
        """The tokenizer manager's checks (ValueError -> 400 {"error": {"message"}}); the max_new_tokens run."""
        ids = body.get("input_ids")
        if ids is None:
            raise Refused.value_error("the dev server takes input_ids only (it runs without a tokenizer)")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise Refused.value_error("input_ids must be a list of ints (batches are not supported here)")
        if not ids:
            raise Refused.value_error("input_ids cannot be empty.")
        if (params.get("n") or 1) != 1:
            raise Refused.value_error("n > 1 is not supported by the dev server")
        temperature = params.get("temperature")
        if temperature is not None and temperature < 0:
            raise Refused.value_error(
                f"temperature must be a non-negative finite number, got {float(temperature)}."
            )
        if params.get("stop"):
            raise Refused.value_error(
                f"stop={params['stop']!r} is unavailable when skip_tokenizer_init=True (requires "
                "tokenizer to decode tokens to text for matching)."
            )
        wanted = admit_lengths(len(ids), params.get("max_new_tokens"), self.context_length)
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise Refused.value_error("rid must be a string (batches are not supported here)")
        if rid in self._live:
            raise Refused.value_error(f"Duplicate request ID detected: {rid}")
        return rid, ids, wanted

    async def _run(
        self, body: dict[str, Any], params: dict[str, Any], fault: str | None = None
    ) -> tuple[Live, list[int], GenerateResult | None]:
        """Run one request; the result is None when it was aborted (while waiting or running). `fault`: the
        FAULT_HEADER's abort on demand."""
        rid, ids, wanted = self._admit(body, params)
        rec = self._live[rid] = Live(rid)
        params = {**params, "max_new_tokens": wanted}  # cut to the room left, silently, as SGLang does
        rec.max_new = wanted
        if fault == "abort_waiting":
            del self._live[rid]
            return rec, ids, None  # never left the waiting queue
        cut = None  # abort_running: stop after `cut` tokens and answer as an abort
        if fault is not None and fault.startswith("abort_running"):
            _, _, k = fault.partition(":")
            cut = min(wanted, int(k) if k else max(1, wanted // 4))
            params = {**params, "max_new_tokens": cut}
        request = GenerateRequest(
            session_id=_TURN_SUFFIX.sub("", rid),
            prompt_ids=ids,
            sampling_params=dict(params),
            rid=rid,
            return_logprob=bool(body.get("return_logprob")),
        )
        rec.task = asyncio.ensure_future(self._work(rec, request))
        try:
            await asyncio.wait({rec.task})
        finally:
            rec.task.cancel()  # no-op when done; stops the work if our client went away
            self._live.pop(rid, None)
        if rec.task.cancelled():
            return rec, ids, None
        exc = rec.task.exception()
        if isinstance(exc, BackendRequestError):
            raise Refused.value_error(str(exc))
        if exc is not None:
            status = 503 if isinstance(exc, BackendUnavailable) else 500
            raise Refused.http(status, f"{type(exc).__name__}: {exc}")
        res = rec.task.result()
        if cut is not None and res.finish_reason == "length" and len(res.token_ids) < wanted:
            res = replace(res, finish_reason="abort", abort_message="Aborted")  # partial output, as SGLang's
        self.cache.insert(ids + list(res.token_ids))
        self.prompt_tokens += len(ids)
        self.cached_tokens += rec.cached
        n_out = len(res.token_ids)
        self.log.append(
            {"rid": rid, "prompt_tokens": len(ids), "cached_tokens": rec.cached, "output_tokens": n_out}
        )
        log.info("generate rid=%s prompt=%d cached=%d out=%d", rid, len(ids), rec.cached, n_out)
        return rec, ids, res

    async def _work(self, rec: Live, request: GenerateRequest) -> GenerateResult:
        await self._unpaused.wait()
        async with self._slots or contextlib.nullcontext():
            await self._unpaused.wait()
            rec.started = True
            ids = request.prompt_ids
            rec.cached = max(0, min(self.cache.match(ids), len(ids) - 1))  # SGLang computes >= 1 token
            self.cache.insert(ids)  # concurrent requests with this prompt now hit, as in SGLang
            return await self.backend.generate(request)

    # -- control endpoints -----------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.failing else 200)

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.failing or self.paused else 200)

    async def _model_info(self, request: web.Request) -> web.Response:
        info = model_info(self.model_path, self.served_model_name, self.tokenizer_path, self.weight_version)
        return web.json_response(info)

    async def _server_info(self, request: web.Request) -> web.Response:
        """The fields clients read (SGLang sends every server argument besides): `context_length` is null
        unless it was set, `max_req_input_len` is INPUT_MARGIN below the context length."""
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.served_model_name,
                "host": self.host,
                "port": self.port,
                "context_length": self.context_length_set,
                "skip_tokenizer_init": True,
                "max_total_num_tokens": self.cache.max_tokens,
                "max_req_input_len": self.context_length - INPUT_MARGIN,
                "weight_version": self.weight_version,
                "internal_states": [{"memory_released": sorted(self.memory_released), "paused": self.paused}],
                "version": VERSION,
            }
        )

    async def _loads(self, request: web.Request) -> web.Response:
        rids = self.backend.running_rids() if hasattr(self.backend, "running_rids") else None  # in its batch
        running = sum(rec.started and (rids is None or rec.rid in rids) for rec in self._live.values())
        body = loads(
            running=running,
            waiting=len(self._live) - running,
            used=self.cache.size,
            capacity=self.cache.max_tokens,
            hit_rate=self.cached_tokens / max(1, self.prompt_tokens),
        )
        return web.json_response(body)

    async def _flush_cache(self, request: web.Request) -> web.Response:
        """SGLang's texts, and no Content-Type: 400 "Flush cache failed." while requests run or wait."""
        if self._live:
            return _Untyped(status=400, body=b"Flush cache failed.\n")
        self.cache.clear()
        flush = getattr(self.backend, "flush_cache", None)
        if flush is not None:
            await flush()
        return _Untyped(
            body=b"Cache flushed.\nPlease check backend logs for more details. (When there are running "
            b"or waiting requests, the operation will not be performed.)\n"
        )

    async def _abort_request(self, request: web.Request) -> web.Response:
        """SGLang semantics: the rid must itself be live; then every live rid it prefixes is aborted, a running
        one with its partial output when the backend can stop one mid-generation (HFBackend). A request that
        arrived while paused has not reached the scheduler: the abort is lost and it runs after continue."""
        body = await _body(request)
        rid = body.get("rid") or ""
        abort_all = bool(body.get("abort_all"))
        if not abort_all and rid not in self._live:
            return web.Response(status=200)
        which = (lambda r: True) if abort_all else (lambda r: r.startswith(rid))
        backend_abort = getattr(self.backend, "abort_request", None)
        if backend_abort is not None:
            await backend_abort(rid, abort_all=abort_all)
            self._abort(lambda r: which(r) and not self._live[r].started and not self.paused)
        else:
            self._abort(lambda r: which(r) and (self._live[r].started or not self.paused))
        return web.Response(status=200)

    def _abort(self, which: Callable[[str], bool]) -> None:
        for rid, rec in list(self._live.items()):
            if which(rid) and rec.task is not None:
                rec.task.cancel()

    async def _pause(self, request: web.Request) -> web.Response:
        """SGLang's modes. New requests wait until /continue_generation in every mode. "abort" aborts every
        live request: waiting ones as waiting-queue aborts, running ones with their partial output (when the
        backend can stop mid-generation: HFBackend; others are cancelled without output). "retract" requeues
        running requests, which start over after continue; "in_place" holds them mid-generation and continues
        them. Backends that cannot pause (scripted ones) let running requests finish in those two modes."""
        mode = (await _body(request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _error(Refused.value_error(f"unknown pause mode {mode!r}"))
        self.paused, self.pause_mode = True, mode
        self._unpaused.clear()
        pause = getattr(self.backend, "pause_generation", None)
        if pause is not None:
            await pause(mode)
        if mode == "abort":
            self._abort(lambda r: not self._live[r].started or pause is None)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        resume = getattr(self.backend, "continue_generation", None)
        if resume is not None:
            await resume()
        self.paused, self.pause_mode = False, None
        self._unpaused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _release_memory(self, request: web.Request) -> web.Response:
        tags = (await _body(request)).get("tags") or ["weights", "kv_cache"]
        self.memory_released.update(tags)
        if "kv_cache" in tags:
            self.cache.clear()
        return web.json_response(None)

    async def _resume_memory(self, request: web.Request) -> web.Response:
        tags = (await _body(request)).get("tags") or ["weights", "kv_cache"]
        self.memory_released.difference_update(tags)
        return web.json_response(None)

    async def _update_weights(self, request: web.Request) -> web.Response:
        body = await _body(request)
        path, version = body.get("model_path"), body.get("weight_version")
        update = getattr(self.backend, "update_weights_from_disk", None)
        try:
            if not path:
                raise ValueError("model_path is required")
            if update is not None:
                await update(path, weight_version=version)
        except (ValueError, OSError, BackendRequestError) as e:
            return web.json_response(
                {"success": False, "message": str(e), "num_paused_requests": 0}, status=400
            )
        if body.get("abort_all_requests"):
            self._abort(lambda r: True)
        self.model_path = path
        if version is not None:
            self.weight_version = str(version)
        if body.get("flush_cache", True) and self.pause_mode == "in_place" and self._live:
            # SGLang loads the weights, then cannot flush a cache that held requests still use
            message = (
                "Weights were updated, but the cache was not flushed because requests are still running or "
                "queued. Retract or finish them, then call /flush_cache."
            )
            return web.json_response(
                {"success": False, "message": message, "num_paused_requests": 0}, status=400
            )
        if body.get("flush_cache", True):
            self.cache.clear()
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def _unsupported_update(self, request: web.Request) -> web.Response:
        """Tensor and NCCL weight updates need SGLang's model runner: refused, as a failed load is."""
        message = f"{request.path} is not supported by the dev server; use /update_weights_from_disk"
        return web.json_response({"success": False, "message": message}, status=400)


class _Untyped(web.Response):
    """A body without a Content-Type, as SGLang's plain-text answers come (aiohttp would add one)."""

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self._headers.pop("Content-Type", None)


async def _body(request: web.Request) -> dict[str, Any]:
    """Optional JSON object body of a control call ({} when empty)."""
    if not request.can_read_body:
        return {}
    with contextlib.suppress(ValueError):
        body = await request.json()
        return body if isinstance(body, dict) else {}
    return {}


def _error(r: Refused) -> web.Response:
    return web.json_response(r.body, status=r.status)


# -- CLI -------------------------------------------------------------------------------------------


async def _serve(backend: Backend, host: str, port: int, **options: Any) -> None:
    """Serve until SIGTERM/SIGINT, then stop cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with DevServer(backend, host=host, port=port, **options) as srv:
        log.info("The server is fired up and ready to roll! %s", srv.url)
        await stop.wait()
    close = getattr(backend, "close", None)
    if close is not None:
        await close()


def _tool_script(tokenizer: str, script: str | None) -> ToolScript:
    """The scripted tool-calling model over a real tokenizer (transformers is imported only here)."""
    from transformers import AutoTokenizer

    if not (Path(tokenizer) / "tokenizer_config.json").is_file():  # never a name to fetch: we are offline
        raise ValueError(
            f"--tokenizer {tokenizer}: no tokenizer_config.json there (a tokenizer folder is needed)"
        )
    tok = AutoTokenizer.from_pretrained(tokenizer)
    return ToolScript.from_file(tok, script) if script else ToolScript(tok)


def _backend(args: argparse.Namespace) -> tuple[Backend, dict[str, Any]]:
    """The backend the flags name, and what DevServer is told of it besides."""
    tokenizer = args.tokenizer or str(ASSET_DIR)
    if args.hashlm:
        return HashLM(vocab=args.vocab, stop_every=args.stop_every, latency_s=args.latency), {}
    if args.scripted_tools:
        try:
            script = _tool_script(tokenizer, args.script)
        except (OSError, ValueError) as e:  # no such tokenizer or script; a script not a list of steps
            raise SystemExit(f"dev server: --scripted-tools: {e}") from None
        return ScriptedBackend(
            script, latency_s=args.latency, model_name="scripted-tools", record_requests=False
        ), {}
    if args.scripted_calculator:
        try:
            return calculator_backend(tokenizer, latency_s=args.latency), {}
        except (OSError, ValueError, KeyError) as e:  # no such folder, not a tokenizer, no eos_token
            raise SystemExit(f"dev server: --scripted-calculator --tokenizer {tokenizer}: {e}") from None
    if args.scripted:
        return echo_backend(latency_s=args.latency), {}
    from backends.hf import HFBackend  # torch and transformers only for a model

    model = args.model or str(ASSET_DIR)
    return HFBackend(model, device=args.device, dtype=args.dtype), {"model_path": model}


def parser() -> argparse.ArgumentParser:
    """`python -m backends.devserver`'s command line: backends/devflags.py's flags, as `agentfsm dev-server`'s."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    dev_server_flags(ap)
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args, ignored = parser().parse_known_args(argv)  # SGLang launch flags (--tp-size, ...) are ignored
    serve(args, ignored)


def serve(args: argparse.Namespace, ignored: Sequence[str] = ()) -> None:
    """Serve what the flags (backends/devflags.py) name until SIGTERM or SIGINT."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    if ignored:
        log.info("ignoring SGLang flags: %s", " ".join(ignored))
    backend, options = _backend(args)
    options.update(context_length=args.context_length, max_running_requests=args.max_running_requests)
    asyncio.run(_serve(backend, args.host, args.port, **options))


if __name__ == "__main__":
    main()
