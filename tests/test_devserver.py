"""The dev server speaks SGLang 0.5.23's wire format (reference/sglang-http.md): shapes, status codes, semantics."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from backends.base import BackendRequestError, GenerateRequest
from backends.devserver import DevServer
from backends.prefix_cache import PrefixCache
from backends.scripted import echo_backend
from backends.sglang import SGLangBackend


@pytest.fixture
async def srv():
    async with DevServer(echo_backend(latency_s=0.05), context_length=64) as s:
        yield s


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, body: Any = None) -> tuple[int, Any]:
    async with http.post(url, json=body) as r:
        text = await r.text()
        return r.status, (json.loads(text) if text and r.content_type == "application/json" else text)


def gen(ids: list[int], rid: str, **params: Any) -> dict[str, Any]:
    return {"input_ids": ids, "rid": rid, "return_logprob": True, "sampling_params": params}


async def test_generate_shape_and_cached_tokens_grow_across_turns(srv, http):
    context = list(range(1, 11))
    cached = []
    for turn in range(3):
        status, body = await post(
            http, srv.url + "/generate", gen(context, f"s1_t{turn:02d}", max_new_tokens=16)
        )
        assert status == 200
        meta = body["meta_info"]
        assert "text" not in body  # no tokenizer: like --skip-tokenizer-init
        assert list(meta) == [
            "id",
            "finish_reason",
            "prompt_tokens",
            "weight_version",
            "num_retractions",
            "input_token_logprobs",
            "output_token_logprobs",
            "output_token_logprobs_length",
            "reasoning_tokens",
            "completion_tokens",
            "cached_tokens",
            "weight_versions",
            "cached_tokens_details",
            "dp_rank",
            "e2e_latency",
            "response_sent_to_client_ts",
        ]
        out = body["output_ids"]
        assert meta["finish_reason"] == {"type": "stop", "matched": 2} and out[-1] == 2  # eos included
        assert [t[1] for t in meta["output_token_logprobs"]] == out
        assert all(t[2] is None and isinstance(t[0], float) for t in meta["output_token_logprobs"])
        assert meta["id"] == f"s1_t{turn:02d}" and meta["prompt_tokens"] == len(context)
        cached.append(meta["cached_tokens"])
        expected_cached = 0 if turn == 0 else len(context) - 3  # everything but this turn's observation
        assert meta["cached_tokens"] == expected_cached
        context = context + out + [3, 4, 5]
    assert cached[0] < cached[1] < cached[2]


async def test_length_finish_reason(srv, http):
    status, body = await post(http, srv.url + "/generate", gen([1, 2, 3], "len", max_new_tokens=4))
    assert status == 200 and body["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert len(body["output_ids"]) == 4


async def test_streaming_is_cumulative_and_ends_with_done(srv, http):
    async with http.post(srv.url + "/generate", json={**gen([1, 2, 3], "st"), "stream": True}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        raw = (await r.read()).decode()
    events = [e[len("data: ") :] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 9  # 8 echo ids + eos, one per token
    for i, chunk in enumerate(chunks):
        assert len(chunk["output_ids"]) == i + 1 == len(chunk["meta_info"]["output_token_logprobs"])
        assert chunk["output_ids"] == chunks[-1]["output_ids"][: i + 1]
        assert (chunk["meta_info"]["finish_reason"] is None) == (i < len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "stop"


async def test_streaming_error_is_an_event(srv, http):
    async with http.post(srv.url + "/generate", json={**gen(list(range(70)), "big"), "stream": True}) as r:
        raw = (await r.read()).decode()
    first, done = [e for e in raw.split("\n\n") if e]
    err = json.loads(first[len("data: ") :])["error"]
    assert "longer than the model's context length (64 tokens)" in err["message"]
    assert (err["type"], err["code"], err["retryable"], done) == (
        "invalid_request_error",
        400,
        False,
        "data: [DONE]",
    )


async def test_refusals_have_sglang_bodies(srv, http):
    url = srv.url + "/generate"
    status, body = await post(http, url, gen([1, 2], "a", seed=1))
    assert status == 400 and isinstance(body["error"], str)
    assert body["error"].startswith("unknown field `seed`, expected one of `max_new_tokens`")
    status, body = await post(http, url, gen([1, 2], "a", temperature="hot"))
    assert (status, body) == (400, {"error": 'invalid type: string "hot", expected f64'})
    status, body = await post(http, url, gen(list(range(64)), "a"))
    assert (status, body) == (
        400,
        {
            "error": {
                "message": "The input (64 tokens) is longer than the model's context length (64 tokens)."
            }
        },
    )
    status, body = await post(http, url, gen(list(range(58)), "a"))  # SGLang: max_req_input_len = context - 6
    assert (status, body) == (
        400,
        {
            "error": {
                "message": "Input length (58 tokens) exceeds the maximum allowed "
                "length (58 tokens). Use a shorter input or enable "
                "--allow-auto-truncate."
            }
        },
    )
    status, body = await post(http, url, gen(list(range(50)), "a", max_new_tokens=15))
    assert status == 400 and body["error"]["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 64 tokens. You requested a total "
        "of 65 tokens: 50 tokens from the input messages and 15 tokens for the completion."
    )
    status, body = await post(http, url, gen(list(range(50)), "a", max_new_tokens=14))  # fits: cut, silently
    assert status == 200 and body["meta_info"]["finish_reason"] in (
        {"type": "length", "length": 12},
        {"type": "stop", "matched": 2},
    )
    async with http.post(url, data=b"{not json", headers={"Content-Type": "application/json"}) as r:
        body = await r.json()
    assert (
        r.status == 400
        and body["object"] == "error"
        and body["code"] == 400
        and body["type"] == "Bad Request"
    )


async def test_duplicate_live_rid_is_refused_then_reusable(srv, http):
    url = srv.url + "/generate"
    first = asyncio.create_task(post(http, url, gen([1, 2, 3], "dup_t00")))
    await asyncio.sleep(0.01)
    status, body = await post(http, url, gen([1, 2, 3], "dup_t00"))
    assert (status, body) == (400, {"error": {"message": "Duplicate request ID detected: dup_t00"}})
    assert (await first)[0] == 200
    assert (await post(http, url, gen([1, 2, 3], "dup_t00")))[0] == 200  # finished: the rid may be reused


async def test_abort_request_matches_by_prefix_of_a_live_rid(srv, http):
    url = srv.url + "/generate"
    rids = ["traj42", "traj42_t01", "traj43_t01"]
    tasks = [asyncio.create_task(post(http, url, gen([1, 2, 3], rid))) for rid in rids]
    await asyncio.sleep(0.01)
    assert await post(http, srv.url + "/abort_request", {"rid": "traj4"}) == (200, "")  # not live: nothing
    assert await post(http, srv.url + "/abort_request", {"rid": "traj42"}) == (200, "")
    bodies = [body for _, body in await asyncio.gather(*tasks)]
    reasons = [b["meta_info"]["finish_reason"] for b in bodies]
    abort = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert reasons[:2] == [abort, abort] and reasons[2]["type"] == "stop"
    assert bodies[0]["meta_info"]["prompt_tokens"] == 3 and "cached_tokens" in bodies[0]["meta_info"]


async def test_abort_in_waiting_queue_has_no_prompt_tokens(http):
    async with DevServer(echo_backend(latency_s=0.2), max_running_requests=1) as srv:
        running = asyncio.create_task(post(http, srv.url + "/generate", gen([1, 2], "run_t00")))
        waiting = asyncio.create_task(post(http, srv.url + "/generate", gen([1, 2], "wait_t00")))
        await asyncio.sleep(0.05)
        async with http.get(srv.url + "/v1/loads") as r:
            load = (await r.json())["loads"][0]
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (1, 1)
        await post(http, srv.url + "/abort_request", {"rid": "wait_t00"})
        status, body = await waiting
        assert status == 200 and body["output_ids"] == []
        meta = body["meta_info"]
        assert body["text"] == ""  # as SGLang's, even without a tokenizer (tests/fixtures/sglang/pauses.json)
        assert meta == {
            "id": "wait_t00",
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "weight_version": "default",
            "e2e_latency": meta["e2e_latency"],
            "weight_versions": [{"version": "default", "start": 0, "end": 0}],
            "input_token_logprobs": [],
            "output_token_logprobs": [],
            "output_token_logprobs_length": 0,
            "completion_tokens": 0,
            "response_sent_to_client_ts": meta["response_sent_to_client_ts"],
        }
        assert (await running)[0] == 200


async def test_info_health_and_loads(srv, http):
    for path in ("/health", "/health_generate", "/ready"):
        async with http.get(srv.url + path) as r:
            assert r.status == 200 and await r.read() == b""
    infos = []
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        async with http.get(srv.url + path) as r:
            infos.append(await r.json())
    assert (
        infos[0] == infos[1] and infos[0]["model_path"] == "echo" and infos[0]["weight_version"] == "default"
    )
    assert infos[2] == infos[3] and infos[2]["context_length"] == 64 and infos[2]["max_req_input_len"] == 58
    async with http.get(srv.url + "/v1/loads") as r:
        loads = await r.json()
    assert set(loads) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    assert loads["loads"][0]["num_running_reqs"] == 0
    srv.failing = True
    async with http.get(srv.url + "/health") as r:
        assert r.status == 503
    status, body = await post(http, srv.url + "/generate", gen([1], "x"))
    assert status == 503 and body["code"] == 503 and body["object"] == "error"


async def test_control_calls_through_the_client(srv, http):
    async with SGLangBackend(srv.url) as b:
        assert b.context_length is None
        await b.generate(GenerateRequest("c", [1, 2, 3, 4], {}, rid="c_t00"))
        assert b.context_length == 64 and b.model_name == "echo"
        assert await b.health() and await b.ready()
        await b.wait_ready(timeout=5)
        assert srv.cache.size > 0
        assert await b.flush_cache() is True and srv.cache.size == 0

        slow = asyncio.create_task(b.generate(GenerateRequest("c", [1, 2, 3, 4], {}, rid="c_t01")))
        await asyncio.sleep(0.01)
        assert await b.flush_cache() is False  # a request is running
        await b.abort("c")  # the session's live rid, found by the client
        res = await slow
        assert (res.finish_reason, res.abort_message) == ("abort", "Aborted")

        assert (await b.pause_generation("in_place"))["status"] == "ok"
        assert not await b.ready()
        paused = asyncio.create_task(b.generate(GenerateRequest("c", [5, 6], {}, rid="c_t02")))
        await asyncio.sleep(0.1)
        assert not paused.done()
        assert (await b.continue_generation())["message"] == "Generation continued successfully."
        assert (await paused).finish_reason == "stop"

        await b.sleep(["kv_cache"])
        assert srv.memory_released == {"kv_cache"} and srv.cache.size == 0
        await b.wake_up()
        assert srv.memory_released == set()
        out = await b.update_weights_from_disk("/ckpt/step-3", weight_version="step-3")
        assert out == {
            "success": True,
            "num_paused_requests": 0,
            "message": "Succeeded to update model weights. Weight version updated to step-3.",
        }
        res = await b.generate(GenerateRequest("c", [7, 8], {}, rid="c_t03"))
        assert res.weight_version == "step-3"
        with pytest.raises(BackendRequestError, match="model_path is required"):  # 400 {"success": false}
            await b.update_weights_from_disk("")


def test_prefix_cache_radix_and_lru_budget():
    cache = PrefixCache(max_tokens=10)
    cache.insert([1, 2, 3, 4, 5])
    cache.insert([1, 2, 3, 9, 9])  # splits the edge after [1, 2, 3]
    assert cache.size == 7 and cache.match([1, 2, 3, 9, 9, 7]) == 5 and cache.match([1, 2, 4]) == 2
    cache.match([1, 2, 3, 4, 5])  # touch: [4, 5] is now the most recent leaf
    cache.insert([8, 8, 8, 8])  # 11 tokens > 10: the least recently used leaf [9, 9] is trimmed
    assert cache.size == 10 and cache.match([1, 2, 3, 9, 9]) == 4 and cache.match([1, 2, 3, 4, 5]) == 5
    cache.insert(list(range(100, 120)))  # bigger than the budget: older entries go first, then its tail
    assert cache.size == 10 and cache.match(list(range(100, 120))) == 10 and cache.match([1, 2, 3]) == 0


def _flags(parser: Any) -> dict[str, tuple[Any, ...]]:
    """Each flag of a parser: its dest, default, type, choices, metavar and help."""
    import argparse

    return {
        "/".join(a.option_strings): (a.dest, a.default, a.type, a.choices, a.metavar, a.help)
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction)
    }


def test_the_dev_server_and_agentfsm_dev_server_parse_the_same_flags():
    """One declaration (backends/devflags.py): `python -m backends.devserver` and `agentfsm dev-server` accept
    the same flags with the same defaults, checks and help; SGLang's launch flags still pass the dev server."""
    import argparse

    from backends import devserver
    from fsm.cli.commands import build_parser

    cli = build_parser(["dev-server"])
    (sub,) = (a for a in cli._actions if isinstance(a, argparse._SubParsersAction))
    own = devserver.parser()
    assert _flags(own) == _flags(sub.choices["dev-server"])
    assert (
        own.format_help().split("options:")[1] == sub.choices["dev-server"].format_help().split("options:")[1]
    )
    assert {"--model/--model-path", "--hashlm", "--scripted-calculator", "--latency", "--port"} <= set(
        _flags(own)
    )
    for bad in (["--port", "0"], ["--context-length", "8"], ["--dtype", "fp8"], ["--latency", "-1"]):
        with pytest.raises(SystemExit):  # the CLI's checks, in both
            own.parse_known_args(bad)
    args, ignored = own.parse_known_args(["--model-path", "m", "--tp-size", "2", "--port", "31000"])
    assert (args.model, args.port, args.log_level, ignored) == ("m", 31000, "info", ["--tp-size", "2"])
