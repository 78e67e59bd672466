"""The vLLM client reads vLLM's answers as real vLLM 0.32 gives them: every exchange recorded by
`python -m tests.vllm.record` (tests/fixtures/vllm/exchanges.json) is replayed by a loopback server that
answers exactly the recorded status and body for the recorded request, and `VLLMBackend` is driven through it.
Needs no vLLM; tests/vllm checks the same client against the live server.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from backends.base import BackendRequestError, BackendUnavailable, GenerateRequest
from backends.engines import detect_engine, one_kind
from backends.router import Router
from backends.sglang import SGLangBackend
from backends.vllm import REQUEST_PREFIX, VLLMBackend
from tests.conftest import REPO
from tests.sglang.scenarios import PROMPT

RECORDED = json.loads((REPO / "tests" / "fixtures" / "vllm" / "exchanges.json").read_text())["exchanges"]
BY_NAME = {e["name"]: e for e in RECORDED}


def recorded(name: str) -> dict[str, Any]:
    return BY_NAME[name]


def rpc(body: Any) -> str:
    return str(body.get("method", "")) if isinstance(body, dict) else ""


ANSWERS: dict[str, dict[str, Any]] = {}  # a test's own answer for a route, in place of the recorded one
SEEN: list[str] = []  # the control calls the replay was sent, in order


@pytest.fixture
async def replay() -> AsyncIterator[str]:
    """A server answering each generate by its request_id, and each other route (and query) by its first
    recording."""
    ANSWERS.clear()
    SEEN.clear()
    by_rid = {e["request"]["request_id"]: e for e in RECORDED if e["path"] == "/inference/v1/generate"}
    by_route: dict[tuple[str, str, str], dict[str, Any]] = {}
    for e in RECORDED:  # a pause by its mode, a collective RPC by its method
        by_route.setdefault(
            (e["method"], e["path"], (e["params"] or {}).get("mode", "") or rpc(e["request"])), e
        )

    async def answer(request: web.Request) -> web.Response:
        if request.path == "/inference/v1/generate":
            rid = (await request.json())["request_id"]
            e = by_rid[rid]
        else:
            body = await request.json() if request.can_read_body else None
            e = ANSWERS.get(request.path) or by_route.get(
                (request.method, request.path, request.query.get("mode", "") or rpc(body))
            )
            SEEN.append(f"{request.method} {request.path} {rpc(body)}".strip())
            if e is None:
                return web.json_response({"detail": "Not Found"}, status=404)
        body = e["body"]
        return web.Response(
            status=e["status"], text="" if body is None else json.dumps(body), content_type="application/json"
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


def req(rid: str, max_new: int, prompt: list[int] = PROMPT, **params: Any) -> GenerateRequest:
    return GenerateRequest(
        "s", list(prompt), {"temperature": 0.0, "max_new_tokens": max_new, **params}, rid=rid, vocab_size=576
    )


async def test_generate_answers_parse_as_recorded(replay):
    async with VLLMBackend(replay, max_retries=0) as c:
        greedy = await c.generate(req("rec_greedy", 8))
        body = recorded("greedy")["body"]["choices"][0]
        assert greedy.token_ids == body["token_ids"] and greedy.finish_reason == "length"
        assert greedy.logprobs == [x["logprob"] for x in body["logprobs"]["content"]]
        assert greedy.prompt_tokens == 28 and greedy.cached_tokens == 0
        assert (
            greedy.weight_version is not None
            and greedy.extra["token_versions"] == [greedy.weight_version] * 8
        )
        assert c.context_length == 4096 and c.model_name == recorded("models")["body"]["data"][0]["id"]
        stop = await c.generate(req("rec_stop", 8, stop_token_ids=[485]))
        assert (
            stop.finish_reason == "stop"
            and stop.token_ids[-1] == 485
            and stop.extra["finish"]["matched"] == 485
        )
        bare = await c.generate(
            GenerateRequest(
                "s", PROMPT, {"temperature": 0.0, "max_new_tokens": 3}, rid="rec_nolp", return_logprob=False
            )
        )
        assert bare.logprobs is None and len(bare.token_ids) == 3
        cut = await c.generate(req("rec_abort", 400, ignore_eos=True))  # an abort keeps the partial output
        assert (
            cut.finish_reason == "abort"
            and 0 < len(cut.token_ids) < 400
            and len(cut.logprobs or []) == len(cut.token_ids)
        )
        held = await c.generate(req("rec_pause_keep", 200, ignore_eos=True))
        assert held.finish_reason == "length" and len(held.token_ids) == 200
        early = await c.generate(req("rec_early", 4))
        assert early.extra["token_versions"] == ["7"] * 4


async def test_vllms_refusals_are_one_line_request_errors(replay):
    async with VLLMBackend(replay, max_retries=0, context_length=100_000) as c:
        for rid, prompt, params, words in (
            ("rec_topp", PROMPT, {"top_p": 7.0}, "top_p must be in (0, 1], got 7.0"),
            ("rec_long", [5] * 4100, {}, "longer than the maximum model length of 4096"),
        ):
            with pytest.raises(BackendRequestError) as e:
                await c.generate(req(rid, 10 if rid == "rec_long" else 3, prompt, **params))
            assert words in str(e.value) and "\n" not in str(e.value) and f"rid {rid}" in str(e.value)
        with pytest.raises(
            BackendRequestError, match=r"/pause failed: HTTP 400: 1 validation error: .*'abort', 'wait'"
        ):
            await c._control("POST", "/pause", params={"mode": "retract"})
        with pytest.raises(BackendUnavailable, match="Weight transfer not configured"):
            await c.start_weight_update()


async def test_the_request_is_vllms_shape_and_a_zero_budget_or_unknown_parameter_is_answered_here(replay):
    """vLLM answers max_tokens 0 with a 400 and ignores a sampling parameter it does not know (it ran
    `max_new_tokens` as if absent: recorded "unknown_param"); the client answers the one and refuses the
    other before sending."""
    assert recorded("zero_budget")["status"] == 400 and recorded("unknown_param")["status"] == 200
    async with VLLMBackend(replay, max_retries=0) as c:
        zero = await c.generate(req("never_sent", 0))
        assert (zero.token_ids, zero.finish_reason, c.counts["requests"]) == ([], "length", 0)
        with pytest.raises(BackendRequestError, match="'stop' has no vLLM equivalent|'custom_params'"):
            await c.generate(req("never_sent", 3, custom_params={"x": 1}))
        assert c.counts["requests"] == 0
    sent = recorded("greedy")["request"]
    assert set(sent) == {"token_ids", "request_id", "sampling_params"}
    assert (
        recorded("greedy")["body"]["request_id"] == REQUEST_PREFIX + sent["request_id"]
    )  # what an abort names


async def test_control_answers_are_read_as_recorded(replay):
    async with VLLMBackend(replay, max_retries=0) as c:
        assert await c.health() and await c.is_paused() is False and await c.ready()
        assert await c.flush_cache() is True
        assert (await c.model_info())["weight_version"] == recorded("weight_info")["body"]["weight_version"]
        assert await detect_engine(replay) == "vllm"


async def test_a_fleet_is_one_engine_kind():
    with pytest.raises(
        ValueError,
        match=r"a fleet is one engine kind; these servers mix sglang and vllm: "
        r"http://a:1 \(sglang\), http://b:2 \(vllm\)",
    ):
        Router([SGLangBackend("http://a:1"), VLLMBackend("http://b:2")])
    assert one_kind(["u", "v"], ["vllm", "vllm"]) == "vllm"


async def test_which_engine_answers():
    from backends.devserver import DevServer
    from backends.scripted import echo_backend

    async with DevServer(echo_backend()) as dev:
        assert await detect_engine(dev.url) == "sglang"  # the dev server speaks SGLang's protocol
    app = web.Application()
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:  # answers 404 to everything: neither engine
        with pytest.raises(BackendUnavailable, match="answers as neither SGLang .* nor vLLM"):
            await detect_engine(f"http://127.0.0.1:{runner.addresses[0][1]}")
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ["--launch-sglang", "m", "--launch-vllm", "m"],
            "--launch-sglang and --launch-vllm: a fleet is one engine kind",
        ),
        (
            ["--engine", "sglang", "--launch-vllm", "m"],
            "--engine sglang with --launch-vllm: a fleet is one engine kind",
        ),
    ],
)
def test_the_cli_refuses_two_engine_kinds(capsys, argv, words):
    from tests.test_cli import one_line_error

    assert words in one_line_error(capsys, ["run", "specs/calculator.yaml", *argv])


async def test_an_update_is_exact_through_the_worker_extension_and_refused_without_it(replay):
    """The server has backends/vllm_reload.py (recorded /server_info): the update reloads through it, under a
    keep pause; its report of a head left on other weights fails the update, naming the layer; a CPU server
    without it (vLLM reports no worker_extension_cls) is refused before anything is sent."""
    info, report = recorded("server_info"), recorded("exact_reload")
    assert (
        info["body"]["vllm_config"]["parallel_config"]["worker_extension_cls"]
        == "backends.vllm_reload.ExactReload"
    )
    assert (
        report["body"]["results"][0]["stale"] == [] and "lm_head" in report["body"]["results"][0]["refreshed"]
    )
    async with VLLMBackend(replay, max_retries=0) as c:
        done = await c.update_weights_from_disk("/ckpt/early", weight_version="7")
        assert done["success"] and SEEN == [
            "GET /server_info",
            "POST /pause",
            "POST /collective_rpc agentfsm_reload_weights",
            "POST /update_weight_version",
            "POST /resume",
        ]
        SEEN.clear()
        # the head the plain reload leaves on the old embedding, as the extension measured it on real vLLM
        ANSWERS["/collective_rpc"] = {
            **report,
            "body": {"results": [{"refreshed": ["lm_head"], "stale": [["lm_head", 0.797]]}]},
        }
        with pytest.raises(
            BackendRequestError,
            match=r"computes with other weights than it holds: lm_head \(off by "
            r"0.797 relative\); it does not serve the checkpoint",
        ) as e:
            await c.update_weights_from_disk("/ckpt/early", weight_version="8")
        assert replay in str(e.value) and SEEN[-2:] == [
            "POST /collective_rpc agentfsm_reload_weights",
            "POST /resume",
        ]
    config = info["body"]["vllm_config"]
    ANSWERS["/server_info"] = {
        **info,
        "body": {"vllm_config": {**config, "parallel_config": {"worker_extension_cls": None}}},
    }
    SEEN.clear()
    async with VLLMBackend(replay, max_retries=0) as c:
        with pytest.raises(
            BackendRequestError,
            match="refused an update from /ckpt/early: vLLM's CPU engine keeps "
            "the output head's packed copy through reload_weights",
        ) as e:
            await c.update_weights_from_disk("/ckpt/early", weight_version="9")
        assert "--worker-extension-cls backends.vllm_reload.ExactReload" in str(e.value) and "\n" not in str(
            e.value
        )
    assert SEEN == ["GET /server_info"]  # nothing paused, nothing reloaded
