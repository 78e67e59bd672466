"""Servers that fail, lie or hang: every row comes back right or as an error row with a reason, none is lost,
and the summary's fault counts equal what was injected.

Real HTTP on loopback: HashLM dev servers (deterministic, so a fault-free run is the reference for every
row) behind backends/faults.py's proxy, the SGLang client and the router; real processes where one is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.answer import ANSWER_FAULTS
from backends.devserver import DevServer
from backends.faults import CLIENT_COUNTER, FaultProxy
from backends.launcher import SGLangLauncher
from backends.router import Router
from backends.scripted import HashLM
from backends.sglang import SGLangBackend
from fsm.output.batch import fault_summary
from fsm.run.runtime import Runner
from tests.conftest import ASSETS, until, user_row
from tests.test_router import _free_ports

SPEC = """
    name: faults
    extends: {specs}/single_turn.yaml
    limits:
      prompt_length: 64
      response_length: 48
      max_resumes: 20
%s
"""
FAILED_ATTEMPTS = ("http_errors", "refused", "disconnects", "resets", "timeouts", *ANSWER_FAULTS)


def hashlm(**kw: Any) -> HashLM:
    return HashLM(vocab=516, eos=2, stop_every=30, **kw)


def rows(n: int) -> list[dict]:
    return [user_row(f"What is {i} * {i + 3}?") for i in range(n)]


def router(urls: list[str], *, max_retries: int = 2, reroutes: int = 2, **client_kw: Any) -> Router:
    clients = [SGLangBackend(u, max_retries=max_retries, backoff_s=0.005, **client_kw) for u in urls]
    return Router(clients, health_interval_s=0, max_retries=reroutes, cooldown_s=0.05, retry_window_s=0)


async def run(agent: Any, tok: Any, backend: Any, data: list[dict]):
    from fsm.api import RolloutEngine

    async with RolloutEngine(agent, tok, backend=backend) as engine:
        sampling = engine.sampling({"temperature": 0.0})
        trajs = await engine.arun(data, sampling=sampling)
        batch = engine.to_batch(trajs, sampling)
        stats = backend.stats()
    return trajs, batch, stats


@contextlib.asynccontextmanager
async def fleet(count: int, **proxy_kw: Any):
    """`count` HashLM dev servers, each behind its own fault proxy: (devs, proxies)."""
    async with contextlib.AsyncExitStack() as stack:
        devs = [await stack.enter_async_context(DevServer(hashlm())) for _ in range(count)]
        proxies = [await stack.enter_async_context(FaultProxy(d.url, **proxy_kw)) for d in devs]
        yield devs, proxies


def injected(proxies: list[FaultProxy]) -> Counter[str]:
    return sum((p.injected for p in proxies), Counter())


def assert_rows_right_or_errors(trajs, batch, ref) -> None:
    """No row carries an empty or truncated turn: each equals the fault-free run's row, or is an error row."""
    assert len(trajs) == len(ref)  # none lost
    for i, t in enumerate(trajs):
        if t.failed:
            assert t.termination_reason.startswith("error: ") and len(t.response_ids) == 0
            assert int(batch.batch["response_mask"][i].sum()) == 0
            continue
        for key in ("responses", "response_mask", "rollout_log_probs"):
            assert torch.equal(batch.batch[key][i], ref.batch[key][i]), (i, key, t.termination_reason)


def assert_faults_add_up(trajs, stats, proxies) -> dict[str, Any]:
    """The summary's counts equal the proxies' injections, and every failure has exactly one consequence."""
    summary = fault_summary(trajs, stats)
    expected = Counter()
    for kind, n in injected(proxies).items():
        if CLIENT_COUNTER.get(kind) is not None:  # None: a valid form the client absorbs
            expected[CLIENT_COUNTER[kind]] += n
    assert {k: v for k, v in summary["faults"].items() if v} == dict(expected)
    failed_attempts = sum(summary["faults"][k] for k in FAILED_ATTEMPTS)
    ended_on_failure = sum(n for k, n in summary["error_reasons"].items() if k in ("backend", "timeout"))
    assert failed_attempts == summary["retries"] + summary["failovers"] + ended_on_failure
    aborts = summary["faults"]["aborts_waiting"] + summary["faults"]["aborts_running"]
    assert aborts == summary["resumes"] + summary["error_reasons"].get("aborted", 0)
    return summary


@pytest.fixture
def agent(compile_yaml):
    return compile_yaml(SPEC % "")


