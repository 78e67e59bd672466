"""`agentfsm bench trees`: what a fork saves, on the tiny model behind the dev server (real HTTP).

A K-way fork encodes and prefills its prefix once and sends every branch to the server its prefix went to; K
independent samples of the same row (a GRPO group) each send the whole prompt. Both runs here use one dev server
with a prefix cache, which reports `cached_tokens` as SGLang does. Then the training tokens a packing trainer
stores for the shipped tree specs: every row in full, against each shared prefix once (`shared_prefix`).
With `--server URL` (real SGLang or vLLM), the cached share of the branch prompts as the server counts it.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backends.devserver import DevServer
from fsm import RolloutEngine
from fsm.api import make_backend, model_tokenizer, tiny_model_dir
from fsm.run.tree import row_nodes
from specs.calculator import make_prompts

K, PROMPTS = 4, 8


def packing(trajs: list[Any]) -> dict[str, Any]:
    """Row tokens (prompt + response, every row in full) against a packing trainer's: each shared prefix once."""
    full = saved = 0
    for root in trajs:
        seen: set[tuple[str | None, int]] = set()
        for n in row_nodes(root):
            full += len(n.prompt_ids) + len(n.response_ids)
            shared = n.node.shared_length
            key = (n.node.parent, shared)
            if shared and key in seen:
                saved += shared
            seen.add(key)
    return {
        "row_tokens": full,
        "packed_tokens": full - saved,
        "saved_share": round(saved / full, 4) if full else 0.0,
    }


async def _run(spec: str, n: int) -> dict[str, Any]:
    served = make_backend()
    async with DevServer(served) as dev:
        async with RolloutEngine(
            spec, model_tokenizer(tiny_model_dir()), servers=[dev.url], engine="sglang"
        ) as engine:
            trajs = await engine.arun(make_prompts(PROMPTS, 0), n=n, sampling_params={"seed": 0})
        log = list(dev.log)
    await served.close()
    rows = [r for t in trajs for r in row_nodes(t)]
    first = [e for e in log if e["rid"].endswith("_t00")]
    return {
        "rows": len(rows),
        "generated_tokens": sum(r.response_mask.count(1) for r in rows),
        "requests": len(log),
        "prompt_tokens_sent": sum(e["prompt_tokens"] for e in log),
        "prefilled_tokens": sum(e["prompt_tokens"] - e["cached_tokens"] for e in log),
        "first_turn_cached_share": round(
            sum(e["cached_tokens"] for e in first) / max(sum(e["prompt_tokens"] for e in first), 1), 4
        ),
        "packing": packing(trajs),
    }


def bench_trees(servers: Sequence[str] = (), prompts: int = PROMPTS // 2) -> dict[str, Any]:
    """On the dev server; with `servers` (real SGLang or vLLM serving the tiny model), the cached share of the
    branch prompts of `prompts` trees per run as each server counts it instead (bench/fork_cache.py)."""
    if servers:
        from bench.fork_cache import bench_fork_cache

        with tempfile.TemporaryDirectory() as tmp:
            return asyncio.run(bench_fork_cache(servers, Path(tmp), prompts=prompts))
    fork = asyncio.run(_run("specs/fork_calculator.yaml", 1))
    independent = asyncio.run(_run("specs/calculator.yaml", K))
    planner = asyncio.run(_run("specs/planner_solver.yaml", 1))
    return {
        "setup": f"{PROMPTS} prompts; fork into K={K} branches at the first model turn vs n={K} independent "
        "samples; one dev server over the tiny model (prefix cache)",
        "fork_K": fork,
        "independent_K": independent,
        "planner_solver": planner,
    }
