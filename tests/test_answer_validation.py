"""Hostile server answers never enter a row: each is a counted, absorbed fault or an error row naming the
server, the batch keeps one row per input, nothing hangs and memory stays bounded.

Real HTTP on loopback: HashLM dev servers behind backends/faults.py's proxy, whose hostile kinds
(backends/hostile.py) rewrite the real answer; the client's one check (backends/answer.py) must catch each.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import time

import pytest
import torch
from aiohttp import web

from backends.answer import parse_generate, token_versions
from backends.base import BackendMalformed, GenerateRequest
from backends.devserver import DevServer
from backends.faults import FaultProxy
from backends.hostile import CUT_KINDS, HOSTILE
from backends.router import Router
from backends.sglang import SGLangBackend
from tests.test_server_faults import (  # noqa: F401 (agent and reference are fixtures)
    agent,
    assert_faults_add_up,
    assert_rows_right_or_errors,
    fleet,
    hashlm,
    reference,
    router,
    rows,
    run,
)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(HOSTILE))
async def test_each_hostile_answer_is_a_counted_fault_never_a_row(agent, tok, reference, kind):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    async with fleet(2, rates={kind: 0.3}, seed=3) as (_, proxies):
        trajs, batch, stats = await run(agent, tok, router([p.url for p in proxies], max_retries=2), rows(16))
    assert sum(p.injected[kind] for p in proxies) > 0, (
        "the plan injected nothing: the test would prove nothing"
    )
    if kind in CUT_KINDS:  # the rows it landed on say the context cut them, the others are untouched
        cut = [i for i, t in enumerate(trajs) if t.termination_reason == "context_length"]
        assert cut and all(
            trajs[i].extra["spec_reason"] == "done" and trajs[i].extra["context_cut"] for i in cut
        )
        for i, t in enumerate(trajs):  # a cut row keeps what came before its empty turn, unchanged
            n = len(t.response_ids) if i in cut else None
            for key in ("responses", "response_mask", "rollout_log_probs"):
                assert torch.equal(batch.batch[key][i][:n], reference.batch[key][i][:n]), (i, key)
    else:
        assert_rows_right_or_errors(trajs, batch, reference)
    summary = assert_faults_add_up(trajs, stats, proxies)
    assert summary["error_rows"] == 0  # 30 % of answers, 3 attempts per server and 3 routes: all absorbed
    counter = HOSTILE[kind][1]
    if counter is None:  # a valid form: mapped, nothing counted
        assert not any(summary["faults"].values())
        assert int(batch.batch["weight_versions"].max()) < 2**31
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 400_000  # KiB: no huge expansion


@pytest.mark.parametrize(
    "kind,words",
    [
        ("out_of_vocab", "token id 9999 outside the vocabulary [0, 576)"),
        ("negative_id", "token id -5 outside the vocabulary"),
        ("nan_logprob", "logprob nan: logprobs are finite and <= 0"),
        ("positive_logprob", "logprob 7.5"),
        ("bool_logprob", "not [logprob, id, text] triples"),
        ("past_stop", "token(s) after stop id 2"),
        ("more_than_asked", "output ids where max_new_tokens was"),
        ("huge_version_span", "meta_info.weight_versions"),
        ("string_count", "meta_info.cached_tokens '5', not a non-negative integer"),
        ("oversize", "past the"),
        ("huge_logprob", "logprob '-100000000000"),
        ("short_triples_phantom", "output logprobs for"),
        ("deep_json", "JSON nested 50001 levels deep, past the 64-level bound"),
        ("mismatched_logprob_ids", "logprobs for other tokens"),
    ],
)
async def test_a_server_that_always_lies_gives_an_error_row_naming_it(agent, tok, kind, words):
    async with fleet(1, rates={kind: 1.0}) as (_, proxies):
        (traj,), batch, stats = await run(
            agent, tok, router([proxies[0].url], max_retries=1, reroutes=0), rows(1)
        )
    reason = traj.termination_reason
    assert reason.startswith("error: backend: ") and proxies[0].url in reason and words in reason, reason
    assert "\n" not in reason and len(traj.response_ids) == 0
    assert stats["faults"][HOSTILE[kind][1]] == 2  # the first attempt and its retry, each counted by kind


@pytest.mark.parametrize(
    "kind", ["huge_logprob", "short_triples_phantom", "deep_json", "out_of_vocab", "mismatched_logprob_ids"]
)
async def test_a_lying_server_beside_a_healthy_one_loses_no_row(agent, tok, reference, kind):
    """The JSON edge cases (issue 27 item 4) fail over like out-of-vocabulary ids: counted, no row lost."""
    async with (
        DevServer(hashlm()) as liar_dev,
        DevServer(hashlm()) as good_dev,
        FaultProxy(liar_dev.url, rates={kind: 1.0}) as liar,
        FaultProxy(good_dev.url) as good,
    ):
        trajs, batch, stats = await run(agent, tok, router([liar.url, good.url], max_retries=1), rows(16))
    assert liar.injected[kind] > 0
    assert not any(t.failed for t in trajs), [t.termination_reason for t in trajs if t.failed]
    assert_rows_right_or_errors(trajs, batch, reference)
    summary = assert_faults_add_up(trajs, stats, [liar, good])
    assert summary["faults"][HOSTILE[kind][1]] == liar.injected[kind] and stats["failovers"] >= 1


def _req(**params) -> GenerateRequest:
    return GenerateRequest(
        "s", [1, 2, 3], {"max_new_tokens": 4, "stop_token_ids": [2], **params}, vocab_size=576
    )


def _answer(ids, logprobs=None, **meta):
    lps = logprobs if logprobs is not None else [-0.5] * len(ids)
    return {
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": "stop"},
            "prompt_tokens": 3,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
            **meta,
        },
    }


def _triples(ids, triples):
    body = _answer(ids)
    body["meta_info"]["output_token_logprobs"] = triples
    return body


_BAD_TRIPLES = [
    [[-0.5, 5, None], [-0.5, True, None]],  # True == 1: an id is an int
    [[-0.5, 5, None], [True, 1, None]],
    [[-0.5, 5, None], [float("nan"), 1, None]],
    [[-0.5, 5, None], [float("inf"), 1, None]],
    [[float("-inf"), 5, None], [float("inf"), 1, None]],  # each alone bad; their sum NaN
    [[-0.5, 5, None], [0.5, 1, None]],
    [[-0.5, 5, None], [-(10**400), 1, None]],
    [[-0.5, 5, None], [-0.5]],
    [[-0.5, 5, None], {"0": -0.5, "1": 1}],
    [[-0.5, 5, None], "ab"],
    [[-0.5, 5, None], [-0.5, 2, None]],
]


def test_the_check_accepts_exactly_what_sglang_may_send():
    ok = parse_generate(
        _answer([5, 7, 2], weight_version=3, cached_tokens=0), server="s", return_logprob=True, request=_req()
    )
    assert ok.token_ids == [5, 7, 2] and ok.weight_version == "3" and ok.logprobs == [-0.5] * 3
    assert parse_generate(
        _answer([5, 2], [0.0, -0.0]), server="s", return_logprob=True, request=_req()
    ).logprobs
    # finite, though their sum overflows: the close read takes them
    assert parse_generate(
        _answer([5, 2], [-1e308, -1e308]), server="s", return_logprob=True, request=_req()
    ).logprobs == [-1e308, -1e308]
    assert parse_generate(
        _answer([2, 5], ignore=1), server="s", return_logprob=True, request=_req(ignore_eos=True)
    ).token_ids == [2, 5]
    for body, kind in [
        (_answer([5, True]), "malformed"),
        (_answer([5, 2**31 + 5]), "bad_ids"),
        (_answer([5, 7], [float("-inf"), -1.0]), "bad_logprobs"),
        (_answer([5, 7], weight_version={"v": 1}), "bad_fields"),
        (_answer([5, 7], prompt_tokens=True), "bad_fields"),
        (_answer([5, 7], weight_version="x" * 300), "bad_fields"),
        ({**_answer([5, 7]), "output_ids": [5, 8]}, "bad_logprobs"),  # right count, another token's logprob
        ({**_answer([5, 1]), "output_ids": [5, True]}, "malformed"),
        *((_triples([5, 1], t), "bad_logprobs") for t in _BAD_TRIPLES),  # past the one-pass read of logprobs
    ]:
        with pytest.raises(BackendMalformed) as e:
            parse_generate(body, server="s", return_logprob=True, request=_req())
        assert e.value.kind == kind, (body, e.value)


def test_version_spans_are_checked_before_they_are_expanded():
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="end 1000000000000"):
        token_versions([{"version": "1", "start": 0, "end": 10**12}], 3)
    assert time.perf_counter() - t0 < 0.1
    assert token_versions(
        [{"version": "1", "start": 0, "end": 2}, {"version": 2, "start": 2, "end": 3}], 3
    ) == ["1", "1", "2"]
    assert token_versions([{"version": "1", "start": 0, "end": 2}], 3) is None  # not covering: fall back
    assert token_versions([{"version": "0", "start": 0, "end": 0}], 0) == []  # a waiting-queue abort's span


# --- outages and slow metadata --------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_fleet_wide_outage_shorter_than_the_retry_window_costs_no_row(agent, tok, reference):
    async with fleet(2) as (_, proxies):
        for p in proxies:
            p.outage(2.0)
        backend = Router(
            [SGLangBackend(p.url, backoff_s=0.005) for p in proxies],
            health_interval_s=0,
            cooldown_s=0.05,
            retry_window_s=30,
        )
        trajs, batch, stats = await run(agent, tok, backend, rows(16))
    assert sum(p.injected["outage"] for p in proxies) > 0
    assert not any(t.failed for t in trajs)
    assert_rows_right_or_errors(trajs, batch, reference)


async def test_without_a_window_the_same_outage_fails_rows(agent, tok):
    async with fleet(1) as (_, proxies):
        proxies[0].outage(2.0)
        backend = Router(
            [SGLangBackend(proxies[0].url, backoff_s=0.005)], health_interval_s=0, retry_window_s=0
        )
        trajs, _, _ = await run(agent, tok, backend, rows(2))
    assert all(t.failed and "HTTP 503" in t.termination_reason for t in trajs)


@contextlib.asynccontextmanager
async def info_server(
    upstream: str, *, hang_info: bool = False, context_length: object = None, deep_info: bool = False
):
    """Forwards /generate to `upstream`; its /model_info hangs or (`deep_info`) is 50,000 levels deep, or its
    /server_info says `context_length`."""
    import aiohttp

    stop = asyncio.Event()

    async def model_info(request: web.Request) -> web.Response:
        if hang_info:
            await stop.wait()
        if deep_info:
            return web.Response(
                body=b'{"model_path": "m", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
                content_type="application/json",
            )
        return web.json_response({"model_path": "m", "weight_version": "default"})

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"context_length": context_length, "max_req_input_len": None})

    async def forward(request: web.Request) -> web.Response:
        async with (
            aiohttp.ClientSession() as http,
            http.post(upstream + request.path, data=await request.read()) as r,
        ):
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    app = web.Application()
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/server_info", server_info)

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/ready", ready)
    app.router.add_post("/generate", forward)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        stop.set()
        await runner.cleanup()


@pytest.mark.slow
async def test_a_server_whose_info_hangs_costs_each_row_one_deadline_not_a_queue(agent, tok):
    async with DevServer(hashlm()) as dev, info_server(dev.url, hang_info=True) as stuck:
        clients = [SGLangBackend(u, request_timeout_s=1.0, backoff_s=0.005) for u in (stuck, dev.url)]
        backend = Router(clients, health_interval_s=0, retry_window_s=0)
        t0 = time.monotonic()
        trajs, _, stats = await run(agent, tok, backend, rows(8))
        elapsed = time.monotonic() - t0
    assert not any(t.failed for t in trajs)
    assert stats["faults"]["timeouts"] >= 1 and stats["failovers"] >= 1
    assert elapsed < 20, elapsed  # rows queued behind a lock would take 8 deadlines and more


@pytest.mark.slow
async def test_a_lone_server_whose_info_hangs_gives_error_rows_not_a_traceback(agent, tok):
    async with DevServer(hashlm()) as dev, info_server(dev.url, hang_info=True) as stuck:
        backend = Router([SGLangBackend(stuck, request_timeout_s=0.5)], health_interval_s=0, retry_window_s=0)
        trajs, _, _ = await run(agent, tok, backend, rows(2))
    assert all(t.failed and "gave no answer within 0.5 s" in t.termination_reason for t in trajs)


async def test_malformed_server_info_is_one_line_naming_the_server(agent, tok):
    async with DevServer(hashlm()) as dev, info_server(dev.url, context_length="abc") as odd:
        backend = Router(
            [SGLangBackend(odd, max_retries=0)], health_interval_s=0, max_retries=0, retry_window_s=0
        )
        (traj,), _, _ = await run(agent, tok, backend, rows(1))
    reason = traj.termination_reason
    assert (
        traj.failed
        and odd in reason
        and "server info has context_length 'abc', not a positive integer" in reason
    )


async def test_a_deep_json_model_info_is_a_server_fault_not_a_crash(agent, tok):
    """Issue 27 item 5: a 50,000-deep /model_info left the run with a RecursionError traceback at start."""
    from fsm.api import ServerNotReady, probe_servers

    async with DevServer(hashlm()) as dev, info_server(dev.url, deep_info=True) as deep:
        probe = await probe_servers([deep, dev.url], timeout_s=5.0)
        assert probe.servers == [dev.url]
        assert "JSON nested 50001 levels deep, past the 64-level bound" in probe.left_out[deep]
        with pytest.raises(ServerNotReady, match="nested 50001 levels deep"):
            await probe_servers([deep], timeout_s=5.0)
        clients = [SGLangBackend(u, max_retries=0) for u in (deep, dev.url)]
        trajs, _, stats = await run(
            agent, tok, Router(clients, health_interval_s=0, retry_window_s=0), rows(4)
        )
    assert not any(t.failed for t in trajs) and stats["faults"]["malformed"] >= 1 and stats["failovers"] >= 1


@pytest.mark.slow
async def test_the_start_probe_leaves_out_bad_servers_unless_strict():
    from fsm.api import ServerNotReady, probe_servers

    black_hole = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, never reads
    hole = f"http://127.0.0.1:{black_hole.sockets[0].getsockname()[1]}"
    try:
        async with DevServer(hashlm()) as dev, info_server(dev.url, context_length="abc") as odd:
            t0 = time.monotonic()
            probe = await probe_servers([hole, dev.url, odd, "http://127.0.0.1:9"], timeout_s=2.0)
            assert time.monotonic() - t0 < 10
            assert probe.servers == [dev.url]
            assert set(probe.left_out) == {hole, odd, "http://127.0.0.1:9"}
            assert (
                "no answer within 2 s" in probe.left_out[hole]
                and "context_length 'abc'" in probe.left_out[odd]
            )
            with pytest.raises(ServerNotReady, match="context_length 'abc'"):
                await probe_servers([dev.url, odd], strict=True, timeout_s=2.0)
            with pytest.raises(ServerNotReady, match=hole):
                await probe_servers([hole], timeout_s=1.0)
    finally:
        black_hole.close()


async def test_an_empty_turn_that_says_length_is_the_contexts_cut(agent, tok, reference):
    """Issue 36 item 3: 0 tokens with finish "length" where tokens were asked ended the row `done` with an empty
    response. Whatever backend answers it (here a generate function, which reports no context length), only a
    full context answers that: the row ends `context_length`, the spec's name for the end kept in extra."""
    from backends.function import FunctionBackend

    async with DevServer(hashlm()) as dev:
        real = SGLangBackend(dev.url)

        async def generate(prompt_ids: list[int], params: dict) -> dict:
            if "What is 1 * 4?" in tok.decode(prompt_ids):
                return {"token_ids": [], "logprobs": [], "finish_reason": "length"}
            answer = await real.generate(GenerateRequest("s", prompt_ids, dict(params), return_logprob=True))
            return {
                "token_ids": answer.token_ids,
                "logprobs": answer.logprobs,
                "finish_reason": answer.finish_reason,
            }

        trajs, batch, _ = await run(agent, tok, FunctionBackend(generate), rows(3))
        await real.close()
    reasons = [t.termination_reason for t in trajs]
    expected = list(reference.non_tensor_batch["termination_reason"][:3])
    assert reasons == [expected[0], "context_length", expected[2]], (
        reasons,
        expected,
        trajs[1].extra,
        trajs[1].last_finish_reason,
    )
    cut = trajs[1]
    assert len(cut.response_ids) == 0 and cut.extra["spec_reason"] == "done"
    assert cut.extra["context_cut"] == len(cut.prompt_ids)  # no context length known: what the request held
    for i in (0, 2):
        for key in ("responses", "rollout_log_probs"):
            assert torch.equal(batch.batch[key][i], reference.batch[key][i]), (i, key)
