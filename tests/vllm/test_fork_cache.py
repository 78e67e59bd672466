"""A fork's branch prompts and vLLM's prefix cache (docs/trees.md, "Forks"; numbers in docs/benchmarks.md).

The branches of a fork send their parent's routing key, so they reach the server that ran the parent; vLLM
says per request how many prompt tokens it took from its cache (`usage.prompt_tokens_details.cached_tokens`,
on with `--enable-prompt-tokens-details`, as the launcher starts it) and counts the same over the run on /metrics
(`vllm:prefix_cache_hits_total` / `_queries_total`). Prefix caching is on by default in vLLM 0.32 (the suite's
server logs `enable_prefix_caching=True`); its CPU engine caches whole 128-token blocks only, so a branch can
reuse at most the full blocks of its shared prefix (bench/fork_cache.py `full_blocks`).
"""

from __future__ import annotations

import pytest

from bench.fork_cache import fork_cache

pytestmark = pytest.mark.vllm


def _counted_as_metrics(out: dict) -> None:
    """The per-request counts add up to vLLM's own counters over the run."""
    every, metrics = out["all_requests"], out["vllm_metrics"]
    assert metrics["prefix_cache_queries"] == every["prompt_tokens"], out
    assert metrics["prefix_cache_hits"] == every["cached_tokens"], out


@pytest.mark.slow
async def test_branch_prompts_after_the_first_turn_are_served_from_cache(vllm, tok, tmp_path):
    """One tree from a flushed cache: what its branches find cached, only its own root's turn can have left."""
    out = await fork_cache(vllm.url, "after_call", tmp_path, prompts=1, tokenizer=tok)
    print(out["branches"], out["all_requests"], out["vllm_metrics"], flush=True)  # docs/benchmarks.md (-s)
    branches = out["branch_prompts"]
    assert out["engine"] == "vllm" and out["block_size"] == 128 and len(branches) == 4
    for b in branches:
        assert b["route"] == "sticky" and b["full_blocks"] >= 128, b
        assert b["full_blocks"] <= b["cached"] <= b["prompt"] // 128 * 128, b
    _counted_as_metrics(out)


async def test_branches_sent_at_once_share_one_prefill(vllm, tok, tmp_path):
    """specs/fork_calculator.yaml: the K branches send one prompt no request has run yet, all at once. vLLM
    schedules them in one step and caches the first's blocks as it allocates them: the other K-1 reuse them.
    Padded prompts (286 tokens) give two full blocks, the second holding the row's own question."""
    out = await fork_cache(vllm.url, "first_turn", tmp_path, prompts=2, pad=7, tokenizer=tok)
    print(out["branches"], out["vllm_metrics"], flush=True)
    branches = out["branch_prompts"]
    assert len(branches) == 8 and {b["full_blocks"] for b in branches} == {256}
    for tree in {b["node"].split()[0] for b in branches}:
        mine = [b for b in branches if b["node"].startswith(tree + " ")]
        assert sum(b["cached"] >= b["full_blocks"] for b in mine) >= len(mine) - 1, mine
    _counted_as_metrics(out)
