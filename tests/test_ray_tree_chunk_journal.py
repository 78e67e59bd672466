"""A Ray chunk's journal keeps trees (fsm/adapters/ray_journal.py, fsm/run/treejournal.py), without Ray: a chunk
of a tree spec stopped mid-tree (its task cancelled as a killed actor's stops, model turns in flight) goes on from
its journal in the next attempt, in the actor's own code path (`run_chunk` under an Owner), and ends as the
uninterrupted chunk does: every node's tokens and place in its tree, finished nodes never asked for again."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from backends.scripted import ScriptedBackend
from fsm.adapters.ray_journal import chunk_files, run_chunk
from fsm.api import load_agent, load_tokenizer
from fsm.run.fold import rebuild
from fsm.run.journal import records
from fsm.run.resume import identity
from fsm.run.runtime import Owner, Runner
from fsm.run.tree import nodes_of, tree_record
from specs.calculator import make_prompts
from tests.conftest import ASSETS, REPO, hermes_text
from tests.test_tree_journal import SPECS, _ids, _tok


async def _attempt(
    runner: Runner, root: Path, key: str, k: int, stop: asyncio.Event | None
) -> tuple[list[Any], dict[str, int]] | None:
    """Attempt `k` of chunk `key`-0 (2 rows, 1 sample each): to the end, or cancelled once `stop` is set."""
    ident = identity(runner.agent, runner.codec)
    sampling = runner.make_context({"temperature": 0.0}).sampling
    fresh = runner.trajectories(make_prompts(2), 1)

    async def tick(traj: Any) -> None:
        return None

    async with Owner(runner).serving() as owner:
        job = asyncio.create_task(
            run_chunk(
                owner,
                0,
                lambda: ident,
                tick,
                lambda t: None,
                (key, 0, (str(root), k, "1s", False)),
                sampling,
                1,
                fresh,
            )
        )
        if stop is None:
            return await asyncio.wait_for(job, 60)
        await asyncio.wait_for(stop.wait(), 60)
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
    return None


def _rows(trajs: list[Any]) -> list[tuple[Any, ...]]:
    out = []
    for root in sorted(trajs, key=lambda t: t.index):
        for t in nodes_of(root):
            place = tree_record(t)
            place.pop("tree")
            out.append(
                (place, t.response_ids.tolist(), t.response_mask.tolist(), t.response_logprobs.tolist())
                + (t.termination_reason, t.reward_score)
            )
    return out


RECURSIVE = """
name: recursive
extends: {specs}/planner_solver.yaml
children:
  calculator:
    spec: self
    policy: solver
    input: expression
    schema: specs.calculator:TOOL_SCHEMA
tree:
  max_depth: 2
"""


def _recursive(session_id: str, turn: int, prompt: list[int]) -> list[int]:
    """A spec that starts itself, two levels deep: a node above the bottom delegates once, then answers."""
    if session_id.count(":") < 2 and "<tool_response>" not in _tok().decode(prompt):
        return _ids(hermes_text([("calculator", {"expression": "1 + 2"})]))
    return _ids("It is done.\n#### 3")


MODELS = {**SPECS, "recursive": _recursive}


@pytest.mark.parametrize("spec", sorted(MODELS))
async def test_a_tree_chunk_stopped_mid_tree_goes_on_from_its_journal(tmp_path, spec):
    asked: list[str] = []
    stop_after = {"n": -1}
    stop = asyncio.Event()

    def turn(session_id: str, n: int, prompt: list[int]) -> list[int]:
        asked.append(session_id)
        if len(asked) == stop_after["n"]:
            stop.set()
        return MODELS[spec](session_id, n, prompt)

    if spec == "recursive":
        (tmp_path / "recursive.yaml").write_text(RECURSIVE.format(specs=REPO / "specs"))
    agent = load_agent(str(tmp_path / "recursive.yaml") if spec == "recursive" else spec)
    backend = ScriptedBackend(turn, latency_s=0.02)
    runner = Runner(agent, backend, load_tokenizer(str(ASSETS)), max_concurrency=8)
    whole = await _attempt(runner, tmp_path, "whole", 0, None)
    assert whole is not None
    reference = _rows(whole[0])
    assert len(reference) > 2  # trees: more rows than roots
    if spec == "recursive":
        assert max(r[0]["depth"] for r in reference) == 2
    whole_asked = len(asked)
    asked.clear()
    stop_after["n"] = 3
    await _attempt(runner, tmp_path, "cut", 0, stop)
    [(_, path)] = chunk_files(tmp_path, "cut", 0)
    assert b'"n":{"node":"0.' in path.read_bytes(), "stopped before any tree node was journaled"
    before = len(asked)
    journaled = rebuild(records(path))
    finished = {s for s in journaled.done if ":" in s}
    stop_after["n"] = -1
    last = await _attempt(runner, tmp_path, "cut", 1, None)
    assert last is not None
    trajs, counts = last
    assert counts["refused"] == 0 and chunk_files(tmp_path, "cut", 0) == []
    assert _rows(trajs) == reference
    again = asked[before:]
    assert not set(again) & finished  # a finished child is taken back, never asked again
    # the model turns the journal held (finished, up to each node's last boundary) are not asked for again; how
    # many it held depends on how far the 8 concurrent turns got before the stop (none, on a loaded machine)
    held = sum(t.assistant_turns for t in journaled.trajs.values())
    assert len(again) <= whole_asked - held, (len(again), whole_asked, held)
