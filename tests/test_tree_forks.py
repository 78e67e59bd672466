"""Forks through `agentfsm run` (docs/trees.md): a branch does not fork again at the entry it was copied at, in
a run and in its resume from a journal cut there; `times: N` counts entries along a path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_run_interrupts import ASSETS, ENV, REPO
from tests.test_tree_journal import _same_batches, _same_trees

SPECS = REPO / "specs"


def agentfsm(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`agentfsm ARGS` as a real process."""
    return subprocess.run(
        [sys.executable, "-m", "fsm.cli.commands", *args],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run(spec: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """`agentfsm run SPEC --out OUT` of one prompt at temperature 0 on the embedded tiny model."""
    args = ["run", str(spec), "--out", str(out), "--tokenizer", str(ASSETS), "--temperature", "0", "-q"]
    return agentfsm(*args, "--num-prompts", "1", *extra)


def nodes(out: Path) -> list[tuple[str, str, int]]:
    """(path, kind, branch offset) of every node in the run's trajectories.jsonl."""
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    return [(r["node"], r["node_kind"], r["branch_offset"]) for r in rows]


def spec(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nextends: {SPECS}/calculator.yaml\n{body}")
    return path


@pytest.mark.slow
def test_a_branch_does_not_fork_again_where_it_was_copied_nor_on_resume(tmp_path):
    """`times: null` on a state off any cycle: one fork, 2 branches (the copies forked again at once: 15 nodes
    up to max_depth 3). A journal cut when the first branch was made (it is at its copied entry) resumes to the
    uninterrupted run's rows, 3 nodes."""
    fork_null = spec(
        tmp_path,
        "fork_null",
        "states:\n  PENDING:\n    fork: {branches: 2, times: null}\ntree: {max_depth: 3}\n",
    )
    ref = tmp_path / "ref"
    done = run(fork_null, ref)
    assert done.returncode == 0, done.stderr[-3000:]
    assert nodes(ref) == [("0", "root", 0), ("0.0", "branch", 0), ("0.1", "branch", 0)]

    cut = tmp_path / "cut"
    cut.mkdir()
    lines = (ref / "journal.log").read_bytes().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if b'"s":"' in line and b':0.0"' in line)
    assert b'"fresh":true' in lines[first]  # the branch's first record: at the entry it was copied at
    (cut / "journal.log").write_bytes(b"".join(lines[: first + 1]))  # as a kill -9 there leaves it
    resumed = agentfsm("run", "--resume", str(cut), "-q")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert nodes(cut) == nodes(ref)
    _same_batches(ref, cut)
    _same_trees(ref, cut)


@pytest.mark.slow
def test_times_counts_entries_along_a_path(tmp_path):
    """`times: 2` at GENERATING (on the tool loop): the root forks at its first turn, each branch at its own
    second turn (after its tool call), never twice at one entry: every grandchild branched off past its
    parent's own tokens."""
    twice = spec(
        tmp_path,
        "fork_twice",
        "states:\n  GENERATING:\n    fork: {branches: 2, times: 2}\ntree: {max_depth: 3}\n",
    )
    out = tmp_path / "out"
    done = run(twice, out)
    assert done.returncode == 0, done.stderr[-3000:]
    got = nodes(out)
    offset = {path: off for path, _, off in got}
    assert [p for p, _, _ in got] == ["0", "0.0", "0.0.0", "0.0.1", "0.1", "0.1.0", "0.1.1"]
    for path, kind, off in got[1:]:
        assert kind == "branch"
        if path.count(".") == 2:
            assert off > offset[path.rsplit(".", 1)[0]], got  # a turn and a tool call of its own first


def test_only_a_branch_record_may_be_fresh():
    """A forged journal cannot make a root or a child 'fresh' (it would skip its fork)."""
    from fsm.run.treejournal import META, _shape

    m = {k: 0 for k in META} | {
        "node": "0.0",
        "parent": "0",
        "kind": "child",
        "policy": "p",
        "route": "r",
        "forks": {},
        "origin": "c",
        "forked": False,
        "fresh": True,
    }
    with pytest.raises(ValueError, match="wrong kind"):
        _shape(m, "j")
    _shape({**m, "kind": "branch"}, "j")
    old = {k: v for k, v in m.items() if k != "fresh"}  # a journal from before: not fresh
    _shape(old, "j")


async def broken_calculator(expression: str) -> str:
    """A calculator that always raises (a state's retry, then its catch, handles it)."""
    raise RuntimeError(f"cannot evaluate {expression}")


@pytest.mark.slow
def test_each_branch_lists_its_own_handled_failures_in_trajectories_jsonl(tmp_path):
    """docs/errors.md: `failures` in trajectories.jsonl lists the failures a state's retry or catch handled (it
    was documented, never written); a branch's list is its own, not shared with its siblings'."""
    failing = spec(
        tmp_path,
        "fork_failing",
        "states:\n  GENERATING:\n    fork: {branches: 2, times: 1}\n"
        "  PROCESSING_TOOLS:\n    retry:\n      - {errors: [tool.exception], max_attempts: 2, backoff_s: 0}\n"
        "    catch:\n      - {errors: [tool.exception], to: TERMINATED, reason: tool_failed}\n"
        "tools:\n  - {function: tests.test_tree_forks:broken_calculator, name: calculator, "
        "schema: specs.calculator:TOOL_SCHEMA, isolation: none}\n",
    )
    out = tmp_path / "out"
    done = run(failing, out)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    branches = [r for r in rows if r["node_kind"] == "branch"]
    assert len(branches) == 2 and all(r["termination_reason"] == "tool_failed" for r in branches), rows
    for r in branches:
        handled = [(f["handled"], f["state"], f["error"], f["attempt"]) for f in r["failures"]]
        assert handled == [
            ("retry", "PROCESSING_TOOLS", "tool.exception", 1),
            ("catch", "PROCESSING_TOOLS", "tool.exception", 2),
        ], r["failures"]


def test_a_branch_copies_its_parents_failures_into_a_list_of_its_own():
    """A fork after a handled failure: what one branch handles later is not written into its siblings' list."""
    from fsm.run.failures import Failure
    from fsm.run.trajectory import Trajectory
    from fsm.run.tree import _copy

    parent = Trajectory(0, 0, "r", "u", {"raw_prompt": []}, "GENERATING")
    parent.failures.append(Failure("backend", "GENERATING", "503", 1, "retry"))
    a, b = _copy(parent, "r:0.0"), _copy(parent, "r:0.1")
    a.failures.append(Failure("backend", "GENERATING", "503", 2, "catch", "DOWN"))
    assert parent.failures == b.failures == a.failures[:1] and len(a.failures) == 2


BOMB = """states:
  PENDING:
    fork: {branches: 64, times: 1}
  GENERATING:
    fork: {branches: 64, times: 1}
tree: {max_depth: 2, max_children: 64, max_nodes: 5000, max_run_nodes: 100}
"""


@pytest.mark.slow
def test_a_fork_bomb_within_its_trees_bounds_stops_at_the_runs_node_bound(tmp_path):
    """Issue 50: forks within each tree's bounds made 20,000 nodes from one prompt (2.4 GB; 100,000 crashed a
    4 GB process). `validate` says what one tree can reach and warns past tree.max_run_nodes; the run makes the
    first fork's 64 branches, and each branch's own fork of 64, past the run's 100, ends that row as an error
    (one line naming the bound), before any model turn."""
    bomb = spec(tmp_path, "bomb", BOMB)
    checked = agentfsm("validate", str(bomb))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{bomb}: ok (1 warning); a tree: up to 4161 nodes, the root included" in checked.stdout
    assert "warning: tree-size: one tree can reach 4161 nodes" in checked.stdout
    out = tmp_path / "out"
    done = run(bomb, out)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 65 and rows[0]["termination_reason"] == "forked"
    for r in rows[1:]:
        assert r["node_kind"] == "branch" and r["depth"] == 1
        assert r["error"].startswith("fork of 64 branches in GENERATING: tree.max_run_nodes 100 reached"), r
        assert r["turns"] == [] or all(
            t["role"] != "assistant" for t in r["turns"]
        )  # no model turn was spent


@pytest.mark.slow
def test_a_tree_that_ended_gives_its_nodes_back_to_the_run(tmp_path):
    """tree.max_run_nodes counts the trees in flight: one at a time (--concurrency 1), each prompt's fork of 2
    fits a run bound of 2, because the tree before it ended and released its branches."""
    one_at_a_time = spec(
        tmp_path,
        "fork_two",
        "states:\n  PENDING:\n    fork: {branches: 2, times: 1}\ntree: {max_run_nodes: 2}\n",
    )
    out = tmp_path / "out"
    done = run(one_at_a_time, out, "--num-prompts", "3", "--concurrency", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert [r["node_kind"] for r in rows] == ["root", "branch", "branch"] * 3
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows]
