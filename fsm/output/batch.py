"""Trajectories -> verl's padded batch, vectorized over the batch (no per-sample tokenizer.pad).

The layout is exactly verl's `_agent_loop_postprocess` + `_postprocess` (each key, shape and dtype: docs/contracts.md,
"batch.pt"): prompts left-padded, responses right-padded and cut to R, position_ids
`clip(cumsum(attention_mask) - 1, 0)`, the score on the last valid response token (an empty response: column R-1,
where verl's index -1 puts it).

One row per segment (fsm/run/trajectory.py), each exactly what the model was given and produced;
`trajectory_id`, `segment_index` and `num_segments` tie rows to their trajectory (`uid` stays the GRPO group).
The reward goes on the last segment (`reward_placement="last"`, the others 0.0) or on every one ("every":
session-level GRPO). `summarize` and `rollout_metrics` count a batch for a person and for a trainer's logger.
batch.pt (`save_batch`) loads with torch's default `weights_only=True`, which refuses numpy arrays: each
non-tensor column is saved as a list with its numpy dtype beside it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from fsm.data.rows import is_dataproto
from fsm.output.rundir import harness_failure, reason_key
from fsm.run.trajectory import Trajectory
from fsm.run.tree import nodes_of, row_nodes, tree_record

log = logging.getLogger("agentfsm.batch")


@dataclass
class RolloutBatch:
    """DataProto-shaped: `batch` (tensors), `non_tensor_batch` (numpy object arrays), `meta_info`."""

    batch: TensorDict
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.batch.batch_size[0])


def _place(out: np.ndarray, seqs: Sequence[np.ndarray], fill: float, left: bool) -> np.ndarray:
    """Pad variable-length rows into `out` ([B, width], written whole), row by row: each row's tokens and its
    padding are written once, straight from the trajectory's array (a scatter through row/column indices or a
    mask read everything twice). Returns the rows' lengths cut to the width."""
    width = out.shape[1]
    lens = np.empty(len(seqs), dtype=np.int64)
    for i, (row, s) in enumerate(zip(out, seqs)):
        n = lens[i] = min(len(s), width)
        # Left padding keeps a row's tail (verl cuts long prompts on the left), right padding its head.
        if left:
            row[: width - n], row[width - n :] = fill, s[len(s) - n :]
        else:
            row[:n], row[n:] = s[:n], fill
    return lens


REWARD_PLACEMENTS = ("last", "every")


def dropped(traj: Trajectory) -> bool:
    """A failed row left out of the batch (the spec's `on_error: drop`)."""
    return traj.failure is not None and traj.failure.on_error == "drop"


def node_policy(t: Trajectory, default: str) -> str:
    """The policy that generated `t`'s rows (a root's: its run's spec's, `default`)."""
    return t.node.policy if t.node.kind != "root" else default


def tree_nodes(
    trajs: Sequence[Trajectory], policy: str | None = None, default: str = "default"
) -> list[Trajectory]:
    """Every node of the trajectories' trees that is a training row, tree by tree in preorder (a linear
    trajectory is its own one node); with `policy`, only that policy's."""
    nodes = [n for t in trajs for n in row_nodes(t)]
    if policy is not None:
        nodes = [n for n in nodes if node_policy(n, default) == policy]
    return nodes


def policies_of(trajs: Sequence[Trajectory], default: str) -> list[str]:
    """The policies with rows among `trajs`' trees, in order of first appearance."""
    return list(dict.fromkeys(node_policy(n, default) for n in tree_nodes(trajs, default=default)))


def segment_rows(trajs: Sequence[Trajectory]) -> tuple[list[Any], list[Trajectory], list[int]]:
    """(rows, the trajectory of each row, each row's segment index): the trajectories themselves when none
    was rewritten (nothing built), else every segment of each in order. Trees are expanded before
    (`tree_nodes`). A failed row the spec's `failures.on_error: drop` names is left out (`dropped` counts and
    names it)."""
    trajs = [t for t in trajs if not dropped(t)]
    if not any(t.closed for t in trajs):
        return list(trajs), list(trajs), [0] * len(trajs)
    rows, owners, index = [], [], []
    for t in trajs:
        for seg in t.segments:
            rows.append(seg)
            owners.append(t)
            index.append(seg.index)
    return rows, owners, index


