"""`agentfsm bench trees --server URL`: the cached share of a fork's branch prompts, as the server itself counts it.

A fork sends every branch to the server its prefix went to (one routing key, docs/trees.md), so a branch's prompt
should be served from that server's prefix cache. This runs two forks of the calculator against a real server
from a flushed cache and reads, per request, the server's own count of prompt tokens it did not prefill: SGLang's
`meta_info.cached_tokens`; vLLM's `usage.prompt_tokens_details.cached_tokens` (on with
`--enable-prompt-tokens-details`, as backends/launcher.py starts it) and, over the run, its /metrics counters
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`.
- `first_turn`: specs/fork_calculator.yaml, forked before the first model turn: the K branches send the same
  prompt at once, nothing of it computed before (what they share depends on how the engine batches them);
- `after_call`: the calculator forked once its first model turn has ended (on entering PROCESSING_TOOLS): the
  root's turn ran the shared prefix (prompt and output), then each branch runs the call and sends its own turn.
`shared` is a branch's prefix in common with its parent (`shared_prefix.length`); `full_blocks` that prefix in
the engine's whole cache blocks (vLLM caches whole blocks only; SGLang's page is 1 token), less the last token
of the parent's output, which no engine has run through the model before the branch's request.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

import fsm
from backends.base import GenerateRequest, GenerateResult
from backends.engines import client, detect_engine
from backends.router import Router
from fsm.api import model_tokenizer, tiny_model_dir
from fsm.run.tree import row_nodes
from specs.calculator import make_prompts

SPECS = Path(__file__).resolve().parents[1] / "specs"
AFTER_CALL = f"""
name: fork_after_call
extends: {SPECS / "calculator.yaml"}
states:
  PROCESSING_TOOLS:
    fork: {{branches: 4, times: 1}}
"""
COUNTERS = ("prefix_cache_hits_total", "prefix_cache_queries_total")


class Recording(Router):
    """The router, keeping every model request with its answer."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.calls: list[tuple[GenerateRequest, GenerateResult]] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        result = await super().generate(request)
        self.calls.append((request, result))
        return result


