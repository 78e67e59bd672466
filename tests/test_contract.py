"""The engine contract (fsm/output/engine.py `Engine`), one test per call, run against every implementation: RolloutEngine in
this process and RayRunner on a real local Ray instance, each over its own scripted dev servers (subprocesses).
Code written against one works against the other, or the difference is the typed refusal `EngineRefused`.

The gateway's workers write their merged run with the engines' own batch code (fsm/api.py `batch_of`); they are
tested end to end in tests/gateway/.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from backends.scripted import scripted_servers
from fsm import Engine, RolloutEngine
from fsm.api import BaseEngine
from fsm.run.engine import EngineRefused
from fsm.run.stream import StreamEmpty
from specs.calculator import make_prompts
from tests.conftest import ASSETS

TAKE_S = 240  # bounds, not waits: a loaded 2-core machine starts Ray actors slowly


def server_info(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/server_info", timeout=5) as r:
        return json.load(r)


def model_info(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/model_info", timeout=5) as r:
        return json.load(r)


@pytest.fixture(scope="module", params=["local", "ray"])
def engine(request):
    """(engine, its servers): each implementation over two scripted servers of its own."""
    with scripted_servers(2) as urls:
        if request.param == "local":
            with RolloutEngine("calculator", str(ASSETS), servers=urls, max_concurrency=8) as e:
                yield e, urls
            return
        from tests.conftest import extra

        ray = extra("ray", "ray")
        from fsm import RayRunner

        started = not ray.is_initialized()
        if started:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            with RayRunner(
                "calculator", tokenizer=str(ASSETS), servers=urls, workers=2, max_concurrency=4
            ) as e:
                yield e, urls
        finally:
            if started:
                ray.shutdown()


@pytest.mark.slow
def test_it_is_the_contract(engine):
    e, _ = engine
    assert isinstance(e, Engine) and isinstance(e, BaseEngine)


@pytest.mark.slow
def test_a_batch_comes_back_in_input_order(engine):
    e, _ = engine
    rows = make_prompts(3)
    batch = e.generate_sequences(rows, n=2)
    assert list(batch.non_tensor_batch["uid"]) == [r["uid"] for r in rows for _ in range(2)]
    assert batch.meta_info["rollout_metrics"]["rollout/samples"] == 6.0
    trajs = asyncio.run(e.arun(rows[:1], n=2))
    assert [t.sample for t in trajs] == [0, 1] and all(t.state == "TERMINATED" for t in trajs)


def test_the_continuous_mode_hands_out_whole_groups(engine):
    e, _ = engine
    rows = make_prompts(4)
    assert e.submit(rows, n=2) == [r["uid"] for r in rows]
    first = e.take(1, timeout=TAKE_S)
    rest = e.take(3, timeout=TAKE_S)
    uids = list(first.non_tensor_batch["uid"]) + list(rest.non_tensor_batch["uid"])
    assert sorted(uids) == sorted(r["uid"] for r in rows for _ in range(2)) and uids[0::2] == uids[1::2]
    assert rest.meta_info["staleness"] == [0, 0, 0]
    stats = e.stream_stats
    assert stats["submitted_groups"] >= 4 and stats["taken_groups"] >= 4 and stats["ready_groups"] == 0
    with pytest.raises(StreamEmpty, match="submit rows first"):
        e.take(1, timeout=TAKE_S)


def test_control_calls_reach_every_server_and_count_versions(engine, tmp_path):
    e, urls = engine
    version = e.weight_version
    assert isinstance(version, int)
    assert e.update_weights_from_disk(str(tmp_path)) == version + 1 == e.weight_version
    assert all(model_info(u)["weight_version"] == str(version + 1) for u in urls)
    assert (
        e.update_weights_from_disk(str(tmp_path), weight_version=version + 5)
        == version + 5
        == e.weight_version
    )
    with pytest.raises(TypeError, match="weight_version must be an int"):
        e.update_weights_from_disk(str(tmp_path), weight_version="7")
    e.pause()
    assert e.paused
    e.resume()
    assert not e.paused
    with pytest.raises(ValueError, match="unknown pause mode"):
        e.pause("sideways")
    e.sleep()
    assert all(
        server_info(u)["internal_states"][0]["memory_released"] == ["kv_cache", "weights"] for u in urls
    )
    e.wake_up()
    assert all(server_info(u)["internal_states"][0]["memory_released"] == [] for u in urls)
    batch = e.generate_sequences(make_prompts(2), n=2)  # after a pause and resume, rows run again
    assert len(batch.non_tensor_batch["uid"]) == 4


def test_a_snapshot_is_written_or_refused_by_type(engine, tmp_path):
    e, _ = engine
    e.submit(make_prompts(2), n=2)
    if e.snapshots:
        info = e.snapshot(tmp_path / "s.json")
        assert info["ready_groups"] + info["running_groups"] == 2 and (tmp_path / "s.json").is_file()
    else:
        with pytest.raises(EngineRefused, match=rf"{type(e).__name__}\.asnapshot\(\)"):
            e.snapshot(tmp_path / "s.json")
        with pytest.raises(NotImplementedError):  # a refusal is a NotImplementedError
            e.restore(tmp_path / "s.json")
    assert len(e.take(2, timeout=TAKE_S).non_tensor_batch["uid"]) == 4


def test_the_sync_forms_refuse_inside_a_loop(engine):
    e, _ = engine

    async def inside():
        e.take(1)

    with pytest.raises(RuntimeError, match="atake"):
        asyncio.run(inside())
