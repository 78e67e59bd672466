"""A fork's tree stays on one server of several: the root's turns and every branch's (docs/trees.md, "Forks").

Two dev servers over the tiny model (real HTTP, each with its own prefix cache that reports `cached_tokens` as
SGLang does) behind the Router. Forked after its first model turn, a tree's root has run its prompt and output
on one server before its branches start; each branch sends the root's routing key, so it lands there and its
prompt is served from that cache up to the root's last sampled token. The real engines' numbers:
tests/sglang/test_fork_cache.py and tests/vllm/test_fork_cache.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import defaultdict

import pytest

import fsm
from backends.devserver import DevServer
from backends.sglang import SGLangBackend
from bench.fork_cache import Recording, branch_prompts, spec_path
from fsm.api import make_backend
from fsm.run.tree import row_nodes
from specs.calculator import make_prompts

TREES = 4


@pytest.mark.slow
async def test_a_tree_and_its_branches_stay_on_one_of_two_servers(tmp_path, tok):
    """Forked after the root's first turn (a fork before it: tests/test_trees.py, over the same two servers)."""
    served = make_backend()
    async with DevServer(served) as a, DevServer(served) as b:
        clients = [SGLangBackend(d.url, max_retries=1, backoff_s=0.01) for d in (a, b)]
        async with Recording(clients, health_interval_s=0) as router:
            runner = fsm.Runner(
                fsm.compile_spec(spec_path("after_call", tmp_path)),
                router,
                tok,
                check_tokens=True,
            )
            trajs = await runner.run(make_prompts(TREES, 3), sampling_params={"seed": 1})
            assert router.stats()["sessions"] == 0  # every pin released once its tree ended
            counts = dict(router.counts)
    await served.close()
    servers_of: dict[str, set[str]] = defaultdict(set)
    for request, result in router.calls:
        servers_of[request.session_id].add(result.server or "?")
        tree = (request.rid or "").split(":")[0].split("_t")[0]  # a branch's rid: <root>:<node>_tNN
        assert request.session_id == tree, (request.rid, request.session_id)  # the root's routing key
    for root in trajs:
        assert root.node is not None and root.node.forked, root.termination_reason
        assert all(n.token_check is None for n in row_nodes(root))
        assert len(servers_of[root.session_id]) == 1, (root.session_id, servers_of[root.session_id])
    # the trees were spread over both servers, and each placed once: every later request was sticky
    assert {s for where in servers_of.values() for s in where} == {a.url, b.url}
    assert counts["new"] == TREES and counts["moved"] == 0 and counts["sticky"] == len(router.calls) - TREES
    branches = branch_prompts(trajs, router.calls, block=1)
    assert len(branches) == 4 * TREES
    roots = {t.session_id: t for t in trajs}
    for br in branches:
        root = roots[br["node"].split()[0]]
        assert br["server"] == next(iter(servers_of[root.session_id]))
        assert br["shared"] == len(root.prompt_ids) + len(root.response_ids)
        # the root's turn ran the prefix there: all of it but its last sampled token is hit
        assert len(root.response_ids) > 0 and br["cached"] >= br["full_blocks"] == br["shared"] - 1, br


@pytest.mark.slow
async def test_bench_trees_with_a_server_reads_its_cached_tokens():
    """`agentfsm bench trees --server URL --n 1` (its own process) against a dev server: the branch prompts of each run
    with the server's `cached_tokens`; forked after the first turn, all but the root's last token is cached."""
    served = make_backend()
    async with DevServer(served) as dev:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "fsm.cli.commands",
            "bench",
            "trees",
            "--server",
            dev.url,
            "--n",
            "1",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(300):
            out, err = await proc.communicate()
    await served.close()
    assert proc.returncode == 0, err.decode()[-2000:]
    runs = json.loads(out)
    assert list(runs) == [
        f"{dev.url} sglang {fork}" for fork in ("first_turn", "after_call", "first_turn pad=7")
    ]
    after = runs[f"{dev.url} sglang after_call"]
    assert after["branches"]["requests"] == 4 and after["branches"]["cached_share"] > 0.9
    assert all(b["cached"] >= b["full_blocks"] == b["shared"] - 1 for b in after["branch_prompts"])
    padded = runs[f"{dev.url} sglang first_turn pad=7"]["branch_prompts"]
    assert len(padded) == 4 and min(b["prompt"] for b in padded) > 256  # two of vLLM's CPU blocks
