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

import pytest
import torch

from examples.grpo import GRPO, Config, LogprobMismatch, check_logprobs


def run(trainer_class: type[GRPO] = GRPO, **options) -> tuple[GRPO, list]:
    trainer = trainer_class(Config(**{"eval_prompts": 32, "eval_samples": 2, "eval_every": 0, **options}),
                            log=[].append)  # fmt: skip
    try:
        return trainer, trainer.run()
    finally:
        trainer.close()


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


def test_continuous_grpo_checks_stale_tokens_against_their_own_weights():
    trainer, logs = run(Settled, mode="continuous", steps=3, prompts=4, group=4, eval_prompts=8, eval_samples=1)
    assert [s.stale_tokens for s in logs] == [0.0, 1.0, 1.0]  # steps 2 and 3: tokens of the previous weights
    assert all(s.checked > 0 and s.max_diff <= trainer.cfg.logprob_tol for s in logs)
    assert trainer.engine.stream_stats["staleness"] == {0: 4, 1: 8}


def test_the_check_fails_loudly():
    where = torch.tensor([[True, False]])
    assert check_logprobs(torch.tensor([[-1.0, -5.0]]), torch.tensor([[-1.00001, 0.0]]), where, 1e-4, "x")[0] == 1
    with pytest.raises(LogprobMismatch, match=r"x: .* by 0\.01 \(tolerance 0\.0001\) over 1 tokens"):
        check_logprobs(torch.tensor([[-1.0, -5.0]]), torch.tensor([[-1.01, -5.0]]), where, 1e-4, "x")


class Recorded(GRPO):
    """Keeps each step's sampled tokens."""

    def train_on(self, batch, version):
        self.responses = [*getattr(self, "responses", []), batch.batch["responses"].clone()]
        return super().train_on(batch, version)


def test_the_evaluation_schedule_does_not_change_training():
    """Evaluating after every step or only at the end: the same tokens sampled and the same weights, bit for bit
    (the update once used the engine's log-probabilities, whose last bits vary with how requests were batched,
    and Adam made full-size steps of that noise: the trained weights, and soon the samples, differed)."""
    runs = [run(Recorded, mode="sync", steps=3, prompts=4, group=4, eval_prompts=8, eval_samples=1,
                eval_every=every, seed=3)[0] for every in (1, 0)]  # fmt: skip
    (a, _), (b, _) = [(t.responses, t) for t in runs]
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b) == 3
    wa, wb = runs[0].policy.state_dict(), runs[1].policy.state_dict()
    different = [name for name in wa if not torch.equal(wa[name], wb[name])]
    assert not different, different