def collate(
    trajs: Sequence[Trajectory],
    *,
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
    logprobs: bool = True,
    reward_placement: str = "last",
    policy: str | None = None,
    default_policy: str = "default",
    weight: str = "per_root",
) -> RolloutBatch:
    """Pad finished trajectories into verl's batch: one row per segment, in the trajectories' order; a tree's
    nodes follow their root (preorder). `policy`: that policy's rows only (one batch per policy)."""
    if reward_placement not in REWARD_PLACEMENTS:
        raise ValueError(f"reward_placement must be one of {REWARD_PLACEMENTS}, got {reward_placement!r}")
    weights = tree_weights(trajs, weight, default_policy)
    trajs = tree_nodes(trajs, policy, default_policy)
    rows, owners, seg_index = segment_rows(trajs)
    P, R, B = prompt_length, response_length, len(rows)

    def arr(a: Any, dtype: Any) -> np.ndarray:
        return np.frombuffer(a, dtype=dtype) if len(a) else np.zeros(0, dtype=dtype)

    def right(name: str, dtype: Any, fill: float, out_dtype: Any) -> np.ndarray:
        out = np.empty((B, R), dtype=out_dtype)
        _place(out, [arr(getattr(t, name), dtype) for t in rows], fill, left=False)
        return out

    input_ids = np.empty((B, P + R), dtype=np.int64)
    p_len = _place(input_ids[:, :P], [arr(t.prompt_ids, np.int32) for t in rows], pad_token_id, left=True)
    r_len = _place(input_ids[:, P:], [arr(t.response_ids, np.int32) for t in rows], pad_token_id, left=False)
    # mask 1 on generated tokens, times the response attention mask (verl): 0 past r_len, where _place pads
    mask = right("response_mask", np.int8, 0, np.int64)
    versions = right("response_versions", np.int32, -1, np.int64)
    versions[mask == 0] = -1  # a token the model did not generate has no version, whatever was recorded

    attention, position = _attention_positions(P, R, p_len, r_len)
    tensors: dict[str, torch.Tensor] = {
        "prompts": torch.from_numpy(input_ids[:, :P].copy()),
        "responses": torch.from_numpy(input_ids[:, P:].copy()),
        "response_mask": torch.from_numpy(mask),
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention),
        "position_ids": torch.from_numpy(position),
        "weight_versions": torch.from_numpy(versions),
    }
    # Logprobs a server did not give are never invented (0.0 reads as probability 1 in a PPO ratio): the rows
    # keep their tokens and the batch has no rollout_log_probs, as verl's when a sample lacks them, so a trainer
    # that needs them fails on the key; failing the rows would drop good samples for a fleet-wide setting.
    missing = [i for i, t in enumerate(owners) if t.logprobs_missing]
    if logprobs and not missing:
        tensors["rollout_log_probs"] = torch.from_numpy(
            right("response_logprobs", np.float32, 0.0, np.float32)
        )
    if trajs and all(t.reward_score is not None for t in owners):
        tensors["rm_scores"] = torch.from_numpy(_reward_rows(owners, seg_index, r_len, R, reward_placement))

    batch = TensorDict(tensors, batch_size=[B])
    meta: dict[str, Any] = {
        "metrics": [t.metrics.as_dict() for t in owners],
        "timing": timing(owners, r_len, p_len),
    }
    generated = versions[versions >= 0]
    meta["weight_version_min"] = int(generated.min()) if generated.size else None
    meta["weight_version_max"] = int(generated.max()) if generated.size else None
    if logprobs and missing:
        meta["rollout_log_probs_missing"] = missing  # rows whose server returned no logprobs
        log.warning(
            "rollout_log_probs left out of the batch: %d row(s) got no logprobs from their server (rows %s)",
            len(missing),
            missing[:10],
        )
    non_tensors = _non_tensors(owners)
    non_tensors["trajectory_id"] = _objects([t.session_id for t in owners])
    non_tensors["segment_index"] = np.asarray(seg_index, dtype=np.int32)
    non_tensors["num_segments"] = np.asarray([t.num_segments for t in owners], dtype=np.int32)
    non_tensors.update(tree_columns(owners, seg_index, weights, default_policy))
    return RolloutBatch(batch, non_tensors, meta)


