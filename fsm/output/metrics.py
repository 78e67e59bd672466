"""One batch's metrics as a flat dict of numbers, ready for `wandb.log` or a TensorBoard writer.

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

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fsm.output.stats import reason_key
from fsm.run.trajectory import Trajectory
from fsm.run.tree import nodes_of, row_nodes

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
