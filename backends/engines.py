"""Which inference engine a server URL runs, and the client that speaks to it: SGLang (or the dev server, which
speaks SGLang's protocol) or vLLM. A fleet behind one router is one engine kind: pause modes, weight updates
and even greedy tokens differ between engines, so a mixed fleet is refused, naming which server is which.

How a server is recognised: SGLang (and the dev server) answer `GET /model_info` with an object; vLLM does
not have that route and answers `GET /v1/models` with cards `owned_by: "vllm"`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import aiohttp

from backends.answer import read_json
from backends.base import BackendUnavailable
from backends.server_client import CONTROL_BODY_BYTES, read_bounded

if TYPE_CHECKING:
    from backends.sglang import SGLangBackend
    from backends.vllm import VLLMBackend

ENGINES = ("sglang", "vllm")


async def detect_engine(url: str, timeout_s: float = 10.0) -> str:
    """ "sglang" or "vllm" for the server at `url`; BackendUnavailable when it does not answer in `timeout_s` or
    answers as neither."""
    base = url.rstrip("/")

    # the 200 body, read as the clients read one
    async def get(http: aiohttp.ClientSession, path: str) -> Any:
        async with http.get(base + path) as resp:
            what = f"{base}: GET {path}"
            data = await read_bounded(resp, CONTROL_BODY_BYTES, what)
            if resp.status != 200:
                return None
            return read_json(data, what=what, server=base, status=resp.status, max_bytes=CONTROL_BODY_BYTES)

    try:
        async with asyncio.timeout(timeout_s), aiohttp.ClientSession() as http:
            if isinstance(await get(http, "/model_info"), dict):
                return "sglang"
            body = await get(http, "/v1/models")
    except TimeoutError:
        raise BackendUnavailable(
            f"{base}: no answer within {timeout_s:g} s to /model_info or /v1/models "
            "(which engine it runs cannot be told)",
            server=base,
            kind="timeouts",
        ) from None
    except (aiohttp.ClientError, ValueError) as e:
        raise BackendUnavailable(
            f"{base}: cannot tell which engine it runs ({type(e).__name__}: {e})", server=base
        ) from None
    cards = body.get("data") if isinstance(body, dict) else None
    first = cards[0] if isinstance(cards, list) and cards else None
    if isinstance(first, dict) and first.get("owned_by") == "vllm":
        return "vllm"
    raise BackendUnavailable(
        f"{base}: answers as neither SGLang (no /model_info) nor vLLM (no /v1/models card "
        "owned by vllm); pass the engine explicitly (--engine)",
        server=base,
    )


def client(engine: str, url: str, **options: Any) -> SGLangBackend | VLLMBackend:
    """The client of `engine` for one server; `options` go to its constructor (request_timeout_s, ...)."""
    if engine == "sglang":
        from backends.sglang import SGLangBackend

        return SGLangBackend(url, **options)
    if engine == "vllm":
        from backends.vllm import VLLMBackend

        return VLLMBackend(url, **options)
    raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")


def one_kind(urls: Sequence[str], engines: Sequence[str]) -> str:
    """The fleet's engine, or ValueError naming which server runs what when they differ."""
    kinds = set(engines)
    if len(kinds) > 1:
        which = ", ".join(f"{u} ({e})" for u, e in zip(urls, engines))
        raise ValueError(
            f"a fleet is one engine kind; these servers mix {' and '.join(sorted(kinds))}: {which}"
        )
    return engines[0]


async def detect_fleet(urls: Sequence[str], timeout_s: float = 10.0, default: str = "sglang") -> str:
    """The one engine the servers at `urls` run, each asked at once. A server that does not answer now (down,
    starting) is not counted: the Router's health checks take it out and back in; `default` when none answers.
    ValueError naming each server's engine for a mixed fleet."""
    found = await asyncio.gather(*(detect_engine(u, timeout_s) for u in urls), return_exceptions=True)
    told = [(u, e) for u, e in zip(urls, found) if isinstance(e, str)]
    return one_kind([u for u, _ in told], [e for _, e in told]) if told else default
