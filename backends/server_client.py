"""The engine-neutral half of a model-server client: HTTP exchanges bounded in size, retried under a policy,
faults counted by kind, deadlines and server messages. backends/sglang.py and backends/vllm.py build on it;
what is SGLang's or vLLM's own (request and answer shapes, rids, aborts' routes, pause modes, weights, the
context edge) stays in each engine's module.

- `_send` is one exchange (backends/wire.py: HTTP/1.1 on asyncio's transport, the request body written by
  orjson), unbounded in time (callers set the deadline) and bounded in size; a transport failure becomes a
  retryable `BackendUnavailable` whose kind says when it happened (refused, before or during the body).
  Every body is read by `backends.answer.read_json` (bounded in size and depth);
- `_call` is a control call with retries (`backends.base.RetryPolicy`: jittered exponential backoff, Retry-After
  honoured): 408/429/5xx, redirects (never followed) and transport faults are retried, 2xx and 4xx come back
  as (status, body);
- `generate` runs a turn under the retry policy: each attempt has its own wire rid (the engine picks
  it), is live for `abort(session_id)` and `where()`, and counts its fault by kind; a `BackendTimeout` is
  not retried here (a hung server stays hung) but fails over in the router;
- `_exchange` is one generate attempt under its deadline (`request_timeout_s`, else the request's, else
  300 s). Past it the rid is aborted at the server (`_abort_route`); a live server then answers with its
  partial output (finish_reason abort), which the engine resumes, awaited `_grace()` longer (the abort's own
  call included); a hung one does not, and the attempt fails with `BackendTimeout`. While this client has the server paused
  (backends/pause_clock.py) no deadline runs and no deadline abort is sent. A deadline that does expire
  never relies on its abort: without an answer in the grace time the connection is closed;
- the server info (context length, model name) is read once (`_ensure_info`), shared by every waiter;
- the connections' keep-alive is below uvicorn's 5 s (both engines serve through uvicorn), so a pooled
  connection is never reused as the server closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import aiohttp
import orjson

from backends.answer import DEFAULT_MAX_NEW_TOKENS, read_json, snippet
from backends.base import (
    BackendError,
    BackendMalformed,
    BackendRequestError,
    BackendTimeout,
    BackendUnavailable,
    BaseBackend,
    GenerateRequest,
    GenerateResult,
    PromptIds,
    RetryPolicy,
    parse_retry_after,
    retry,
)
from backends.pause_clock import PauseClock
from backends.wire import Wire, WireError

T = TypeVar("T")

DEFAULT_REQUEST_TIMEOUT_S = 300.0  # per generate attempt, when neither the client nor the request sets one
# info, health and control answers are small; generate answers have their own bound
CONTROL_BODY_BYTES = 16 << 20


def error_message(body: Any, fallback: str) -> str:
    """The server's message from any error shape SGLang or vLLM sends (`{"error": str}`,
    `{"error": {"message"}}`, `{"message"}`, FastAPI's `{"detail": str | [{"msg", "loc"}]}`), else `fallback`."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, str):
            return err  # SGLang's contract violation, vLLM's /pause 400: {"error": "..."}
        if isinstance(err, dict) and err.get("message"):  # SGLang's ValueError, vLLM's ErrorResponse
            return str(err["message"])
        if body.get("message"):
            return str(body["message"])  # FastAPI / scheduler abort: {"object": "error", "message": ...}
        detail = body.get("detail")
        if isinstance(detail, str) and detail:
            return detail  # FastAPI's HTTPException
        if (
            isinstance(detail, list) and detail and all(isinstance(d, dict) for d in detail)
        ):  # a validation error
            return "; ".join(f"{'.'.join(map(str, d.get('loc') or ()))}: {d.get('msg')}" for d in detail[:5])
    return fallback


def _redirect(status: int) -> bool:
    """A 3xx: never followed (a model server answers where it was asked; its Location may name any host, and the
    request would carry this client's API key there), so a server fault, retried and failed over as a 5xx."""
    return 300 <= status < 400


