"""`agentfsm bench hf`: throughput of the embedded transformers backend (`backends.hf`).

Two questions. Does batching concurrent `generate()` calls into one forward pass pay off on this machine
(greedy tokens/s at batch size 1 against a full batch)? And how close does a real rollout come to that
batch: the calculator spec (`agentfsm run specs/calculator.yaml`: 64 prompts, a tool turn, then the answer)
through `RolloutEngine` in generated tokens/s, against the same backend generating as many tokens for the
same first-turn prompts in one batch. The rollout pays for its turns (a prompt that grows, trajectories that
come back at different times) and for the engine's own work; the ratio says how much of the batch's speed
survives.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from backends.base import GenerateRequest
from backends.hf import HFBackend


def bench_hf(
    model_dir: str | os.PathLike[str] | PreTrainedModel,
    batch_sizes: Sequence[int] = (1, 32),
    prompt_len: int = 170,
    new_tokens: int = 64,
    *,
    torch_threads: int | None = 2,
    device: str | None = None,
    repeats: int = 3,
    rollout_prompts: int = 64,
    rollout_threads: int | None = 1,
) -> dict[str, Any]:
    """Greedy generated tokens/s at each batch size: `batch` concurrent requests of random prompts; then the
    calculator rollout against one batch (`bench_rollout`, skipped when `rollout_prompts` is 0) on
    `rollout_threads` torch threads: the rollout's own event loop needs a core too, and on a small shared
    machine a second torch thread that loses its core stalls every step.

    Every request generates exactly `new_tokens` (eos ignored). A warm-up batch runs first, then each batch
    size `repeats` times; the best run counts (on a shared machine the others measure the neighbours). Call
    it outside an event loop. Returns {"tokens_per_s": {batch: total generated tokens/s}, "rollout": ...}.
    """

    async def run() -> dict[str, Any]:
        backend = HFBackend(
            model_dir, device=device, torch_threads=torch_threads, max_batch_size=max(batch_sizes)
        )
        rng = random.Random(0)
        params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}

        async def rate(n: int) -> float:
            prompts = [[rng.randrange(backend.vocab_size) for _ in range(prompt_len)] for _ in range(n)]
            requests = [GenerateRequest(f"bench{i}", p, params) for i, p in enumerate(prompts)]
            start = time.perf_counter()
            results = await asyncio.gather(*(backend.generate(r) for r in requests))
            return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)

        async with backend:
            await rate(1)  # warm-up
            best = {n: max([await rate(n) for _ in range(repeats)]) for n in batch_sizes}
        return {
            "model": backend.model_name,
            "device": str(backend.device),
            "threads": torch.get_num_threads(),
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "tokens_per_s": best,
        }

    out = asyncio.run(run())
    print(
        f"bench hf: greedy tokens/s by batch size (best of {repeats}): "
        + ", ".join(f"{n}: {r:.0f}" for n, r in out["tokens_per_s"].items()),
        file=sys.stderr,
    )
    if rollout_prompts:
        out["rollout"] = bench_rollout(
            model_dir, rollout_prompts, torch_threads=rollout_threads, device=device, repeats=repeats
        )
    return out


def bench_rollout(
    model_dir: str | os.PathLike[str] | PreTrainedModel,
    prompts: int = 64,
    *,
    spec: str = "calculator",
    torch_threads: int | None = 1,
    device: str | None = None,
    max_batch_size: int = 64,
    repeats: int = 3,
) -> dict[str, Any]:
    """Generated tokens/s of the calculator rollout (through `RolloutEngine`, the embedded backend, as
    `agentfsm run` builds it) against `HFBackend.generate` over the rollout's first-turn prompts in one batch,
    each row generating as many tokens as its trajectory did (eos ignored, the spec's temperature, seeded).

    The engine and the model are built once, outside the timings (no import or load time), and warmed up.
    The two variants alternate `repeats` times; medians of wall time and of this process's CPU time (all
    threads) count. ratio = rollout tokens/s / one-batch tokens/s.
    """
    from fsm.api import RolloutEngine
    from fsm.spec.registry import resolve

    engine = RolloutEngine(
        spec,
        model=model_dir,
        torch_threads=torch_threads,
        device=device,
        max_batch_size=max_batch_size,
        max_concurrency=256,
        watchdog_s=None,
    )
    rows = resolve(engine.agent.spec.demo_data, engine.agent.spec.trust.allow_modules)(prompts, seed=0)
    temperature = engine.agent.spec.sampling.temperature

    def rollout() -> tuple[int, list[tuple[list[int], int]]]:
        trajs = asyncio.run(engine.arun(rows, sampling_params={"seed": 0}))
        bad = [t for t in trajs if t.failed]
        assert not bad, f"bench rollout: a trajectory failed: {bad[0].termination_reason}"
        work = [(list(t.prompt_ids), sum(t.response_mask)) for t in trajs]
        return sum(n for _, n in work), work

    async def one_batch(work: list[tuple[list[int], int]]) -> tuple[int, float, float]:
        # a backend of its own (on this loop) over the engine's very model module
        single = HFBackend(engine.backend.model, device=device, max_batch_size=max_batch_size)
        requests = [
            GenerateRequest(
                f"one{i}",
                prompt,
                {"max_new_tokens": n, "temperature": temperature, "ignore_eos": True, "sampling_seed": i},
            )
            for i, (prompt, n) in enumerate(work)
        ]
        async with single:
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            results = await asyncio.gather(*(single.generate(r) for r in requests))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        batches = {r.extra["batch"] for r in results}
        assert len(batches) == 1, f"bench rollout: the one batch ran as {len(batches)}"
        return sum(len(r.token_ids) for r in results), wall, cpu

    try:
        _, work = rollout()  # warm-up: the first run pays for lazy initialisation
        asyncio.run(one_batch(work))
        walls: dict[str, list[float]] = {"rollout": [], "one_batch": []}
        cpus: dict[str, list[float]] = {"rollout": [], "one_batch": []}
        tokens: dict[str, list[int]] = {"rollout": [], "one_batch": []}
        for _ in range(repeats):
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            n, work = rollout()
            walls["rollout"].append(time.perf_counter() - t0)
            cpus["rollout"].append(time.process_time() - c0)
            tokens["rollout"].append(n)
            n, wall, cpu = asyncio.run(one_batch(work))
            walls["one_batch"].append(wall)
            cpus["one_batch"].append(cpu)
            tokens["one_batch"].append(n)
    finally:
        engine.close()
    out: dict[str, Any] = {
        "spec": spec,
        "prompts": prompts,
        "max_batch_size": max_batch_size,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
    }
    for kind in walls:
        wall, cpu = statistics.median(walls[kind]), statistics.median(cpus[kind])
        n = statistics.median(tokens[kind])
        out[kind] = {
            "generated_tokens": n,
            "wall_s": round(wall, 3),
            "cpu_s": round(cpu, 3),
            "tokens_per_s": round(n / wall, 1),
            "tokens_per_cpu_s": round(n / cpu, 1),
        }
    out["ratio"] = round(out["rollout"]["tokens_per_s"] / out["one_batch"]["tokens_per_s"], 3)
    out["ratio_cpu"] = round(out["rollout"]["tokens_per_cpu_s"] / out["one_batch"]["tokens_per_cpu_s"], 3)
    r, b = out["rollout"], out["one_batch"]
    print(
        f"bench hf rollout: {spec}, {prompts} prompts, median of {repeats} (wall / CPU):\n"
        f"  rollout    {r['tokens_per_s']:7.0f} / {r['tokens_per_cpu_s']:7.0f} tokens/s  ({r['wall_s']:.2f} s / {r['cpu_s']:.2f} s)\n"
        f"  one batch  {b['tokens_per_s']:7.0f} / {b['tokens_per_cpu_s']:7.0f} tokens/s  ({b['wall_s']:.2f} s / {b['cpu_s']:.2f} s)\n"
        f"  ratio      {out['ratio']:.2f}x / {out['ratio_cpu']:.2f}x",
        file=sys.stderr,
    )
    return out