async def vllm_counters(url: str) -> dict[str, float]:
    """vLLM's prefix-cache counters (tokens) and its cache block size, from /metrics."""
    async with aiohttp.ClientSession() as http, http.get(url.rstrip("/") + "/metrics") as r:
        r.raise_for_status()
        text = await r.text()
    out = {
        name: sum(float(v) for v in re.findall(rf"^vllm:{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.M))
        for name in COUNTERS
    }
    block = re.search(r'^vllm:cache_config_info{[^}]*block_size="(\d+)"', text, re.M)
    out["block_size"] = float(block.group(1)) if block else 0.0
    return out


def spec_path(name: str, tmp: Path) -> Path:
    """The spec file of fork `name` ("first_turn" or "after_call"); the latter is written into `tmp`."""
    if name == "first_turn":
        return SPECS / "fork_calculator.yaml"
    path = tmp / "fork_after_call.yaml"
    path.write_text(AFTER_CALL)
    return path


def branch_prompts(
    trajs: list[Any], calls: list[tuple[GenerateRequest, GenerateResult]], block: int
) -> list[dict[str, Any]]:
    """Each branch's first request: {node, prompt, cached, share, shared, full_blocks, server, route}."""
    by_rid = {req.rid: (req, res) for req, res in calls if req.rid}
    out = []
    for root in trajs:
        for b in row_nodes(root):
            if b.node.kind != "branch":
                continue
            first = min(
                (rid for rid in by_rid if rid.startswith(b.session_id + "_t")), default=None
            )  # its turn numbers go on from the parent's: the smallest is its first
            if first is None:
                continue
            req, res = by_rid[first]
            prompt, cached = len(req.prompt_ids), res.cached_tokens or 0
            shared = b.node.shared_length
            out.append(
                {
                    "node": f"{root.session_id} {b.node.node}",
                    "prompt": prompt,
                    "cached": cached,
                    "share": round(cached / prompt, 4) if prompt else 0.0,
                    "shared": shared,
                    "full_blocks": (shared - 1) // block * block,
                    "server": res.server,
                    "route": res.route,
                }
            )
    return out


def padded_rows(prompts: int, seed: int, pad: int) -> list[dict[str, Any]]:
    """`prompts` calculator rows, each question followed by `pad` repeats of a short sentence: a longer prompt
    (about 12 tokens each: within the spec's prompt_length 320 up to pad 9), so that a prefix spans more than one of vLLM's CPU cache
    blocks (128 tokens) and the second block holds the row's own question, which only its own tree shares."""
    rows = make_prompts(prompts, seed)
    for row in rows:
        user = row["raw_prompt"][-1]
        user["content"] += " Show your work." * pad
    return rows


async def fork_cache(
    url: str,
    fork: str,
    tmp: Path,
    *,
    prompts: int = 4,
    seed: int = 0,
    pad: int = 0,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Run fork `fork` on `prompts` calculator rows (`padded_rows`) against the server at `url` from a flushed
    cache; returns the branch prompts (`branch_prompts`), their totals, every request's totals and, on vLLM, its
    counters' deltas over the run."""
    engine = await detect_engine(url)
    server = client(engine, url, max_retries=1, backoff_s=0.01)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_tokenizer(tiny_model_dir()))
    async with Recording([server], health_interval_s=0) as router:
        if not await server.flush_cache():
            raise RuntimeError(f"{url}: the server refused to flush its prefix cache (requests running?)")
        before = await vllm_counters(url) if engine == "vllm" else {}
        runner = fsm.Runner(
            fsm.compile_spec(spec_path(fork, tmp)), router, tokenizer, max_concurrency=prompts
        )
        trajs = await runner.run(padded_rows(prompts, seed, pad), sampling_params={"seed": seed})
        after = await vllm_counters(url) if engine == "vllm" else {}
    failed = [t.error or t.termination_reason for t in trajs if t.failed]
    if failed:
        raise RuntimeError(f"{url}: {len(failed)} of {prompts} {fork} trees failed: {failed[0]}")
    block = int(after.get("block_size") or 1)
    branches = branch_prompts(trajs, router.calls, block)
    prompt = sum(b["prompt"] for b in branches)
    cached = sum(b["cached"] for b in branches)
    every_p = sum(len(q.prompt_ids) for q, _ in router.calls)
    every_c = sum(r.cached_tokens or 0 for _, r in router.calls)
    out: dict[str, Any] = {
        "engine": engine,
        "fork": fork,
        "pad": pad,
        "block_size": block,
        "branch_prompts": branches,
        "branches": {
            "requests": len(branches),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "cached_share": round(cached / prompt, 4) if prompt else 0.0,
        },
        "all_requests": {
            "requests": len(router.calls),
            "prompt_tokens": every_p,
            "cached_tokens": every_c,
            "cached_share": round(every_c / every_p, 4) if every_p else 0.0,
        },
    }
    if engine == "vllm":
        hits, queries = (after[n] - before[n] for n in COUNTERS)
        out["vllm_metrics"] = {
            "prefix_cache_hits": hits,
            "prefix_cache_queries": queries,
            "hit_rate": round(hits / queries, 4) if queries else 0.0,
        }
    return out


RUNS = (
    ("first_turn", 0),
    ("after_call", 0),
    ("first_turn", 7),
)  # (fork, pad): the padded prompt spans 2 blocks


async def bench_fork_cache(servers: Sequence[str], tmp: Path, prompts: int = 4) -> dict[str, Any]:
    """Each fork of RUNS against each server in turn; per run the branch prompts' totals and the whole run's."""
    out: dict[str, Any] = {}
    for url in servers:
        for fork, pad in RUNS:
            r = await fork_cache(url, fork, tmp, prompts=prompts, pad=pad)
            name = f"{url} {r['engine']} {fork}" + (f" pad={pad}" if pad else "")
            out[name] = r
    return out
