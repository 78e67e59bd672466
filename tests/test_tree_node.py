"""One tree model (issue 47 §2): every trajectory has a Node (fsm/run/trajectory.py), a linear row's its root alone, and
the runner reaches trees only at fixed points (fsm/run/tree.py `enter`, `finish`, `reward_of`, `end`). In process
on the scripted echo model: about a second."""

from __future__ import annotations

import asyncio
import types
from pathlib import Path

from backends.scripted import echo_backend
from fsm.api import load_agent
from fsm.run.journal import Recorder
from fsm.run.tree import nodes_of, row_nodes, tree_record
from specs.calculator import make_prompts
from tests.conftest import run_agent

SPECS = Path(__file__).resolve().parents[1] / "specs"


def _journaled(trajs) -> list[dict]:
    """The journal's first record of each trajectory, as the run's Recorder writes it (its file is
    tests/test_journal.py's; here only the record's fields matter)."""
    records: list[dict] = []
    recorder = Recorder(types.SimpleNamespace(append=records.append))
    for t in trajs:
        recorder.whole(t, "start", done=True)
    return records


def test_a_linear_row_is_a_tree_of_one_node(tok):
    """No `None` case: a linear row's node is its root, with no children; it routes by its own session id, reads
    as its tree's root, and the journal keeps no place in a tree for it (journals are as they were)."""
    trajs = asyncio.run(run_agent(load_agent("calculator"), echo_backend(), tok, make_prompts(2, 0)))
    for t in trajs:
        assert t.node.alone and t.node.kind == "root" and nodes_of(t) == row_nodes(t) == [t]
        assert t.node.route == t.session_id and t.node.ordinal == 0
        assert tree_record(t, 0, "planner") == {
            "tree": t.session_id,
            "node": "0",
            "parent": None,
            "node_kind": "root",
            "branch_offset": 0,
            "policy": "planner",  # a root's policy is its run's spec's
            "depth": 0,
            "shared_prefix": {"length": 0, "node": None},
        }
    assert [sorted(r) for r in _journaled(trajs)] == [["d", "done", "ev", "s", "t"]] * 2  # no tree place `n`


def test_a_fork_past_its_trees_bounds_is_refused_and_the_row_goes_on_alone(tok, tmp_path):
    """`fork: {branches: 4}` under `tree: {max_children: 2}`: no branch is made, the refusal is noted once and
    counted on the path (so a resume does not fork there either: the journal keeps the count), the row ends as a
    linear one would."""
    spec = tmp_path / "forky.yaml"
    spec.write_text(
        f"name: forky\nextends: {SPECS}/calculator.yaml\nstates:\n  GENERATING:\n"
        "    fork: {branches: 4, times: 1}\ntree: {max_children: 2}\n"
    )
    [t] = asyncio.run(run_agent(load_agent(str(spec)), echo_backend(), tok, make_prompts(1, 0)))
    assert t.extra["fork_refused"] == (
        "GENERATING: 4 branches past tree bounds (max_depth 3, max_children 2, max_nodes 64)"
    )
    assert t.node.nodes == [] and t.node.forks == {"GENERATING": 1} and not t.node.forked
    assert not t.failed and t.termination_reason == "done" and nodes_of(t) == [t]
    [record] = _journaled([t])
    assert record["n"]["forks"] == {"GENERATING": 1} and record["n"]["k"] == 0
