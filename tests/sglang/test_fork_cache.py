"""A fork's branch prompts and SGLang's radix cache (docs/trees.md, "Forks"; numbers in docs/benchmarks.md).

The branches of a fork send their parent's routing key, so they reach the server that ran the parent, and
SGLang's own `meta_info.cached_tokens` says how much of each branch's prompt it did not prefill
(bench/fork_cache.py). Forked after the first model turn, the root's turn has run the shared prefix: every
branch's prompt is served from cache up to the root's last sampled token. (Forked before it,
specs/fork_calculator.yaml, the K branches send one prompt no request has run yet, all at once: SGLang 0.5.23
prefilled them in one batch and served none from cache, under `--schedule-policy fcfs`, its default and the
suite's, and `lpm` alike; docs/benchmarks.md. Not asserted: it hangs on when the requests reach the scheduler.)
"""

from __future__ import annotations

import pytest

from bench.fork_cache import fork_cache

pytestmark = pytest.mark.sglang


@pytest.mark.slow
async def test_branch_prompts_after_the_first_turn_are_served_from_cache(sglang, tok, tmp_path):
    out = await fork_cache(sglang.url, "after_call", tmp_path, prompts=4, tokenizer=tok)
    print(out["branches"], out["all_requests"], flush=True)  # the numbers docs/benchmarks.md reports (-s)
    branches = out["branch_prompts"]
    assert out["engine"] == "sglang" and out["block_size"] == 1 and len(branches) == 16
    for b in branches:  # the root's prompt and output, but at most its last sampled token, were not prefilled
        assert b["route"] == "sticky" and b["shared"] < b["prompt"], b
        # More may be: a node's branches send one prompt (forked after the call, the same tool result), and a
        # branch that reaches the scheduler after a sibling's prefill is served from it, all but its last token
        # (a suite run here: 245 of 246 cached, 229 shared with the root).
        assert b["full_blocks"] == b["shared"] - 1 and b["full_blocks"] <= b["cached"] < b["prompt"], b
    assert out["branches"]["cached_share"] > 0.9
