"""The trainer-facing API: RolloutEngine's input forms, sync/async forms, validation sampling, servers and
control calls over in-process dev servers, and load_rows."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from backends.devserver import DevServer
from backends.scripted import ScriptedBackend, echo_backend
from fsm import DataError, RolloutEngine, load_rows
from fsm.api import make_backend
from fsm.data.rows import to_rows
from specs.calculator import make_prompts
from tests.conftest import ASSETS, REPO


def echo(latency_s: float = 0.0) -> ScriptedBackend:
    """In-process twin of the dev servers' scripted model: a deterministic function of the prompt."""
    return echo_backend(latency_s=latency_s)


@dataclass
class DataProto:  # verl's shape, recognised by class name (verl is not installed here)
    batch: Any = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


def columns(rows: list[dict]) -> dict[str, np.ndarray]:
    """Rows as verl's non_tensor_batch: one object array per column."""
    out = {}
    for key in rows[0]:
        col = np.empty(len(rows), dtype=object)
        col[:] = [r[key] for r in rows]
        out[key] = col
    return out


def same_tensors(a, b) -> None:
    assert set(a.batch.keys()) == set(b.batch.keys())
    for key in a.batch.keys():
        assert torch.equal(a.batch[key], b.batch[key]), key


def test_list_rows_sync_form_layout(tok):
    rows = make_prompts(3)
    with RolloutEngine("calculator", tok, backend=echo()) as engine:
        out = engine.generate_sequences(rows, n=2)
    assert len(out) == 6
    assert list(out.non_tensor_batch["uid"]) == ["calc-0-0"] * 2 + ["calc-0-1"] * 2 + ["calc-0-2"] * 2
    limits = engine.agent.limits
    assert out.batch["prompts"].shape == (6, limits.prompt_length)
    assert out.batch["responses"].shape == (6, limits.response_length)
    assert {"rm_scores", "rollout_log_probs", "position_ids"} <= set(out.batch.keys())
    assert out.meta_info["timing"]["agent_loop/generate_sequences/max"] >= 0.0
    assert out.meta_info["reward_extra_keys"] == []
    assert all(r == "done" for r in out.non_tensor_batch["termination_reason"])
    # samples of a row share the prompt; the echo model answers the prompt, so their responses agree too
    assert torch.equal(out.batch["input_ids"][0], out.batch["input_ids"][1])


async def test_column_dict_and_dataproto_inputs_match_rows(tok):
    rows = make_prompts(4)
    async with RolloutEngine("calculator", tok, backend=echo()) as engine:
        by_rows = await engine.agenerate_sequences(rows)
        by_columns = await engine.agenerate_sequences(columns(rows))
        proto = await engine.agenerate_sequences(
            DataProto(non_tensor_batch=columns(rows), meta_info={"step": 3})
        )
    same_tensors(by_rows, by_columns)
    assert list(by_columns.non_tensor_batch["uid"]) == [r["uid"] for r in rows]
    assert type(proto) is DataProto
    same_tensors(by_rows, proto)
    assert "metrics" not in proto.meta_info and "timing" in proto.meta_info  # as verl's manager returns it
    assert list(proto.non_tensor_batch["data_source"]) == ["calculator"] * 4


def test_to_rows_rejects_bad_batches():
    with pytest.raises(ValueError, match="raw_prompt"):
        to_rows({"prompt": np.array(["x"])})
    with pytest.raises(ValueError, match="differ in length"):
        to_rows({"raw_prompt": np.array([None, None]), "uid": np.array(["a"])})
    with pytest.raises(TypeError):
        to_rows("raw_prompt")


async def test_sync_form_refuses_inside_a_running_loop(tok):
    engine = RolloutEngine("calculator", tok, backend=echo())
    with pytest.raises(RuntimeError, match=r"await agenerate_sequences"):
        engine.generate_sequences(make_prompts(1))
    with pytest.raises(RuntimeError, match=r"await asleep"):
        engine.sleep()
    await engine.aclose()


