"""Snapshots of tree runs (fsm/run/stream.py `Stream.snapshot`): every node is written as the journal keeps it
(fsm/run/treejournal.py), a parent that waits on its nodes at its last state boundary, so that a restore takes
the finished nodes back as they are (never asked for again) and the running ones go on from their boundaries,
to the rows of a run that was never snapshotted: token ids, masks, logprobs and rewards of every node, and the
batch of each policy. Child machines (planner_solver, two children at once) and forks (fork_calculator, four
branches), each snapshotted with a node still running and its siblings finished."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from backends.base import GenerateRequest, GenerateResult
from backends.scripted import ScriptedBackend
from fsm import RolloutEngine
from fsm.run.journal import records
from fsm.run.tree import nodes_of
from tests.conftest import ASSETS, REPO, hermes_text, user_row

SEED = 1
GREEDY = {"temperature": 0, "seed": SEED}
ROWS = [user_row(f"What is {i} + {i}?", uid=f"r{i}", reward_model={"ground_truth": "6"}) for i in range(2)]
SLOW_CHILD = ":0.1"  # a root's second child: the snapshot is taken at its first model turn
SLOW_BRANCH = (
    2  # a fork's second branch, by its number in its tree (branches share their parent's session id)
)


@functools.cache
def _tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSETS)


def _ids(text: str) -> list[int]:
    return _tok().encode(text, add_special_tokens=False) + [_tok().eos_token_id]


def _ordinal(request: GenerateRequest) -> int:
    """The node's number in its tree, from its sampling seed (fsm/run/context.py `Sampling.for_turn`)."""
    return (int(request.sampling_params["sampling_seed"]) - SEED) // 7919


def _answered(request: GenerateRequest) -> bool:
    return "<tool_response>" in _tok().decode(request.prompt_ids)


def _slow_child(request: GenerateRequest) -> bool:
    return request.session_id.endswith(SLOW_CHILD)


def _slow_branch(request: GenerateRequest) -> bool:
    return _ordinal(request) == SLOW_BRANCH


def _planner(request: GenerateRequest) -> list[int]:
    """planner_solver's model: the planner hands two sums to two solver children at once; the first answers at
    once, the second calls its calculator first; then the planner answers."""
    if ":" in request.session_id:  # a child's session id is <root>:<path>
        if _slow_child(request) and not _answered(request):
            return _ids(hermes_text([("calculator", {"expression": "2 + 2"})]))
        return _ids("It is done.\n#### 4")
    if not _answered(request):
        return _ids(
            hermes_text([("calculator", {"expression": "1 + 1"}), ("calculator", {"expression": "2 + 2"})])
        )
    return _ids("The answer is 6.\n#### 6")


def _brancher(request: GenerateRequest) -> list[int]:
    """fork_calculator's model: each branch answers at once with its own number, but the second, which calls
    its calculator first."""
    k = _ordinal(request)
    if _slow_branch(request) and not _answered(request):
        return _ids(hermes_text([("calculator", {"expression": "2 + 2"})]))
    return _ids(f"Branch {k} says\n#### {k}")


class Model(ScriptedBackend):
    """A scripted model decided by each request (a restored row's backend counts turns anew); with `slow`, the
    first turn of that node says so (`reached`) and takes a while, so that a snapshot asked for then finds it
    running and its siblings finished."""

    def __init__(self, model: Callable[[GenerateRequest], list[int]], slow: Any = None) -> None:
        super().__init__(lambda *a: [], logprob=lambda turn, i: -0.1 - 0.01 * (i % 7), model_name="scripted")
        self.model, self.slow = model, slow
        self.reached = asyncio.Event()

    def _turn_ids(self, request: GenerateRequest, turn: int) -> list[int]:
        return self.model(request)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.slow is not None and self.slow(request) and not self.reached.is_set():
            self.reached.set()
            await asyncio.sleep(0.3)
        return await super().generate(request)


# spec, what the test spec adds, its model, its slow node, its nodes per tree (the root's included), its policies
TREES = {
    "children": (
        "planner_solver",
        "limits:\n  max_parallel_calls: 2\n",
        _planner,
        _slow_child,
        3,
        ["planner", "solver"],
    ),
    "fork": ("fork_calculator", "", _brancher, _slow_branch, 5, None),
}


def _groups(engine: RolloutEngine) -> dict[str, Any]:
    groups = engine._run_sync(engine.atake_groups(len(ROWS), timeout=120))
    return {g.uid: g for g in groups}


