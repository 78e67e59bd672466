"""examples/grpo.py trains the tiny model: a few real GRPO steps from the `mid` checkpoint raise the held-out
reward, and the trainer's recomputed log-probabilities match the engine's on every step (the run raises
LogprobMismatch otherwise), in both forms.

The synchronous run is deterministic: the prompts and sampling seeds are fixed, the embedded model's seeded
sampling does not depend on batching, and the held-out reward is measured before and after on the same
prompts with the same seeds, so the difference comes from the weights alone (3 steps: 20.3 % -> 42.2 %, run
after run; 4 steps with another training seed: +15 and +17 points; asserted: +8). The continuous test fixes its interleaving (each step's next groups
finish before the weights change), so it always trains on tokens of older weights and checks them.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from backends.tiny import ASSET_DIR
from examples.grpo import GRPO, Config, LogprobMismatch, advantages, check_logprobs


def run(trainer_class: type[GRPO] = GRPO, **options) -> tuple[GRPO, list]:
    trainer = trainer_class(
        Config(**{"eval_prompts": 32, "eval_samples": 2, "eval_every": 0, **options}), log=[].append
    )
    try:
        return trainer, trainer.run()
    finally:
        trainer.close()


@pytest.mark.slow
def test_sync_grpo_raises_the_held_out_reward_and_logprobs_match():
    trainer, logs = run(mode="sync", steps=3, prompts=8, group=8)
    assert [s.step for s in logs] == [1, 2, 3] and [s.version for s in logs] == [0, 1, 2]
    assert all(s.checked > 1000 and s.max_diff <= trainer.cfg.logprob_tol for s in logs)
    assert all(s.stale_tokens == 0 for s in logs)  # synchronous: every token from the weights trained
    assert logs[-1].accuracy >= trainer.before + 0.08, (trainer.before, logs[-1].accuracy)


class Settled(GRPO):
    """Syncs only once the groups in flight have finished: they are all made by the weights before it."""

    def sync(self) -> int:
        deadline = time.monotonic() + 300
        while self.engine.stream_stats.get("running_groups") and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().sync()


@pytest.mark.slow
def test_continuous_grpo_checks_stale_tokens_against_their_own_weights():
    trainer, logs = run(
        Settled, mode="continuous", steps=3, prompts=4, group=4, eval_prompts=8, eval_samples=1
    )
    assert [s.stale_tokens for s in logs] == [0.0, 1.0, 1.0]  # steps 2 and 3: tokens of the previous weights
    assert all(s.checked > 0 and s.max_diff <= trainer.cfg.logprob_tol for s in logs)
    assert trainer.engine.stream_stats["staleness"] == {0: 4, 1: 8}


def test_the_check_fails_loudly():
    where = torch.tensor([[True, False]])
    assert (
        check_logprobs(torch.tensor([[-1.0, -5.0]]), torch.tensor([[-1.00001, 0.0]]), where, 1e-4, "x")[0]
        == 1
    )
    with pytest.raises(LogprobMismatch, match=r"x: .* by 0\.01 \(tolerance 0\.0001\) over 1 tokens"):
        check_logprobs(torch.tensor([[-1.0, -5.0]]), torch.tensor([[-1.01, -5.0]]), where, 1e-4, "x")


class Recorded(GRPO):
    """Keeps each step's sampled tokens."""

    def train_on(self, batch, version):
        self.responses = [*getattr(self, "responses", []), batch.batch["responses"].clone()]
        return super().train_on(batch, version)


@pytest.mark.slow
def test_the_evaluation_schedule_does_not_change_training():
    """Evaluating after every step or only at the end: the same tokens sampled and the same weights, bit for bit
    (the update once used the engine's log-probabilities, whose last bits vary with how requests were batched,
    and Adam made full-size steps of that noise: the trained weights, and soon the samples, differed)."""
    runs = [
        run(
            Recorded,
            mode="sync",
            steps=3,
            prompts=4,
            group=4,
            eval_prompts=8,
            eval_samples=1,
            eval_every=every,
            seed=3,
        )[0]
        for every in (1, 0)
    ]
    (a, _), (b, _) = [(t.responses, t) for t in runs]
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b) == 3
    wa, wb = runs[0].policy.state_dict(), runs[1].policy.state_dict()
    different = [name for name in wa if not torch.equal(wa[name], wb[name])]
    assert not different, different