def _attention_positions(
    P: int, R: int, p_len: np.ndarray, r_len: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Attention 1 on the prompt's last p_len columns and the response's first r_len; positions count them."""
    B = len(p_len)
    attention = np.empty((B, P + R), dtype=np.int64)
    position = np.empty((B, P + R), dtype=np.int64)
    counting = np.arange(P + R, dtype=np.int64)
    for row, pos, pl, rl in zip(attention, position, (P - p_len).tolist(), (P + r_len).tolist()):
        row[:pl], row[pl:rl], row[rl:] = 0, 1, 0
        pos[:pl], pos[pl:rl], pos[rl:] = 0, counting[: rl - pl], max(rl - pl - 1, 0)
    return attention, position


def _reward_rows(
    owners: Sequence[Trajectory], seg_index: Sequence[int], r_len: np.ndarray, R: int, placement: str
) -> np.ndarray:
    """Each row's score on its last response token (`placement` "last": a trajectory's last segment only)."""
    every = placement == "every"
    scores = [t.reward_score if every or k == t.num_segments - 1 else 0.0 for t, k in zip(owners, seg_index)]
    rm = np.zeros((len(owners), R), dtype=np.float32)
    # verl: attention_mask[:, P:].sum(1) - 1, so an empty (failed) response's score lands at -1, the
    # last column: its reward still counts in a group's sum (GRPO), on a masked position
    rm[np.arange(len(owners)), r_len - 1] = np.asarray(scores, dtype=np.float32)
    return rm


def tree_weights(roots: Sequence[Trajectory], weight: str, default: str = "default") -> dict[int, float]:
    """id(node) -> the weight of each of its rows: "per_root" splits 1.0 evenly over a root's rows (segments,
    children and branches included, whatever their policy), "per_row" gives each 1.0."""
    if weight not in ("per_root", "per_row"):
        raise ValueError(f"tree.weight must be per_root or per_row, got {weight!r}")
    out = {}
    for root in roots:
        nodes = row_nodes(root)
        share = 1.0 if weight == "per_row" else 1.0 / max(sum(n.num_segments for n in nodes), 1)
        for n in nodes:
            out[id(n)] = share
    return out


def tree_columns(
    owners: Sequence[Trajectory], seg_index: Sequence[int], weights: Mapping[int, float], default: str
) -> dict[str, np.ndarray]:
    """The batch's per-row tree columns (non-tensor, numpy): tree, node, parent, node_kind, branch_offset,
    policy, depth, weight, shared_prefix."""
    records = [tree_record(t, k, default) for t, k in zip(owners, seg_index)]
    out = {
        key: _objects([r[key] for r in records]) for key in ("tree", "node", "parent", "node_kind", "policy")
    }
    out["branch_offset"] = np.asarray([r["branch_offset"] for r in records], dtype=np.int64)
    out["depth"] = np.asarray([r["depth"] for r in records], dtype=np.int32)
    out["weight"] = np.asarray([weights.get(id(t), 1.0) for t in owners], dtype=np.float64)
    out["shared_prefix"] = _objects([r["shared_prefix"] for r in records])
    return out


def _objects(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _non_tensors(trajs: Sequence[Trajectory]) -> dict[str, np.ndarray]:
    """verl's non-tensor keys plus agentfsm's; every input row column comes back, one entry per sample."""
    out = {
        "__num_turns__": np.array([t.num_turns for t in trajs], dtype=np.int32),
        "termination_reason": _objects([t.termination_reason for t in trajs]),
        "uid": _objects([t.uid for t in trajs]),
        "state_path": _objects([list(t.path) for t in trajs]),
        "turn_scores": _objects([list(t.turn_scores) for t in trajs]),
        "tool_rewards": _objects([list(t.tool_rewards) for t in trajs]),
        "raw_prompt": _objects([t.row.get("raw_prompt") for t in trajs]),
    }
    # verl's extra_fields columns: every key any trajectory's tools (or server) set, None where missing;
    # as in verl they win over a row column of the same name
    for key in sorted({key for t in trajs for key in t.extra_fields} - set(out)):
        out[key] = _objects([t.extra_fields.get(key) for t in trajs])
    columns = {key for t in trajs for key in t.row} - set(out) - {"agent_name"}
    for key in sorted(columns):
        out[key] = _objects([t.row.get(key) for t in trajs])
    extra_keys = {key for t in trajs for key in t.extra.get("reward_extra_info", {})}
    for key in sorted(extra_keys):
        out[key] = _objects([t.extra.get("reward_extra_info", {}).get(key) for t in trajs])
    return out


def timing(trajs: Sequence[Trajectory], r_len: np.ndarray, p_len: np.ndarray) -> dict[str, float]:
    """verl's `agent_loop/...` timing keys (min/max/mean over samples, and the slowest sample)."""
    if not trajs:
        return {}
    cols = {
        "generate_sequences": np.array([t.metrics.generate_sequences for t in trajs]),
        "tool_calls": np.array([t.metrics.tool_calls for t in trajs]),
        "compute_score": np.array([t.metrics.compute_score for t in trajs]),
        "num_preempted": np.array([t.metrics.num_preempted for t in trajs], dtype=np.float64),
    }
    out = {}
    for name, values in cols.items():
        out[f"agent_loop/{name}/min"] = float(values.min())
        out[f"agent_loop/{name}/max"] = float(values.max())
        out[f"agent_loop/{name}/mean"] = float(values.mean())
    slowest = int(np.argmax(cols["generate_sequences"] + cols["tool_calls"] + cols["compute_score"]))
    for name, values in cols.items():
        out[f"agent_loop/slowest/{name}"] = float(values[slowest])
    out["agent_loop/slowest/prompt_length"] = float(p_len[slowest])
    out["agent_loop/slowest/response_length"] = float(r_len[slowest])
    return out


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


