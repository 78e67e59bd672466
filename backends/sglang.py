"""Token-in-token-out client for an SGLang 0.5.23 server (backends/launcher.py starts SGLang replicas).

The wire contract is SGLang's native HTTP API (`/generate` with `input_ids`, `/abort_request`, `/model_info`,
the memory and weight endpoints); backends/devserver.py serves the same contract for tests. What this module
adds on top of a bare POST:
- `max_new_tokens` is clamped to the room left in the context (SGLang answers 400 instead of truncating);
- 400s become `BackendRequestError` with the server's own message, whatever the body shape;
- a server fault is retried on the same server (`backends.retry` policy: jittered exponential backoff,
  Retry-After honoured), then raised as a retryable `BackendUnavailable` the router fails over on. Faults
  are: 408/429/5xx, a refused, dropped or mid-response reset connection, and a 200 whose body is not a
  /generate response (`BackendMalformed`: not JSON, an HTML page, another schema), never an empty turn;
- every /generate attempt has a deadline (`request_timeout_s`, default 300 s). Past it the rid is aborted at
  the server (`/abort_request`); a live server then answers with its partial output (finish_reason abort,
  which the engine resumes; awaited up to `abort_grace_s`, 5 s by default: a loaded server takes over a
  second), a hung one does not and the attempt fails with `BackendTimeout`, which is not retried here (a
  hung server stays hung) but fails over in the router;
- a rid whose attempt ended without an answer (a deadline, a cut connection, SGLang's "Duplicate request
  ID") may still be held by the server, which refuses it again: no later attempt reuses or prefixes it;
- a turn cut short because the context is full ("length" with fewer tokens than asked: clamped here, cut
  further by SGLang) says so: `extra["context_cut"]` holds the context length;
- aborts (`finish_reason.type == "abort"`) are returned as results, with the tokens produced before the abort:
  the engine resumes them. Every fault is counted by kind in `stats()["faults"]`;
- SGLang aborts every live rid that starts with the rid it is asked to abort, so the rids this client has
  live are kept prefix-free (`_wire_rid`): a resume `{turn}_r1` sent while `{turn}` still lives goes out
  under another rid;
- while this client has the server paused (`pause_generation` until `continue_generation`) no deadline runs
  and no deadline abort is sent: SGLang holds a request that arrives while paused in its front end, where an
  /abort_request never reaches it (it is lost, a second one too) and it runs after continue. A deadline that
  does expire never relies on its abort: without an answer in the grace time the connection is closed;
- the connector's keep-alive is below uvicorn's 5 s, so a pooled connection is never reused as it closes.
`sglang` itself is never imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import aiohttp

from backends.answer import (
    ANSWER_FAULTS,
    DEFAULT_MAX_NEW_TOKENS,
    body_limit,
    parse_generate,
    read_json,
    snippet,
)
from backends.base import (
    BackendError,
    BackendMalformed,
    BackendRequestError,
    BackendTimeout,
    BackendUnavailable,
    BaseBackend,
    GenerateRequest,
    GenerateResult,
)
from backends.pause_clock import PauseClock
from backends.retry import RetryPolicy, parse_retry_after, retry

__all__ = ["SGLangBackend", "parse_generate", "error_message", "FAULT_KINDS"]

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_REQUEST_TIMEOUT_S = 300.0  # per /generate attempt; SGLang's own watchdog_timeout is also 300 s
_WEIGHTS_TIMEOUT_S = 600.0  # a weight reload may take minutes
# After a deadline's /abort_request a live SGLang answers the request with its partial output once its
# scheduler gets to the abort: 0.7-1.4 s on a loaded CPU server (docs/engines.md). Waiting less turned most
# deadline aborts into lost work; a hung server costs this much more before the router fails over.
DEFAULT_ABORT_GRACE_S = 5.0
# How long a rid whose attempt ended without an answer is kept from reuse: past SGLang's own watchdog.
_HELD_S = 600.0
CONTROL_BODY_BYTES = 16 << 20  # info, health and control answers are small; /generate has its own bound
# SGLang 0.5.23 reports max_req_input_len = context length - 6 and refuses an input that long or longer.
_INPUT_MARGIN = 6
# SGLang's 400 for an update that loaded the weights but could not flush the cache (requests held or running)
_UPDATED_NOT_FLUSHED = "Weights were updated, but the cache was not flushed"
# Attempts that end this way may leave their rid at the server (a deadline, a cut connection, a duplicate).
_MAY_BE_HELD = ("timeouts", "disconnects", "resets", "duplicate")
# What a /generate can meet, counted in stats()["faults"]; each is one failed attempt or one abort.
FAULT_KINDS = ("http_errors", "refused", "disconnects", "resets", "timeouts", *ANSWER_FAULTS, "aborts_waiting",
               "aborts_running")  # fmt: skip


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


async def _read_bounded(resp: aiohttp.ClientResponse, max_bytes: int, what: str) -> bytes:
    """The whole body, or BackendMalformed once it passes `max_bytes` (the rest is never read)."""

    def oversize(size: str) -> BackendMalformed:
        return BackendMalformed(f"{what}: answered a body of {size} bytes, past the {max_bytes}-byte bound for "
                                "this request; a server fault", server=str(resp.url.origin()),
                                status=resp.status, kind="oversize")  # fmt: skip

    if resp.content_length is not None and resp.content_length > max_bytes:
        raise oversize(str(resp.content_length))
    data = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        data += chunk
        if len(data) > max_bytes:
            raise oversize(f"more than {len(data)}")
    return bytes(data)


class SGLangBackend(BaseBackend):
    """One SGLang server. Safe to share across all trajectories of an event loop."""

    provider = "sglang"

    def __init__(
        self,
        url: str,
        *,
        # Per /generate attempt; when set it overrides the spec's limits.request_timeout_s carried by each
        # request; neither set: DEFAULT_REQUEST_TIMEOUT_S.
        request_timeout_s: float | None = None,
        max_retries: int = 3,  # retries after the first attempt, for retryable failures only
        backoff_s: float = 0.05,  # first retry delay; doubles each retry, ±20 % jitter
        backoff_max_s: float = 5.0,
        retry: RetryPolicy | None = None,  # the whole policy; replaces max_retries/backoff_s/backoff_max_s
        # After a deadline's /abort_request, how long the partial answer is awaited; None: DEFAULT_ABORT_GRACE_S.
        abort_grace_s: float | None = None,
        keepalive_s: float = 4.0,  # must stay below uvicorn's 5 s keep-alive
        context_length: int | None = None,  # skip discovery when given
        model_name: str | None = None,
        api_key: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.retry_policy = retry or RetryPolicy(attempts=1 + max_retries, backoff_s=backoff_s,
                                                 backoff_max_s=backoff_max_s)  # fmt: skip
        self.abort_grace_s = abort_grace_s
        self.keepalive_s = keepalive_s
        self.context_length = context_length
        self.max_input_len: int | None = None  # server's max_req_input_len when it reports one
        self.model_name = model_name or "unknown"
        self._name_given = model_name is not None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._session: aiohttp.ClientSession | None = None
        self._info: dict[str, Any] | None = None
        self._info_task: asyncio.Future[dict[str, Any]] | None = None  # one read shared by every waiter
        self._live: dict[str, str] = {}  # rid -> session_id, for abort(session_id) and where()
        # rids whose attempt ended without an answer (deadline, cut connection, duplicate): the server may
        # still hold them until this monotonic time, so no new request reuses or prefixes one (`_wire_rid`)
        self._held: dict[str, float] = {}
        self._pause = PauseClock()  # the pause this client set: /generate deadlines run only outside it
        # /generate attempts, re-sends of one, and deadline aborts sent; then the faults met, by kind
        self.counts = {"requests": 0, "retries": 0, "aborts_sent": 0}
        self.faults = dict.fromkeys(FAULT_KINDS, 0)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s)
            # No aiohttp timeout (its default is 5 min): every call here has its own deadline.
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers,
                                                  timeout=aiohttp.ClientTimeout(total=None))  # fmt: skip

    async def close(self) -> None:
        if self._info_task is not None and not self._info_task.done():
            self._info_task.cancel()
            await asyncio.wait({self._info_task})
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- HTTP plumbing ---------------------------------------------------------------------------

    async def _send(self, method: str, path: str, payload: Any = None,
                    max_bytes: int = CONTROL_BODY_BYTES) -> tuple[int, Mapping[str, str], bytes]:  # fmt: skip
        """One HTTP exchange, unbounded in time (callers set the deadline) and bounded in size: a body past
        `max_bytes` is not read on (BackendMalformed "oversize"). A transport failure becomes a retryable
        BackendUnavailable whose kind says when it happened: refused, before or during the body."""
        await self.start()
        assert self._session is not None
        what = f"{self.url}: {method} {path}"
        try:
            async with self._session.request(method, self.url + path, json=payload) as resp:
                try:
                    data = await _read_bounded(resp, max_bytes, what)
                except (aiohttp.ClientError, ConnectionError) as e:  # the headers came, the body did not
                    raise BackendUnavailable(f"{what}: connection lost mid-response ({type(e).__name__} {e})",
                                             server=self.url, status=resp.status, kind="resets") from e  # fmt: skip
                return resp.status, resp.headers, data
        except aiohttp.ClientConnectorError as e:
            raise BackendUnavailable(f"{what}: cannot connect ({e})", server=self.url, kind="refused") from e
        except (aiohttp.ClientError, ConnectionError) as e:
            raise BackendUnavailable(f"{what}: connection dropped before a response ({type(e).__name__} {e})",
                                     server=self.url, kind="disconnects") from e  # fmt: skip

    async def _retrying(self, what: str, attempt_fn: Callable[[int], Awaitable[T]], policy: RetryPolicy,
                        retryable: Callable[[BaseException], bool] | None = None) -> T:  # fmt: skip
        """`retry()` with this client's message: the last failure, named by server and attempt count."""
        tries = 0

        async def counted(n: int) -> T:
            nonlocal tries
            tries = n
            return await attempt_fn(n)

        try:
            return await retry(policy, counted, retryable=retryable)
        except BackendUnavailable as e:
            message = f"{self.url} unavailable after {tries} attempt(s) of {what}: {str(e).removeprefix(self.url + ': ')}"
            raise type(e)(message, server=self.url, status=e.status, kind=e.kind) from e

    async def _call(self, method: str, path: str, payload: Any = None, *, timeout_s: float = 30.0,
                    retries: int | None = None) -> tuple[int, Any]:  # fmt: skip
        """A control call with retries: (status, parsed body) for 2xx and 4xx; raises BackendUnavailable."""
        policy = self.retry_policy if retries is None else replace(self.retry_policy, attempts=1 + retries)

        async def attempt(n: int) -> tuple[int, Any]:
            try:
                async with asyncio.timeout(timeout_s):
                    status, headers, data = await self._send(method, path, payload)
            except TimeoutError:
                raise BackendTimeout(f"{self.url}: {method} {path}: no answer within {timeout_s:g} s",
                                     server=self.url, kind="timeouts") from None  # fmt: skip
            body = read_json(data, what=f"{self.url}: {method} {path}", server=self.url, status=status,
                             max_bytes=CONTROL_BODY_BYTES)  # fmt: skip
            if policy.retryable_status(status) or status >= 500:
                raise BackendUnavailable(f"HTTP {status}: {error_message(body, str(body)[:200])}", server=self.url,
                                         status=status, kind="http_errors",
                                         retry_after=parse_retry_after(headers.get("Retry-After")))  # fmt: skip
            return status, body

        return await self._retrying(f"{method} {path}", attempt, policy)

    async def _get_info(self, paths: Sequence[str]) -> dict[str, Any]:
        """GET the first path that exists (new name, then the deprecated alias)."""
        for path in paths:
            status, body = await self._call("GET", path, timeout_s=30)
            if status == 200 and isinstance(body, dict):
                return body
        return {}

    async def _ensure_info(self, timeout_s: float = 30.0) -> None:
        """Read /model_info and /server_info once: context length, input limit and model name.

        One read is shared by every caller, and each caller waits for it at most `timeout_s` (its own request
        deadline): a server whose info hangs costs each row one deadline (BackendTimeout, failed over), never
        a queue behind a lock. A failed read is tried again by the next caller."""
        if self._info is not None:
            return
        task = self._info_task
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._info_task = asyncio.ensure_future(self._read_info())
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(task)
        except TimeoutError:
            raise BackendTimeout(f"{self.url}: /model_info and /server_info gave no answer within {timeout_s:g} s",
                                 server=self.url, kind="timeouts") from None  # fmt: skip

    async def _read_info(self) -> dict[str, Any]:
        info = await self._get_info(("/model_info", "/get_model_info"))
        server = await self._get_info(("/server_info", "/get_server_info"))
        states = server.get("internal_states") or [{}]
        state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
        self.max_input_len = self._count(server.get("max_req_input_len") or state.get("max_req_input_len"),
                                         "max_req_input_len")  # fmt: skip
        # Server args hold the context length when it was set at launch (else null); the input limit is
        # always there, `_INPUT_MARGIN` below it.
        if self.context_length is None:
            ctx = server.get("context_length") or state.get("context_length") or info.get("context_length")
            ctx = self._count(ctx, "context_length")
            self.context_length = ctx or (self.max_input_len + _INPUT_MARGIN if self.max_input_len else None)
        if not self._name_given:
            name = info.get("served_model_name") or info.get("model_path")
            self.model_name = name if isinstance(name, str) and name else self.model_name
        self._info = info
        return info

    def _count(self, value: Any, key: str) -> int | None:
        """A positive integer the server info reports, or None when it reports none; else a one-line fault."""
        if value is None or value == 0:
            return None
        if type(value) is int and value > 0:
            return value
        raise BackendMalformed(f"{self.url}: server info has {key} {snippet(value)}, not a positive integer",
                               server=self.url, status=200, kind="bad_fields")  # fmt: skip

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
        if self.max_input_len is not None and len(ids) >= self.max_input_len:
            raise BackendRequestError(
                f"{self.url}: prompt of {len(ids)} tokens reaches the server's max input length "
                f"{self.max_input_len} (it takes fewer); lower the trajectory's prompt/response budget",
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
        wanted = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        clamped = room if wanted is None else min(int(wanted), room)
        if clamped != wanted:
            params = {**params, "max_new_tokens": clamped}
        return params

    def deadline(self, request: GenerateRequest) -> float:
        """Seconds one /generate attempt may take: ours if set (the CLI's), else the request's (the spec's)."""
        if self.request_timeout_s is not None:
            return self.request_timeout_s
        return request.timeout_s if request.timeout_s is not None else DEFAULT_REQUEST_TIMEOUT_S

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        ids = list(request.prompt_ids)
        # A fixed-width random suffix cannot be a prefix of another live rid: SGLang's abort matches rids
        # by prefix, so aborting one must never abort another.
        base = request.rid or f"{request.session_id}_g{uuid.uuid4().hex}"
        timeout_s = self.deadline(request)
        rid = ""

        async def attempt(n: int) -> GenerateResult:
            nonlocal rid
            if n > 1:
                self.counts["retries"] += 1
            rid = self._wire_rid(base, request.session_id)  # each attempt: the last one's may still be held
            self._live[rid] = request.session_id
            try:
                await self._ensure_info(timeout_s)
                params = self._clamp(ids, dict(request.sampling_params))
                payload = {"input_ids": ids, "sampling_params": params, "return_logprob": request.return_logprob,
                           "rid": rid}  # fmt: skip
                asked = replace(request, sampling_params=params, rid=rid)  # what the answer is held to
                result = await self._generate_once(payload, rid, timeout_s, asked)
                return self._context_cut(result, request)
            except BackendError as e:
                if e.kind in self.faults:
                    self.faults[e.kind] += 1
                if e.kind in _MAY_BE_HELD:
                    self._held[rid] = asyncio.get_running_loop().time() + _HELD_S
                raise
            finally:
                self._live.pop(rid, None)

        def retryable(e: BaseException) -> bool:  # a hung server stays hung: the router fails over instead
            return self.retry_policy.retryable(e) and not isinstance(e, BackendTimeout)

        return await self._retrying(f"POST /generate (rid {base})", attempt, self.retry_policy, retryable)

    def _context_cut(self, result: GenerateResult, request: GenerateRequest) -> GenerateResult:
        """Mark a turn that ended by "length" with fewer tokens than the engine asked for: the context was full
        (this client clamps `max_new_tokens` to the room left, and SGLang silently cuts it a little further), so
        "length" alone would read as the engine's own budget."""
        wanted = request.sampling_params.get("max_new_tokens")
        wanted = DEFAULT_MAX_NEW_TOKENS if wanted is None else wanted
        if result.finish_reason == "length" and len(result.token_ids) < wanted:
            result.extra["context_cut"] = self.context_length
        return result

    def _wire_rid(self, rid: str, session_id: str) -> str:
        """`rid`, unless it and a rid live here or held by the server would prefix one another (SGLang aborts
        by prefix and refuses a rid it still holds: a resume `{turn}_r1` while `{turn}` lives, a retry after a
        deadline): then `{session}_x<random>`, which extends no such rid and which none extends."""
        now = asyncio.get_running_loop().time()
        for held in [r for r, until in self._held.items() if until <= now]:
            del self._held[held]

        def clash(r: str) -> bool:
            return any(other.startswith(r) or r.startswith(other) for other in (*self._live, *self._held))

        for _ in range(3):
            if not clash(rid):
                return rid
            rid = f"{session_id}_x{uuid.uuid4().hex[:12]}"
        return uuid.uuid4().hex  # a session id that is itself a prefix of a live rid: no lineage at all

    async def _generate_once(self, payload: dict[str, Any], rid: str, timeout_s: float,
                             asked: GenerateRequest) -> GenerateResult:  # fmt: skip
        """One /generate attempt under its deadline; every answer that is not a response raises."""
        self.counts["requests"] += 1
        # owned: ends in `finally`
        exchange = asyncio.ensure_future(self._send("POST", "/generate", payload, body_limit(asked)))
        try:
            if not await self._pause.wait(exchange, timeout_s):
                # Past the deadline: abort the rid at the server. A live server answers this very request
                # with what it generated so far (finish_reason abort), which the engine resumes. The abort may
                # be lost (a request SGLang holds in its front end): then closing the connection ends it.
                await self._abort_quietly(rid)
                grace = self.abort_grace_s if self.abort_grace_s is not None else DEFAULT_ABORT_GRACE_S
                if not await self._pause.wait(exchange, grace):
                    raise BackendTimeout(f"{self.url}: /generate rid {rid} had no answer within {timeout_s:g} s "
                                         "(request_timeout_s); aborted at the server", server=self.url,
                                         kind="timeouts")  # fmt: skip
            status, headers, data = exchange.result()
        finally:
            if not exchange.done():
                exchange.cancel()  # closes the connection: SGLang aborts a request whose client went away
                await asyncio.wait({exchange})
        body = read_json(data, what=f"{self.url}: /generate (rid {rid})", server=self.url, status=status,
                         max_bytes=body_limit(asked))  # fmt: skip
        if status == 200:
            if not isinstance(body, (dict, list)):
                kind = headers.get("Content-Type", "no content type").split(";")[0]
                raise BackendMalformed(f"{self.url}: /generate (rid {rid}) answered 200 with a {kind} body that "
                                       f"is not JSON: {snippet(body or '')}; a server fault", server=self.url,
                                       status=200, kind="malformed")  # fmt: skip
            result = parse_generate(body, server=self.url, return_logprob=asked.return_logprob, rid=rid,
                                    request=asked)  # fmt: skip
            if result.finish_reason == "abort":
                self.faults[f"aborts_{result.extra['abort_kind']}"] += 1
            return result
        message = error_message(body, str(body)[:200])
        if self.retry_policy.retryable_status(status) or status >= 500:
            raise BackendUnavailable(f"HTTP {status} for rid {rid}: {message}", server=self.url, status=status,
                                     kind="http_errors", retry_after=parse_retry_after(headers.get("Retry-After")))  # fmt: skip
        if "Duplicate request ID" in message:  # an earlier attempt of ours is still live there: retry later
            raise BackendUnavailable(f"HTTP {status} for rid {rid}: {message}", server=self.url, status=status,
                                     kind="duplicate")  # fmt: skip
        raise BackendRequestError(f"{self.url} rejected rid {rid}: {message}", server=self.url, status=status)

    async def _abort_quietly(self, rid: str) -> None:
        """Best effort `/abort_request` for a rid past its deadline (the server may be the thing that hangs)."""
        self.counts["aborts_sent"] += 1
        with contextlib.suppress(BackendError):
            await self._call("POST", "/abort_request", {"rid": rid}, timeout_s=5, retries=0)

    def where(self, session_id: str) -> str | None:
        rids = [rid for rid, sid in self._live.items() if sid == session_id]
        return f"{self.url} (rid {', '.join(rids)})" if rids else self.url

    def stats(self) -> dict[str, Any]:
        return {"server": self.url, **self.counts, "faults": dict(self.faults)}

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
        if self._pause.mode == "in_place":
            # Held requests keep their cache, so SGLang cannot flush it: it would load the weights and answer
            # 400 "Weights were updated, but the cache was not flushed". Say so up front instead.
            payload.setdefault("flush_cache", False)
        status, body = await self._call("POST", "/update_weights_from_disk", payload, timeout_s=_WEIGHTS_TIMEOUT_S)
        message = error_message(body, str(body)[:500])
        if status == 400 and message.startswith(_UPDATED_NOT_FLUSHED):
            log.warning("%s: %s", self.url, message)  # the new weights serve; only the prefix cache is stale
            return {**body, "success": True, "cache_flushed": False}
        if status >= 400:  # a failed load: 400 {"success": false, "message": ...}
            raise BackendRequestError(f"{self.url}/update_weights_from_disk failed: {message}", server=self.url,
                                      status=status)  # fmt: skip
        return body

    async def update_weights_from_tensor(self, weight_version: str | None = None, **payload: Any) -> dict[str, Any]:
        """`/update_weights_from_tensor`: payload passed through (serialized_named_tensors, load_format,
        flush_cache...)."""
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self._control("POST", "/update_weights_from_tensor", payload, timeout_s=_WEIGHTS_TIMEOUT_S)

    async def update_weights_from_distributed(self, weight_version: str | None = None,
                                              **payload: Any) -> dict[str, Any]:  # fmt: skip
        """`/update_weights_from_distributed`: payload passed through (names, dtypes, shapes, group_name...)."""
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return await self._control("POST", "/update_weights_from_distributed", payload,
                                   timeout_s=_WEIGHTS_TIMEOUT_S)  # fmt: skip

    async def init_weights_update_group(self, **payload: Any) -> dict[str, Any]:
        """`/init_weights_update_group` (master_address, master_port, rank_offset, world_size, group_name...)."""
        return await self._control("POST", "/init_weights_update_group", payload, timeout_s=_WEIGHTS_TIMEOUT_S)

    async def destroy_weights_update_group(self, **payload: Any) -> dict[str, Any]:
        return await self._control("POST", "/destroy_weights_update_group", payload)

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """`/pause_generation` in SGLang's mode: "abort", "retract" or "in_place". From now until
        `continue_generation` the deadlines of this client's requests stand still (module docstring)."""
        self._pause.set(mode)
        try:
            return await self._control("POST", "/pause_generation", {"mode": mode})
        except BaseException:
            self._pause.set(None)
            raise

    async def continue_generation(self) -> dict[str, Any]:
        body = await self._control("POST", "/continue_generation", {})
        self._pause.set(None)
        return body
