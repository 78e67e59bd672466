"""Token-in-token-out client for an SGLang 0.5.23 server, and a launcher for SGLang replicas.

The wire contract is SGLang's native HTTP API (`/generate` with `input_ids`, `/abort_request`, `/model_info`,
the memory and weight endpoints); backends/devserver.py serves the same contract for tests. What this module
adds on top of a bare POST:
- `max_new_tokens` is clamped to the room left in the context (SGLang answers 400 instead of truncating);
- 400s become `BackendRequestError` with the server's own message, whatever the body shape;
- transport failures and 5xx are retried with jittered exponential backoff, then `BackendUnavailable`;
- the connector's keep-alive is below uvicorn's 5 s, so a pooled connection is never reused as it closes.
`sglang` itself is never imported: the launcher runs it in subprocesses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from backends.base import (
    BackendError,
    BackendRequestError,
    BackendUnavailable,
    BaseBackend,
    GenerateRequest,
    GenerateResult,
)

log = logging.getLogger(__name__)

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}  # smg's retryable set
_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when the key is absent


def error_message(body: Any, fallback: str) -> str:
    """The server's message from any of SGLang's error shapes (`{"error": str}`, `{"error": {"message"}}`,
    `{"message"}`), else `fallback`."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, str):
            return err  # contract violation: {"error": "unknown field ..."}
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])  # ValueError: {"error": {"message": ...}}
        if body.get("message"):
            return str(body["message"])  # FastAPI / scheduler abort: {"object": "error", "message": ...}
    return fallback


def parse_generate(body: dict[str, Any], *, server: str, return_logprob: bool) -> GenerateResult:
    """One /generate response object -> GenerateResult. Optional keys stay optional (waiting-queue aborts)."""
    out: list[int] = list(body.get("output_ids") or [])
    meta: dict[str, Any] = body.get("meta_info") or {}
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type", "abort") if isinstance(fr, dict) else str(fr)
    abort_message = fr.get("message") if kind == "abort" and isinstance(fr, dict) else None
    extra: dict[str, Any] = {"id": meta.get("id"), "finish": fr}
    logprobs: list[float] | None = None
    if return_logprob:
        triples = meta.get("output_token_logprobs") or []
        if len(triples) == len(out):
            logprobs = [float(t[0]) for t in triples]
        elif not out:
            logprobs = []  # phantom entry with max_new_tokens=0
        elif len(triples) > len(out) and [t[1] for t in triples[-len(out) :]] == out:
            logprobs = [float(t[0]) for t in triples[-len(out) :]]  # leading phantom entry
        elif kind == "abort":
            extra["logprobs_missing"] = True  # aborts may carry no logprob payload; never invent values
        else:
            raise BackendError(
                f"{server}: {len(triples)} output logprobs for {len(out)} output ids (rid {meta.get('id')})",
                server=server,
            )
    return GenerateResult(
        token_ids=out,
        logprobs=logprobs,
        finish_reason=kind,
        prompt_tokens=meta.get("prompt_tokens"),
        cached_tokens=meta.get("cached_tokens"),
        weight_version=meta.get("weight_version"),
        server=server,
        abort_message=abort_message,
        extra=extra,
    )