def summarize(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """Counts a person reads after a run: termination reasons, failures, turns, rewards, tokens. `trajs` are the
    roots (`trajectories`); the rest counts every node of their trees as `rollout_metrics` does: the
    training rows (`rows`: a fork's branches, child machines' runs) and each generated token once."""
    roots, trajs = trajs, [n for t in trajs for n in row_nodes(t)]
    reasons = Counter(map(reason_key, trajs))
    scores = [t.reward_score for t in trajs if t.reward_score is not None]
    return {
        "trajectories": len(roots),
        "rows": len(trajs),
        # an engine error, or a gateway row whose harness failed (it ends `harness_failed`, no engine error)
        "failed": sum(
            t.failed or harness_failure({"harness": t.extra.get("harness")}) is not None for t in trajs
        ),
        "dropped": sum(dropped(t) for t in trajs),  # failed rows left out of the batch (on_error: drop)
        "dropped_rows": [t.row_name for t in trajs if dropped(t)],
        "termination_reasons": dict(reasons.most_common()),
        "reward_mean": float(np.mean(scores)) if scores else None,
        "accuracy": float(np.mean([s > 0 for s in scores])) if scores else None,
        "turns_mean": float(np.mean([t.num_turns for t in trajs])) if trajs else 0.0,
        "response_tokens_mean": float(np.mean([len(t.response_ids) for t in trajs])) if trajs else 0.0,
        "model_tokens": model_tokens(roots),
        "tool_errors": int(sum(t.metrics.tool_errors for t in trajs)),
        "dropped_calls": int(sum(t.metrics.dropped_calls for t in trajs)),
        "token_check_failures": sum(t.token_check is not None for t in trajs),
        "resumes": int(sum(t.metrics.num_preempted for t in trajs)),
        "logprobs_missing_rows": sum(t.logprobs_missing for t in trajs),
    }


def fault_summary(trajs: Sequence[Trajectory], backend_stats: Mapping[str, Any] | None) -> dict[str, Any]:
    """What the servers did wrong and what the engine did about it, so that injected faults add up.

    `faults`: what the clients met on /generate, by kind: failed attempts (http_errors, refused, disconnects,
    resets, timeouts, malformed; SGLang's duplicate rids) and abort answers (aborts_waiting, aborts_running).
    Each failed attempt is followed by exactly one retry on the same server (`retries`), failover to another
    (`failovers`) or end of its row (an error row); each abort is resumed (`resumes`) or ends its row ("error:
    aborted"). `aborts_sent`: requests past their deadline aborted at the server.
    """
    stats = dict(backend_stats or {})
    reroutes = int(stats.get("retries", 0)) if "client_retries" in stats else 0  # a router's re-routes
    failovers = int(stats.get("failovers", 0))
    same_server = int(stats.get("client_retries", stats.get("retries", 0))) + reroutes - failovers
    errors = Counter(t.failure.kind for t in trajs if t.failure is not None)
    return {
        "faults": dict(stats.get("faults", {})),
        "retries": same_server,
        "failovers": failovers,
        "aborts_sent": int(stats.get("aborts_sent", 0)),
        "resumes": int(sum(t.metrics.num_preempted for t in trajs)),
        "error_rows": sum(t.failed for t in trajs),
        "error_reasons": dict(errors.most_common()),
    }


def rollout_metrics(
    trajs: Sequence[Trajectory], *, faults: Mapping[str, float] | None = None, wall_s: float | None = None
) -> dict[str, float]:
    """One batch's metrics as a flat dict of numbers, ready for `wandb.log` or a TensorBoard writer; `trajs` the
    roots, `faults` from `FaultDelta.take()`. A tree counts every node (docs/trees.md): `samples` are the roots,
    the rest are over the training rows (a fork's branches, child machines' runs; a forking node has no row) and
    `model_tokens` counts each generated token once. Keys are "rollout/..." paths (one wandb panel section):
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


COUNTERS = ("retries", "failovers", "aborts_sent", "client_retries")  # backend stats() keys that are counts


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


def to_batch(
    trajs: Sequence[Trajectory],
    agent: Any,
    codec: Any,
    *,
    logprobs: bool,
    like: Any = None,
    meta: Mapping[str, Any] | None = None,
    policy: str | None = None,
) -> Any:
    """Finished trajectories of `agent` (a CompiledAgent) -> RolloutBatch padded with `codec`'s pad id, or a
    `DataProto` of the input's class when `like` is one (as verl's AgentLoopManager returns it). `meta`: the
    input's meta_info, carried under agentfsm's keys. `policy`: that policy's rows only (None: every row)."""
    limits = agent.limits
    if like is not None and is_dataproto(like) and any(dropped(t) for t in trajs):
        names = [t.row_name for t in trajs if dropped(t)]
        raise ValueError(
            f"failures.on_error: drop left out rows {names}, but verl's generate_sequences must return one row "
            "per input (it unions the output with its batch): use on_error: mask or zero_reward under verl"
        )
    if policy is not None:  # a child machine's rows may hold more than the root's limits
        nodes = tree_nodes(trajs, policy, agent.spec.policy)
        agents = {id(n.node.agent): n.node.agent for n in nodes if n.node.agent}
        lims = [a.limits for a in agents.values()] or [limits]
        prompt_length = max(x.prompt_length for x in lims)
        response_length = max(x.response_length for x in lims)
    else:
        prompt_length, response_length = limits.prompt_length, limits.response_length
    out = collate(
        trajs,
        prompt_length=prompt_length,
        response_length=response_length,
        pad_token_id=codec.pad_id,
        logprobs=logprobs,
        reward_placement=agent.spec.context.reward_placement,
        policy=policy,
        default_policy=agent.spec.policy,
        weight=agent.spec.tree.weight,
    )
    out.meta_info = {**(meta or {}), **out.meta_info}
    if policy is not None:
        out.meta_info["policy"] = policy
    if "rm_scores" in out.batch.keys():
        out.meta_info["reward_extra_keys"] = sorted(
            {k for t in trajs for k in t.extra.get("reward_extra_info", {})}
        )
    if like is not None and is_dataproto(like):
        out.meta_info.pop("metrics", None)
        return type(like)(batch=out.batch, non_tensor_batch=out.non_tensor_batch, meta_info=out.meta_info)
    return out


