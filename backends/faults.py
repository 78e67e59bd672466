"""A fault-injecting HTTP proxy in front of an SGLang-protocol server: what the fault tests and
`agentfsm bench faults` break servers with, for real, over loopback HTTP.

    async with FaultProxy(dev.url, every={"http_503": 5}) as proxy:   # every 5th /generate answers 503
        ...point the client at proxy.url...
    proxy.injected    # Counter: what was injected, by kind

Kinds, applied to /generate only (every other path, /abort_request and /health included, is forwarded):
  http_503       503 with SGLang's scheduler-abort body; nothing reaches the server
  drop           the connection is closed before any response
  reset          forwarded, then the response is cut after half its body and the connection closed
  hang           never answered (a server whose /health is fine while its /generate is stuck)
  non_json       200 text/plain that is not JSON
  html           200 text/html: a load balancer's or captive proxy's error page
  wrong_schema   200 JSON that is not a /generate response: `{"foo": 1}`
  abort_waiting  forwarded with the dev server's fault header: aborted in the waiting queue
  abort_running  likewise: aborted mid-generation, answering the partial output_ids and logprobs; counted only
                 when the server did abort (a turn that ends by itself before the cut is not a fault)
The abort kinds need backends/devserver.py upstream (a real SGLang ignores the header).
The hostile kinds (backends/hostile.py's HOSTILE) forward the request and rewrite the real answer; counted only
when the answer could carry it.
An outage (`outage(seconds)`, or `{"outage_s": s}` over HTTP) answers every /generate 503 for that long: a
server restart as its clients see it.

What to inject, per /generate in arrival order: `script` (a kind or None per request; then nothing), else
`every` (kind -> n: every n-th request, the first kind that matches), else `rates` (kind -> probability,
from a seeded generator). Over HTTP: `POST /_faults {"script"|"every"|"rates": ..., "seed": ...}` replaces the
plan, `GET /_faults` answers the counts.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Mapping, Sequence

import aiohttp
from aiohttp import web

from backends.contract import Refused
from backends.devserver import FAULT_HEADER
from backends.hostile import HOSTILE, rewrite

# Each kind, and which counter of the client's stats()["faults"] each kind shows up in (None: a valid form it absorbs).
CLIENT_COUNTER = {
    "http_503": "http_errors",
    "drop": "disconnects",
    "reset": "resets",
    "hang": "timeouts",
    "non_json": "malformed",
    "html": "malformed",
    "wrong_schema": "malformed",
    "abort_waiting": "aborts_waiting",
    "abort_running": "aborts_running",
    **{kind: counter for kind, (_, counter) in HOSTILE.items()},
}
FAULT_KINDS = tuple(CLIENT_COUNTER)

_ERR_503 = Refused.http(503, "Request timed out in the waiting queue (fault injection)").body
_HTML = (
    "<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad Gateway</h1></center>"
    "<hr><center>nginx</center></body></html>\n"
)


class FaultProxy:
    """An aiohttp reverse proxy over `upstream` that injects faults into /generate; an async context manager."""

    def __init__(
        self,
        upstream: str,
        *,
        script: Sequence[str | None] | None = None,
        every: Mapping[str, int] | None = None,
        rates: Mapping[str, float] | None = None,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.upstream = upstream.rstrip("/")
        self.host, self.port = host, port
        self.injected: Counter[str] = Counter()
        self.requests = 0  # /generate requests seen
        self.abort_requests: list[str] = []  # rids of the /abort_request calls that came through
        self.plan(script=script, every=every, rates=rates, seed=seed)
        self.outage_until = 0.0  # loop time before which every /generate answers 503
        self._stop = asyncio.Event()  # releases hung requests on close
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    def plan(
        self,
        *,
        script: Sequence[str | None] | None = None,
        every: Mapping[str, int] | None = None,
        rates: Mapping[str, float] | None = None,
        seed: int = 0,
    ) -> None:
        """Replace what is injected from the next /generate on (counts are kept)."""
        for kind in [*(script or ()), *(every or {}), *(rates or {})]:
            if kind is not None and kind not in FAULT_KINDS:
                raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
        self.script = list(script) if script is not None else None
        self.every = dict(every or {})
        self.rates = dict(rates or {})
        self._rng = random.Random(seed)
        self._planned_from = self.requests

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def outage(self, seconds: float) -> None:
        """Answer every /generate 503 for the next `seconds` (a restart, as the clients see it)."""
        self.outage_until = asyncio.get_running_loop().time() + seconds

    def _pick(self) -> str | None:
        i = self.requests - self._planned_from
        self.requests += 1
        if self.script is not None:
            return self.script[i] if i < len(self.script) else None
        for kind, n in self.every.items():
            if n > 0 and (i + 1) % n == 0:
                return kind
        draw, total = self._rng.random(), 0.0
        for kind, p in self.rates.items():
            total += p
            if draw < total:
                return kind
        return None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._runner is not None:
            return
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/_faults", self._control)
        app.router.add_route("*", "/generate", self._generate)
        app.router.add_route("*", "/{tail:.*}", self._forward_handler)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        self._stop.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- handlers --------------------------------------------------------------------------------

    async def _forward(
        self, request: web.Request, body: bytes, headers: Mapping[str, str] | None = None
    ) -> tuple[int, str, bytes]:
        """(status, content type, body) of the same request sent upstream; 502 when upstream is unreachable."""
        assert self._http is not None
        send = {"Content-Type": request.headers.get("Content-Type", "application/json"), **(headers or {})}
        try:
            async with self._http.request(
                request.method, self.upstream + request.path_qs, data=body, headers=send
            ) as r:
                return r.status, r.headers.get("Content-Type", "application/octet-stream"), await r.read()
        except aiohttp.ClientError as e:
            return 502, "application/json", json.dumps({"error": f"fault proxy: upstream {e}"}).encode()

    async def _forward_handler(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.path == "/abort_request":
            try:
                self.abort_requests.append(json.loads(body or b"{}").get("rid", ""))
            except (ValueError, AttributeError):
                pass
        status, ctype, data = await self._forward(request, body)
        return web.Response(status=status, body=data, headers={"Content-Type": ctype})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        if asyncio.get_running_loop().time() < self.outage_until:
            self.requests += 1
            self.injected["outage"] += 1
            return web.json_response(_ERR_503, status=503)
        kind = self._pick()
        body = await request.read()
        if kind is None or kind in HOSTILE or kind in ("abort_waiting", "abort_running"):  # forwarded
            if kind == "abort_waiting":
                self.injected[kind] += 1
            header = {FAULT_HEADER: str(kind)} if kind in ("abort_waiting", "abort_running") else None
            status, ctype, data = await self._forward(request, body, header)
            if kind in HOSTILE and status == 200 and (bad := rewrite(kind, data, body)) is not None:
                self.injected[kind] += 1
                data = bad
            elif kind == "abort_running" and status == 200 and _finish_type(data) == "abort":
                self.injected[kind] += 1
            return web.Response(status=status, body=data, headers={"Content-Type": ctype})
        self.injected[kind] += 1
        if kind == "http_503":
            return web.json_response(_ERR_503, status=503)
        if kind == "non_json":
            return web.Response(status=200, text="upstream connect error or disconnect/reset before headers")
        if kind == "html":
            return web.Response(status=200, text=_HTML, content_type="text/html")
        if kind == "wrong_schema":
            return web.json_response({"foo": 1})
        if kind == "hang":
            await self._stop.wait()  # until the client goes away (the handler is cancelled) or we close
            return web.Response(status=503)
        assert request.transport is not None
        if kind == "drop":
            request.transport.close()
            return web.Response(status=500)  # never sent: the connection is gone
        # reset: the real answer, cut in the middle of its body
        status, ctype, data = await self._forward(request, body)
        resp = web.StreamResponse(status=status, headers={"Content-Type": ctype})
        resp.content_length = len(data)
        await resp.prepare(request)
        await resp.write(data[: len(data) // 2])
        request.transport.close()
        return resp

    async def _control(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            body = await request.json() if request.can_read_body else {}
            try:
                if "outage_s" in body:
                    self.outage(float(body["outage_s"]))
                else:
                    plan = {key: body.get(key) for key in ("script", "every", "rates")}
                    self.plan(**plan, seed=int(body.get("seed", 0)))
            except (ValueError, TypeError) as e:
                return web.json_response({"error": str(e)}, status=400)
        return web.json_response(
            {
                "requests": self.requests,
                "injected": dict(self.injected),
                "abort_requests": list(self.abort_requests),
            }
        )


def _finish_type(data: bytes) -> str | None:
    try:
        return json.loads(data)["meta_info"]["finish_reason"]["type"]
    except (ValueError, KeyError, TypeError):
        return None