def _server_fault(policy: RetryPolicy, status: int) -> bool:
    """The server's fault, not the request's: the policy's statuses (408, 429...), a 5xx, a redirect."""
    return policy.retryable_status(status) or status >= 500 or _redirect(status)


def _fault_message(status: int, headers: Mapping[str, str], body: Any) -> str:
    """A server fault's message, on one line: where a redirect pointed, or the server's own message."""
    if _redirect(status):
        where = snippet(headers.get("Location") or "nowhere")
        return f"redirected to {where}, which is not followed; a server fault"
    return " ".join(error_message(body, str(body)[:200]).split())


def encode_json(payload: Any) -> bytes:
    """`payload` as JSON bytes, as json.dumps writes its values: orjson (20x faster on a prompt's ids) unless its
    output holds a null, which is also how orjson writes NaN and infinities (json.dumps writes NaN, which the
    server then refuses) or a value it cannot write; then json.dumps. A request's `PromptIds` are not encoded
    again: their kept JSON is spliced in (`_spliced`), the same bytes at the cost of the new ids alone."""
    if isinstance(payload, dict) and payload:
        key, value = next(iter(payload.items()))  # the ids come first in both engines' bodies
        if type(value) is PromptIds:
            return _spliced(payload, key, value)
    try:
        data = orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # orjson.JSONEncodeError: an integer past 64 bits, a type it does not know
        data = b"null"
    return json.dumps(payload).encode() if b"null" in data else data


def wire_ids(ids: Any) -> list[int]:
    """A request's prompt ids as a body holds them: a list as it is (a `PromptIds` keeps its JSON; no copy of
    238k ids per call), anything else (a tuple, an array) as a list."""
    return ids if isinstance(ids, list) else list(ids)


def _spliced(payload: dict[Any, Any], key: Any, ids: PromptIds) -> bytes:
    """`encode_json(payload)` where `ids` is the first value, under `key`: the rest encoded with an empty list in
    its place, then the ids' kept JSON written into it (one copy of the body, no list built or encoded whole)."""
    rest = encode_json({**payload, key: []})
    # orjson's form; json.dumps's (": [") means the slow path was taken
    head = b"{" + orjson.dumps(key) + b":["
    if not rest.startswith(head):
        return encode_json({**payload, key: list(ids)})
    return b"".join((head, ids.json(), rest[len(head) :]))


async def read_bounded(resp: aiohttp.ClientResponse, max_bytes: int, what: str) -> bytes:
    """The whole body, or BackendMalformed once it passes `max_bytes` (the rest is never read)."""

    def oversize(size: str) -> BackendMalformed:
        return BackendMalformed(
            f"{what}: answered a body of {size} bytes, past the {max_bytes}-byte bound for "
            "this request; a server fault",
            server=str(resp.url.origin()),
            status=resp.status,
            kind="oversize",
        )

    if resp.content_length is not None and resp.content_length > max_bytes:
        raise oversize(str(resp.content_length))
    data = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        data += chunk
        if len(data) > max_bytes:
            raise oversize(f"more than {len(data)}")
    return bytes(data)