@pytest.fixture
async def reference(agent, tok):
    """The fault-free batch for rows(16)."""
    async with DevServer(hashlm()) as dev:
        _, ref, _ = await run(agent, tok, router([dev.url]), rows(16))
    return ref


# --- one kind at a time ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind",
    ["http_503", "drop", "reset", "non_json", "html", "wrong_schema", "abort_waiting", "abort_running"],
)
async def test_each_fault_kind_is_counted_and_every_row_is_right(agent, tok, reference, kind):
    async with fleet(2, every={kind: 3}) as (_, proxies):
        trajs, batch, stats = await run(agent, tok, router([p.url for p in proxies]), rows(16))
    assert injected(proxies)[kind] >= (1 if kind == "abort_running" else 3)  # a turn may end before the cut
    assert_rows_right_or_errors(trajs, batch, reference)
    summary = assert_faults_add_up(trajs, stats, proxies)
    assert summary["error_rows"] == 0  # one fault in three is always absorbed by retries and failovers


async def test_retried_faults_leave_nothing_for_the_cyclic_collector(agent, tok, reference):
    """A caught failure kept in a local of the frame that caught it is a cycle (the frame is in its traceback):
    each retried 503 left its attempt's frames, its exception and its request, prompt ids included, for the
    collector, which the engine runs rarely (fsm/run/heap.py). A retried and failed-over batch leaves none."""
    import gc

    from fsm.api import RolloutEngine

    async with (
        fleet(2, every={"http_503": 3}) as (_, proxies),
        RolloutEngine(agent, tok, backend=router([p.url for p in proxies])) as engine,
    ):
        sampling = engine.sampling({"temperature": 0.0})
        await engine.arun(rows(4), sampling=sampling)  # connections and caches: not the batch's
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector would free stays in gc.garbage, to be named
        try:
            trajs = await engine.arun(rows(16), sampling=sampling)
            gc.collect()
            kinds = Counter(type(o).__name__ for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        batch = engine.to_batch(trajs, sampling)
    assert injected(proxies)["http_503"] >= 5
    assert_rows_right_or_errors(trajs, batch, reference)
    assert not {"frame", "traceback", "GenerateRequest", "BackendUnavailable"} & set(kinds), kinds


async def test_malformed_answers_everywhere_end_as_error_rows_naming_the_server(agent, tok):
    async with fleet(2, rates={"html": 1.0}) as (_, proxies):
        (traj,), batch, stats = await run(
            agent, tok, router([p.url for p in proxies], max_retries=1), rows(1)
        )
    reason = traj.termination_reason
    assert (
        reason.startswith("error: backend: http://127.0.0.1:")
        and "answered 200 with a text/html body" in reason
    )
    assert any(p.url in reason for p in proxies) and "502 Bad Gateway" in reason
    assert len(traj.response_ids) == 0
    summary = assert_faults_add_up([traj], stats, proxies)
    assert summary["faults"]["malformed"] == 6 and summary["failovers"] >= 1  # 2 attempts on each of 3 routes


async def test_wrong_schema_is_a_fault_not_an_empty_turn(agent, tok):
    async with fleet(1, rates={"wrong_schema": 1.0}) as (_, proxies):
        (traj,), _, stats = await run(
            agent, tok, router([proxies[0].url], max_retries=0, reroutes=0), rows(1)
        )
    assert traj.termination_reason.startswith("error: backend: ") and '{"foo": 1}' in traj.termination_reason
    assert stats["faults"]["malformed"] == 1


# --- hangs ---------------------------------------------------------------------------------------------------


async def test_a_hung_generate_is_aborted_at_the_server_and_fails_over(agent, tok, reference):
    async with contextlib.AsyncExitStack() as stack:
        devs = [await stack.enter_async_context(DevServer(hashlm())) for _ in range(2)]
        hung = await stack.enter_async_context(FaultProxy(devs[0].url, rates={"hang": 1.0}))
        t0 = time.perf_counter()
        trajs, batch, stats = await run(
            agent, tok, router([hung.url, devs[1].url], request_timeout_s=0.3, abort_grace_s=0.05), rows(16)
        )
        wall = time.perf_counter() - t0
    assert wall < 10
    assert_rows_right_or_errors(trajs, batch, reference)
    assert not any(t.failed for t in trajs)
    hangs = hung.injected["hang"]
    assert hangs >= 1 and stats["faults"]["timeouts"] == hangs == stats["failovers"] == stats["aborts_sent"]
    # each hung request was aborted at its server by rid before the row moved on
    hung_rids = {r for r in hung.abort_requests}
    assert len(hung_rids) == hangs and all(rid.endswith("_t00") for rid in hung_rids)
    assert_faults_add_up(trajs, stats, [hung])


@pytest.mark.slow
async def test_the_spec_request_deadline_and_turn_deadline(compile_yaml, tok):
    async with fleet(1, rates={"hang": 1.0}) as (_, (proxy,)):
        agent = compile_yaml(SPEC % "      request_timeout_s: 0.2")
        # a hung server sends no partial answer after the abort: wait 1 s for it, not SGLang's default 30 s
        (traj,), _, stats = await run(agent, tok, router([proxy.url], reroutes=1, abort_grace_s=1.0), rows(1))
        assert traj.termination_reason.startswith(
            f"error: timeout: {proxy.url} unavailable after 1 attempt(s)"
        )
        assert "no answer within 0.2 s (request_timeout_s); aborted at the server" in traj.termination_reason
        assert stats["faults"]["timeouts"] == 2 and len(proxy.abort_requests) == 2  # two routes, both hung

        agent = compile_yaml(SPEC % "      turn_timeout_s: 0.3")  # the request deadline is the default 300 s
        t0 = time.perf_counter()
        (traj,), _, _ = await run(agent, tok, router([proxy.url]), rows(1))
        assert time.perf_counter() - t0 < 5
        assert traj.termination_reason.startswith(
            "error: timeout: model turn 0 exceeded limits.turn_timeout_s 0.3 s"
        )
        assert proxy.url in traj.termination_reason


async def test_the_cli_request_timeout_overrides_the_spec():
    from backends.base import GenerateRequest
    from fsm.api import make_backend

    backend = make_backend(servers=["http://127.0.0.1:9"], request_timeout_s=7.5)

    [client] = [s.backend for s in backend.servers]
    assert client.deadline(GenerateRequest("s", [1], {}, timeout_s=2.0)) == 7.5
    assert SGLangBackend("http://x").deadline(GenerateRequest("s", [1], {}, timeout_s=2.0)) == 2.0
    assert SGLangBackend("http://x").deadline(GenerateRequest("s", [1], {})) == 300.0


# --- killed servers ------------------------------------------------------------------------------------------


async def _running_at(url: str) -> bool:
    """Whether the server itself reports requests running (its /v1/loads), not merely sent to it."""
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(url + "/v1/loads") as r:
        return (await r.json())["loads"][0]["num_running_reqs"] > 0


async def test_a_server_killed_mid_batch_loses_no_row(agent, tok, reference, tmp_path):
    launcher = SGLangLauncher(
        "unused",
        dp=3,
        base_port=_free_ports(3),
        log_dir=tmp_path,
        module="backends.devserver",
        extra_args=["--hashlm", "--vocab", "516", "--stop-every", "30", "--latency", "0.3"],
        startup_timeout_s=60,
        stop_grace_s=5,
    )
    async with launcher:
        backend = router(launcher.urls, max_retries=1, reroutes=3)
        batch_run = asyncio.ensure_future(run(agent, tok, backend, rows(16)))
        await until(lambda: _running_at(launcher.urls[1]), "turns running at server 1")
        launcher.kill(1)
        trajs, batch, stats = await batch_run
    assert_rows_right_or_errors(trajs, batch, reference)
    assert not any(t.failed for t in trajs)
    lost = stats["faults"]["disconnects"] + stats["faults"]["resets"] + stats["faults"]["refused"]
    assert lost >= 1 and stats["failovers"] >= 1 and stats["servers"][1]["failures"] >= 1
    summary = fault_summary(trajs, stats)
    assert sum(summary["faults"][k] for k in FAILED_ATTEMPTS) == summary["retries"] + summary["failovers"]


# --- everything at once, through the CLI ---------------------------------------------------------------------


MIXED = {
    "http_503": 0.03,
    "drop": 0.03,
    "reset": 0.03,
    "hang": 0.02,
    "non_json": 0.02,
    "html": 0.02,
    "wrong_schema": 0.02,
    "abort_waiting": 0.05,
    "abort_running": 0.08,
}


@pytest.mark.slow
def test_cli_summary_counts_equal_what_was_injected(tmp_path, capsys):
    """`agentfsm run` over two faulty servers: summary.json and the table show what the proxies injected."""
    from fsm.cli.commands import main

    ready = threading.Event()
    stop: dict[str, Any] = {}
    proxies: list[FaultProxy] = []

    def serve() -> None:
        async def body() -> None:
            async with fleet(2, rates=MIXED, seed=7) as (_, ps):
                proxies.extend(ps)
                stop["event"], stop["loop"] = asyncio.Event(), asyncio.get_running_loop()
                ready.set()
                await stop["event"].wait()

        asyncio.run(body())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(30)
    spec = tmp_path / "faults.yaml"
    spec.write_text(
        f"name: faults\nextends: {Path('specs/calculator.yaml').resolve()}\n"
        # 4 s: a hang is injected as a timeout only after this, and nothing else may time out. At 0.5 s a suite
        # under load (CI builds the frameworks' virtualenvs meanwhile) timed out 8 healthy calls besides.
        "limits:\n  request_timeout_s: 4\n  max_resumes: 20\n"
    )
    try:
        code = main(
            [
                "run",
                str(spec),
                "--num-prompts",
                "24",
                "--n",
                "2",
                "--temperature",
                "0",
                "--out",
                str(tmp_path / "run"),
                "--tokenizer",
                str(ASSETS),
                *[arg for p in proxies for arg in ("--server", p.url)],
            ]
        )
    finally:
        stop["loop"].call_soon_threadsafe(stop["event"].set)
        thread.join(30)
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["trajectories"] == 48  # none lost
    faults = summary["server_faults"]
    got = injected(proxies)
    assert sum(got.values()) >= 10 and len(got) >= 4  # which kinds, exactly, depends on the requests' order
    expected = Counter()
    for kind, n in got.items():
        expected[CLIENT_COUNTER[kind]] += n
    assert {k: v for k, v in faults["faults"].items() if v} == dict(expected)
    failed_attempts = sum(faults["faults"][k] for k in FAILED_ATTEMPTS)
    ended = sum(n for k, n in faults["error_reasons"].items() if k in ("backend", "timeout"))
    assert failed_attempts == faults["retries"] + faults["failovers"] + ended
    assert faults["resumes"] + faults["error_reasons"].get("aborted", 0) == (
        faults["faults"]["aborts_waiting"] + faults["faults"]["aborts_running"]
    )
    # batch.pt's metrics count what summary.json counts (they were read after the run: 0 for everything)
    metrics = torch.load(tmp_path / "run" / "batch.pt", weights_only=False)["meta_info"]["rollout_metrics"]
    assert faults["aborts_sent"] >= 1 and metrics["rollout/aborts_sent"] == faults["aborts_sent"]
    assert metrics["rollout/failovers"] == faults["failovers"]
    assert {
        k.removeprefix("rollout/faults/"): v for k, v in metrics.items() if k.startswith("rollout/faults/")
    } == {k: v for k, v in faults["faults"].items() if v}
    records = [
        json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    ]
    for r in records:  # every row is a finished one or an error row, never a short "done" made of a fault
        assert r["termination_reason"] in ("done", "response_length", "max_assistant_turns") or r[
            "termination_reason"
        ].startswith("error: ")
    table = capsys.readouterr().out  # the run table goes to stdout
    kind = CLIENT_COUNTER[got.most_common(1)[0][0]].replace("_", " ")
    assert f"server fault: {kind}" in table and "failovers" in table and "resumes" in table


# --- the watchdog --------------------------------------------------------------------------------------------


async def test_the_watchdog_names_stuck_rows_their_state_and_server(agent, tok, caplog):
    async with DevServer(hashlm(latency_s=0.8)) as dev:
        backend = router([dev.url])
        async with backend:
            runner = Runner(agent, backend, tok, watchdog_s=0.25)
            with caplog.at_level(logging.WARNING, logger="agentfsm.runtime"):
                trajs = await runner.run(rows(2))
    assert all(t.termination_reason == "done" for t in trajs)
    assert runner.stalls >= 1
    [message, *_] = [r.getMessage() for r in caplog.records if "watchdog" in r.getMessage()]
    assert "no trajectory has changed state for" in message and "2 in flight" in message
    assert "in GENERATING for" in message and f"on {dev.url} (rid " in message and "_t00)" in message
    assert not [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Runner._watchdog"]  # stopped


# --- the pieces: retry policy, cooldown, the proxy's HTTP control ------------------------------------------


async def test_retry_policy_backoff_retry_after_and_what_is_retried():
    from backends.base import (
        BackendRequestError,
        BackendUnavailable,
        RetryPolicy,
        parse_retry_after,
        retry,
    )

    policy = RetryPolicy(attempts=4, backoff_s=0.01, multiplier=2.0, backoff_max_s=0.03, jitter=0.2)
    for attempt, base in ((1, 0.01), (2, 0.02), (3, 0.03), (4, 0.03)):  # doubling, capped, ±20 % jitter
        assert 0.8 * base <= policy.delay(attempt) <= 1.2 * base
    assert policy.delay(1, retry_after=0.05) >= 0.05 and policy.delay(1, retry_after=99) <= 30.0
    assert (
        parse_retry_after("2") == 2.0
        and parse_retry_after("soon") is None
        and parse_retry_after(None) is None
    )
    assert (
        0 < parse_retry_after("Wed, 21 Oct 2099 07:28:00 GMT")
        and parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0
    )

    waits: list[float] = []
    calls: list[int] = []

    async def flaky(attempt: int) -> str:
        calls.append(attempt)
        if attempt < 3:
            raise BackendUnavailable("busy", retry_after=0.02 if attempt == 2 else None)
        return "ok"

    assert await retry(policy, flaky, on_retry=lambda a, e, w: waits.append(w)) == "ok"
    assert calls == [1, 2, 3] and waits[1] >= 0.02

    async def refused(attempt: int) -> str:
        calls.append(attempt)
        raise BackendRequestError("bad request")

    calls.clear()
    with pytest.raises(BackendRequestError):
        await retry(policy, refused)
    assert calls == [1]  # not retryable: one attempt
    with pytest.raises(ValueError, match="attempts must be >= 1"):
        RetryPolicy(attempts=0)


async def test_a_failed_server_sits_out_its_cooldown_despite_a_healthy_health_check(agent, tok):
    async with fleet(1, rates={"hang": 1.0}) as (devs, (proxy,)):
        clients = [SGLangBackend(proxy.url, request_timeout_s=0.1, abort_grace_s=0.01)]
        async with Router(clients, health_interval_s=0, max_retries=0, cooldown_s=0.3, retry_window_s=0) as r:
            with pytest.raises(Exception, match="no answer within 0.1 s"):
                from backends.base import GenerateRequest

                await r.generate(GenerateRequest("s", [1, 2, 3], {"max_new_tokens": 4}, rid="s_t00"))
            assert await r.check_health() == [False]  # /health answers 200, but /generate just hung
            await asyncio.sleep(0.35)
            assert await r.check_health() == [True]


async def test_a_turn_cut_by_the_servers_context_says_so(agent, tok):
    """Issue 26 item 8: a prompt that leaves the server's context room for 15 tokens: the client clamps the
    turn to them, and the row ended `done` as if the model had finished. It says `context_length` now."""
    long_turns = HashLM(vocab=516, eos=2, stop_every=10**6)
    async with DevServer(long_turns) as dev:
        (full,), _, _ = await run(agent, tok, router([dev.url]), rows(1))
    assert full.termination_reason == "response_length" and len(full.response_ids) == 48
    context = len(full.prompt_ids) + 16
    async with DevServer(long_turns, context_length=context) as dev:
        (cut,), batch, _ = await run(agent, tok, router([dev.url]), rows(1))
    assert cut.termination_reason == "context_length" and not cut.failed
    assert cut.extra["context_cut"] == context and cut.extra["spec_reason"] == "done"
    assert (
        0 < len(cut.response_ids) <= 15 and cut.response_ids == full.response_ids[: len(cut.response_ids)]
    )  # what fit, unchanged
    assert list(batch.non_tensor_batch["termination_reason"]) == ["context_length"]


async def test_the_proxy_is_driven_over_http():
    import aiohttp

    async with fleet(1) as (_, (proxy,)), aiohttp.ClientSession() as http:
        async with http.post(
            proxy.url + "/_faults", json={"script": ["http_503", None, "wrong_schema"]}
        ) as r:
            assert r.status == 200
        statuses = []
        for i in range(3):
            body = {"input_ids": [1, 2, 3], "rid": f"p_t0{i}", "sampling_params": {"max_new_tokens": 4}}
            async with http.post(proxy.url + "/generate", json=body) as r:
                statuses.append((r.status, "output_ids" in await r.json()))
        async with http.get(proxy.url + "/_faults") as r:
            counts = await r.json()
        async with http.post(proxy.url + "/_faults", json={"every": {"melt": 2}}) as r:
            assert r.status == 400 and "unknown fault kind 'melt'" in (await r.json())["error"]
    assert statuses == [(503, False), (200, True), (200, False)]
    assert counts == {"requests": 3, "injected": {"http_503": 1, "wrong_schema": 1}, "abort_requests": []}