def test_one_engine_serves_sync_then_async_then_sync(tok):
    engine = RolloutEngine("calculator", tok, backend=echo())
    first = engine.generate_sequences(make_prompts(2))  # the engine's own loop, in its thread

    async def elsewhere():
        return await engine.agenerate_sequences(make_prompts(2))

    second = asyncio.run(elsewhere())  # a caller's loop, bridged to the engine's
    third = asyncio.run(elsewhere())  # another loop: the first one is closed by now
    fourth = engine.generate_sequences(make_prompts(2))
    for out in (second, third, fourth):
        same_tensors(first, out)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate_sequences(make_prompts(1))


def test_one_engine_serves_async_then_sync(tok):
    engine = RolloutEngine("calculator", tok, backend=echo())

    async def first():
        out = await engine.agenerate_sequences(make_prompts(2))
        assert await engine.asleep() is None
        return out

    out = asyncio.run(first())
    same_tensors(out, engine.generate_sequences(make_prompts(2)))
    engine.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("agentfsm engine")]


UNCLOSED = """
import asyncio, sys

from backends.scripted import echo_backend
from fsm import RolloutEngine
from specs.calculator import make_prompts


async def main():
    engine = RolloutEngine("calculator", sys.argv[1], backend=echo_backend())
    assert len(await engine.agenerate_sequences(make_prompts(2))) == 2


asyncio.run(main())  # the engine is never closed
"""


