"""One trajectory as one flat sample: the form every trainer adapter maps from.

A trainer wants, per sample, the tokens it trains on and what it needs to weight them; a `Trajectory` holds
far more (states, segments, counters used by guards). `Sample` is that subset in plain lists, unpadded, in the
layout of verl's AgentLoopOutput (prompt, then one response with a mask over it):

    prompt_ids      [P_i]  the rendered prompt (chat template, tools)
    response_ids    [R_i]  every token after it: model turns (mask 1) and observations/template (mask 0)
    mask            [R_i]  1 where the model generated the token: the tokens a policy loss sums over
    logprobs        [R_i]  the engine's logprob of each token (0.0 where mask is 0), or None when a server gave
                           none; what a PPO/GRPO ratio divides by, under the batch's meta_info["sampling"]
    versions        [R_i]  the weight version that generated each token; -1 where mask is 0
    reward                 the spec's reward function's score (None: the spec has none; 0.0 on a failed row)
    turn_rewards           tool rewards and interaction turn scores, each at the response position of the
                           last token of the model turn it judges (empty on a failed row: no tokens left)
    termination_reason     why it ended ("answered", "max_turns", "error: ...")
Failed rows keep their place (one sample per input row and k): empty response, `failed` True.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fsm.run.trajectory import Trajectory


class TurnReward(NamedTuple):
    source: str  # "tool" | "interaction"
    position: int  # index into response_ids of the judged turn's last token; -1: before any model token
    value: float


@dataclass(slots=True)
class Sample:
    uid: str  # the GRPO group: samples of one input row share it
    index: int  # its row in the batch (input row i, sample k of n: i * n + k)
    sample: int  # k: which of its input row's n samples
    prompt_ids: list[int]
    response_ids: list[int]
    mask: list[int]
    logprobs: list[float] | None
    versions: list[int]
    reward: float | None
    turn_rewards: list[TurnReward]
    termination_reason: str
    failed: bool
    truncated: bool  # the last model turn was cut by its token budget (finish reason "length")
    num_turns: int  # verl's count: user turns + assistant turns + 1
    messages: list[dict[str, Any]]  # the conversation: prompt, model turns, tool results, user replies
    metrics: dict[str, float]  # per-sample timing and counters (fsm.run.trajectory.Metrics)
    row: dict[str, Any]  # the input row (ground truth, extra_info, dataset columns)
    reward_extra_info: dict[str, Any] = field(default_factory=dict)  # what a dict-returning reward added

    @property
    def ids(self) -> list[int]:
        """prompt + response: the sequence a trainer's forward pass scores."""
        return self.prompt_ids + self.response_ids


@dataclass(slots=True)
class SampleBatch:
    """`RolloutEngine.generate_samples`: the samples in verl's order (a row's n samples contiguous) and the
    batch's meta_info ("sampling": what produced the logprobs; "rollout_metrics": fsm/output/metrics.py)."""

    samples: list[Sample]
    meta_info: dict[str, Any]

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)


def to_sample(traj: Trajectory) -> Sample:
    """A finished trajectory as a flat sample."""
    mask = traj.response_mask.tolist()
    return Sample(
        uid=traj.uid,
        index=traj.index,
        sample=traj.sample,
        prompt_ids=traj.prompt_ids.tolist(),
        response_ids=traj.response_ids.tolist(),
        mask=mask,
        logprobs=None if traj.logprobs_missing else traj.response_logprobs.tolist(),
        versions=traj.response_versions.tolist(),  # -1 on observation tokens already
        reward=traj.reward_score,
        turn_rewards=[TurnReward(str(s), int(p), float(v)) for s, p, v in traj.turn_rewards],
        termination_reason=traj.termination_reason or traj.state.lower(),
        failed=traj.failed,
        truncated=traj.last_finish_reason == "length",
        num_turns=traj.num_turns,
        messages=list(traj.messages),
        metrics=traj.metrics.as_dict(),
        row=traj.row,
        reward_extra_info=dict(traj.extra.get("reward_extra_info", {})),
    )


def to_samples(trajs: Sequence[Trajectory]) -> list[Sample]:
    return [to_sample(t) for t in trajs]
