"""`agentfsm bench hf`: greedy decode throughput of the embedded transformers backend (`backends.hf`).

It answers whether batching concurrent `generate()` calls into one forward pass pays off on this machine:
tokens/s at batch size 1 against a full batch, every request generating the same number of tokens.
"""

from __future__ import annotations

import asyncio
import os
import random
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
) -> dict[str, Any]:
    """Greedy generated tokens/s at each batch size: `batch` concurrent requests of random prompts.

    Every request generates exactly `new_tokens` (eos ignored). A warm-up batch runs first, then each batch
    size `repeats` times; the best run counts (on a shared machine the others measure the neighbours). Call
    it outside an event loop. Returns {"tokens_per_s": {batch: total generated tokens/s}, ...}.
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

    return asyncio.run(run())