class SGLangBackend(BaseBackend):
    """One SGLang server. Safe to share across all trajectories of an event loop."""

    provider = "sglang"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 600.0,  # per /generate call, all of it
        max_retries: int = 3,  # retries after the first attempt, for retryable failures only
        backoff_s: float = 0.05,  # first retry delay; doubles each retry, ±20 % jitter
        backoff_max_s: float = 5.0,
        keepalive_s: float = 4.0,  # must stay below uvicorn's 5 s keep-alive
        context_length: int | None = None,  # skip discovery when given
        model_name: str | None = None,
        api_key: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.keepalive_s = keepalive_s
        self.context_length = context_length
        self.max_input_len: int | None = None  # server's max_req_input_len when it reports one
        self.model_name = model_name or "unknown"
        self._name_given = model_name is not None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._session: aiohttp.ClientSession | None = None
        self._info_lock = asyncio.Lock()
        self._info: dict[str, Any] | None = None
        self._live: dict[str, str] = {}  # rid -> session_id, for abort(session_id)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- HTTP plumbing ---------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        payload: Any = None,
        *,
        timeout_s: float | None = None,
        retries: int | None = None,
        rid: str | None = None,
    ) -> tuple[int, Any]:
        """One request with retries; returns (status, parsed body) for 2xx and 4xx, raises otherwise.

        With `rid` (a /generate call), a timed-out attempt may still be running server-side: it is aborted
        before the retry, and a retry answered "Duplicate request ID" is retried again rather than a 400.
        """
        await self.start()
        assert self._session is not None
        url = self.url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        attempts = 1 + (self.max_retries if retries is None else retries)
        last = ""
        status: int | None = None
        for attempt in range(attempts):
            if attempt:
                delay = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            try:
                async with self._session.request(method, url, json=payload, timeout=timeout) as resp:
                    status, text = resp.status, await resp.text()
            except (TimeoutError, aiohttp.ClientError) as e:
                status, last = None, f"{type(e).__name__} {e}".strip()
                if rid is not None and isinstance(e, asyncio.TimeoutError):
                    with contextlib.suppress(BackendError):
                        await self._call("POST", "/abort_request", {"rid": rid}, timeout_s=10, retries=0)
                continue
            body: Any = text
            with contextlib.suppress(ValueError):
                body = json.loads(text) if text else None
            message = error_message(body, text[:200])
            if status in _RETRY_STATUS or (rid is not None and attempt and "Duplicate request ID" in message):
                last = f"HTTP {status}: {message}"
                continue
            return status, body
        raise BackendUnavailable(
            f"{self.url} unavailable after {attempts} attempt(s) of {method} {path}: {last}",
            server=self.url,
            status=status,
        )

    async def _get_info(self, paths: Sequence[str]) -> dict[str, Any]:
        """GET the first path that exists (new name, then the deprecated alias)."""
        for path in paths:
            status, body = await self._call("GET", path, timeout_s=30)
            if status == 200 and isinstance(body, dict):
                return body
        return {}

    async def _ensure_info(self) -> None:
        """Read /model_info and /server_info once: context length, input limit and model name."""
        if self._info is not None:
            return
        async with self._info_lock:
            if self._info is not None:
                return
            info = await self._get_info(("/model_info", "/get_model_info"))
            server = await self._get_info(("/server_info", "/get_server_info"))
            states = server.get("internal_states") or [{}]
            state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
            max_in = server.get("max_req_input_len") or state.get("max_req_input_len")
            self.max_input_len = int(max_in) if max_in else None
            # Server args hold the context length when it was set at launch; else the input limit bounds it.
            if self.context_length is None:
                ctx = (
                    server.get("context_length") or state.get("context_length") or info.get("context_length")
                )
                self.context_length = (
                    int(ctx) if ctx else (self.max_input_len + 1 if self.max_input_len else None)
                )
            if not self._name_given:
                self.model_name = info.get("served_model_name") or info.get("model_path") or self.model_name
            self._info = info

    async def model_info(self) -> dict[str, Any]:
        """`/model_info`, falling back to the deprecated `/get_model_info` of older servers."""
        await self._ensure_info()
        assert self._info is not None
        return self._info

    async def server_info(self) -> dict[str, Any]:
        return await self._get_info(("/server_info", "/get_server_info"))

    # -- generation ------------------------------------------------------------------------------

    def _clamp(self, ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """Clamp `max_new_tokens` to the room left so the turn ends by 'length' instead of a 400.

        SGLang refuses `max_new_tokens + len(input_ids) >= context_len` (newer releases: `> max_req_len`,
        which is `context_len - 1`), so the room is `context_len - 1 - len(input_ids)`: one token stricter
        than "≤ context_len − len", and accepted by every release.
        """
        if self.max_input_len is not None and len(ids) > self.max_input_len:
            raise BackendRequestError(
                f"{self.url}: prompt of {len(ids)} tokens exceeds the server's max input length "
                f"{self.max_input_len}; lower the trajectory's prompt/response budget",
                server=self.url,
            )
        if self.context_length is None:
            return params
        room = self.context_length - 1 - len(ids)
        if room <= 0:
            raise BackendRequestError(
                f"{self.url}: prompt of {len(ids)} tokens leaves no room in the context length "
                f"{self.context_length}: nothing can be generated; lower the trajectory's budget",
                server=self.url,
            )
        wanted = params.get("max_new_tokens", _DEFAULT_MAX_NEW_TOKENS)
        clamped = room if wanted is None else min(int(wanted), room)
        if clamped != wanted:
            params = {**params, "max_new_tokens": clamped}
        return params

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await self._ensure_info()
        ids = list(request.prompt_ids)
        params = self._clamp(ids, dict(request.sampling_params))
        # A fixed-width random suffix cannot be a prefix of another live rid: SGLang's abort matches rids
        # by prefix, so aborting one must never abort another.
        rid = request.rid or f"{request.session_id}_g{uuid.uuid4().hex}"
        payload = {
            "input_ids": ids,
            "sampling_params": params,
            "return_logprob": request.return_logprob,
            "rid": rid,
        }
        self._live[rid] = request.session_id
        try:
            status, body = await self._call("POST", "/generate", payload, rid=rid)
        finally:
            self._live.pop(rid, None)
        if status >= 400:
            raise BackendRequestError(
                f"{self.url} rejected rid {rid}: {error_message(body, str(body)[:500])}",
                server=self.url,
                status=status,
            )
        if isinstance(body, list):  # never sent as a batch, but be exact about what came back
            body = body[0]
        return parse_generate(body, server=self.url, return_logprob=request.return_logprob)

    # -- control ---------------------------------------------------------------------------------

    async def _control(self, method: str, path: str, payload: Any = None, timeout_s: float = 60) -> Any:
        status, body = await self._call(method, path, payload, timeout_s=timeout_s)
        if status >= 400:
            raise BackendRequestError(
                f"{self.url}{path} failed: {error_message(body, str(body)[:500])}",
                server=self.url,
                status=status,
            )
        return body

    async def _ok(self, path: str, timeout_s: float) -> bool:
        try:
            status, _ = await self._call("GET", path, timeout_s=timeout_s, retries=0)
        except BackendUnavailable:
            return False
        return status == 200

    async def health(self, timeout_s: float = 25.0) -> bool:
        """`/health` runs a 1-token generate server-side (≥ 1 s, up to 20 s): True when it answered 200."""
        return await self._ok("/health", timeout_s)

    async def ready(self, timeout_s: float = 5.0) -> bool:
        """`/ready`: cheap; False while starting, shutting down or paused."""
        return await self._ok("/ready", timeout_s)

    async def wait_ready(self, timeout: float = 600.0, interval_s: float = 0.5) -> None:
        """Poll `/health` until 200 (a 200 from /model_info is not readiness)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not await self.health(timeout_s=min(25.0, timeout)):
            if asyncio.get_running_loop().time() + interval_s > deadline:
                raise BackendUnavailable(f"{self.url} not healthy after {timeout:.0f} s", server=self.url)
            await asyncio.sleep(interval_s)

    async def flush_cache(self) -> bool:
        """False when the server refused because requests are running or waiting."""
        status, _ = await self._call("POST", "/flush_cache", timeout_s=60)
        return status == 200

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort one live rid (the server also aborts live rids it prefixes), or everything."""
        await self._control("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def abort(self, session_id: str) -> None:
        """Abort whatever this client has in flight for a trajectory."""
        for rid, sid in list(self._live.items()):
            if sid == session_id:
                await self.abort_request(rid)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._control("POST", "/release_memory_occupation", {"tags": tags} if tags else {})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._control("POST", "/resume_memory_occupation", {"tags": tags} if tags else {})

    sleep = release_memory_occupation
    wake_up = resume_memory_occupation

    async def update_weights_from_disk(
        self, path: str, weight_version: str | None = None, **options: Any
    ) -> dict[str, Any]:
        """Reload weights in place; `options` are passed through (load_format, abort_all_requests, flush_cache)."""
        payload: dict[str, Any] = {"model_path": path, **options}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        # A failed load is a 400 {"success": false, "message": ...}: _control raises it as BackendRequestError.
        return await self._control("POST", "/update_weights_from_disk", payload, timeout_s=self.timeout_s)

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return await self._control("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict[str, Any]:
        return await self._control("POST", "/continue_generation", {})


# -- launcher ------------------------------------------------------------------------------------


class LaunchError(RuntimeError):
    """A replica exited or never became healthy; the message carries the tail of its log."""


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class SGLangLauncher:
    """Start one `python -m sglang.launch_server` per data-parallel replica; stop them all on exit.

    Replica i listens on `base_port + i` and uses GPUs `[i*tp, (i+1)*tp)` (`--base-gpu-id`). Each process
    runs in its own process group so that SIGTERM/SIGKILL reach SGLang's scheduler children too.
    `module` exists so tests can launch `backends.devserver`, which accepts the same core flags.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dp: int = 1,
        tp: int = 1,
        host: str = "127.0.0.1",
        base_port: int = 30000,
        mem_fraction: float | None = 0.85,
        extra_args: Sequence[str] = (),
        log_dir: str | os.PathLike[str] = "sglang_logs",
        startup_timeout_s: float = 900.0,
        stop_grace_s: float = 15.0,
        module: str = "sglang.launch_server",
        env: dict[str, str] | None = None,
    ):
        self.model_path = model_path
        self.dp, self.tp, self.host, self.base_port = dp, tp, host, base_port
        self.mem_fraction = mem_fraction
        self.extra_args = list(extra_args)
        self.log_dir = Path(log_dir)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.module = module
        self.env = env
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        client_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.urls = [f"http://{client_host}:{base_port + i}" for i in range(dp)]

    def command(self, i: int) -> list[str]:
        cmd = [sys.executable, "-m", self.module, "--model-path", self.model_path, "--host", self.host]
        cmd += ["--port", str(self.base_port + i), "--tp-size", str(self.tp)]
        if self.dp > 1:
            cmd += ["--base-gpu-id", str(i * self.tp)]
        if self.mem_fraction is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction)]
        return cmd + self.extra_args

    async def __aenter__(self) -> SGLangLauncher:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(self.env or {})}
        try:
            for i in range(self.dp):
                path = self.log_dir / f"replica{i}_port{self.base_port + i}.log"
                with open(path, "wb") as fh:
                    self.procs.append(
                        subprocess.Popen(
                            self.command(i),
                            stdout=fh,
                            stderr=subprocess.STDOUT,
                            env=env,
                            start_new_session=True,
                        )
                    )
                self.logs.append(path)
            waits = [asyncio.ensure_future(self._wait_healthy(i)) for i in range(self.dp)]
            try:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    t.result()  # re-raise the first replica's LaunchError
            finally:
                for t in waits:
                    t.cancel()
                await asyncio.gather(*waits, return_exceptions=True)
        except BaseException:
            await self.stop()  # also on Ctrl-C / cancellation during startup
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _wait_healthy(self, i: int) -> None:
        proc, url = self.procs[i], self.urls[i]
        timeout = aiohttp.ClientTimeout(total=25)
        deadline = asyncio.get_running_loop().time() + self.startup_timeout_s
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                if proc.poll() is not None:
                    raise LaunchError(
                        f"replica {i} ({url}) exited with code {proc.returncode} during startup; "
                        f"log {self.logs[i]} ends with:\n{_tail(self.logs[i])}"
                    )
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with http.get(url + "/health") as resp:
                        if resp.status == 200:
                            return
                if asyncio.get_running_loop().time() > deadline:
                    raise LaunchError(
                        f"replica {i} ({url}) not healthy after {self.startup_timeout_s:.0f} s; "
                        f"log {self.logs[i]} ends with:\n{_tail(self.logs[i])}"
                    )
                await asyncio.sleep(0.2)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Signal replica i's whole process group (tests use this to simulate a crash)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[i].pid, sig)

    async def stop(self) -> None:
        """SIGTERM every replica, wait `stop_grace_s`, then SIGKILL what is left. Idempotent."""
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                self.kill(i, signal.SIGTERM)
        deadline = asyncio.get_running_loop().time() + self.stop_grace_s
        while any(p.poll() is None for p in self.procs) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                log.warning("replica %d did not stop within %.0f s: SIGKILL", i, self.stop_grace_s)
                self.kill(i, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                self.kill(i, signal.SIGKILL)  # stray children left in the group
            p.wait()
