"""Faults and edges against real SGLang 0.5.23 (CPU engine, tiny model): a crash and restart during a run
(issue 26 item 6) and a 1 s request deadline (item 7), each over two real servers, the session's and a second
one (`second_sglang`, tests/sglang/conftest.py); a turn the context cuts (item 8) and a `retract` pause across
a weight update (item 9) on the session's server. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from backends.tiny import EARLY_DIR
from tests.conftest import ASSETS, SPECS
from tests.sglang.test_real_sglang import LONG, client, req, running, used_tokens

pytestmark = pytest.mark.sglang
GREEDY = {"temperature": 0.0}


def short_turns(tmp_path: Path, **limits: int) -> str:
    """The calculator with turns of at most 8 tokens (and `limits`): rows end quickly on a CPU server."""
    spec = tmp_path / "calc.yaml"
    spec.write_text(
        f"name: calc_short\nextends: {SPECS}/calculator.yaml\nlimits: {{max_new_tokens: 8"
        + "".join(f", {k}: {v}" for k, v in limits.items())
        + "}\n"
    )
    return str(spec)


async def until(condition, what: str, timeout_s: float) -> float:
    """Poll `condition` every 20 ms until it holds; the monotonic time it did. Fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        await asyncio.sleep(0.02)
    return time.monotonic()


async def test_a_crashed_server_takes_rows_again_within_seconds_of_answering_health(
    sglang, second_sglang, tmp_path
):
    """Two real servers behind the engine's Router (the defaults a run uses) in the continuous mode: 16 rows
    running, a new one for each that ends. The second server is killed (SIGKILL, its whole process group) with
    8 requests in flight and started again on its port; meanwhile the trainer submits a row every 0.5 s.
    Every row ends done (the cut requests fail over), and rows reach the restarted server within 10 s of its
    /health answering: the crash was one strike (a 5 s cooldown, long over by then; were each cut request
    one, 5 min), and each server's health is probed on its own every 5 s."""
    from fsm.api import RolloutEngine
    from specs.calculator import make_prompts

    servers = [sglang.url, second_sglang.url]
    async with RolloutEngine(short_turns(tmp_path), str(ASSETS), servers=servers) as engine:
        router = engine.backend
        first, second = router.servers  # type: ignore[attr-defined]
        submitted, groups, stop = 0, [], False

        async def submit() -> None:
            nonlocal submitted
            seed = 1000 + submitted  # one uid per row
            submitted += 1
            await engine.asubmit(make_prompts(1, seed=seed), sampling_params=GREEDY)

        async def keep_running() -> None:  # the continuous mode: a new row for each that ends
            while not stop:
                groups.extend(await engine.atake_groups(1, timeout=600))
                if not stop:
                    await submit()

        for _ in range(16):
            await submit()
        feeder = asyncio.ensure_future(keep_running())
        try:
            await until(
                lambda: second.in_flight >= 8 and first.in_flight >= 1, "8 requests in flight there", 300
            )
            second_sglang.kill()
            crashed = time.monotonic()
            await until(lambda: not second.healthy, "the router took the crashed server out", 60)
            healthy = await second_sglang.restart()
            placed = second.requests  # what reaches it from now on reaches a server that answers /health
            back = None
            while back is None:
                assert time.monotonic() < healthy + 120, "no request reached the restarted server in 120 s"
                await submit()  # the trainer's next row
                for _ in range(25):  # 0.5 s
                    if second.requests > placed:
                        back = time.monotonic()
                        break
                    await asyncio.sleep(0.02)
            stop = True
            await asyncio.wait_for(feeder, 600)
            groups += await engine.atake_groups(submitted - len(groups), timeout=600)
        finally:
            stop = True
            feeder.cancel()
        stats = router.stats()  # type: ignore[attr-defined]
    reasons = [t.termination_reason for g in groups for t in g.trajectories]
    print(
        f"crash -> /health {healthy - crashed:.0f} s; /health -> a request to it {back - healthy:.1f} s; "
        f"{len(reasons)} rows, {stats['failovers']} failovers"
    )
    assert len(reasons) == submitted and not [r for r in reasons if r != "done"], reasons
    assert stats["servers"][1]["failures"] >= 8 and stats["failovers"] >= 8  # the requests the crash cut
    assert back - healthy < 10, (
        f"rows reached the restarted server {back - healthy:.1f} s after /health answered"
    )


async def test_a_one_second_request_deadline_loses_no_row(sglang, second_sglang, tmp_path):
    """96 rows over two real servers with a 1 s deadline per request (the CLI's --request-timeout 1). Turns
    run past it, are aborted at the server, answered with their partial output and resumed: every row ends
    done, every abort's answer is awaited (at most 1 in 10 is not, on a loaded machine), no retry meets
    "Duplicate request ID".

    32 rows run at a time (max_concurrency): with all 96 at once, one step of each CPU server takes longer than
    the deadline on a loaded 2-core machine, so most attempts are aborted before they make a token, whatever
    the client does; the resume budget is raised for the same reason (a few tokens per attempt)."""
    from fsm.api import RolloutEngine
    from specs.calculator import make_prompts

    spec = short_turns(tmp_path, max_resumes=1000)
    async with RolloutEngine(
        spec, str(ASSETS), servers=[sglang.url, second_sglang.url], request_timeout_s=1.0, max_concurrency=32
    ) as engine:
        t0 = time.monotonic()
        trajs = await asyncio.wait_for(engine.arun(make_prompts(96, seed=5), sampling_params=GREEDY), 1200)
        wall = time.monotonic() - t0
        stats = engine.backend.stats()  # type: ignore[attr-defined]
    faults = stats["faults"]
    print(
        f"96 rows in {wall:.0f} s: {stats['aborts_sent']} deadline aborts, {stats['resumes']} resumes, "
        f"{faults['timeouts']} aborts unanswered, {faults['duplicate']} duplicate rids, "
        f"{stats['failovers']} failovers"
    )
    assert not [(t.uid, t.termination_reason) for t in trajs if t.failed]
    assert stats["aborts_sent"] >= 1 and stats["resumes"] >= 1  # the deadline did cut turns, which resumed
    assert faults["duplicate"] == 0
    assert faults["timeouts"] * 10 <= stats["aborts_sent"], faults  # aborts answered, not timed out


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
        start = await used_tokens(c)
        deadline = time.monotonic() + 120
        while await used_tokens(c) < start + 8:  # some tokens made before the retraction
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
