"""bench/fleet_sim.py: the modeled vLLM server's scheduler, prefix cache and routes, and `bench fleet --sim`
end to end (through the engines' own routers where .ci/routers_env.sh built them)."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends.tiny import ASSET_DIR
from bench.fleet import ROUTERS_VENV, Completions, metrics
from bench.fleet_sim import PROBES, Costs, Engine, Work, app, features, nonnegative_fit

FREE = Costs(*(0.0,) * 6)  # steps that take no time: the scheduler alone


def words(key: str, n: int) -> list[str]:
    return [f"{key}{i}" for i in range(n)]


def run(coro):
    return asyncio.run(coro)


async def served(engine: Engine, *requests: tuple[list[str], int, int]):
    out = await asyncio.gather(*(engine.generate(*r) for r in requests))
    await engine.close()
    return out


def test_a_repeated_prompt_is_served_from_full_blocks_and_never_its_last_token():
    async def go():
        e = Engine(FREE)
        first = await e.generate(words("a", 300), 4, 0)
        again = await e.generate(words("a", 300), 4, 0)
        exact = await e.generate(words("b", 256), 1, 0)
        exact2 = await e.generate(words("b", 256), 1, 0)
        await e.close()
        return e, first, again, exact, exact2

    e, first, again, exact, exact2 = run(go())
    assert (first.cached, again.cached) == (0, 256)  # 2 full blocks of 128; the partial third is computed
    assert exact2.cached == 128  # a prompt of exactly 2 blocks: its last token is computed, so its last block
    assert (e.counters.queries, e.counters.hits) == (300 + 300 + 256 + 256, 256 + 128)
    assert e.counters.success == 4


def test_a_request_scheduled_after_another_in_the_same_step_hits_its_blocks():
    """vLLM caches a chunk's blocks when it allocates them: a group's samples arriving together share one
    prefill of the shared prompt."""
    shared = words("g", 1024)
    e = Engine(FREE)
    seqs = run(served(e, *[(shared + words(f"s{k}", 64), 8, 0) for k in range(4)]))
    assert [s.cached for s in seqs] == [0, 1024, 1024, 1024]


def test_the_cache_forgets_its_least_recent_blocks_beyond_its_size():
    async def go():
        e = Engine(Costs(*FREE.prices(), frontend_s=0, cache_blocks=2))
        await e.generate(words("a", 257), 1, 0)  # 2 blocks
        await e.generate(words("b", 257), 1, 0)  # 2 more: a's are evicted
        b = await e.generate(words("b", 257), 1, 0)
        a = await e.generate(words("a", 257), 1, 0)
        await e.close()
        return a, b

    a, b = run(go())
    assert (a.cached, b.cached) == (0, 256)


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    e = Engine(FREE)
    run(served(e, (words("p", 5000), 1, 0)))
    assert e.counters.work.steps == math.ceil(5000 / 2048)  # its first token comes with the last chunk
    assert e.counters.work.prefilled == 5000 and e.counters.work.decoding == 0


def test_priority_orders_the_waiting_queue_and_fcfs_ignores_it():
    def order(priority: bool) -> list[int]:
        async def go():
            e = Engine(Costs(*FREE.prices(), frontend_s=0, max_num_seqs=1), priority=priority)
            done: list[int] = []

            async def one(i: int, p: int) -> None:
                await e.generate(words(f"r{i}", 8), 4, p)
                done.append(i)

            tasks = [asyncio.create_task(one(i, 0)) for i in range(4)]
            await asyncio.sleep(0)
            tasks.append(asyncio.create_task(one(9, -8)))  # sent last, while the others wait
            await asyncio.gather(*tasks)
            await e.close()
            return done

        return run(go())

    assert order(True).index(9) <= 1  # the first admitted may run; then the priority request
    assert order(False)[-1] == 9


def test_steps_take_the_prices_of_their_work():
    costs = Costs(base_s=1e-3, prefill_token_s=1e-6, pair_s=0.0, decode_seq_s=1e-4, context_token_s=0.0)
    assert costs.step(Work(steps=1, prefilled=1000, decoding=10)) == pytest.approx(1e-3 + 1e-3 + 1e-3)

    async def timed() -> float:
        e = Engine(costs)
        t = asyncio.get_running_loop().time()
        await served(e, (words("t", 100), 21, 0))
        return asyncio.get_running_loop().time() - t

    # 1 step of 100 prompt tokens (its first token), 20 of one decoding sequence
    expected = costs.step(Work(steps=21, prefilled=100, decoding=20))
    assert expected <= run(timed()) < expected + 2.0  # the sleeps happen; a loaded machine only adds to them


def test_the_fit_recovers_known_prices_from_the_probes_work():
    """calibrate's solve: real seconds made from known prices over the model's own work for each probe."""
    from bench.fleet import Words

    w = Words(ASSET_DIR)
    rows = [run(features(p, w)) for p in PROBES]
    truth = [5e-3, 4e-5, 5e-8, 1.5e-4, 7e-7, 2e-3, 4e-3]
    seconds = [sum(a * b for a, b in zip(row, truth)) for row in rows]
    assert nonnegative_fit(rows, seconds) == pytest.approx(truth, rel=1e-6)
    fit = nonnegative_fit(rows, [s * 1.0 for s in seconds[:-1]] + [seconds[-1] * 0.1])
    assert min(fit) >= 0  # never a negative price, whatever the timings


def test_the_routes_are_vllms_as_the_bench_and_the_routers_read_them():
    async def go():
        e = Engine(FREE)
        async with TestServer(app(e, "tiny", str(ASSET_DIR))) as server, aiohttp.ClientSession() as http:
            url = str(server.make_url("")).rstrip("/")
            async with http.get(url + "/v1/models") as r:
                assert (await r.json())["data"][0]["root"] == str(ASSET_DIR)
            async with http.get(url + "/health") as r:
                assert r.status == 200
            client = Completions(url, http, "tiny")
            from backends.base import GenerateRequest

            prompt = " " + " ".join(words("w", 200))
            req = GenerateRequest("s", [], {"text": prompt, "max_new_tokens": 5}, priority=-2)
            first, second = [await client.generate(req) for _ in range(2)]
            counted = await metrics(http, url)
            async with http.post(url + "/reset_prefix_cache") as r:
                assert r.status == 200
            third = await client.generate(req)
        await e.close()
        return first, second, third, counted

    first, second, third, counted = run(go())
    assert len(first.token_ids) == 5 and first.prompt_tokens == 200
    assert (first.cached_tokens, second.cached_tokens, third.cached_tokens) == (0, 128, 0)
    assert counted == {
        "prefix_cache_queries_total": 400.0,
        "prefix_cache_hits_total": 128.0,
        "request_success_total": 2.0,
    }


def test_bench_fleet_replays_a_shape_through_agentfsm_over_modeled_servers():
    from bench.fleet import bench_fleet

    out = bench_fleet(sim=2, shapes=["calculator"], routers=["agentfsm"], repeats=1)
    row = out["results"]["calculator | agentfsm"]
    assert out["simulated"] == 2 and row["errors"] == 0
    assert row["hit_rate"] == pytest.approx(0.437, abs=0.01)  # every turn after the first from its server
    assert row["max_server_share"] <= 0.6 and row["makespan_s"] > 0


@pytest.mark.skipif(
    not (ROUTERS_VENV / "bin" / "vllm-router").exists(), reason="no engine routers: bash .ci/routers_env.sh"
)
def test_the_engines_own_routers_forward_to_modeled_servers():
    from bench.fleet import bench_fleet

    names = ["vllm-router consistent_hash", "sglang-router manual"]
    out = bench_fleet(sim=2, shapes=["skewed"], routers=names, repeats=1)
    for name in names:
        row = out["results"][f"skewed | {name}"]
        assert row["errors"] == 0 and row["hit_rate"] > 0.5
    # the skewed keys are found by asking vllm-router: 18 of 24 sessions hash to the first server
    assert out["results"]["skewed | vllm-router consistent_hash"]["max_server_share"] > 0.65


def test_the_bench_client_retries_a_dropped_connection_on_its_server_as_the_engine_does():
    """A connection the server drops is retried on the same server (the engine's client's policy) before the
    router sees a failure: otherwise one dropped connection would fail a whole server over in the bench."""
    from backends.base import GenerateRequest

    dropped = []

    @web.middleware
    async def drop_first(request, handler):
        if not dropped:
            dropped.append(request.path)
            request.transport.close()  # the connection ends before an answer
            raise web.HTTPInternalServerError
        return await handler(request)

    async def go():
        e = Engine(FREE)
        a = app(e, "tiny", str(ASSET_DIR))
        a.middlewares.append(drop_first)
        async with TestServer(a) as server, aiohttp.ClientSession() as http:
            url = str(server.make_url("")).rstrip("/")
            req = GenerateRequest("s", [], {"text": " a b c", "max_new_tokens": 2})
            result = await Completions(url, http, "tiny").generate(req)
        await e.close()
        return result

    assert len(run(go()).token_ids) == 2 and dropped == ["/v1/completions"]


def test_a_malformed_or_oversized_request_is_refused_with_400_and_the_server_serves_on():
    bad = [
        b"{not json",
        b'{"prompt": 7, "max_tokens": 4}',  # a token-id prompt: not the text route
        b'{"max_tokens": 4}',
        b'{"prompt": " a b", "max_tokens": "many"}',
        b'{"prompt": " a b", "max_tokens": 100000}',  # past the context: it would never end
    ]

    async def go():
        e = Engine(FREE)
        async with TestServer(app(e, "tiny", str(ASSET_DIR))) as server, aiohttp.ClientSession() as http:
            url = str(server.make_url("")).rstrip("/") + "/v1/completions"
            answers = []
            for body in bad:
                async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    answers.append((r.status, (await r.json())["error"]["message"]))
            async with http.post(url, json={"prompt": " a b", "max_tokens": 2}) as r:
                ok = (r.status, len((await r.json())["choices"][0]["token_ids"]))
        await e.close()
        return answers, ok

    answers, ok = run(go())
    assert [status for status, _ in answers] == [400] * len(bad)
    assert "exceed the context of 32768" in answers[-1][1]
    assert ok == (200, 2)


def test_the_token_route_answers_the_engines_vllm_client_with_the_calculators_turns():
    """The route the engine's client drives (vLLM's /inference/v1/generate, token ids in and out), as the engine
    sees the server: told apart as vLLM, a real calculator prompt answered with its tool call, scheduled as its
    tokens (a repeat of the prompt served from the prefix cache); a request without token ids, or to a server
    whose --root has no tokenizer, refused in one line."""
    from backends.base import GenerateRequest
    from backends.engines import detect_engine
    from backends.vllm import VLLMBackend
    from fsm.api import load_tokenizer
    from specs.calculator import SYSTEM_PROMPT, TOOL_SCHEMA

    tok = load_tokenizer(str(ASSET_DIR))
    asked = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "What is 37 * 12 + 5?"},
    ]
    text = tok.apply_chat_template(asked, tools=[TOOL_SCHEMA], add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)

    async def go():
        e = Engine(FREE)
        async with TestServer(app(e, "tiny", str(ASSET_DIR))) as server:
            url = str(server.make_url("")).rstrip("/")
            engine = await detect_engine(url)
            client = VLLMBackend(url)
            await client.start()
            try:
                params = {"max_new_tokens": 64, "stop_token_ids": [tok.eos_token_id]}
                first, second = [await client.generate(GenerateRequest("s", ids, params)) for _ in range(2)]
                status, refused = await client._call("POST", "/inference/v1/generate", {"token_ids": "37"})
            finally:
                await client.close()
        async with TestServer(app(e, "tiny", "/nonexistent")) as server, aiohttp.ClientSession() as http:
            url = str(server.make_url("/inference/v1/generate"))
            async with http.post(url, json={"token_ids": ids, "sampling_params": {"max_tokens": 4}}) as r:
                no_tokenizer = (r.status, (await r.json())["error"]["message"])
        await e.close()
        return engine, first, second, status, refused, no_tokenizer

    engine, first, second, status, refused, no_tokenizer = run(go())
    assert engine == "vllm"
    assert tok.decode(first.token_ids) == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 12 + 5"}}\n</tool_call>'
        + tok.eos_token
    )
    assert first.finish_reason == "stop" and len(first.logprobs) == len(first.token_ids)
    assert (first.prompt_tokens, first.cached_tokens) == (len(ids), 0)
    assert second.cached_tokens == (len(ids) - 1) // 128 * 128 > 0
    assert status == 400 and "not a generate request with token_ids" in refused["error"]["message"]
    assert no_tokenizer[0] == 400 and "the tokenizer in --root '/nonexistent'" in no_tokenizer[1]
