"""A run's statistics: how often each edge fired, how long each state took, how runs ended. They are a run
result (the "fsm" section of summary.json, written by fsm/output/rundir.py; its format: docs/contracts.md);
viz/diagram.py only draws them. `run_stats(agent, trajectories)` makes it, `load_run_stats(run_dir)` reads it back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def reason_key(traj: Any) -> str:
    """A row's termination reason as summary.json groups it (here and in fsm/output/batch.py's `summarize`): a
    failure by its kind ("error: backend", fsm/run/trajectory.py `Failure`)."""
    if traj.failure is not None:
        return f"error: {traj.failure.kind}"
    return traj.termination_reason or "?"


def run_stats(agent: Any, trajectories: Sequence[Any] | None = None) -> dict[str, Any]:
    """Statistics of finished trajectories (`run_stats(agent, trajs)`, or `run_stats(trajs)` without the
    agent, which then leaves out guard labels and reasons)."""
    if trajectories is None:
        agent, trajectories = None, agent
    edges: dict[int, dict[str, Any]] = {}
    if agent is not None:
        for e in agent.edges:
            edges[e.index] = {
                "source": e.source,
                "dest": e.dest,
                "guard": e.label,
                "reason": e.reason,
                "count": 0,
                "trajectories": 0,
            }
    states: dict[str, dict[str, Any]] = {}
    if agent is not None:
        for name in agent.spec.states:
            states[name] = {"visits": 0, "total_s": 0.0, "failed": 0}
    timed: dict[str, int] = {}  # visits with a duration (not a final state, not the state a failure left)
    reasons: dict[str, int] = {}
    finals: dict[str, dict[str, int]] = {}
    per_trajectory: dict[int, int] = {}  # segments -> trajectories
    for root in trajectories:
        in_tree: set[int] = set()  # edges that fired anywhere in this tree
        for traj, start, parent in machine_nodes(root, agent):
            path, times, fired = traj.path, getattr(traj, "path_times", ()), traj.transitions_fired
            own = max(0, start - 1)  # a branch's first own edge and timed visit: the forking state's
            # a branch's times hold one more entry per fork above it: its driver's start, the time it entered
            # the forking state (the copied entry before it is its parent's)
            shift = max(0, len(times) - len(path))
            for k in range(own, len(fired)):
                index = fired[k]
                e = edges.get(index)
                if e is None:  # no agent given: what the path says
                    e = edges[index] = {
                        "source": path[k],
                        "dest": path[k + 1],
                        "guard": None,
                        "reason": None,
                        "count": 0,
                        "trajectories": 0,
                    }
                e["count"] += 1
                in_tree.add(index)
            for k in range(own, len(path)):
                s = states.setdefault(path[k], {"visits": 0, "total_s": 0.0, "failed": 0})
                s["visits"] += int(k >= start)  # the forking state was entered once, by the node that forked
                if k + 1 + shift < len(times):  # left the state: it has a duration
                    s["total_s"] += times[k + 1 + shift] - times[k + shift]
                    timed[path[k]] = timed.get(path[k], 0) + 1
            _count_retries(traj, parent, states)
            _count_segments(traj, edges, states, own)
            if not traj.node.forked:  # a training row
                n_segments = getattr(traj, "num_segments", 1)
                per_trajectory[n_segments] = per_trajectory.get(n_segments, 0) + 1
            key = reason_key(traj)
            reasons[key] = reasons.get(key, 0) + 1
            if traj.error is not None:
                states[traj.state]["failed"] += 1
            else:
                final = finals.setdefault(traj.state, {})
                final[key] = final.get(key, 0) + 1
        for index in in_tree:
            edges[index]["trajectories"] += 1
    n = len(trajectories)
    for e in edges.values():
        e["share"] = round(e["trajectories"] / n, 6) if n else 0.0
    for name, s in states.items():
        s["mean_s"] = s["total_s"] / timed[name] if timed.get(name) else None
    return {
        "trajectories": n,
        "agent": getattr(agent, "name", None),
        "agent_hash": getattr(agent, "hash", None),
        "edges": {str(i): edges[i] for i in sorted(edges)},
        "states": states,
        "termination_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        "final_states": finals,
        "segments": {
            "rows": sum(k * v for k, v in per_trajectory.items()),
            "rewritten": sum(v for k, v in per_trajectory.items() if k > 1),
            "per_trajectory": {str(k): per_trajectory[k] for k in sorted(per_trajectory)},
        },
        "trees": tree_stats(trajectories),
    }


def machine_nodes(root: Any, agent: Any = None) -> Iterator[tuple[Any, int, Any]]:
    """The nodes of `root`'s tree that run its machine, each with where its own path begins and the node it
    forked from (None but for a branch): a fork's branch repeats its parent's path up to the fork, which the
    parent counts (docs/trees.md). A child machine of
    another spec (planner_solver's solver) is not drawn on this diagram, nor is its subtree."""
    machine = getattr(agent, "hash", None) or getattr(root.node.agent, "hash", None)

    def walk(traj: Any, start: int, parent: Any) -> Iterator[tuple[Any, int, Any]]:
        yield traj, start, parent
        for sub in traj.node.nodes:
            if sub.node.kind == "branch":
                yield from walk(sub, len(traj.path), traj)
            elif getattr(sub.node.agent, "hash", None) == machine:
                yield from walk(sub, 0, None)

    yield from walk(root, 0, None)


def _count_retries(traj: Any, parent: Any, states: dict[str, dict[str, Any]]) -> None:
    """A state's retries and catches (the failure rules'). A branch's list begins with its `parent`'s, which the
    parent counts."""
    for f in traj.failures[len(parent.failures) :] if parent is not None else traj.failures:
        s = states.setdefault(f.state, {"visits": 0, "total_s": 0.0, "failed": 0})
        key = "retries" if f.handled == "retry" else "catches"
        s[key] = s.get(key, 0) + 1


def _count_segments(
    traj: Any, edges: dict[int, dict[str, Any]], states: dict[str, dict[str, Any]], own: int = 0
) -> None:
    """Each segment after the first: counted on the state that started it and on the edge that entered it
    (a segment the initial state started has no edge). `own`: where the node's own path begins (a branch's
    segments before it are its parent's)."""
    starts = traj.segment_starts() if getattr(traj, "closed", ()) else ()
    entered: set[int] = set()  # path positions already counted as a rewrite of their edge
    for reason, at in starts:
        if at < own:
            continue
        s = states[traj.path[at]]
        s["segments"] = s.get("segments", 0) + 1
        by_reason = s.setdefault("segment_reasons", {})
        by_reason[reason] = by_reason.get(reason, 0) + 1
        if at > 0:
            e = edges[traj.transitions_fired[at - 1]]
            e["segments"] = e.get("segments", 0) + 1
            if at not in entered:
                entered.add(at)
                e["rewrites"] = e.get("rewrites", 0) + 1


def tree_stats(trajectories: Sequence[Any]) -> dict[str, Any]:
    """How many nodes the trees of a run produced: in all, per child machine and per forking state."""
    children: dict[str, int] = {}
    branches: dict[str, int] = {}
    nodes = 0

    def walk(t: Any) -> None:
        nonlocal nodes
        nodes += 1
        node = t.node
        if node.kind != "root" and node.origin is not None:
            into = children if node.kind == "child" else branches
            into[node.origin] = into.get(node.origin, 0) + 1
        for sub in node.nodes:
            walk(sub)

    for t in trajectories:
        walk(t)
    return {"nodes": nodes, "children": children, "branches": branches}


def run_file(run_dir: str | Path, name: str, what: str) -> Path:
    """`run_dir`'s file `name` (`run_dir` is the run directory or the file itself); FileNotFoundError naming
    `what` is missing when it is not there."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {what} here; pass the directory `agentfsm run --out DIR` wrote")
    return path


def load_run_stats(run_dir: str | Path) -> dict[str, Any]:
    """The "fsm" section of a run's summary.json (`run_dir` is the run directory or the file itself)."""
    path = run_file(run_dir, "summary.json", "run summary")
    summary = json.loads(path.read_text(encoding="utf-8"))
    stats = summary.get("fsm")
    if not isinstance(stats, dict) or "edges" not in stats:
        raise ValueError(f'{path} has no "fsm" run statistics section (written by `agentfsm run`)')
    return stats
