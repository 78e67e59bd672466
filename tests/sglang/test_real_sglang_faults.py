"""Faults and edges against real SGLang 0.5.23 (CPU engine, tiny model), each a case measured on real servers:
a crash and restart under load (issue 26 item 6), short request deadlines (item 7), a turn the context cuts
(item 8), and a `retract` pause across a weight update (item 9).

The session's server (tests/sglang/conftest.py) is reused; the crash test starts one more, the suite's second,
and kills and restarts it. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from backends.launcher import SGLangLauncher
from backends.router import Router
from backends.sglang import SGLangBackend
from backends.tiny import EARLY_DIR
from tests.conftest import ASSETS, SPECS
from tests.sglang.conftest import PYTHON, READY_S, free_port
from tests.sglang.scenarios import PROMPT
from tests.sglang.test_real_sglang import LONG, client, req, running

pytestmark = pytest.mark.sglang


async def _used_tokens(c: SGLangBackend) -> int:
    _, body = await c._call("GET", "/v1/loads")
    return int(body["loads"][0]["num_used_tokens"])


async def test_a_turn_the_context_cuts_says_so(sglang):
    """A 4,079-token prompt in a 4,096-token context: the client clamps the turn and SGLang cuts it further;
    the result says the context cut it."""
    async with client(sglang.url) as c:
        cut = await c.generate(req("ctx_t00", 64, prompt=[5] * 4079))
        whole = await c.generate(req("ctx_t01", 8))
        assert await c.flush_cache()  # a long context in the prefix cache slows the CPU engine down
    assert cut.finish_reason == "length" and 0 < len(cut.token_ids) < 17
    assert cut.extra["context_cut"] == 4096
    assert whole.finish_reason == "length" and len(whole.token_ids) == 8 and "context_cut" not in whole.extra


async def test_retract_keeps_the_tokens_made_before_it(sglang):
    """`pause_generation("retract")` puts a running request back in the queue with the tokens it made; after a
    weight update and continue it goes on from them: one turn, tokens of both versions, in order."""
    async with client(sglang.url) as c:
        turn = asyncio.ensure_future(c.generate(req("rtr_t00", LONG, ignore_eos=True)))
        await running(c)
        start = await _used_tokens(c)
        deadline = time.monotonic() + 120
        while await _used_tokens(c) < start + 8:  # some tokens made before the retraction
            assert time.monotonic() < deadline, "the request made no tokens"
            await asyncio.sleep(0.05)
        await c.pause_generation("retract")
        try:
            await c.update_weights_from_disk(str(EARLY_DIR), weight_version="301")
        finally:
            await c.continue_generation()
        out = await turn
        await c.update_weights_from_disk(str(ASSETS), weight_version="302")
    versions = out.extra["token_versions"]
    assert out.finish_reason == "length" and len(out.token_ids) == LONG
    made_before = versions.index("301")
    assert made_before >= 1 and set(versions[:made_before]) == {versions[0]} and versions[0] != "301"
    assert set(versions[made_before:]) == {"301"}  # the rest, after continue, by the new weights


async def test_a_one_second_request_deadline_loses_no_row(sglang, tmp_path):
    """`--request-timeout 1` on a loaded CPU server: each deadline's abort is answered with the partial turn
    (after up to about 1.4 s) and the turn resumes from it; no retry meets "Duplicate request ID"."""
    from fsm.api import RolloutEngine
    from specs.calculator import make_prompts

    spec = tmp_path / "calc.yaml"  # a 1 s deadline on this machine: many resumes per turn
    spec.write_text(f"name: calc_deadline\nextends: {SPECS}/calculator.yaml\nlimits: {{max_resumes: 200}}\n")
    clients = [SGLangBackend(sglang.url, request_timeout_s=1.0)]
    async with RolloutEngine(str(spec), backend=Router(clients), tokenizer=str(ASSETS)) as engine:
        out = await engine.agenerate_sequences(make_prompts(16, seed=5), sampling_params={"temperature": 0.0})
        stats = engine.backend.stats()
    reasons = list(out.non_tensor_batch["termination_reason"])
    assert not [r for r in reasons if r.startswith("error")], reasons
    assert stats["aborts_sent"] >= 1 and stats["resumes"] >= 1  # the deadline did cut turns, which resumed
    assert stats["faults"]["timeouts"] <= stats["aborts_sent"] // 10, stats  # aborts answered, not timed out


async def test_a_crashed_server_takes_rows_again_within_seconds_of_answering_health(sglang, tmp_path):
    """Two real servers, requests streaming; the second is killed with requests in flight and restarted. Every
    cut request fails over, and once the restarted server answers /health new sessions reach it within 10 s
    (the router's own health checks: every 5 s, after a 5 s cooldown for the one incident)."""
    port = free_port()
    second = SGLangLauncher(str(ASSETS), base_port=port, device="cpu", python=str(PYTHON), log_dir=tmp_path / "a",
                            startup_timeout_s=READY_S, extra_args=["--log-level", "warning"])  # fmt: skip
    again = SGLangLauncher(str(ASSETS), base_port=port, device="cpu", python=str(PYTHON), log_dir=tmp_path / "b",
                           startup_timeout_s=READY_S, extra_args=["--log-level", "warning"])  # fmt: skip
    async with second:
        url = second.urls[0]
        router = Router([client(sglang.url), client(url)])  # the defaults a run uses
        async with router:
            stop = asyncio.Event()
            placed: list[tuple[float, str]] = []  # (when the request went out, where)
            errors: list[BaseException] = []

            async def stream(worker: int) -> None:
                k = 0
                while not stop.is_set():
                    k += 1
                    sid = f"w{worker}n{k}"
                    s0 = time.monotonic()
                    try:
                        res = await router.generate(req(f"{sid}_t00", 24, prompt=PROMPT + [worker, k % 500]))
                    except Exception as e:  # noqa: BLE001 (a lost row: asserted below)
                        errors.append(e)
                        continue
                    placed.append((s0, res.server or ""))

            workers = [asyncio.ensure_future(stream(w)) for w in range(8)]
            try:
                c2 = router.servers[1].backend
                await running(c2)  # requests in flight at the second server
                second.kill(0)
                crashed = time.monotonic()
                async with again:  # restarted on the same port; returns once its /health answers 200
                    healthy = time.monotonic()
                    deadline = healthy + 10
                    while not any(when >= healthy and where == url for when, where in placed):
                        assert time.monotonic() < deadline + 60, "no request reached the restarted server"
                        await asyncio.sleep(0.1)
                    back = min(when for when, where in placed if when >= healthy and where == url)
                    stop.set()
                    await asyncio.wait_for(asyncio.gather(*workers), 300)
            finally:
                stop.set()
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
            stats = router.stats()
    assert not errors, errors[:3]
    assert stats["servers"][1]["failures"] >= 1 and stats["failovers"] >= 1
    print(f"crash -> health {healthy - crashed:.0f} s; health -> first request back {back - healthy:.1f} s")
    assert back - healthy < 10, back - healthy
