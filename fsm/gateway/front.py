"""Sessions pinned by id across several gateway processes: one front address for harnesses, N workers behind
it, each its own engine process with its own gateway (fsm/gateway/server.py) holding its own rows' sessions.

A worker's gateway is made with a `tag` (`Gateway(tag="w1", front=front.url)`): the ids of the sessions it opens
start with `w1-` and the base URLs it hands its harnesses are the front's. The front forwards each request under
`/sessions/{id}/` to the worker whose tag starts the id, body and key unchanged, and streams the answer back
(SSE included), so a session always lands on the process that owns its trajectory: nothing is shared between
workers, and one process's `max_sessions` bounds only its own share. The front only reads the tag: the key
is checked by the worker, as without a front, and so is the process the request comes from: the front names its
caller's socket in a header (fsm/gateway/peer.py).

Workers are registered by the program that owns the front (`register`), or, made with a `token`, register
themselves: `POST /workers/{tag}` with `Authorization: Bearer <token>` and `{"port": N}` (the worker's gateway
on this host's loopback), once per tag the front `expects` (`agentfsm gateway --workers N`,
fsm/gateway/workers.py).
"""

from __future__ import annotations

import hmac
import json
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp
from aiohttp import web

from fsm.gateway import peer
from fsm.gateway.record import GatewayError
from fsm.gateway.server import GatewayLimits, _error, listen, read_body, route

# A name no worker or harness is given (stripped from what they inherit): a worker reads its registration token
# from a pipe (fsm/gateway/workers.py), never its environment, which /proc/PID/environ shows for the process's life.
TOKEN_ENV = "AGENTFSM_FRONT_TOKEN"
FORWARDED = ("Authorization", "x-api-key", "Content-Type", "Accept", "anthropic-version", "anthropic-beta")


class Front:
    """The front: `register(tag, url)` each worker, then harnesses call `url/sessions/{id}/...`."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: GatewayLimits | None = None,
        timeout_s: float = 600.0,
        token: str | None = None,
        expects: Iterable[str] = (),
        on_register: Callable[[str], None] | None = None,
    ):
        self.host, self.port = host, port
        self.token, self.expects, self.on_register = token, set(expects), on_register
        self.limits = limits or GatewayLimits()
        self.timeout_s = timeout_s  # one forwarded request, answer included
        self.workers: dict[str, str] = {}  # tag -> the worker gateway's URL
        self.routed: Counter[str] = Counter()  # requests forwarded per tag
        self._runner: web.BaseRunner | None = None
        self._http: aiohttp.ClientSession | None = None
        self._callers: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def register(self, tag: str, url: str) -> None:
        self.workers[tag] = url.rstrip("/")

    async def start(self) -> Front:
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=self.timeout_s)
        )
        self._runner, self.port = await listen(self._serve, self.host, self.port)
        return self

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        if self._runner is not None:
            await self._runner.cleanup()
        self._http = self._runner = None

    async def __aenter__(self) -> Front:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        if self.token and request.method == "POST" and request.path.startswith("/workers/"):
            return await self._join(request, request.path[len("/workers/") :])
        return await self._forward(request)

    async def _join(self, request: web.BaseRequest, tag: str) -> web.Response:
        """A worker registers itself (see the module docstring); refused: 401 without the token, 409 for a tag
        the front does not expect or has already, 400 for a body without a port."""
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {self.token}".encode()):
            return web.json_response({"error": "not a worker of this front"}, status=401)
        if tag not in self.expects or tag in self.workers:
            return web.json_response({"error": f"the front expects no (more) worker {tag!r}"}, status=409)
        try:
            port = json.loads(await read_body(request, 4096))["port"]
        except (ValueError, TypeError, KeyError, GatewayError):
            port = None
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            return web.json_response({"error": 'the body must be {"port": N}'}, status=400)
        self.register(tag, f"http://127.0.0.1:{port}")
        if self.on_register is not None:
            self.on_register(tag)
        return web.json_response({"tag": tag})

    async def _forward(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            sid = route(request)[0]
            tag = sid.split("-", 1)[0] if "-" in sid else ""
            worker = self.workers.get(tag)
            if worker is None:
                raise GatewayError("unknown session, or not its key", code="invalid_api_key", status=401)
            body = await read_body(request, self.limits.max_request_bytes)
        except GatewayError as exc:
            return _error(request, exc)
        headers = {k: request.headers[k] for k in FORWARDED if k in request.headers}
        caller = self._caller(request)
        if caller is not None:  # the worker checks that its session's harness holds it (fsm/gateway/peer.py)
            headers[peer.PEER_HEADER] = str(caller)
        self.routed[tag] += 1
        assert self._http is not None
        response = None
        try:
            async with self._http.request(
                request.method, worker + request.rel_url.path_qs, data=body, headers=headers
            ) as upstream:
                kept = {
                    k: upstream.headers[k] for k in ("Content-Type", "Cache-Control") if k in upstream.headers
                }
                response = web.StreamResponse(status=upstream.status, headers=kept)
                try:
                    await response.prepare(request)
                    async for chunk in upstream.content.iter_any():
                        await response.write(chunk)
                    await response.write_eof()
                except ConnectionResetError:  # the caller went away (its row ended): nothing left to answer
                    pass
                return response
        except (TimeoutError, aiohttp.ClientError) as exc:
            if response is not None:  # the answer had started: the connection is dropped, as the worker's was
                raise
            return _error(
                request,
                GatewayError(
                    f"the gateway worker {tag!r} ({worker}) did not answer: {type(exc).__name__}: {exc}",
                    code="server_error",
                    status=502,
                ),
            )

    def _caller(self, request: web.BaseRequest) -> int | None:
        """The inode of the caller's socket, looked up once per connection."""
        transport = request.transport
        if transport is None:
            return None
        if transport not in self._callers:
            self._callers[transport] = peer.socket_inode(
                transport.get_extra_info("peername"), transport.get_extra_info("sockname")
            )
        return self._callers[transport]
