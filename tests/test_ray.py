"""RayRunner on a local CPU Ray instance over scripted dev servers (subprocesses): same batch as one process,
input order kept, control calls reach the servers, a killed actor loses no rows; the continuous mode streams
groups back from the actors, and a hung actor is treated as a dead one.

Ray's start-up dominates, so the instance, the servers and the actors are module-scoped; the kill test leaves
the pool one actor short (the continuous-mode test after it has `submit` replace it).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
import torch

from tests.conftest import extra  # noqa: E402

ray = extra("ray", "ray")

from backends.scripted import scripted_servers  # noqa: E402
from fsm import RayRunner, RolloutEngine  # noqa: E402
from specs.calculator import make_prompts  # noqa: E402
from tests.conftest import ASSETS  # noqa: E402

LATENCY_S = 0.1  # per request: a batch lasts long enough to kill an actor in the middle of it


@pytest.fixture(scope="module")
def cluster():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def servers():
    with scripted_servers(2, latency_s=LATENCY_S) as urls:
        yield urls


@pytest.fixture(scope="module")
def runner(cluster, servers):
    r = RayRunner("calculator", tokenizer=str(ASSETS), servers=servers, workers=2, max_concurrency=4)
    r.start()  # the actors import while the reference run below goes
    yield r
    r.close()


@pytest.fixture(scope="module")
def reference(servers):
    """The single-process batch over the same servers: 12 rows x 2 samples, and 24 rows x 2."""

    async def run():
        async with RolloutEngine("calculator", str(ASSETS), servers=servers) as engine:
            return [await engine.agenerate_sequences(make_prompts(k), n=2) for k in (12, 24)]

    return asyncio.run(run())


def same_batch(a, b) -> None:
    assert set(a.batch.keys()) == set(b.batch.keys())
    for key in a.batch.keys():
        assert torch.equal(a.batch[key], b.batch[key]), key
    for key in ("uid", "termination_reason", "data_source", "__num_turns__"):
        assert list(a.non_tensor_batch[key]) == list(b.non_tensor_batch[key]), key


@pytest.mark.slow
def test_matches_single_process_in_input_order(runner, reference):
    rows = make_prompts(12)
    out = runner.generate_sequences(rows, n=2)
    same_batch(reference[0], out)
    assert list(out.non_tensor_batch["uid"]) == [r["uid"] for r in rows for _ in range(2)]
    stats = runner.stats
    assert stats["chunks"] == 12 and stats["rerun_rows"] == 0
    assert all(v > 0 for v in stats["rows_per_actor"].values())  # both actors took work
    assert out.meta_info["timing"]["agent_loop/generate_sequences/min"] >= LATENCY_S


def test_rows_without_uid_keep_their_groups(runner):
    rows = [{k: v for k, v in r.items() if k != "uid"} for r in make_prompts(3)]
    out = runner.generate_sequences(rows, n=3)
    uids = list(out.non_tensor_batch["uid"])
    assert len(set(uids)) == 3 and uids[0::3] == uids[1::3] == uids[2::3]


def test_control_calls_reach_the_servers(runner, servers):
    def released(url: str) -> list[str]:
        with urllib.request.urlopen(f"{url}/server_info", timeout=5) as r:
            return json.load(r)["internal_states"][0]["memory_released"]

    runner.sleep()
    assert all(released(u) == ["kv_cache", "weights"] for u in servers)
    runner.wake_up()
    assert all(released(u) == [] for u in servers)


def test_sync_form_refuses_inside_a_loop(runner):
    async def inside():
        runner.generate_sequences(make_prompts(1))

    with pytest.raises(RuntimeError, match="agenerate_sequences"):
        asyncio.run(inside())


async def test_killed_actor_loses_no_rows(runner, reference):
    rows = make_prompts(24)
    before = runner.stats
    task = asyncio.create_task(runner.agenerate_sequences(rows, n=2))
    while runner.stats is before or runner.stats["rows_done"] < 4:
        await asyncio.sleep(0.005)
    ray.kill(runner.actors[0])  # it holds rows in flight: max_concurrency 4 = 2 groups of 2
    out = await task
    stats = runner.stats
    assert stats["actor_deaths"] == 1 and stats["rerun_rows"] >= 1
    assert stats["rows_done"] == 24 and sum(stats["rows_per_actor"].values()) == 24
    same_batch(reference[1], out)  # every row back, in input order, as one process computes it


# --- continuous mode and hang detection ----------------------------------------------------------------------


@pytest.mark.slow
def test_continuous_mode_streams_groups_back_from_the_actors(runner, reference):
    rows = make_prompts(12)
    assert runner.submit(rows[:8], n=2) == [r["uid"] for r in rows[:8]]
    first = runner.take(3, timeout=240)  # bounds, not waits: a loaded 2-core machine starts actors slowly
    runner.submit(rows[8:], n=2)
    rest = runner.take(9, timeout=240)
    uids = list(first.non_tensor_batch["uid"]) + list(rest.non_tensor_batch["uid"])
    assert sorted(uids) == sorted(r["uid"] for r in rows for _ in range(2))  # none lost, none twice
    assert uids[0::2] == uids[1::2]  # whole groups
    ref_uids = list(reference[0].non_tensor_batch["uid"])
    for batch in (first, rest):
        for i, uid in enumerate(batch.non_tensor_batch["uid"]):
            j = ref_uids.index(uid) + i % 2
            assert torch.equal(batch.batch["responses"][i], reference[0].batch["responses"][j])
    assert runner.stream_stats["taken_groups"] == 12


@pytest.mark.slow
def test_a_hung_actor_is_treated_as_dead(cluster, tmp_path):
    from tests.fixtures.hang import HangOnce

    rows = make_prompts(6)
    with RayRunner(
        "calculator",
        tokenizer=str(ASSETS),
        backend_factory=HangOnce(str(tmp_path / "hung")),
        workers=2,
        max_concurrency=2,
        hang_s=5.0,
    ) as hung:
        hung.submit(rows, n=2)
        batch = hung.take(6, timeout=240)
        stats = hung.stream_stats
    assert sorted(set(batch.non_tensor_batch["uid"])) == sorted(r["uid"] for r in rows)
    assert all(r == "done" for r in batch.non_tensor_batch["termination_reason"])
    assert stats["hung_actors"] == 1 and stats["actor_deaths"] == 1 and stats["rerun_rows"] >= 1
