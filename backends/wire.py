"""The HTTP/1.1 exchanges of a model-server client (backends/server_client.py), on asyncio's own transport.

Why not aiohttp here: a generate call is one small POST and one small JSON answer, thousands a second across a
fleet, and aiohttp's client builds URL and header objects, cookie jars, tracing hooks, a payload writer and a
stream reader for each, more CPU than the rest of a model call's client work together (docs/benchmarks.md,
"The client under load"). This module writes the request in one `transport.write` and parses the answer in
`data_received`. Every request of a server client goes this way; aiohttp stays
for the one-off probes (backends/engines.py's detection, backends/launcher.py's health wait).

What it speaks, exactly: HTTP/1.1 over TCP (TLS for https URLs), persistent connections reused last-in
first-out and closed past `keepalive_s` idle (below uvicorn's 5 s, so a pooled connection is never reused as
the server closes it) or when the answer says `Connection: close`; answers delimited by Content-Length,
chunked transfer coding or the connection's end; informational (1xx) answers skipped. No redirects, cookies,
proxies or compression (none is asked for: a compressed answer is refused). A connection whose exchange was
cancelled or failed is closed, never reused: both engines abort a request whose client went away.

Failures are `WireError`s whose kind says when they happened, which server_client turns into its
BackendUnavailable kinds: "refused" (no connection), "disconnects" (the connection ended or broke the protocol
before an answer's head), "resets" (the head came, the body did not), and "oversize" (a body past its bound,
never read further).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterator, Mapping
from typing import cast
from urllib.parse import urlencode, urlsplit

MAX_HEAD_BYTES = 64 << 10  # an answer's status line and headers; a server's are a few hundred bytes


class WireError(Exception):
    """An exchange that failed; `kind`: refused | disconnects | resets | oversize; `status` once the head came."""

    def __init__(self, message: str, kind: str, status: int | None = None):
        super().__init__(message)
        self.kind, self.status = kind, status


class Headers(Mapping[str, str]):
    """An answer's headers, names matched without case (the last of a repeated name wins)."""

    __slots__ = ("_items",)

    def __init__(self, items: dict[str, str]):
        self._items = items  # lower-case name -> value

    def __getitem__(self, name: str) -> str:
        return self._items[name.lower()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


Answer = tuple[int, Headers, bytes]  # status, headers, body
_NO_BODY = frozenset({204, 304})


class _Connection(asyncio.Protocol):
    """One TCP connection; at most one exchange at a time. `data_received` parses the answer as it arrives and
    settles `waiter` with (status, Headers, body) or a WireError."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop the connection lives on
        self.closed = False
        self.idle_since = 0.0
        self.waiter: asyncio.Future[Answer] | None = None
        self._buf = bytearray()
        self._max = 0  # the body bound of the exchange in flight
        self._head: tuple[int, Headers] | None = None  # the answer's head, once it came
        self._length: int | None = None  # Content-Length; None: chunked or to the connection's end
        self._chunked = False
        self._body = bytearray()  # a chunked body decoded so far
        self.keep = True  # whether the connection may serve another exchange

    # -- asyncio.Protocol ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without subclassing it
        self.loop = asyncio.get_running_loop()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is None or self.waiter.done():
            return
        if self._head is not None and self._length is None and not self._chunked:  # delimited by the end
            status, headers = self._head
            self._settle((status, headers, bytes(self._buf)))
            return
        why = f" ({type(exc).__name__} {exc})" if exc else ""
        if self._head is None:
            self._fail(f"connection dropped before a response{why}", "disconnects")
        else:
            self._fail(f"connection lost mid-response{why}", "resets", self._head[0])

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():  # nothing asked: the connection is out of step
            self.keep = False
            if self.transport is not None:
                self.transport.close()
            return
        self._buf += data
        try:
            self._parse()
        except WireError as e:
            self._fail(str(e), e.kind, e.status)

    # -- one exchange -------------------------------------------------------------------------------------

    def begin(self, request: bytes, max_bytes: int) -> asyncio.Future[Answer]:
        assert self.transport is not None and self.loop is not None  # the running loop (Wire._pooled)
        self.waiter = self.loop.create_future()
        self._max, self._head, self._length, self._chunked = max_bytes, None, None, False
        self._body.clear()
        self.transport.write(request)
        return self.waiter

    def _parse(self) -> None:
        buf = self._buf
        while self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise WireError(f"an answer head past {MAX_HEAD_BYTES} bytes", "disconnects")
                return
            head = bytes(buf[:end])
            del buf[: end + 4]
            self._start(head)
        status, headers = self._head
        if self._length is not None:
            if len(buf) < self._length:
                return
            body = bytes(buf[: self._length])
            del buf[: self._length]
        elif self._chunked:
            if not self._dechunk():
                return
            body = bytes(self._body)
        else:
            if len(buf) > self._max:
                raise self._oversize(f"more than {len(buf)}")
            return  # read to the connection's end (connection_lost)
        if buf:  # bytes past the answer: nothing else was asked
            self.keep = False
        self._settle((status, headers, body))

    def _start(self, head: bytes) -> None:
        """Read an answer's head (status line and headers); skips a 1xx answer."""
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if (
            len(parts) < 2
            or not parts[0].startswith(b"HTTP/1.")
            or not parts[1].isdigit()
            or len(parts[1]) != 3
        ):
            raise WireError(f"not an HTTP/1.x status line: {lines[0][:80]!r}", "disconnects")
        status = int(parts[1])
        items: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise WireError(f"a malformed header line: {line[:80]!r}", "disconnects", status)
            items[name.decode("latin-1").lower()] = value.strip().decode("latin-1")
        if 100 <= status < 200:
            return  # informational: the answer follows
        if parts[0] == b"HTTP/1.0" or items.get("connection", "").lower() == "close":
            self.keep = False
        encoding = items.get("content-encoding", "identity").lower()
        if encoding != "identity":
            raise WireError(
                f"a body in Content-Encoding {encoding!r}, which was not asked for", "resets", status
            )
        self._head = (status, Headers(items))
        if status in _NO_BODY:
            self._length = 0
        elif "chunked" in items.get("transfer-encoding", "").lower():
            self._chunked = True
        elif "content-length" in items:
            text = items["content-length"]
            if not (text.isascii() and text.isdigit()):  # str.isdigit also takes "²", which int() refuses
                raise WireError(f"Content-Length {text[:40]!r}", "resets", status)
            self._length = int(text)
            if self._length > self._max:
                raise self._oversize(str(self._length))
        else:
            self.keep = False  # delimited by the connection's end

    def _dechunk(self) -> bool:
        """Move whole chunks from the buffer to the body; True once the last chunk (and trailers) came."""
        buf = self._buf
        while True:
            eol = buf.find(b"\r\n")
            if eol < 0:
                if len(buf) > 1024:
                    raise WireError("a chunk size line past 1024 bytes", "resets", self._status())
                return False
            size_text = bytes(buf[:eol]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise WireError(f"chunk size {size_text[:40]!r}", "resets", self._status()) from None
            if size == 0:
                end = buf.find(b"\r\n\r\n", eol)  # the trailers' end (none: right after the size line)
                if end < 0:
                    return False
                del buf[: end + 4]
                return True
            if len(self._body) + size > self._max:
                raise self._oversize(f"more than {len(self._body) + size}")
            if len(buf) < eol + 2 + size + 2:
                return False
            self._body += buf[eol + 2 : eol + 2 + size]
            del buf[: eol + 2 + size + 2]

    def _status(self) -> int | None:
        return self._head[0] if self._head is not None else None

    def _oversize(self, size: str) -> WireError:
        return WireError(
            f"answered a body of {size} bytes, past the {self._max}-byte bound for this request; a server fault",
            "oversize",
            self._status(),
        )

    def _settle(self, result: Answer) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(result)

    def _fail(self, message: str, kind: str, status: int | None = None) -> None:
        self.keep = False
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(WireError(message, kind, status))
        if self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        """Close from any thread; a connection whose loop has ended went with it."""
        self.closed = True
        if self.transport is None or self.loop is None or self.loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.transport.close()
        else:
            self.loop.call_soon_threadsafe(self.transport.close)


class Wire:
    """The connections to one server (`url`: scheme, host, port and an optional path prefix); `headers` go on
    every request. Safe to share across the tasks of one event loop."""

    def __init__(self, url: str, *, keepalive_s: float = 4.0, headers: Mapping[str, str] | None = None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url}: not an http:// or https:// server URL")
        self.host = parts.hostname
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = self.port == (443 if self.tls else 80)
        lines = [f"Host: {host if default else f'{host}:{self.port}'}", "Accept: */*"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self._common = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        self.keepalive_s = keepalive_s
        self._idle: list[_Connection] = []  # last in, first out: the warmest connection first
        self._busy: set[_Connection] = set()

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        max_bytes: int,
        params: Mapping[str, str] | None = None,
    ) -> Answer:
        """One exchange -> (status, headers, body); WireError (module docstring) when it fails. No deadline of
        its own: a cancelled exchange closes its connection."""
        request = self._request(method, path, body, params)
        return await self._begin(await self._acquire(), request, max_bytes)

    def pooled(self, method: str, path: str, body: bytes, *, max_bytes: int) -> asyncio.Future[Answer] | None:
        """`request`'s exchange begun now on a pooled connection, as a future (no task: one a model call saves),
        or None when none is idle (the caller then awaits `request`, whose connect its deadline must bound)."""
        conn = self._pooled()
        if conn is None:
            return None
        return self._begin(conn, self._request(method, path, body, None), max_bytes)

    def _request(self, method: str, path: str, body: bytes | None, params: Mapping[str, str] | None) -> bytes:
        target = self.prefix + path + ("?" + urlencode(params) if params else "")
        head = b"%s %s HTTP/1.1\r\n%s" % (method.encode("ascii"), target.encode("ascii"), self._common)
        if body is None:
            return head + b"\r\n"
        return head + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    def _begin(self, conn: _Connection, request: bytes, max_bytes: int) -> asyncio.Future[Answer]:
        """The exchange's future; once it is done the connection goes back to the pool, or is closed when the
        exchange was cancelled or failed (never reused) or the answer said so."""

        def release(waiter: asyncio.Future[Answer]) -> None:
            self._busy.discard(conn)
            if not waiter.cancelled() and waiter.exception() is None and conn.keep and not conn.closed:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                conn.close()

        waiter = conn.begin(request, max_bytes)
        waiter.add_done_callback(release)
        return waiter

    def _pooled(self) -> _Connection | None:
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.loop is loop and now - conn.idle_since < self.keepalive_s:
                self._busy.add(conn)
                return conn
            conn.close()  # expired, closed by the server, or made on another event loop
        return None

    async def _acquire(self) -> _Connection:
        conn = self._pooled()
        if conn is not None:
            return conn
        try:
            _, conn = await asyncio.get_running_loop().create_connection(
                _Connection,
                self.host,
                self.port,
                ssl=self.tls,
                server_hostname=self.host if self.tls else None,
            )
        except OSError as e:
            raise WireError(
                f"cannot connect to {self.host}:{self.port} ({type(e).__name__}: {e})", "refused"
            ) from None
        self._busy.add(conn)
        return conn

    def close(self) -> None:
        """Close every connection, idle or in an exchange (whose waiter then fails as "disconnects")."""
        for conn in [*self._idle, *self._busy]:
            conn.close()
        self._idle.clear()
        self._busy.clear()
