"""A run's statistics: how often each edge fired, how long each state took, how runs ended. They are a run
result (the "fsm" section of summary.json, written by fsm/output/rundir.py; its format: docs/contracts.md);
viz/diagram.py only draws them. `run_stats(agent, trajectories)` makes it, `load_run_stats(run_dir)` reads it back.

`rollout_metrics`: one batch's metrics as a flat dict of numbers, ready for `wandb.log` or a TensorBoard writer.

A tree counts every node (docs/trees.md): `samples` are the roots, the rest are over the training rows (a fork's
branches, child machines' runs; a forking node has no row) and `model_tokens` counts each generated token once
(a branch's row repeats its parent's tokens before the fork). A linear row is a tree of one node.

Keys are "rollout/..." paths (wandb groups them into one panel section):
    rollout/samples, rollout/rows, rollout/failed        samples (roots), training rows (tree nodes), rows in error
    rollout/termination/<reason>                         count per termination reason (errors by their kind)
    rollout/turns/{mean,max}, rollout/assistant_turns/mean
    rollout/tool_calls, rollout/tool_errors, rollout/tool_dropped_calls, rollout/tool_retries
    rollout/resumes, rollout/preempted_samples           model turns aborted and resumed, samples with any
    rollout/response_length/{mean,max}, rollout/model_tokens
    rollout/reward/mean, rollout/turn_rewards/sum_mean   when there are scores
    rollout/timing/{generate,tools,reward}_s/{mean,max}  per-sample seconds (summed over its turns)
    rollout/timing/batch_s                               the batch's wall time, when the caller measured it
    rollout/faults/<kind>, rollout/retries, rollout/failovers, rollout/aborts_sent
                                                         server faults since the previous batch (`FaultDelta`)
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fsm.run.trajectory import Trajectory
from fsm.run.tree import nodes_of, row_nodes


def reason_key(traj: Any) -> str:
    """A row's termination reason as summary.json groups it (here and in fsm/output/batch.py's `summarize`): a
    failure by its kind ("error: backend", fsm/run/trajectory.py `Failure`)."""
    if traj.failure is not None:
        return f"error: {traj.failure.kind}"
    return traj.termination_reason or "?"


def harness_failure(record: dict[str, Any]) -> str | None:
    """How a row's harness failed, one line (the last line of its error: a traceback's says why); None when it
    returned or exited 0 (fsm/gateway/harness.py's `harness_failed`)."""
    outcome = record.get("harness")
    if (
        not isinstance(outcome, dict)
        or outcome.get("outcome") in (None, "returned")
        or (outcome.get("outcome") == "exit" and outcome.get("exit_code") in (None, 0))
    ):
        return None
    lines = [line.strip() for line in str(outcome.get("error") or "").splitlines() if line.strip()]
    kind = outcome["outcome"] if outcome["outcome"] != "exit" else f"exit {outcome.get('exit_code')}"
    return f"{kind}: {lines[-1]}" if lines else str(kind)


def run_stats(agent: Any, trajectories: Sequence[Any] | None = None) -> dict[str, Any]:
    """Statistics of finished trajectories (`run_stats(agent, trajs)`, or `run_stats(trajs)` without the
    agent, which then leaves out guard labels and reasons)."""
    if trajectories is None:
        agent, trajectories = None, agent
    edges: dict[int, dict[str, Any]] = {}
    states: dict[str, dict[str, Any]] = {}
    if agent is not None:
        edges = {e.index: _edge(e.source, e.dest, e.label, e.reason) for e in agent.edges}
        states = {name: _state() for name in agent.spec.states}
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
                    e = edges[index] = _edge(path[k], path[k + 1])
                e["count"] += 1
                in_tree.add(index)
            for k in range(own, len(path)):
                s = states.setdefault(path[k], _state())
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


def _edge(source: str, dest: str, guard: str | None = None, reason: str | None = None) -> dict[str, Any]:
    return {"source": source, "dest": dest, "guard": guard, "reason": reason, "count": 0, "trajectories": 0}


def _state() -> dict[str, Any]:
    return {"visits": 0, "total_s": 0.0, "failed": 0}


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
        s = states.setdefault(f.state, _state())
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


COUNTERS = ("retries", "failovers", "aborts_sent", "client_retries")  # backend stats() keys that are counts


def generated_tokens(traj: Trajectory) -> int:
    """The tokens the model generated in this node itself: a branch's row begins with its parent's tokens up to
    the fork (`shared_length`), which the parent generated and counts."""
    node = traj.node
    if node.kind != "branch":
        return traj.response_mask.count(1)
    return traj.response_mask[max(0, node.shared_length - len(traj.prompt_ids)) :].count(1)


def model_tokens(roots: Sequence[Trajectory]) -> int:
    """Tokens the model generated for these trees, every node's, each token once."""
    return sum(generated_tokens(n) for t in roots for n in nodes_of(t))


def rollout_metrics(
    trajs: Sequence[Trajectory], *, faults: Mapping[str, float] | None = None, wall_s: float | None = None
) -> dict[str, float]:
    """The batch's metrics (see the module docstring); `trajs` the roots, `faults` from `FaultDelta.take()`."""
    roots, trajs = trajs, [n for t in trajs for n in row_nodes(t)]
    out: dict[str, float] = {
        "rollout/samples": float(len(roots)),
        "rollout/rows": float(len(trajs)),
        "rollout/failed": float(sum(t.failed for t in trajs)),
    }
    reasons = Counter(reason_key(t).replace(": ", "_").replace(" ", "_") for t in trajs)  # error_backend
    out |= {f"rollout/termination/{k}": float(n) for k, n in reasons.items()}
    if trajs:
        m = [t.metrics for t in trajs]
        turns = np.array([t.num_turns for t in trajs], dtype=np.float64)
        lengths = np.array([len(t.response_ids) for t in trajs], dtype=np.float64)
        out |= {
            "rollout/turns/mean": float(turns.mean()),
            "rollout/turns/max": float(turns.max()),
            "rollout/assistant_turns/mean": float(np.mean([t.assistant_turns for t in trajs])),
            "rollout/tool_calls": float(sum(x.num_tool_calls for x in m)),
            "rollout/tool_errors": float(sum(x.tool_errors for x in m)),
            "rollout/tool_dropped_calls": float(sum(x.dropped_calls for x in m)),
            "rollout/tool_retries": float(sum(x.retries for x in m)),
            "rollout/resumes": float(sum(x.num_preempted for x in m)),
            "rollout/preempted_samples": float(sum(x.num_preempted > 0 for x in m)),
            "rollout/response_length/mean": float(lengths.mean()),
            "rollout/response_length/max": float(lengths.max()),
            "rollout/model_tokens": float(model_tokens(roots)),
        }
        for name, attr in (
            ("generate", "generate_sequences"),
            ("tools", "tool_calls"),
            ("reward", "compute_score"),
        ):
            values = np.array([getattr(x, attr) for x in m], dtype=np.float64)
            out[f"rollout/timing/{name}_s/mean"] = float(values.mean())
            out[f"rollout/timing/{name}_s/max"] = float(values.max())
        scores = [t.reward_score for t in trajs if t.reward_score is not None]
        if scores:
            out["rollout/reward/mean"] = float(np.mean(scores))
        per_traj = [t.all_turn_rewards() if t.closed else [(0, r) for r in t.turn_rewards] for t in trajs]
        if any(per_traj):
            out["rollout/turn_rewards/sum_mean"] = float(
                np.mean([sum(r[2] for _, r in rs) for rs in per_traj])
            )
        if any(t.closed for t in trajs):
            out["rollout/segments/mean"] = float(np.mean([t.num_segments for t in trajs]))
    if wall_s is not None:
        out["rollout/timing/batch_s"] = float(wall_s)
    for key, value in (faults or {}).items():
        out[f"rollout/{key}"] = float(value)
    return out


class FaultDelta:
    """A backend's cumulative fault counters (its `stats()`), read as what changed since the last `take()`."""

    def __init__(self, backend: Any):
        self.backend = backend
        self._stats = getattr(backend, "stats", None)
        self._last = self._read()

    def _read(self) -> dict[str, float]:
        if self._stats is None:
            return {}
        try:
            stats = self._stats()
        except Exception:  # counters are for reading; a backend that cannot say has none
            return {}
        out = {f"faults/{k}": float(v) for k, v in dict(stats.get("faults") or {}).items() if _number(v)}
        out |= {k: float(stats[k]) for k in COUNTERS if _number(stats.get(k))}
        return out

    def take(self) -> dict[str, float]:
        now = self._read()
        delta = {k: v - self._last.get(k, 0.0) for k, v in now.items()}
        self._last = now
        return {k: v for k, v in delta.items() if v or not k.startswith("faults/")}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
