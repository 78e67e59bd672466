"""One trajectory as one flat sample: the form every trainer adapter maps from.

`Sample` is the tokens a trainer trains on and what weights them, in unpadded lists, in verl's AgentLoopOutput
layout. Failed rows keep their place (one sample per input row and k): `failed`, and `on_error` says what the
spec's `failures.on_error` made of it. A rewritten context gives one sample per segment, the reward placed as
`context.reward_placement` says; a tree (docs/trees.md) gives its nodes' samples in preorder, as the padded
batch does, each with `tree`: where it sits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fsm.output.batch import tree_nodes, tree_weights
from fsm.run.trajectory import Trajectory
from fsm.run.tree import tree_record


class TurnReward(NamedTuple):
    source: str  # "tool" | "interaction"
    position: int  # index into response_ids of the judged turn's last token; -1: before any model token
    value: float


@dataclass(slots=True)
class Sample:
    uid: str  # the GRPO group: samples of one input row share it
    index: int  # its row in the batch (input row i, sample k of n: i * n + k)
    sample: int  # k: which of its input row's n samples
    prompt_ids: list[int]  # the rendered prompt (chat template, tools)
    response_ids: list[int]  # every token after it: model turns and observations/template tokens
    mask: list[int]  # 1 where the model generated the token: what a policy loss sums over
    logprobs: list[float] | None  # the engine's (0.0 where mask is 0); None when a server gave none
    versions: list[int]  # the weight version that generated each token; -1 where mask is 0
    reward: float | None  # the spec's reward (None: the spec has none; 0.0 on a failed row)
    turn_rewards: list[TurnReward]  # tool rewards and interaction scores, at the turns they judge
    termination_reason: str  # why it ended ("answered", "max_turns", "error: ...")
    failed: bool
    truncated: bool  # the last model turn was cut by its token budget (finish reason "length")
    num_turns: int  # verl's count: user turns + assistant turns + 1
    messages: list[dict[str, Any]]  # the conversation: prompt, model turns, tool results, user replies
    metrics: dict[str, float]  # per-sample timing and counters (fsm.run.trajectory.Metrics)
    row: dict[str, Any]  # the input row (ground truth, extra_info, dataset columns)
    reward_extra_info: dict[str, Any] = field(default_factory=dict)  # what a dict-returning reward added
    segment: int = 0  # which segment of its trajectory (0 unless its context was rewritten)
    num_segments: int = 1
    trajectory_id: str = ""  # the trajectory's session id: its segments share it
    # where the row sits in its tree (docs/trees.md): tree, node, parent, node_kind, branch_offset, policy,
    # depth, weight, shared_prefix; a linear trajectory is its tree's root
    tree: dict[str, Any] = field(default_factory=dict)
    # a failed row: what the spec's failures.on_error made of it (mask, zero_reward, drop); None otherwise
    on_error: str | None = None

    @property
    def ids(self) -> list[int]:
        """prompt + response: the sequence a trainer's forward pass scores."""
        return self.prompt_ids + self.response_ids


@dataclass(slots=True)
class SampleBatch:
    """`RolloutEngine.generate_samples`: the samples in verl's order (a row's n samples contiguous) and the
    batch's meta_info ("sampling": what produced the logprobs; "rollout_metrics": fsm/output/batch.py)."""

    samples: list[Sample]
    meta_info: dict[str, Any]

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)


def to_sample(
    traj: Trajectory,
    segment: Any = None,
    reward_placement: str = "last",
    tree: dict[str, Any] | None = None,
) -> Sample:
    """A finished trajectory (or one `segment` of it, fsm/run/trajectory.py Segment) as a flat sample; `tree`:
    its place in its tree (`to_samples` fills it)."""
    seg = segment if segment is not None else traj
    index = segment.index if segment is not None else traj.num_segments - 1
    last = index == traj.num_segments - 1
    reward = traj.reward_score if last or reward_placement == "every" or traj.reward_score is None else 0.0
    return Sample(
        uid=traj.uid,
        index=traj.index,
        sample=traj.sample,
        prompt_ids=seg.prompt_ids.tolist(),
        response_ids=seg.response_ids.tolist(),
        mask=seg.response_mask.tolist(),
        logprobs=None if traj.logprobs_missing else seg.response_logprobs.tolist(),
        versions=seg.response_versions.tolist(),  # -1 on observation tokens already
        reward=reward,
        turn_rewards=[TurnReward(str(s), int(p), float(v)) for s, p, v in seg.turn_rewards],
        termination_reason=traj.termination_reason or traj.state.lower(),
        failed=traj.failed,
        truncated=traj.last_finish_reason == "length" if last else False,
        num_turns=traj.num_turns,
        messages=list(seg.messages),
        metrics=traj.metrics.as_dict(),
        row=traj.row,
        reward_extra_info=dict(traj.extra.get("reward_extra_info", {})),
        segment=index,
        num_segments=traj.num_segments,
        trajectory_id=traj.session_id,
        tree=tree or {},
        on_error=None if traj.failure is None else traj.failure.on_error,
    )


def to_samples(
    trajs: Sequence[Trajectory],
    reward_placement: str = "last",
    default_policy: str = "default",
    weight: str = "per_root",
) -> list[Sample]:
    """One sample per segment of each trajectory's row nodes (its tree in preorder; itself when linear), in
    order, each with its place in its tree and its weight (`weight`: the spec's tree.weight)."""
    weights = tree_weights(trajs, weight, default_policy)
    out = []
    for t in tree_nodes(trajs, default=default_policy):
        segments = t.segments if t.closed else [None]
        for k, seg in enumerate(segments):
            where = tree_record(t, k, default_policy)
            where["weight"] = weights.get(id(t), 1.0)
            out.append(to_sample(t, seg, reward_placement, where))
    return out
