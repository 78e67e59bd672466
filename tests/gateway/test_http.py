"""The gateway's own HTTP/1.1 server (fsm/gateway/http.py) over real sockets, byte for byte: kept-alive and
pipelined requests, chunked and gzip bodies, SSE answers, the bounds on headers, and clients that drip bytes or idle."""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import Any

from fsm.gateway import http


async def _echo(request: http.Request) -> http.Reply:
    """Answers the body it read, or streams it back as three SSE events at /sse, or at /noread answers unread."""
    if request.path == "/noread":
        return http.Reply(b"{}")
    raw = await request.content.read()
    if request.path == "/sse":
        events = iter([b"data: 1\n\n", b"data: 2\n\n", raw])
        return http.Reply(
            content_type="text/event-stream", events=events, headers=(("Cache-Control", "no-cache"),)
        )
    info = {
        "path": request.path,
        "method": request.method,
        "body": raw.decode(),
        "key": request.query.get("key"),
    }
    return http.Reply(json.dumps(info).encode())


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer read off the socket: its status, headers and body (Content-Length or chunked)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in head[1:] if line)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while size := int((await reader.readline()).strip(), 16):
        body += await reader.readexactly(size)
        await reader.readexactly(2)
    await reader.readexactly(2)
    return status, headers, body


def _post(path: str, body: bytes, *extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _served(case: Any) -> Any:
    server, port = await http.serve(_echo, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            async with asyncio.timeout(30):
                return await case(reader, writer)
        finally:
            writer.close()
    finally:
        await server.cleanup()


def test_kept_alive_pipelined_chunked_and_gzip_requests_are_answered_in_order() -> None:
    async def case(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> list[Any]:
        packed = gzip.compress(b'{"a": 1}')
        chunked = b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        writer.write(_post("/one?key=k1", b"first") + chunked)  # two requests in one write: pipelined
        writer.write(_post("/gz", packed, "Content-Encoding: gzip"))
        return [json.loads((await _answer(reader))[2]) for _ in range(3)]

    first, second, third = asyncio.run(_served(case))
    assert first == {"path": "/one", "method": "POST", "body": "first", "key": "k1"}
    assert second["path"] == "/c" and second["body"] == "abcde"
    assert third["body"] == '{"a": 1}'


def test_an_sse_answer_is_streamed_chunked_and_the_connection_goes_on() -> None:
    async def case(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
        writer.write(_post("/sse", b"data: [DONE]\n\n"))
        stream = await _answer(reader)
        writer.write(_post("/after", b"x"))
        return stream, await _answer(reader)

    (status, headers, body), after = asyncio.run(_served(case))
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert headers["transfer-encoding"] == "chunked" and headers["cache-control"] == "no-cache"
    assert body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    assert json.loads(after[2])["path"] == "/after"


def test_a_header_past_its_bound_or_bytes_that_are_no_http_are_refused_and_closed() -> None:
    async def case(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> Any:
        writer.write(request)
        status, headers, _body = await _answer(reader)
        return status, headers.get("connection"), await reader.read()  # then EOF: closed

    long_header = _post("/x", b"", "X-Big: " + "a" * (http.MAX_FIELD + 10))
    for request in (long_header, b"NOT HTTP AT ALL\r\n\r\n"):
        status, connection, rest = asyncio.run(_served(lambda r, w, q=request: case(r, w, q)))
        assert (status, connection, rest) == (400, "close", b"")


def test_a_client_that_drips_its_request_or_idles_is_disconnected(monkeypatch) -> None:
    monkeypatch.setattr(http, "READ_S", 0.3)
    monkeypatch.setattr(http, "IDLE_S", 0.3)

    async def dripping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly part of it")
        return await reader.read()  # EOF once READ_S is past: the server closed

    async def idle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[Any, bytes]:
        writer.write(_post("/x", b"y"))
        answer = await _answer(reader)
        return answer, await reader.read()

    assert asyncio.run(_served(dripping)) == b""
    (status, _headers, _body), rest = asyncio.run(_served(idle))
    assert status == 200 and rest == b""


def test_an_unread_body_or_connection_close_ends_the_connection_after_the_answer() -> None:
    async def case(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> Any:
        writer.write(request)
        status, headers, _body = await _answer(reader)
        return status, headers.get("connection"), await reader.read()

    # a body still arriving when the handler answered: whatever follows it cannot be framed
    unread = b"POST /noread HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc"
    for request in (unread, _post("/x", b"y", "Connection: close")):
        assert asyncio.run(_served(lambda r, w, q=request: case(r, w, q))) == (200, "close", b"")
