"""`agentfsm bench gateway`'s client in its own process (bench/gateway.py): one process per event loop however
many rows start at once, a row whose client process ends fails instead of waiting, and the whole bench runs."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest

from bench import gateway as bench
from fsm.gateway import HarnessCall

ECHO = "import json, sys\nfor line in sys.stdin:\n    print(json.dumps([json.loads(line)[0], 'ok']), flush=True)\n"


def _calls(n: int) -> list[HarnessCall]:
    return [HarnessCall("http://127.0.0.1:9/v1", "", f"key{i}", "m", {"raw_prompt": []}) for i in range(n)]


def test_rows_started_at_once_share_one_client_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "CLIENT_COMMAND", [sys.executable, "-c", ECHO])
    started = []
    spawn = asyncio.create_subprocess_exec

    async def counting(*args, **kwargs):
        started.append(args)
        return await spawn(*args, **kwargs)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", counting)

    async def main() -> list[str]:
        try:
            return await asyncio.gather(*(bench.remote_harness(c) for c in _calls(8)))
        finally:
            await bench._stop_client()

    assert asyncio.run(main()) == ["ok"] * 8
    assert len(started) == 1


def test_a_client_process_that_ends_fails_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "CLIENT_COMMAND", [sys.executable, "-c", "import sys; sys.stdin.readline()"])

    async def main() -> list[BaseException | str]:
        try:
            async with asyncio.timeout(60):
                return await asyncio.gather(
                    *(bench.remote_harness(c) for c in _calls(3)), return_exceptions=True
                )
        finally:
            await bench._stop_client()

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "output ended (exit code 0)" in str(r) for r in results), (
        results
    )


@pytest.mark.slow
def test_bench_gateway_with_the_client_in_its_own_process() -> None:
    out = bench.bench_gateway(sessions=(1, 4), repeats=1, calls_at_one=4, kinds=("native", "gateway"))
    for row in out["rows"].values():
        assert row["gateway_cpu_us_per_call"] > 0 and row["gateway_ratio"] > 0


@pytest.mark.slow
@pytest.mark.skipif(not bench.placements_here(), reason="pinning needs Linux and two cores")
def test_pinned_kinds_place_the_client_and_unpin_after(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    placed = []
    start = bench._start_client

    async def recording():
        proc, pending, reader = await start()
        placed.append((os.sched_getaffinity(0), os.sched_getaffinity(proc.pid)))
        return proc, pending, reader

    monkeypatch.setattr(bench, "_start_client", recording)
    before = os.sched_getaffinity(0)
    out = bench.bench_gateway(
        sessions=(1,), repeats=1, calls_at_one=4, kinds=("native", "gateway_same_core", "gateway_other_core")
    )
    row = out["rows"]["1_in_flight"]
    assert row["gateway_same_core_cpu_us_per_call"] > 0 and len(row["gateway_other_core_round_ratios"]) == 1
    assert placed[-2:] == [({0}, {0}), ({0}, {1})]  # the warm-up runs come first, placed alike
    assert os.sched_getaffinity(0) == before


def test_bench_gateway_contexts_measures_each_api_at_each_size(real_tokenizer: Any) -> None:
    """`agentfsm bench gateway --workload contexts` at small sizes: every API's rows succeed through the gateway
    (the harness's calls on its own conversation, token-exact) and each size has its first and later calls."""
    real_tokenizer("qwen2_5")  # skips (or fails under CI) with the line that fetches it
    out = bench.bench_context(sizes=(300, 1500), calls=2, repeats=1)
    for api in bench.APIS_MEASURED:
        small, large = out["rows"][f"{api}_300"], out["rows"][f"{api}_1500"]
        assert small["prompt_tokens"] < large["prompt_tokens"]
        assert all(
            cell[k] > 0 for cell in (small, large) for k in ("first_new_us", "first_seen_us", "later_us")
        )
        assert set(out[f"{api}_ratio"]) == {"first_new_us", "first_seen_us", "later_us"}