FORMAT = "agentfsm.batch/2"  # /1: numpy arrays pickled inside (torch.load needed weights_only=False)


def plain(value: Any) -> Any:
    """`value` as data torch's safe unpickler takes: dicts, lists, str, numbers, None and tensors."""
    if isinstance(value, (str, int, float, bool, type(None), torch.Tensor)):
        return value
    if isinstance(value, dict):
        return {plain(k) if not isinstance(k, str) else k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return str(value)  # anything else a row may hold (a date, a custom object): its text


def to_file(batch: Any) -> dict[str, Any]:
    """What torch.save writes: {"format", "batch", "non_tensor_batch", "non_tensor_dtypes", "meta_info"}."""
    return {
        "format": FORMAT,
        "batch": {key: value for key, value in batch.batch.items()},
        "non_tensor_batch": {key: plain(values) for key, values in batch.non_tensor_batch.items()},
        "non_tensor_dtypes": {key: str(values.dtype) for key, values in batch.non_tensor_batch.items()},
        "meta_info": plain(batch.meta_info),
    }


def save_batch(batch: Any, path: str | Path) -> None:
    torch.save(to_file(batch), path)


def load_batch(path: str | Path) -> RolloutBatch:
    """A run's batch.pt (weights_only=True: nothing in it runs code) as the RolloutBatch the run produced."""
    saved = torch.load(path, weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(
            f"{path}: not an {FORMAT} batch.pt (an older one loads with torch.load(path, "
            "weights_only=False), from a source you trust)"
        )
    tensors = saved["batch"]
    size = [len(next(iter(tensors.values())))] if tensors else [0]
    non_tensors = {}
    for key, values in saved["non_tensor_batch"].items():
        dtype = saved["non_tensor_dtypes"][key]
        non_tensors[key] = _objects(values) if dtype == "object" else np.asarray(values, dtype=dtype)
    return RolloutBatch(TensorDict(tensors, batch_size=size), non_tensors, saved["meta_info"])
