"""The engine-neutral half of a model-server client: HTTP exchanges bounded in size, retried under a policy,
faults counted by kind, deadlines and server messages. backends/vllm.py builds on it; what is SGLang's or
vLLM's own (request and answer shapes, aborts, pauses, weights) stays in each engine's module.

- `_send` is one exchange, unbounded in time (callers set the deadline) and bounded in size; a transport
  failure becomes a retryable `BackendUnavailable` whose kind says when it happened (refused, before or
  during the body);
- `_call` is a control call with retries (`backends.retry` policy: jittered exponential backoff, Retry-After
  honoured): 408/429/5xx and transport faults are retried, 2xx and 4xx come back as (status, body);
- the connector's keep-alive is below uvicorn's 5 s (both engines serve through uvicorn), so a pooled
  connection is never reused as the server closes it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import aiohttp

from backends.base import BackendMalformed, BackendTimeout, BackendUnavailable, BaseBackend, GenerateRequest
from backends.retry import RetryPolicy, parse_retry_after, retry

T = TypeVar("T")

DEFAULT_REQUEST_TIMEOUT_S = 300.0  # per generate attempt, when neither the client nor the request sets one
CONTROL_BODY_BYTES = 16 << 20  # info, health and control answers are small; generate answers have their own bound


def error_message(body: Any, fallback: str) -> str:
    """The server's message from any error shape SGLang or vLLM sends (`{"error": str}`,
    `{"error": {"message"}}`, `{"message"}`, FastAPI's `{"detail": str | [{"msg", "loc"}]}`), else `fallback`."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, str):
            return err  # SGLang's contract violation, vLLM's /pause 400: {"error": "..."}
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])  # SGLang's ValueError, vLLM's ErrorResponse: {"error": {"message": ...}}
        if body.get("message"):
            return str(body["message"])  # FastAPI / scheduler abort: {"object": "error", "message": ...}
        detail = body.get("detail")
        if isinstance(detail, str) and detail:
            return detail  # FastAPI's HTTPException
        if isinstance(detail, list) and detail and all(isinstance(d, dict) for d in detail):  # a validation error
            return "; ".join(f"{'.'.join(map(str, d.get('loc') or ()))}: {d.get('msg')}" for d in detail[:5])
    return fallback


def decode(data: bytes) -> Any:
    """The JSON body, else the text (an error page, an empty body: None)."""
    text = data.decode("utf-8", errors="replace")
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


async def read_bounded(resp: aiohttp.ClientResponse, max_bytes: int, what: str) -> bytes:
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


class ServerClient(BaseBackend):
    """One model server over HTTP: the session, exchanges, retries and counters an engine's client shares."""

    def __init__(self, url: str, *, request_timeout_s: float | None, retry_policy: RetryPolicy, keepalive_s: float,
                 api_key: str | None, faults: tuple[str, ...]):  # fmt: skip
        self.url = url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.retry_policy = retry_policy
        self.keepalive_s = keepalive_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._session: aiohttp.ClientSession | None = None
        self._live: dict[str, str] = {}  # wire request id -> session_id, for abort(session_id) and where()
        # generate attempts, re-sends of one, and deadline aborts sent; then the faults met, by kind
        self.counts = {"requests": 0, "retries": 0, "aborts_sent": 0}
        self.faults = dict.fromkeys(faults, 0)

    async def start(self) -> None:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s)
            # No aiohttp timeout (its default is 5 min): every call here has its own deadline.
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers,
                                                  timeout=aiohttp.ClientTimeout(total=None))  # fmt: skip

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _send(self, method: str, path: str, payload: Any = None, max_bytes: int = CONTROL_BODY_BYTES,
                    params: Any = None) -> tuple[int, Mapping[str, str], bytes]:  # fmt: skip
        """One HTTP exchange (see the module docstring)."""
        await self.start()
        assert self._session is not None
        what = f"{self.url}: {method} {path}"
        try:
            async with self._session.request(method, self.url + path, json=payload, params=params) as resp:
                try:
                    data = await read_bounded(resp, max_bytes, what)
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
                    retries: int | None = None, params: Any = None) -> tuple[int, Any]:  # fmt: skip
        """A control call with retries: (status, parsed body) for 2xx and 4xx; raises BackendUnavailable."""
        policy = self.retry_policy if retries is None else replace(self.retry_policy, attempts=1 + retries)

        async def attempt(n: int) -> tuple[int, Any]:
            try:
                async with asyncio.timeout(timeout_s):
                    status, headers, data = await self._send(method, path, payload, params=params)
            except TimeoutError:
                raise BackendTimeout(f"{self.url}: {method} {path}: no answer within {timeout_s:g} s",
                                     server=self.url, kind="timeouts") from None  # fmt: skip
            body = decode(data)
            if policy.retryable_status(status) or status >= 500:
                message = " ".join(error_message(body, str(body)[:200]).split())  # one line
                raise BackendUnavailable(f"HTTP {status}: {message}", server=self.url,
                                         status=status, kind="http_errors",
                                         retry_after=parse_retry_after(headers.get("Retry-After")))  # fmt: skip
            return status, body

        return await self._retrying(f"{method} {path}", attempt, policy)

    async def _ok(self, path: str, timeout_s: float) -> bool:
        try:
            status, _ = await self._call("GET", path, timeout_s=timeout_s, retries=0)
        except BackendUnavailable:
            return False
        return status == 200

    def deadline(self, request: GenerateRequest) -> float:
        """Seconds one generate attempt may take: ours if set (the CLI's), else the request's (the spec's)."""
        if self.request_timeout_s is not None:
            return self.request_timeout_s
        return request.timeout_s if request.timeout_s is not None else DEFAULT_REQUEST_TIMEOUT_S

    def where(self, session_id: str) -> str | None:
        rids = [rid for rid, sid in self._live.items() if sid == session_id]
        return f"{self.url} (rid {', '.join(rids)})" if rids else self.url

    def stats(self) -> dict[str, Any]:
        return {"server": self.url, **self.counts, "faults": dict(self.faults)}
