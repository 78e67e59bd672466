"""Sessions pinned by id across two gateway processes behind a front (fsm/gateway/front.py): each worker is its
own engine process; every session's calls land on the process that owns it, and each row is complete and
token-exact against the prompts its worker's backend was given."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import ClientSession

from bench.gateway import run_workers
from fsm.gateway import Gateway
from fsm.gateway.front import Front


@pytest.mark.slow
def test_two_worker_processes_behind_one_front():
    out = asyncio.run(run_workers(workers=2, sessions=6))
    assert out["routed"] == {"w0": 6, "w1": 6}  # 3 sessions each, 2 model calls each, every one on its owner
    assert len(out["rows"]) == 6
    for row in out["rows"]:
        assert row["ok"] and len(row["requests"]) == 2
        context = row["prompt"] + row["response"]
        starts = [start for start, _end, role in row["runs"] if role == "assistant"]
        for prompt, start in zip(row["requests"], starts):
            assert (
                prompt == context[: len(row["prompt"]) + start]
            )  # what the backend was given, token for token
        for start, end, role in row["runs"]:
            assert set(row["mask"][start:end]) == ({1} if role == "assistant" else {0})


def test_the_front_refuses_unknown_workers_and_a_dead_one():
    async def main() -> list[tuple[int, dict]]:
        async with Front(timeout_s=10) as front, ClientSession() as http:
            front.register("w0", "http://127.0.0.1:9")  # nothing listens there
            out = []
            for sid in ("w7-abc", "abc", "w0-abc"):
                async with http.post(f"{front.url}/sessions/{sid}/v1/chat/completions", json={}) as r:
                    out.append((r.status, await r.json()))
            return out

    (unknown, status_u), (untagged, _), (dead, status_d) = asyncio.run(main())
    assert unknown == untagged == 401 and status_u["error"]["code"] == "invalid_api_key"
    assert dead == 502 and "gateway worker 'w0'" in status_d["error"]["message"]


def test_a_tagged_gateway_hands_out_the_fronts_url():
    gateway = Gateway(tag="w3", front="http://127.0.0.1:1234")
    session = gateway.open("t")
    assert (
        session.id.startswith("w3-") and session.base_url == f"http://127.0.0.1:1234/sessions/{session.id}/v1"
    )


def test_a_worker_registers_only_with_the_token_once_and_a_port():
    joined = []

    async def main() -> list[int]:
        async with (
            Front(token="s3cret", expects={"w0"}, on_register=joined.append) as front,
            ClientSession() as http,
        ):
            out = []
            for tag, key, body in (
                ("w0", "wrong", {"port": 4000}),
                ("w9", "s3cret", {"port": 4000}),
                ("w0", "s3cret", {"port": "x"}),
                ("w0", "s3cret", {"port": 4000}),
                ("w0", "s3cret", {"port": 4001}),
            ):
                async with http.post(
                    f"{front.url}/workers/{tag}", json=body, headers={"Authorization": f"Bearer {key}"}
                ) as r:
                    out.append(r.status)
            return out, dict(front.workers)

    statuses, workers = asyncio.run(main())
    assert statuses == [401, 409, 400, 200, 409]  # the wrong token, an unexpected tag, no port, once only
    assert joined == ["w0"] and workers == {"w0": "http://127.0.0.1:4000"}