def test_an_engine_left_open_at_exit_ends_its_tasks_quietly(tmp_path):
    """fsm/run/local.py: the exit stops an open engine's loop, whose tasks then end there; before, they were
    destroyed pending, with a RuntimeError traceback per task."""
    script = tmp_path / "unclosed.py"
    script.write_text(UNCLOSED)
    done = subprocess.run(
        [sys.executable, str(script), str(ASSETS)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Task was destroyed" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_ctrl_c_interrupts_a_sync_call_promptly(tok):
    """The engine's thread blocks SIGINT, so Ctrl-C reaches the main thread waiting on it. The test sets
    Python's Ctrl-C handler itself: a process started with SIGINT ignored (`nohup ... &`) has none."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    engine = RolloutEngine("calculator", tok, backend=echo(latency_s=0.5), max_concurrency=1)
    try:
        engine.generate_sequences(make_prompts(1))  # started
        sent: list[float] = []

        def ctrl_c_once_under_way() -> None:  # a condition, not a delay: a trajectory is being driven
            deadline = time.monotonic() + 60
            while not engine.runner.live and time.monotonic() < deadline:
                time.sleep(0.005)
            sent.append(time.perf_counter())
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=ctrl_c_once_under_way, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            engine.generate_sequences(make_prompts(8))  # 4 s uninterrupted
        assert time.perf_counter() - sent[0] < 2.0
        assert len(engine.generate_sequences(make_prompts(1))) == 1  # the engine still works
    finally:
        engine.close()
        signal.signal(signal.SIGINT, previous)


async def test_cancelling_the_caller_cancels_the_rollout(tok):
    engine = RolloutEngine("calculator", tok, backend=echo(latency_s=0.5))
    task = asyncio.ensure_future(engine.agenerate_sequences(make_prompts(4)))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    out = await engine.agenerate_sequences(make_prompts(1))  # the engine still works
    assert len(out) == 1
    await engine.aclose()


async def test_validate_uses_val_sampling(tok):
    backend = echo()
    backend.record_requests = True
    async with RolloutEngine("calculator", tok, backend=backend) as engine:
        spec = engine.agent.spec
        assert spec.sampling.temperature != spec.val_sampling.temperature
        await engine.agenerate_sequences(make_prompts(2))
        train = [r.sampling_params["temperature"] for r in backend.requests]
        backend.requests.clear()
        await engine.agenerate_sequences(make_prompts(2), validate=True)
        val = [r.sampling_params["temperature"] for r in backend.requests]
        backend.requests.clear()
        await engine.agenerate_sequences(
            DataProto(non_tensor_batch=columns(make_prompts(2)), meta_info={"validate": True})
        )
        proto_val = [r.sampling_params["temperature"] for r in backend.requests]
        backend.requests.clear()
        await engine.agenerate_sequences(make_prompts(1), {"temperature": 0.5}, validate=True)
        override = [r.sampling_params["temperature"] for r in backend.requests]
    assert set(train) == {spec.sampling.temperature}
    assert set(val) == set(proto_val) == {spec.val_sampling.temperature}
    assert override == [0.5]


@contextlib.asynccontextmanager
async def dev_servers(count: int, latency_s: float = 0.0):
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(DevServer(echo(latency_s))) for _ in range(count)]


async def test_over_dev_servers_matches_in_process(tok):
    rows = make_prompts(6)
    async with RolloutEngine("calculator", tok, backend=echo()) as engine:
        local = await engine.agenerate_sequences(rows, n=3)
    async with dev_servers(2, latency_s=0.005) as devs:
        async with RolloutEngine("calculator", tok, servers=[d.url for d in devs]) as engine:
            remote = await engine.agenerate_sequences(rows, n=3)
            stats = engine.backend.stats()
        logs = [[e["rid"] for e in d.log] for d in devs]
    same_tensors(local, remote)
    assert all(r == "done" for r in remote.non_tensor_batch["termination_reason"])
    assert all(logs)  # both servers worked
    assert stats["group"] == 12  # group affinity: each group's later samples followed its first
    servers_of: dict[str, set[int]] = {}  # session -> servers that saw it; group -> servers
    for server, rids in enumerate(logs):
        for rid in rids:
            session = rid.rsplit("_t", 1)[0]  # "{run}-{row}-{sample}_t{turn}"
            servers_of.setdefault(session, set()).add(server)
            servers_of.setdefault(session.rsplit("-", 1)[0], set()).add(server)
    assert len(servers_of) == 18 + 6
    assert all(len(s) == 1 for s in servers_of.values())  # sticky sessions, and groups met one server


async def test_control_calls_reach_every_dev_server(tok):
    async with dev_servers(2) as devs:
        async with RolloutEngine("calculator", tok, servers=[d.url for d in devs]) as engine:
            await engine.asleep()
            assert all(d.memory_released == {"weights", "kv_cache"} for d in devs)
            await engine.awake_up(["kv_cache"])
            assert all(d.memory_released == {"weights"} for d in devs)
            await engine.awake_up()
            assert all(not d.memory_released for d in devs)
            assert await engine.aupdate_weights_from_disk("/ckpt/step-7", weight_version=7) == 7
            assert all(d.weight_version == "7" for d in devs) and engine.weight_version == 7
            with pytest.raises(TypeError, match="must be an int"):
                await engine.aupdate_weights_from_disk("/ckpt/step-8", weight_version="step-8")
            assert await engine.aupdate_weights_from_disk("/ckpt/step-8") == 8
            out = await engine.agenerate_sequences(make_prompts(2))
            assert await engine.aflush_cache() == [True, True]
            assert all(d.cache.size == 0 for d in devs)
    assert len(out) == 2


async def test_update_weights_needs_a_backend_that_can(tok):
    async with RolloutEngine("calculator", tok, backend=echo()) as engine:
        assert await engine.asleep() is None  # nothing to release in process: a no-op
        with pytest.raises(NotImplementedError, match="update_weights_from_disk"):
            await engine.aupdate_weights_from_disk("/ckpt")


def test_constructor_errors(tok):
    with pytest.raises(ValueError, match="not both"):
        RolloutEngine("calculator", tok, backend=echo(), servers=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="tokenizer is needed"):
        RolloutEngine("calculator", servers=["http://127.0.0.1:1"])
    with pytest.raises(FileNotFoundError, match="no model"):
        make_backend(model="/nonexistent")


def test_embedded_model_object_and_weight_sync_from_tensors():
    from backends.tiny import EARLY_DIR, load_model

    model, early = load_model(ASSETS), load_model(EARLY_DIR)
    rows, greedy = make_prompts(3, seed=5), {"temperature": 0.0}
    with RolloutEngine("calculator", model=model, torch_threads=1) as engine:  # its tokenizer: ASSETS'
        assert engine.backend.model is model
        before = engine.generate_sequences(rows, greedy)
        assert engine.update_weights_from_tensor(named_tensors=early.state_dict()) == 1
        after = engine.generate_sequences(rows, greedy)
    mask = after.batch["response_mask"].bool()
    assert (before.batch["weight_versions"][before.batch["response_mask"].bool()] == 0).all()
    assert (after.batch["weight_versions"][mask] == 1).all() and mask.any()
    assert not torch.equal(before.batch["responses"], after.batch["responses"])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in early.state_dict().items())


def test_embedded_model_tokenizer_is_found_or_said_missing(tok):
    from backends.tiny import EARLY_DIR, load_model

    with pytest.raises(FileNotFoundError, match=r"no tokenizer in .*early .*pass tokenizer="):
        RolloutEngine("calculator", model=EARLY_DIR)
    with pytest.raises(FileNotFoundError, match=r"no tokenizer in .*early"):
        RolloutEngine("calculator", model=load_model(EARLY_DIR))
    with pytest.raises(TypeError, match="not a transformers causal LM"):
        RolloutEngine("calculator", tok, model=torch.nn.Linear(2, 2))
    engine = RolloutEngine("calculator", tok, model=EARLY_DIR)  # with a tokenizer given, it serves
    assert engine.codec.tokenizer is tok
    engine.close()


def test_trajectories_pickle(tok):
    engine = RolloutEngine("calculator", tok, backend=echo())
    trajs = engine._run_sync(engine.arun(make_prompts(2), n=2))
    engine.close()
    back = pickle.loads(pickle.dumps(trajs))
    assert [t.to_output() for t in back] == [t.to_output() for t in trajs]
    assert [t.runs for t in back] == [t.runs for t in trajs]


def test_load_rows_jsonl(tmp_path):
    path = tmp_path / "rows.jsonl"
    good = {"raw_prompt": [{"role": "user", "content": "hi"}], "uid": "a"}
    lines = [
        json.dumps(good),
        "",
        json.dumps({"prompt": [{"role": "user", "content": "verl"}]}),
        json.dumps({"raw_prompt": "plain text"}),
        json.dumps({"question": "no prompt"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    rows = load_rows(path)
    assert [r["raw_prompt"][0]["content"] for r in rows[:3]] == ["hi", "verl", "plain text"]
    assert rows[3] == {"question": "no prompt"}  # kept: the engine fails this row alone

    path.write_text("\n".join([json.dumps(good), "{not json", json.dumps([1])]) + "\n")
    with pytest.raises(DataError) as err:
        load_rows(path)
    assert [p.split(": ", 1)[0] for p in err.value.problems] == [f"{path}:2:2", f"{path}:3"]


def test_load_rows_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(make_prompts(3)), path)
    rows = load_rows(path)
    assert [r["uid"] for r in rows] == ["calc-0-0", "calc-0-1", "calc-0-2"]
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "a"}]}]), path)
    assert load_rows(path)[0]["raw_prompt"] == [{"role": "user", "content": "a"}]
    path.write_bytes(b"not parquet")
    with pytest.raises(DataError, match="cannot read parquet"):
        load_rows(path)
    other = tmp_path / "rows.csv"
    other.touch()
    with pytest.raises(DataError, match="unsupported file type"):
        load_rows(other)


def test_bad_row_in_a_file_fails_alone(tmp_path, tok):
    """A row without a prompt runs as one error row; the others are unaffected."""
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [*make_prompts(2), {"question": "x"}]) + "\n")
    with RolloutEngine("calculator", tok, backend=echo()) as engine:
        batch = engine.generate_sequences(load_rows(path))
    reasons = list(batch.non_tensor_batch["termination_reason"])
    assert not reasons[0].startswith("error") and not reasons[1].startswith("error")
    assert reasons[2].startswith("error: bad row")


@pytest.mark.skipif(not (ASSETS / "model.safetensors").exists(), reason="the tiny model is not trained yet")
def test_embedded_default_runs_the_tiny_model():
    with RolloutEngine("calculator") as engine:  # no backend, no servers: backends.hf over the tiny model
        out = engine.generate_sequences(make_prompts(2), validate=True)
        again = engine.generate_sequences(make_prompts(2), validate=True)
    assert engine.backend.provider == "transformers"
    assert out.batch["response_mask"].sum() > 0
    # Greedy: the same tokens; logprobs agree up to float summation order (batch composition differs).
    for key in out.batch.keys():
        if key == "rollout_log_probs":
            torch.testing.assert_close(out.batch[key], again.batch[key], atol=1e-4, rtol=0)
        else:
            assert torch.equal(out.batch[key], again.batch[key]), key