def _same_rows(ref: dict[str, Any], got: dict[str, Any], size: int) -> None:
    """Every node of every tree: the same place, tokens, mask, logprobs, reward and end."""
    assert sorted(ref) == sorted(got)
    for uid in ref:
        for a, b in zip(ref[uid].trajectories, got[uid].trajectories, strict=True):
            pairs = list(zip(nodes_of(a), nodes_of(b), strict=True))
            assert len(pairs) == size, [n.node.node for n in nodes_of(b)]
            for x, y in pairs:
                where = (uid, x.node.node)
                assert x.node.fields() == {**y.node.fields(), "tree": x.node.tree}, where
                assert list(x.prompt_ids) == list(y.prompt_ids), where
                assert list(x.response_ids) == list(y.response_ids), where
                assert list(x.response_mask) == list(y.response_mask), where
                assert list(x.response_logprobs) == list(y.response_logprobs), where
                assert (x.reward_score, x.termination_reason) == (y.reward_score, y.termination_reason), where


def _same_batches(engine: RolloutEngine, ref: dict[str, Any], got: dict[str, Any], policies: Any) -> None:
    """The batch (of each policy), built from the same groups in the same order: every tensor equal."""
    order = sorted(ref)
    sampling = ref[order[0]].sampling
    a = engine.to_batch([t for u in order for t in ref[u].trajectories], sampling)
    b = engine.to_batch([t for u in order for t in got[u].trajectories], sampling)
    if policies is None:
        a, b = {"": a}, {"": b}
    assert sorted(a) == sorted(b) == sorted(policies or [""])
    for policy in a:
        assert a[policy].batch.keys() == b[policy].batch.keys()
        for key in a[policy].batch.keys():
            assert torch.equal(a[policy].batch[key], b[policy].batch[key]), (policy, key)


@pytest.mark.parametrize("tree", sorted(TREES))
def test_a_tree_snapshotted_with_a_node_running_restores_to_the_uninterrupted_rows(tmp_path, tree):
    base, body, model, slow, size, policies = TREES[tree]
    spec = tmp_path / f"{base}_snapshot.yaml"
    spec.write_text(f"name: {base}_snapshot\nextends: {REPO / 'specs'}/{base}.yaml\n{body}")
    with RolloutEngine(str(spec), _tok(), backend=Model(model)) as engine:
        engine.submit(ROWS, n=1, sampling_params=GREEDY)
        reference = _groups(engine)

    slowed = Model(model, slow)
    with RolloutEngine(str(spec), _tok(), backend=slowed) as engine:

        async def mid_tree() -> dict[str, Any]:
            await engine.asubmit(ROWS, n=1, sampling_params=GREEDY)
            await engine.core.call(asyncio.wait_for(slowed.reached.wait(), 60))
            return await engine.asnapshot(tmp_path / "s.json", meta={"groups": 2}, stop=True)

        info = asyncio.run(mid_tree())
    assert info["restarted"] == 0 and info["running_groups"] >= 1, info
    nodes = {r["s"]: r for r in records(tmp_path / "s.json").records if r["t"] == "traj" and ":" in r["s"]}
    finished = {s for s, r in nodes.items() if r.get("done")}
    assert finished and len(finished) < len(nodes), nodes.keys()  # some nodes finished, some running

    again = Model(model)
    with RolloutEngine(str(spec), _tok(), backend=again) as engine:
        engine.restore(tmp_path / "s.json")
        got = _groups(engine)
        _same_rows(reference, got, size)
        _same_batches(engine, reference, got, policies)
    if tree == "children":  # a child's requests carry its own session id
        asked = {r.session_id for r in again.requests}
        assert not asked & finished, asked & finished  # a finished node is taken back, never asked again


def _asker(request: GenerateRequest) -> list[int]:
    """A root that hands a task to a child whose user simulator (specs/interaction_agent.yaml) asks for a number
    it never gets, until the child's user turns run out; then the root answers."""
    if ":" in request.session_id:
        return _ids("I am not sure.")
    if not _answered(request):
        return _ids(hermes_text([("guesser", {"task": "Guess my number between 1 and 10."})]))
    return _ids("The answer is 6.\n#### 6")


def _in_interaction(request: GenerateRequest) -> bool:
    return ":" in request.session_id and "Please answer with a number." in _tok().decode(request.prompt_ids)