# --- a spec that rewrites its context: session-level advantages -------------------------------------------


def _rows(rewards: list[float], trajectories: list[str], uids: list[str], segments: list[int]) -> Any:
    """A batch's reward and identity columns: one row per segment (segment_index counts up per trajectory)."""
    index = [trajectories[:i].count(t) for i, t in enumerate(trajectories)]
    rm = torch.zeros(len(rewards), 3)
    rm[:, -1] = torch.tensor(rewards)
    nt = {
        "uid": np.array(uids, dtype=object),
        "trajectory_id": np.array(trajectories, dtype=object),
        "segment_index": np.array(index),
        "num_segments": np.array(segments),
    }
    return SimpleNamespace(batch={"rm_scores": rm}, non_tensor_batch=nt)


@pytest.mark.parametrize("placement", ["every", "last"])
def test_session_advantages_count_each_trajectory_once_and_reach_every_segment(placement):
    """Group g: trajectory a (3 segments, reward 1) and b (1 segment, reward 0); group h: c and d, both 1."""
    ra = [1.0, 1.0, 1.0] if placement == "every" else [0.0, 0.0, 1.0]
    tids, uids = ["a", "a", "a", "b", "c", "d"], ["g"] * 4 + ["h"] * 2
    batch = _rows([*ra, 0.0, 1.0, 1.0], tids, uids, [3, 3, 3, 1, 1, 1])
    reward, adv = advantages(batch, session=True)
    assert reward.tolist() == [1.0, 0.0, 1.0, 1.0]  # one per trajectory
    assert torch.allclose(adv, torch.tensor([1.0, 1.0, 1.0, -1.0, 0.0, 0.0]), atol=1e-4)
    _, by_row = advantages(batch)  # rows as samples: a's segments outweigh b, or (last) disagree
    assert not torch.allclose(by_row, adv, atol=1e-2)


class Batches(GRPO):
    """Keeps each step's batch and its advantages."""

    def train_on(self, batch, version):
        self.seen = [*getattr(self, "seen", []), (batch, advantages(batch, session=True)[1])]
        return super().train_on(batch, version)


@pytest.mark.slow
def test_session_grpo_trains_every_segment_of_a_rewritten_context():
    """specs/calculator_results.yaml from the trained model: each trajectory is two segments or more (the call,
    then the result without it); every row of a trajectory gets its trajectory's advantage, and the step trains
    on (and checks the log-probabilities of) the model's tokens of every segment."""
    trainer, logs = run(
        Batches,
        mode="sync",
        steps=2,
        prompts=4,
        group=4,
        eval_prompts=8,
        eval_samples=1,
        spec="specs/calculator_results.yaml",
        init=ASSET_DIR,
        advantages="session",
    )
    for (batch, adv), log in zip(trainer.seen, logs):
        nt = batch.non_tensor_batch
        tids, index, count = nt["trajectory_id"], nt["segment_index"], nt["num_segments"]
        assert len(set(tids)) == 16 and log.rows == len(tids)
        assert sum(count[index == 0] >= 2) >= 12  # most trajectories hold 2 or 3 segments
        for tid in set(tids):
            shared = set(adv[torch.from_numpy(tids == tid)].tolist())
            assert len(shared) == 1, (tid, shared)  # one advantage across the trajectory's segments
        mask = batch.batch["response_mask"]
        assert log.checked == int(mask.sum()) > int(mask[torch.from_numpy(index == 0)].sum())  # every segment
    assert any(bool(adv.abs().sum()) for _, adv in trainer.seen)  # a group with a success: a signal
