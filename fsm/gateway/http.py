"""The gateway's own HTTP/1.1 server: an asyncio protocol over aiohttp's request parser (its C parser where built),
which does the byte-level work, chunked and compressed bodies and the bounds on a request line and its headers.
What aiohttp's server adds per request (a task, a request object of lazy properties, a response object whose headers
are prepared field by field) is most of the gateway's HTTP cost at one call in flight (docs/gateway.md, "Cost"), so
this module answers with bytes written once.

A connection serves its requests in order (pipelined ones wait). A request must arrive whole, line, headers and
body, within READ_S of its first byte, and an idle kept-alive connection is closed after IDLE_S, so a client that
drips bytes holds nothing for long; the handler itself (a session waiting for its model call) is not bounded here.
A handler returns a `Reply` (one body, or `events` sent as a chunked stream: SSE) or raises; a body it did not
read whole closes the connection after the answer, as does a client's `Connection: close` or HTTP/1.0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpRequestParser

log = logging.getLogger("agentfsm.gateway")
READ_S = 60.0  # from a request's first byte to its last
IDLE_S = 75.0  # a kept-alive connection with no request (aiohttp's keepalive_timeout)
BUFFER = 1 << 16  # a body's bytes buffered before reading from the socket pauses
MAX_LINE = MAX_FIELD = 8190  # the request line, and one header (aiohttp's bounds)
MAX_HEADERS = 128


@dataclass
class Reply:
    """An answer: `body` with `content_type`, or when `events` is given, those chunks streamed (SSE)."""

    body: bytes = b""
    status: int = 200
    content_type: str = "application/json"
    events: Iterator[bytes] | None = None
    headers: tuple[tuple[str, str], ...] = ()


class Request:
    """What a handler reads of a request: aiohttp BaseRequest's names for the fields the gateway uses."""

    __slots__ = ("method", "path", "headers", "transport", "content", "content_length", "_url")

    def __init__(self, message: Any, payload: Any, transport: Any):
        self.method: str = message.method
        self._url = message.url
        self.path: str = message.url.path
        self.headers = message.headers
        self.transport = transport
        self.content = payload
        length = message.headers.get("Content-Length")
        self.content_length: int | None = int(length) if length is not None and length.isdigit() else None

    @property
    def query(self) -> Any:
        return self._url.query


Handler = Callable[[Request], Awaitable[Reply]]


def _head(status: int, fields: list[tuple[str, str]]) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in fields)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Connection(BaseProtocol):
    """One client connection: parse, hand each request to the handler in order, write its answer."""

    def __init__(self, handler: Handler, loop: asyncio.AbstractEventLoop, conns: set[Connection]):
        super().__init__(loop)
        self._handler, self._conns = handler, conns
        self._requests = self._parser = HttpRequestParser(
            self,
            loop,
            BUFFER,
            max_line_size=MAX_LINE,
            max_headers=MAX_HEADERS,
            max_field_size=MAX_FIELD,
        )
        self._queue: deque[tuple[Any, Any]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reading = False  # bytes of a request not yet whole have come: READ_S runs
        self._payload: Any = None  # the body of the last request parsed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._conns.add(self)
        self._arm(IDLE_S)

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self._conns.discard(self)
        self._disarm()
        with contextlib.suppress(Exception):
            self._requests.feed_eof()
        if self._payload is not None and not self._payload.is_eof():
            self._payload.set_exception(ConnectionResetError("the client closed the connection"))
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._queue.clear()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self._loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._payload is not None and not self._payload.is_eof():
            self._payload.set_exception(TimeoutError(f"the request did not arrive whole within {READ_S:g} s"))
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if data and not self._reading:  # (b"": aiohttp's resume_reading, parsing what it held)
            self._reading = True
            self._arm(READ_S)
        try:
            messages, _upgraded, _tail = self._requests.feed_data(data)
        except HttpProcessingError as exc:
            self._refuse(exc.code or 400, exc.message or "bad request")
            return
        except Exception as exc:  # what the parser raises for bytes that are no HTTP
            self._refuse(400, f"bad request: {type(exc).__name__}")
            return
        for message, payload in messages:
            self._queue.append((message, payload))
            self._payload = payload
        if self._payload is not None and self._payload.is_eof():  # the last request is whole
            self._reading = False
            self._disarm()
        if self._queue and self._task is None:
            self._task = self._loop.create_task(self._serve())

    def _refuse(self, status: int, why: str) -> None:
        """A request the parser refused: answered, and the connection closed (its framing is lost)."""
        if self.transport is None or self.transport.is_closing():
            return
        body = json.dumps({"error": {"message": why[:500], "type": "invalid_request_error"}}).encode()
        fields = [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
        ]
        self.transport.write(_head(status, fields) + body)
        self.transport.close()

    async def _serve(self) -> None:
        try:
            while self._queue and self.transport is not None and not self.transport.is_closing():
                message, payload = self._queue.popleft()
                try:
                    reply = await self._handler(Request(message, payload, self.transport))
                except (asyncio.CancelledError, ConnectionError):
                    raise
                except Exception:
                    log.exception("gateway: the request handler failed")
                    reply = Reply(b'{"error": {"message": "internal error", "type": "server_error"}}', 500)
                close = message.should_close or not payload.is_eof()
                await self._write(reply, close, head_only=message.method == "HEAD")
                if close:
                    if self.transport is not None:
                        self.transport.close()
                    return
        except (asyncio.CancelledError, ConnectionError):
            return
        finally:
            self._task = None
        if not self._reading and self.transport is not None and not self.transport.is_closing():
            self._arm(IDLE_S)

    async def _write(self, reply: Reply, close: bool, head_only: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        fields = [("Content-Type", reply.content_type), *reply.headers]
        if close:
            fields.append(("Connection", "close"))
        if reply.events is None:
            fields.append(("Content-Length", str(len(reply.body))))
            transport.write(_head(reply.status, fields) + (b"" if head_only else reply.body))
            return
        fields.append(("Transfer-Encoding", "chunked"))
        transport.write(_head(reply.status, fields))
        for event in reply.events:
            if event:
                transport.write(b"%x\r\n%s\r\n" % (len(event), event))
                await self._drain_helper()
        transport.write(b"0\r\n\r\n")


class Server:
    """A listening socket and its connections; `cleanup()` stops both (as aiohttp's runner's)."""

    def __init__(self, server: asyncio.AbstractServer, conns: set[Connection]):
        self._server, self._conns = server, conns

    async def cleanup(self) -> None:
        self._server.close()
        for conn in list(self._conns):
            if conn.transport is not None:
                conn.transport.close()
        await self._server.wait_closed()


async def serve(
    handler: Handler, host: str, port: int, sock: socket.socket | None = None
) -> tuple[Server, int]:
    """Serve `handler` on host:port (0: any free port), or on `sock`, a socket bound already; the server to close
    and the port it got."""
    loop = asyncio.get_running_loop()
    conns: set[Connection] = set()
    if sock is not None:
        server = await loop.create_server(lambda: Connection(handler, loop, conns), sock=sock)
    else:
        server = await loop.create_server(lambda: Connection(handler, loop, conns), host, port)
    return Server(server, conns), server.sockets[0].getsockname()[1]