def test_a_tree_with_a_child_inside_its_interaction_starts_over_from_its_root(tmp_path):
    """A user simulator's state is not ours to write: a tree with a node inside its interaction is written as
    its root before its first action, counted in `restarted`, and runs again whole on restore, to the rows of a
    run that was never snapshotted (the model here answers by its prompt)."""
    spec = tmp_path / "asks_a_user.yaml"
    spec.write_text(
        f"name: asks_a_user\nextends: {REPO / 'specs'}/calculator.yaml\ntools: []\n"
        f"children:\n  guesser:\n    spec: {REPO / 'specs'}/interaction_agent.yaml\n"
        "tree:\n  max_depth: 1\n  max_children: 2\n  max_nodes: 4\n"
    )
    rows = ROWS[:1]
    with RolloutEngine(str(spec), _tok(), backend=Model(_asker)) as engine:
        engine.submit(rows, n=1, sampling_params=GREEDY)
        (reference,) = engine._run_sync(engine.atake_groups(1, timeout=120))

    slowed = Model(_asker, _in_interaction)
    with RolloutEngine(str(spec), _tok(), backend=slowed) as engine:

        async def inside() -> dict[str, Any]:
            await engine.asubmit(rows, n=1, sampling_params=GREEDY)
            await engine.core.call(asyncio.wait_for(slowed.reached.wait(), 60))
            return await engine.asnapshot(tmp_path / "s.json", stop=True)

        info = asyncio.run(inside())
    assert info["restarted"] == 1 and info["running_groups"] == 1, info
    trajs = [r for r in records(tmp_path / "s.json").records if r["t"] == "traj"]
    assert len(trajs) == 1 and ":" not in trajs[0]["s"] and "n" not in trajs[0], trajs  # its root alone

    with RolloutEngine(str(spec), _tok(), backend=Model(_asker)) as engine:
        engine.restore(tmp_path / "s.json")
        (got,) = engine._run_sync(engine.atake_groups(1, timeout=120))
    _same_rows({got.uid: reference}, {got.uid: got}, 2)


def _delegator(request: GenerateRequest) -> list[int]:
    """A root that hands a task to a child, whose one turn calls a side-effecting tool and one that blocks the
    loop (tests/fixtures/snapshot_tools.py); then each answers."""
    if ":" in request.session_id:
        if not _answered(request):
            return _ids(hermes_text([("counted", {"expression": "1"}), ("calculator", {"expression": "2"})]))
        return _ids("It is done.\n#### 4")
    if not _answered(request):
        return _ids(hermes_text([("solver", {"task": "Add them."})]))
    return _ids("The answer is 6.\n#### 6")


def test_a_blocked_loops_snapshot_keeps_a_tree_and_its_childs_finished_side_effecting_call(tmp_path):
    """A child's tool blocks the loop: the snapshot taken from outside it writes the tree node by node (the child
    as it was before its step, the root waiting on it), with the `tool` record of the child's side-effecting call
    that had answered; restored, the child's step runs again without running that call again."""

    from tests.fixtures import snapshot_tools

    child = tmp_path / "child.yaml"
    child.write_text(
        f"name: blocking_child\nextends: {REPO / 'specs'}/calculator.yaml\ntools:\n"
        "  - function: tests.fixtures.snapshot_tools:counted\n    isolation: none\n"
        "  - function: tests.fixtures.snapshot_tools:blocks_until_released\n"
        "    schema: specs.calculator:TOOL_SCHEMA\n    isolation: none\nlimits:\n  max_parallel_calls: 2\n"
    )
    spec = tmp_path / "delegates.yaml"
    spec.write_text(
        f"name: delegates\nextends: {REPO / 'specs'}/calculator.yaml\ntools: []\n"
        f"children:\n  solver:\n    spec: {child}\n"
        "tree:\n  max_depth: 1\n  max_children: 2\n  max_nodes: 4\n"
    )
    snapshot_tools.RUNS.clear()
    snapshot_tools.BLOCKING.clear()
    engine = RolloutEngine(str(spec), _tok(), backend=Model(_delegator))
    engine.submit(ROWS[:1], n=1, sampling_params=GREEDY)
    home = engine.core.home()
    try:
        answer = snapshot_tools.snapshot_while_blocked(engine, tmp_path / "s.json")
        assert answer.get("blocked") is True and answer["restarted"] == 0, answer
        ran = list(snapshot_tools.RUNS)
        assert len(ran) == 1 and ":" in ran[0], ran  # the child's effect, before the loop blocked
        engine.close()
    finally:
        snapshot_tools.RELEASED.set()
        home.close(30)
    try:
        recs = records(tmp_path / "s.json").records
        assert [r["k"] for r in recs if r["t"] == "tool"] == ran
        assert [r.get("done", False) for r in recs if r["t"] == "traj"] == [
            False,
            False,
        ]  # the root, its child
        with RolloutEngine(str(spec), _tok(), backend=Model(_delegator)) as restored:
            restored.restore(tmp_path / "s.json")
            (group,) = restored._run_sync(restored.atake_groups(1, timeout=60))
    finally:
        snapshot_tools.RELEASED.clear()
    assert snapshot_tools.RUNS == ran  # not run again
    (root,) = group.trajectories
    nodes = nodes_of(root)
    assert [n.node.node for n in nodes] == ["0", "0.0"] and not any(n.failed for n in nodes)
    assert [m["content"] for m in nodes[1].messages if m["role"] == "tool"] == ["ran 1", "released 2"]