class ServerClient(BaseBackend):
    """One model server over HTTP: the session, exchanges, retries, deadlines and counters an engine's client
    shares. An engine sets `generate_path`, `info_what`, `context_margin` and `fault_kinds`, and gives
    `_read_info`, `_wire_rid`, `_generate_once`, `_abort_route`, `_grace` and `abort_request`."""

    generate_path = ""  # the engine's generate route
    info_what = ""  # the routes `_read_info` reads, for the message when they hang
    context_margin = 0  # tokens the engine keeps free beyond prompt + max_new_tokens

    fault_kinds: tuple[str, ...] = ()  # what a generate can meet, counted in stats()["faults"]

    def __init__(
        self,
        url: str,
        *,
        # Per generate attempt; when set it overrides the spec's limits.request_timeout_s carried by each
        # request; neither set: DEFAULT_REQUEST_TIMEOUT_S.
        request_timeout_s: float | None = None,
        max_retries: int = 3,  # retries after the first attempt, for retryable failures only
        backoff_s: float = 0.05,  # first retry delay; doubles each retry, ±20 % jitter
        backoff_max_s: float = 5.0,
        retry: RetryPolicy | None = None,  # the whole policy; replaces max_retries/backoff_s/backoff_max_s
        # After a deadline's abort, how long the partial answer is awaited; None: the engine's `_grace`.
        abort_grace_s: float | None = None,
        keepalive_s: float = 4.0,  # must stay below uvicorn's 5 s keep-alive
        context_length: int | None = None,  # skip discovery when given
        model_name: str | None = None,
        api_key: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.retry_policy = retry or RetryPolicy(
            attempts=1 + max_retries, backoff_s=backoff_s, backoff_max_s=backoff_max_s
        )
        self.keepalive_s = keepalive_s
        self.abort_grace_s = abort_grace_s  # after a deadline's abort, how long the partial answer is awaited
        self.context_length = context_length  # discovered from the server when not given
        self.model_name = model_name or "unknown"
        self._name_given = model_name is not None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._wire: Wire | None = None
        self._info: dict[str, Any] | None = None
        self._info_task: asyncio.Future[dict[str, Any]] | None = None  # one read shared by every waiter
        self._live: dict[str, str] = {}  # wire request id -> session_id, for abort(session_id) and where()
        self._pause = PauseClock()  # the pause this client set: generate deadlines run only outside it
        # generate attempts, re-sends of one, and deadline aborts sent; then the faults met, by kind
        self.counts = {"requests": 0, "retries": 0, "aborts_sent": 0}
        self.faults = dict.fromkeys(self.fault_kinds, 0)

    # -- lifecycle ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._connections()

    async def close(self) -> None:
        if self._info_task is not None and not self._info_task.done():
            self._info_task.cancel()
            await asyncio.wait({self._info_task})
        if self._wire is not None:
            self._wire.close()
            self._wire = None

    # -- HTTP plumbing ------------------------------------------------------------------------------------

    async def _send(
        self,
        method: str,
        path: str,
        payload: Any = None,
        max_bytes: int = CONTROL_BODY_BYTES,
        params: Any = None,
    ) -> tuple[int, Mapping[str, str], bytes]:
        """One HTTP exchange (see the module docstring)."""
        body = None if payload is None else encode_json(payload)
        try:
            return await self._connections().request(method, path, body, max_bytes=max_bytes, params=params)
        except WireError as e:
            raise self._wire_fault(e, method, path) from None

    def _connections(self) -> Wire:
        if self._wire is None:
            self._wire = Wire(self.url, keepalive_s=self.keepalive_s, headers=self._headers)
        return self._wire

    def _wire_fault(self, e: WireError, method: str, path: str) -> BackendError:
        """A failed exchange as the retryable fault it is (a body past its bound: the server's malformed answer)."""
        kind = BackendMalformed if e.kind == "oversize" else BackendUnavailable
        return kind(f"{self.url}: {method} {path}: {e}", server=self.url, status=e.status, kind=e.kind)

    async def _retrying(
        self,
        what: str,
        attempt_fn: Callable[[int], Awaitable[T]],
        policy: RetryPolicy,
        retryable: Callable[[BaseException], bool] | None = None,
        failed: tuple[Exception, float] | None = None,
    ) -> T:
        """`retry()` with this client's message: the last failure, named by server and attempt count."""
        retried = [0]  # the attempts retry() retried: counted by its hook, not by a coroutine around each
        try:
            return await retry(
                policy,
                attempt_fn,
                retryable=retryable,
                on_retry=lambda n, *_: retried.append(n),
                failed=failed,
            )
        except BackendUnavailable as e:
            tries = retried[-1] + 1
            message = f"{self.url} unavailable after {tries} attempt(s) of {what}: {str(e).removeprefix(self.url + ': ')}"
            raise type(e)(message, server=self.url, status=e.status, kind=e.kind) from e

    async def _call(
        self,
        method: str,
        path: str,
        payload: Any = None,
        *,
        timeout_s: float = 30.0,
        retries: int | None = None,
        params: Any = None,
    ) -> tuple[int, Any]:
        """A control call with retries: (status, parsed body) for 2xx and 4xx; raises BackendUnavailable."""
        policy = self.retry_policy if retries is None else replace(self.retry_policy, attempts=1 + retries)

        async def attempt(n: int) -> tuple[int, Any]:
            try:
                async with asyncio.timeout(timeout_s):
                    status, headers, data = await self._send(method, path, payload, params=params)
            except TimeoutError:
                raise BackendTimeout(
                    f"{self.url}: {method} {path}: no answer within {timeout_s:g} s",
                    server=self.url,
                    kind="timeouts",
                ) from None
            body = read_json(
                data,
                what=f"{self.url}: {method} {path}",
                server=self.url,
                status=status,
                max_bytes=CONTROL_BODY_BYTES,
            )
            if _server_fault(policy, status):
                raise BackendUnavailable(
                    f"HTTP {status}: {_fault_message(status, headers, body)}",
                    server=self.url,
                    status=status,
                    kind="http_errors",
                    retry_after=parse_retry_after(headers.get("Retry-After")),
                )
            return status, body

        return await self._retrying(f"{method} {path}", attempt, policy)

    async def _control(
        self, method: str, path: str, payload: Any = None, timeout_s: float = 60, params: Any = None
    ) -> Any:
        """A control call whose 4xx is the caller's error: BackendRequestError with the server's message."""
        status, body = await self._call(method, path, payload, timeout_s=timeout_s, params=params)
        if status >= 400:
            message = " ".join(error_message(body, str(body)[:500]).split())
            raise BackendRequestError(
                f"{self.url}{path} failed: HTTP {status}: {message}", server=self.url, status=status
            )
        return body

    async def _ok(self, path: str, timeout_s: float) -> bool:
        try:
            status, _ = await self._call("GET", path, timeout_s=timeout_s, retries=0)
        except BackendUnavailable:
            return False
        return status == 200

    # -- what the server says about itself ----------------------------------------------------------------

    async def _read_info(self) -> dict[str, Any]:
        """The engine's info read: sets `_info` (SGLang's /model_info keys), `context_length`, `model_name`."""
        raise NotImplementedError

    async def _ensure_info(self, timeout_s: float = 30.0) -> None:
        """Read the server's info once. One read is shared by every caller, and each caller waits for it at
        most `timeout_s` (its own request deadline): a server whose info hangs costs each row one deadline
        (BackendTimeout, failed over), never a queue behind a lock. A failed read is tried again by the next
        caller."""
        if self._info is not None:
            return
        task = self._info_task
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._info_task = asyncio.ensure_future(self._read_info())
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(task)
        except TimeoutError:
            raise BackendTimeout(
                f"{self.url}: {self.info_what} gave no answer within {timeout_s:g} s",
                server=self.url,
                kind="timeouts",
            ) from None

    # -- generation ---------------------------------------------------------------------------------------

    def deadline(self, request: GenerateRequest) -> float:
        """Seconds one generate attempt may take: ours if set (the CLI's), else the request's (the spec's)."""
        if self.request_timeout_s is not None:
            return self.request_timeout_s
        return request.timeout_s if request.timeout_s is not None else DEFAULT_REQUEST_TIMEOUT_S

    def _clamp(self, ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """Clamp `max_new_tokens` to the room left in the context, so the turn ends by 'length' instead of a
        400 (both engines refuse a request past the context rather than truncate it)."""
        if self.context_length is None:
            return params
        room = self.context_length - self.context_margin - len(ids)
        if room <= 0:
            raise BackendRequestError(
                f"{self.url}: prompt of {len(ids)} tokens leaves no room in the context length "
                f"{self.context_length}: nothing can be generated; lower the trajectory's "
                "budget",
                server=self.url,
            )
        wanted = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        clamped = room if wanted is None else min(int(wanted), room)
        return params if clamped == wanted else {**params, "max_new_tokens": clamped}

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """One turn under the retry policy (module docstring), entered only after the first attempt failed."""
        # A fixed-width random suffix cannot be a prefix of another live rid: SGLang's abort matches rids
        # by prefix, so aborting one must never abort another.
        rid = request.rid or f"{request.session_id}_g{uuid.uuid4().hex}"
        timeout_s = self.deadline(request)
        start = time.monotonic()
        try:
            return await self._attempt(request, rid, 1, timeout_s)
        except Exception as exc:
            failed = exc

        def retryable(e: BaseException) -> bool:  # a hung server stays hung: the router fails over instead
            return self.retry_policy.retryable(e) and not isinstance(e, BackendTimeout)

        try:
            return await self._retrying(
                f"POST {self.generate_path} (rid {rid})",
                lambda n: self._attempt(request, rid, n, timeout_s),
                self.retry_policy,
                retryable,
                failed=(failed, start),
            )
        finally:
            del failed  # caught here, it holds this frame: kept, both wait for the collector

    async def _attempt(self, request: GenerateRequest, rid: str, n: int, timeout_s: float) -> GenerateResult:
        """Attempt `n` of the turn `rid`: it reads the server's info once, clamps the budget to the context and
        has the engine send it under its own wire rid, live for `abort` and `where` meanwhile."""
        if n > 1:
            self.counts["retries"] += 1
        wire = self._wire_rid(rid, n, request.session_id)
        self._live[wire] = request.session_id
        try:
            if self._info is None:  # read once: no coroutine a call after that
                await self._ensure_info(timeout_s)
            params = self._clamp(request.prompt_ids, request.sampling_params)  # a new dict when it cuts
            asked = request  # what the answer is held to: the request itself, unless cut or renamed
            if params is not request.sampling_params or wire != request.rid:
                asked = replace(request, sampling_params=params, rid=wire)
            return await self._generate_once(request, asked, timeout_s)
        except BackendError as e:
            if e.kind in self.faults:
                self.faults[e.kind] += 1
            self._attempt_failed(wire, e)
            raise
        finally:
            self._live.pop(wire, None)

    def _context_cut(self, result: GenerateResult, request: GenerateRequest) -> GenerateResult:
        """Mark a turn that ended by "length" with fewer tokens than the engine asked for: the context was full
        (`_clamp` cut the budget to the room left, and SGLang cuts a little further on its own), so "length"
        alone would read as the engine's own budget. Both engines' answers pass here, so a turn the context
        cuts ends `context_length` over either (docs/engines.md)."""
        wanted = request.sampling_params.get("max_new_tokens")
        wanted = DEFAULT_MAX_NEW_TOKENS if wanted is None else wanted
        if result.finish_reason == "length" and len(result.token_ids) < wanted:
            result.extra["context_cut"] = self.context_length
        return result

    def _wire_rid(self, rid: str, attempt: int, session_id: str) -> str:
        """The rid attempt `attempt` of the turn `rid` is sent under."""
        raise NotImplementedError

    async def _generate_once(
        self, request: GenerateRequest, asked: GenerateRequest, timeout_s: float
    ) -> GenerateResult:
        """One attempt of `request` as `asked` (its clamped budget, its wire rid): the engine's payload, sent
        by `_exchange`, and its answer checked by `backends.answer.parse_generate`."""
        raise NotImplementedError

    def _attempt_failed(self, rid: str, error: BackendError) -> None:
        """An attempt under `rid` ended in `error` (an engine may keep the rid from reuse)."""

    def _grace(self, timeout_s: float) -> float:
        """After a deadline's abort, how long the partial answer is awaited."""
        raise NotImplementedError

    def _abort_route(self, rid: str) -> tuple[str, Any]:
        """The (path, payload) that aborts the live request `rid` at the server."""
        raise NotImplementedError

    async def _exchange(
        self, payload: Any, rid: str, timeout_s: float, max_bytes: int, shapes: tuple[type, ...] = (dict,)
    ) -> Any:
        """One generate attempt under its deadline (module docstring) -> the 200 answer's JSON body, of one of
        `shapes`. Anything else raises: a body that is not JSON (malformed), a refusal (`_refusal`)."""
        self.counts["requests"] += 1
        path, wire, body = self.generate_path, self._connections(), encode_json(payload)
        exchange = wire.pooled("POST", path, body, max_bytes=max_bytes)
        if exchange is None:  # a connect too, under the deadline: a task, owned (ends in `finally`)
            exchange = asyncio.ensure_future(wire.request("POST", path, body, max_bytes=max_bytes))
        try:
            if not await self._pause.wait(exchange, timeout_s):
                grace = self._grace(timeout_s)  # the abort's call and the partial answer's wait share it
                loop = asyncio.get_running_loop()
                grace_ends = loop.time() + grace
                await self._abort_quietly(rid, grace)
                if not await self._pause.wait(exchange, grace_ends - loop.time()):
                    raise BackendTimeout(
                        f"{self.url}: {self.generate_path} rid {rid} had no answer within "
                        f"{timeout_s:g} s (request_timeout_s); aborted at the server",
                        server=self.url,
                        kind="timeouts",
                    )
            status, headers, data = exchange.result()
        except WireError as e:
            raise self._wire_fault(e, "POST", path) from None
        finally:
            if not exchange.done():
                exchange.cancel()  # closes the connection: both engines abort a request whose client went away
                await asyncio.wait({exchange})
        body = read_json(
            data,
            what=f"{self.url}: {self.generate_path} (rid {rid})",
            server=self.url,
            status=status,
            max_bytes=max_bytes,
        )
        if status != 200:
            raise self._refusal(status, headers, body, rid)
        if not isinstance(body, shapes):
            kind = headers.get("Content-Type", "no content type").split(";")[0]
            raise BackendMalformed(
                f"{self.url}: {self.generate_path} (rid {rid}) answered 200 with a {kind} body "
                f"that is not a JSON response: {snippet(body or '')}; a server fault",
                server=self.url,
                status=200,
                kind="malformed",
            )
        return body

    def _refusal(self, status: int, headers: Mapping[str, str], body: Any, rid: str) -> BackendError:
        """A generate answered other than 200: a server fault (408/429/5xx, a redirect: retried, then failed over)
        or the request's error."""
        if _server_fault(self.retry_policy, status):
            return BackendUnavailable(
                f"HTTP {status} for rid {rid}: {_fault_message(status, headers, body)}",
                server=self.url,
                status=status,
                kind="http_errors",
                retry_after=parse_retry_after(headers.get("Retry-After")),
            )
        message = " ".join(error_message(body, str(body)[:200]).split())  # validation errors may span lines
        return BackendRequestError(
            f"{self.url} rejected rid {rid}: {message}", server=self.url, status=status
        )

    async def _abort_quietly(self, rid: str, within_s: float = 5.0) -> None:
        """Best effort abort of a rid past its deadline (the server may be the thing that hangs), waited for at
        most 5 s or `within_s`."""
        self.counts["aborts_sent"] += 1
        path, payload = self._abort_route(rid)
        with contextlib.suppress(BackendError):
            await self._call("POST", path, payload, timeout_s=max(0.01, min(5.0, within_s)), retries=0)

    # -- control ------------------------------------------------------------------------------------------

    async def health(self, timeout_s: float = 25.0) -> bool:
        return await self._ok("/health", timeout_s)

    async def wait_ready(self, timeout: float = 600.0, interval_s: float = 0.5) -> None:
        """Poll `health()` until it answers (a 200 from the info routes is not readiness)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not await self.health(timeout_s=min(25.0, timeout)):
            if asyncio.get_running_loop().time() + interval_s > deadline:
                raise BackendUnavailable(f"{self.url} not healthy after {timeout:.0f} s", server=self.url)
            await asyncio.sleep(interval_s)

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        raise NotImplementedError

    async def abort(self, session_id: str) -> None:
        """Abort whatever this client has in flight for a trajectory."""
        for rid, sid in list(self._live.items()):
            if sid == session_id:
                await self.abort_request(rid)

    def where(self, session_id: str) -> str | None:
        rids = [rid for rid, sid in self._live.items() if sid == session_id]
        return f"{self.url} (rid {', '.join(rids)})" if rids else self.url

    def stats(self) -> dict[str, Any]:
        return {"server": self.url, **self.counts, "faults": dict(self.faults)}
