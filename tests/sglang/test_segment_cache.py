"""Segments and SGLang's prefix cache: a rewrite starts a new segment, whose prompt is a new render, yet the
trajectory keeps its session, so the router keeps it on its server and SGLang's radix cache serves whatever the
new prompt shares with what that server already ran (docs/contexts.md, "The cached share per segment").

Each model request is recorded with SGLang's own `cached_tokens` (meta_info; the engine adds them up in
`traj.metrics.cached_tokens`) and sorted by where it falls: the first turn of a trajectory, the first turn of a
later segment (after a summary or a rewrite), or a later turn of a segment. `shared` is the longest prefix the
request's prompt has in common with the trajectory's previous request and its output: the most this
trajectory's own history can give. SGLang never runs a sampled token's last position through the model before
the next request, so a hit stops one token short of it at most.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

import fsm
from backends.base import GenerateRequest, GenerateResult
from backends.prefix_cache import PrefixCache
from backends.sglang import SGLangBackend
from bench.fork_cache import Recording
from specs.calculator import make_prompts
from tests.conftest import REPO

pytestmark = pytest.mark.sglang
SPEC = REPO / "specs/calculator_compact.yaml"
# The shipped spec compacts after every tool result (each segment then holds one model turn); with the
# threshold between the tiny model's contexts after one call (233-257 tokens at T=0), some prompts compact and
# the others keep both turns (the call and the answer) in one segment.
SPLIT = f"""
name: compact_some
extends: {SPEC}
states:
  PROCESSING_TOOLS:
    action: call_tools
    next:
      - {{to: TERMINATED, when: response_budget_exhausted, reason: response_length}}
      - {{to: COMPACTING, when: {{context_tokens_over: 247}}}}
      - {{to: GENERATING}}
"""


def _common(ids: list[int], before: list[int]) -> int:
    """How many leading tokens of `ids` a radix cache holding only `before` would match."""
    held = PrefixCache()
    held.insert(before)
    return held.match(ids)


def classify(trajs: list[Any], calls: list[tuple[GenerateRequest, GenerateResult]]) -> dict[str, list[dict]]:
    """Each request as {prompt, cached, shared, previous, route, turn, reason} under its kind: "first" (the
    trajectory's first turn), "segment" (a later segment's first turn), "later" (a later turn of a segment).
    `previous`: the length of the trajectory's previous request and its output."""
    by_session: dict[str, list[tuple[GenerateRequest, GenerateResult]]] = defaultdict(list)
    for request, result in calls:
        by_session[request.session_id].append((request, result))
    out: dict[str, list[dict]] = defaultdict(list)
    for traj in trajs:
        before: list[int] = []  # the previous request's prompt and output: what the server last ran for it
        for turn, (request, result) in enumerate(by_session[traj.session_id]):
            prompt = request.prompt_ids
            # its segment: the longest segment prompt it starts with (a summary's prompt extends the history's)
            seg = max(
                (s for s in traj.segments if prompt[: len(s.prompt_ids)] == s.prompt_ids.tolist()),
                key=lambda s: len(s.prompt_ids),
            )
            kind = "later" if len(prompt) > len(seg.prompt_ids) else "first" if seg.index == 0 else "segment"
            out[kind].append(
                {
                    "prompt": len(prompt),
                    "cached": result.cached_tokens,
                    "shared": _common(prompt, before),
                    "previous": len(before),
                    "route": result.route,
                    "turn": turn,
                    "reason": seg.reason,
                }
            )
            before = prompt + result.token_ids
    return out


def share(records: list[dict]) -> str:
    """Cached tokens against prompt tokens, and against the tokens shared with the previous request."""
    if not records:
        return "no requests"
    cached, prompt = sum(r["cached"] for r in records), sum(r["prompt"] for r in records)
    shared = sum(r["shared"] for r in records)
    return (
        f"{len(records)} requests, {cached}/{prompt} prompt tokens cached ({cached / prompt:.1%}); "
        f"shared with the previous request {shared} ({shared / prompt:.1%})"
    )


async def run_spec(url: str, spec: Any, tok: Any, prompts: int) -> tuple[list[Any], dict[str, list[dict]]]:
    server = SGLangBackend(url, max_retries=1, backoff_s=0.01)
    async with Recording([server], health_interval_s=0) as router:
        assert await server.flush_cache()  # what is cached comes from this run
        runner = fsm.Runner(spec, router, tok, max_concurrency=4)
        trajs = await runner.run(make_prompts(prompts, seed=7), sampling_params={"temperature": 0.0})
        assert router.counts["moved"] == 0 and router.counts["new"] == prompts  # one placement per trajectory
        return trajs, classify(trajs, router.calls)


async def test_segments_keep_their_server_and_hit_its_cache(sglang, tok, tmp_path):
    split = tmp_path / "compact_some.yaml"
    split.write_text(SPLIT)
    report: dict[str, dict[str, str]] = {}
    for name, spec in (("calculator_compact", SPEC), ("compact_some", split)):
        trajs, kinds = await run_spec(sglang.url, fsm.compile_spec(spec), tok, 16)
        report[name] = {kind: share(records) for kind, records in kinds.items()} | {
            f"segment ({reason})": share([r for r in kinds["segment"] if r["reason"] == reason])
            for reason in ("summary", "rewrite")
        }
        print(name, report[name], flush=True)  # the numbers docs/contexts.md reports (pytest -s)
        assert all(t.error is None for t in trajs), [t.error for t in trajs if t.error]
        assert kinds["segment"], "no trajectory was rewritten"
        every = [r for records in kinds.values() for r in records]
        for r in every:  # a new segment keeps its session's server
            assert r["route"] == ("new" if r["turn"] == 0 else "sticky"), r
        for r in kinds["later"]:  # a later turn of a segment: the whole previous request and its output, hit
            assert r["shared"] == r["previous"] and r["cached"] >= r["shared"] - 1, r
        for r in kinds["segment"]:  # a new segment's first turn: all it shares with the segment before
            assert 0 < r["shared"] and r["cached"] >= r["shared"] - 1, r
        summaries = [r for r in kinds["segment"] if r["reason"] == "summary"]
        rewrites = [r for r in kinds["segment"] if r["reason"] == "rewrite"]
        assert summaries and all(r["shared"] == r["previous"] for r in summaries)  # the history, then more
        assert rewrites and all(
            0.5 * r["prompt"] < r["shared"] < r["prompt"] for r in rewrites
        )  # system, task
        assert sum(t.metrics.cached_tokens for t in trajs) == sum(r["cached"] for r in every)
        if name == "compact_some":
            assert kinds["later"], "no segment kept two turns"
