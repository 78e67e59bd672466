"""backends/wire.py against raw sockets that answer exactly as told: every way an HTTP/1.1 answer can be framed
(Content-Length, chunked with trailers, to the connection's end, after a 100 Continue), connections reused and
not reused, and every failure with the kind server_client counts it under."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from backends.server_client import encode_json
from backends.wire import Wire, WireError

Answer = Callable[[bytes], bytes | None]  # the request's bytes -> what to write (None: close without a word)


@asynccontextmanager
async def server(answer: Answer, close_after: bool = False) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server that reads one request at a time (head and Content-Length body) and writes
    `answer(request)`; yields its URL and the count of connections it accepted."""
    accepted: list[int] = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                request = head + await reader.readexactly(length)
                reply = answer(request)
                if reply is None:
                    break
                writer.write(reply)
                await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    async with srv:
        yield f"http://127.0.0.1:{port}", accepted


def fixed(reply: bytes) -> Answer:
    return lambda request: reply


OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{"a":1}'


async def test_content_length_answers_reuse_one_connection():
    seen: list[bytes] = []

    def answer(request: bytes) -> bytes:
        seen.append(request)
        return OK

    async with server(answer) as (url, accepted):
        wire = Wire(url + "/prefix/", headers={"Authorization": "Bearer k"})
        for _ in range(3):
            status, headers, body = await wire.request("POST", "/generate", b'{"x":1}', max_bytes=100)
            assert (status, body, headers["content-type"], headers.get("CONTENT-LENGTH")) == (
                200,
                b'{"a":1}',
                "application/json",
                "7",
            )
        wire.close()
    assert accepted[0] == 1
    head = seen[0].split(b"\r\n")
    assert head[0] == b"POST /prefix/generate HTTP/1.1"
    assert b"Authorization: Bearer k" in head and b"Content-Length: 7" in head
    assert seen[0].endswith(b'\r\n\r\n{"x":1}')


async def test_a_get_with_params_has_no_body():
    seen: list[bytes] = []

    def answer(request: bytes) -> bytes:
        seen.append(request)
        return OK

    async with server(answer) as (url, _):
        wire = Wire(url)
        await wire.request("GET", "/server_info", max_bytes=100, params={"config_format": "json"})
        wire.close()
    assert seen[0].startswith(b"GET /server_info?config_format=json HTTP/1.1\r\n")
    assert b"Content-Length" not in seen[0] and seen[0].endswith(b"\r\n\r\n")


async def test_chunked_with_trailers_and_a_100_continue_first():
    reply = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\nRetry-After: 2\r\n\r\n"
        b'4;ext=1\r\n{"a"\r\n3\r\n:1}\r\n0\r\nX-Trailer: t\r\n\r\n'
    )
    async with server(fixed(reply)) as (url, accepted):
        wire = Wire(url)
        for _ in range(2):
            status, headers, body = await wire.request("GET", "/x", max_bytes=100)
            assert (status, body, headers.get("retry-after")) == (503, b'{"a":1}', "2")
        wire.close()
    assert accepted[0] == 1


async def test_an_answer_to_the_connections_end_and_connection_close_are_not_reused():
    for reply in (
        b"HTTP/1.1 200 OK\r\n\r\nuntil the end",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 13\r\n\r\nuntil the end",
        b"HTTP/1.0 200 OK\r\nContent-Length: 13\r\n\r\nuntil the end",
    ):
        async with server(fixed(reply), close_after=True) as (url, accepted):
            wire = Wire(url)
            for _ in range(2):
                assert (await wire.request("GET", "/x", max_bytes=100))[2] == b"until the end"
            wire.close()
        assert accepted[0] == 2


async def test_an_idle_connection_past_keepalive_is_not_reused():
    async with server(fixed(OK)) as (url, accepted):
        wire = Wire(url, keepalive_s=0.0)
        await wire.request("GET", "/x", max_bytes=100)
        await wire.request("GET", "/x", max_bytes=100)
        wire.close()
    assert accepted[0] == 2


@pytest.mark.parametrize(
    "reply, kind, status",
    [
        (None, "disconnects", None),  # closed without a word
        (b"HTTP/1.1 200 OK\r\nContent-Le", "disconnects", None),  # half a head
        (b"SSH-2.0-OpenSSH\r\n\r\n", "disconnects", None),  # not HTTP
        (b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"a"', "resets", 200),  # half a body
        (b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{"a"', "resets", 200),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "resets", 200),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "resets", 200),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\xb2\r\n\r\nx", "resets", 200),  # a digit int() refuses
        (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 1\r\n\r\nx", "resets", 200),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 101\r\n\r\n", "oversize", 200),  # refused by its header
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n65\r\n" + b"x" * 101, "oversize", 200),
        (b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 101, "oversize", 200),  # to the end, past the bound
    ],
)
async def test_failures_have_the_kind_they_are_counted_under(reply, kind, status):
    async with server(fixed(reply) if reply is not None else (lambda r: None), close_after=True) as (url, _):
        wire = Wire(url)
        with pytest.raises(WireError) as caught:
            await wire.request("POST", "/generate", b"{}", max_bytes=100)
        wire.close()
    assert (caught.value.kind, caught.value.status) == (kind, status), str(caught.value)


async def test_refused_and_cancelled():
    async with server(fixed(OK)) as (url, _):
        pass  # the port is free again
    wire = Wire(url)
    with pytest.raises(WireError, match="cannot connect to 127.0.0.1") as caught:
        await wire.request("GET", "/x", max_bytes=100)
    assert caught.value.kind == "refused"

    hold = asyncio.Event()

    def never(request: bytes) -> bytes | None:
        hold.set()
        return b""  # writes nothing: the answer never comes

    async with server(never) as (url, accepted):
        wire = Wire(url)
        task = asyncio.ensure_future(wire.request("GET", "/x", max_bytes=100))
        await asyncio.wait_for(hold.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not wire._idle and not wire._busy  # the cancelled exchange's connection is closed, not pooled
        wire.close()


def test_encode_json_writes_what_json_dumps_writes():
    import json

    for payload in (
        {"token_ids": [1, 2, 3], "sampling_params": {"temperature": 0.5, "logit_bias": {7: -1.0}}},
        {"x": None, "y": 2**70},
        [1.5, "é", True],
    ):
        assert json.loads(encode_json(payload)) == json.loads(json.dumps(payload))
    assert encode_json({"x": float("nan")}) == b'{"x": NaN}'  # orjson would write null: the server's default
