"""GRPO on the embedded tiny calculator model, in plain PyTorch over RolloutEngine.

    python -m examples.grpo --mode sync         # roll out a step's groups, then train on them
    python -m examples.grpo --mode continuous   # step s+1's groups roll out while the trainer trains on step s's
    python -m examples.grpo --spec specs/calculator_results.yaml --init backends/tiny/assets --advantages session
    python -m examples.grpo --spec fork_calculator --advantages siblings --group 1   # trees: examples/grpo_tree.py
    python -m examples.grpo --spec planner_solver                                 # two policies, two optimizers

The trainer holds its own copy of the policy (the `mid` checkpoint, ~17% sampled accuracy) and the engine
decodes with another, in this process; after every optimizer step the trainer's weights go to the engine with
`update_weights_from_tensor` (no disk round-trip), which bumps the weight version recorded on every token.

One step: `prompts` prompts x `group` samples at the spec's sampling (T=1) -> binary reward (the answer after
`####`) -> group-normalised advantages -> the trainer recomputes the log-probabilities of the generated
(mask-1) tokens -> clipped ratio against the behaviour policy's log-probabilities (the trainer's own for the
current weights' tokens, `rollout_log_probs` for older weights') -> one AdamW step -> weight sync. Before training
on a batch, every step checks that the recomputed log-probabilities match `rollout_log_probs` on the tokens
the current weights made (the check fails the run past `--logprob-tol`); in the continuous form the tokens
that older weights made are checked too, against those weights, kept for `max_staleness` versions.

Held-out accuracy: the share of sampled answers (T=1) with reward 1 on `make_prompts(64, seed=1000)`, the
fresh prompts of backends/tiny/evaluate.py, on a second engine that gets the same weights and its own seeds
(`--eval-seed`); the training engine is paused meanwhile, so the step times (which leave evaluation out) compare
the two forms fairly. Evaluation shares nothing with training but the weights it reads: a synchronous run trains
the same whatever `--eval-every` is (tests/test_grpo_example.py).

A spec that rewrites its context (docs/contexts.md) gives each trajectory several rows, one per segment, tied by
`trajectory_id`. `--advantages session` (session-level GRPO) normalises each trajectory's reward within its
group of trajectories, so a trajectory counts once whatever its number of segments, and gives every one of its
rows that advantage; `row` (the default) treats each row as a sample of its group, which for a spec without
rewrites is the same thing. Rewards and accuracies are per trajectory either way.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backends.tiny import ASSET_DIR, MID_DIR, load_model
from fsm.api import RolloutEngine
from specs.calculator import make_prompts


@dataclass
class Config:
    mode: str = "sync"  # "sync" or "continuous"
    spec: str = "calculator"  # a shipped spec's name or a spec file
    advantages: str = "row"  # "row" (a row is a sample of its group) or "session" (see the docstring)
    steps: int = 60
    prompts: int = 8  # GRPO groups per step
    group: int = 8  # samples per prompt
    lr: float = 1e-2  # AdamW step as a share of each tensor's RMS (see GRPO.__init__), constant
    clip: float = 0.2  # PPO ratio clip
    max_staleness: int = 1  # continuous form: groups whose oldest token is older are re-run
    eval_prompts: int = 64  # held-out prompts (make_prompts(n, seed=1000))
    eval_samples: int = 2  # samples per held-out prompt
    eval_every: int = 1  # steps between evaluations (0: before and after only)
    eval_seed: int = (
        0  # the held-out samples' seeds (the evaluation engine's own; training's come from `seed`)
    )
    seed: int = 0  # the run's sampling seeds derive from it
    init: Path = MID_DIR  # the starting weights
    threads: int = 1  # torch intra-op threads (process-wide)
    logprob_tol: float = 5e-4  # the largest |recomputed - rollout| log-probability allowed
    check_rows: int = 8  # continuous form: rows checked against older weights per step


class LogprobMismatch(AssertionError):
    """The trainer's recomputed log-probabilities differ from the engine's beyond the tolerance."""


@dataclass
class StepLog:
    step: int
    version: int  # the weights that trained on this step's batch
    reward: float  # mean reward of the step's samples
    accuracy: float | None  # held-out sampled accuracy after the step (None: not evaluated)
    loss: float
    clipped: float  # share of mask-1 tokens whose ratio was clipped
    stale_tokens: float  # share of mask-1 tokens made by older weights
    checked: int  # mask-1 tokens whose log-probabilities were checked
    max_diff: float  # the largest |recomputed - rollout| among them
    step_s: float  # wall time of the step (rollout or take, train, sync), evaluation left out
    rows: int = 0  # rows trained on: one per segment of each trajectory


# --- GRPO pieces ---------------------------------------------------------------------------------------------


def last_segments(batch) -> np.ndarray:
    """Each trajectory's last row (its last segment), as a boolean mask over the rows."""
    nt = batch.non_tensor_batch
    return np.asarray(nt["segment_index"]) == np.asarray(nt["num_segments"]) - 1


def advantages(batch, session: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(reward per trajectory, group-normalised advantage per row); a group of equal rewards gives 0 (no
    signal). `session`: each trajectory's reward (its last segment's, where `reward_placement: last` puts it)
    is normalised within its group of trajectories and given to every row of the trajectory; otherwise each
    row's own reward within the rows of its group."""
    reward = batch.batch["rm_scores"].sum(-1)
    uids, last = batch.non_tensor_batch["uid"], last_segments(batch)
    adv = torch.zeros_like(reward)
    if not session:
        for uid in np.unique(uids):
            rows = torch.from_numpy(np.flatnonzero(uids == uid))
            r = reward[rows]
            adv[rows] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
        return reward[torch.from_numpy(last)], adv
    tids = batch.non_tensor_batch["trajectory_id"]
    for uid in np.unique(uids):
        ends = np.flatnonzero((uids == uid) & last)  # one row per trajectory of the group
        r = reward[torch.from_numpy(ends)]
        normed = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
        for end, a in zip(ends, normed):
            adv[torch.from_numpy(tids == tids[end])] = a
    return reward[torch.from_numpy(last)], adv


def token_logprobs(
    model: torch.nn.Module,
    batch,
    temperature: float,
    rows: torch.Tensor | None = None,
    params: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """log_softmax(logits / T) of every response token, [B, R'] (R' = the longest response); `params`
    evaluates other weights (functionally). Every row's prompt opens with the same system turn (~155 of its
    ~175 tokens): that prefix runs once and its KV cache serves every row, whose own tokens follow right-padded
    (causal attention keeps real tokens from seeing the pads after them), as backends/tiny/train.py does."""
    b = batch.batch
    ids, attn, responses = b["input_ids"], b["attention_mask"], b["responses"]
    if rows is not None:
        ids, attn, responses = ids[rows], attn[rows], responses[rows]
    P = b["prompts"].shape[1]
    prompt_len, response_len = attn[:, :P].sum(1), attn[:, P:].sum(1)
    seqs = [ids[i, P - int(p) : P + int(r)] for i, (p, r) in enumerate(zip(prompt_len, response_len))]
    shared = int(prompt_len.min()) - 1  # the logit before each row's first response token is its own
    for seq in seqs[1:]:
        same = (seq[:shared] == seqs[0][:shared]).long()
        shared = min(shared, int(same.cumprod(0).sum()))
    width = max(len(seq) - shared for seq in seqs)
    suffix = torch.full((len(seqs), width), int(ids[0, 0]), dtype=ids.dtype)  # any id: pads are never read
    for i, seq in enumerate(seqs):
        suffix[i, : len(seq) - shared] = seq[shared:]

    def forward(**inputs):
        if params is None:
            return model(**inputs)
        return torch.func.functional_call(model, params, args=(), kwargs=inputs)

    cache = forward(input_ids=seqs[0][None, :shared], use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(seqs))
    logits = forward(input_ids=suffix, past_key_values=cache).logits  # (B, S, V)
    longest = int(response_len.max())
    # response token j of row i sits at suffix column prompt_len[i] - shared + j; the logit before it predicts it
    cols = (prompt_len - shared - 1)[:, None] + torch.arange(longest)[None, :]
    picked = logits.gather(1, cols.clamp(max=width - 1)[:, :, None].expand(-1, -1, logits.shape[-1]))
    logp = torch.log_softmax(picked.float() / temperature, -1)
    return logp.gather(-1, responses[:, :longest, None]).squeeze(-1)


def clipped_loss(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, float]:
    """PPO's clipped surrogate over mask-1 tokens (token mean), and the share of tokens clipped."""
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    loss = -(surrogate * mask).sum() / mask.sum()
    clipped = (((ratio - 1).abs() > clip).float() * mask).sum() / mask.sum()
    return loss, float(clipped)


def check_logprobs(
    recomputed: torch.Tensor, rollout: torch.Tensor, where: torch.Tensor, tol: float, what: str
) -> tuple[int, float]:
    """(tokens checked, largest difference); LogprobMismatch past `tol`."""
    if not where.any():
        return 0, 0.0
    diff = float((recomputed.detach() - rollout)[where].abs().max())
    if not diff <= tol:
        raise LogprobMismatch(
            f"{what}: recomputed log-probabilities differ from rollout_log_probs by {diff:.3g} "
            f"(tolerance {tol:g}) over {int(where.sum())} tokens"
        )
    return int(where.sum()), diff


# --- the trainer -------------------------------------------------------------------------------------------


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW with each tensor's step scaled by its RMS. Adam moves every element by about its lr a step, whatever
    the tensor's scale: a norm gain near 1 and a matrix entry near 0.05 alike. Scaled by each tensor's RMS (as
    LARS and LAMB do), a step changes every tensor by about the same share, the final norm's gain (the logits'
    scale, which GRPO sharpens) too."""
    groups = [{"params": [p], "lr": lr * float(p.detach().pow(2).mean().sqrt())} for p in model.parameters()]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)


class GRPO:
    """The policy, its optimizer, the rollout engine and an evaluation engine; `run()` trains and logs."""

    def __init__(self, cfg: Config, log: Callable[[str], None] = print):
        torch.set_num_threads(cfg.threads)
        self.cfg, self.log = cfg, log
        self.policy = load_model(cfg.init).train()
        self.optimizer = make_optimizer(self.policy, cfg.lr)
        self.engine = self.make_engine(cfg.spec)
        self.evaluator = self.make_engine(self.eval_spec())
        self.temperature = self.engine.agent.spec.sampling.temperature  # what rollout_log_probs are over
        self.held_out = make_prompts(cfg.eval_prompts, seed=1000)
        self.past: dict[
            int, dict[str, torch.Tensor]
        ] = {}  # continuous: older versions' weights, for the check
        self.before = 0.0  # held-out accuracy before training (set by run)

    def make_engine(self, spec: str) -> RolloutEngine:
        return RolloutEngine(spec, model=load_model(self.cfg.init), tokenizer=ASSET_DIR, max_batch_size=64)

    def eval_spec(self) -> str:
        return self.cfg.spec

    def advantages(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        return advantages(batch, session=self.cfg.advantages == "session")

    def close(self) -> None:
        self.engine.close()
        self.evaluator.close()

    def prompts(self, step: int) -> list[dict]:
        return make_prompts(self.cfg.prompts, seed=10_000 + step)  # fresh questions every step

    def sampling(self, step: int) -> dict:
        return {"seed": self.cfg.seed * 1_000_003 + step * 100_003}

    def accuracy(self, version: int) -> float:
        self.evaluator.update_weights_from_tensor(
            weight_version=version, named_tensors=self.policy.state_dict()
        )
        batch = self.evaluator.generate_sequences(
            self.held_out, {"seed": self.cfg.eval_seed}, n=self.cfg.eval_samples
        )
        ends = torch.from_numpy(last_segments(batch))  # one row per trajectory
        return float((batch.batch["rm_scores"].sum(-1)[ends] == 1).float().mean())

    def train_on(
        self,
        batch,
        version: int,
        policy: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        temperature: float | None = None,
        rewards: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[float, float, float, float, int, float]:
        """One optimizer step on a batch: (mean reward, loss, clipped share, stale share, checked, max diff).
        `policy`, `optimizer`, `temperature`, `rewards` ((reward, advantage per row)): another policy's
        (examples/grpo_tree.py); default: this trainer's, and `self.advantages(batch)`."""
        model = self.policy if policy is None else policy
        optimizer = self.optimizer if optimizer is None else optimizer
        temperature = self.temperature if temperature is None else temperature
        b = batch.batch
        reward, adv = self.advantages(batch) if rewards is None else rewards
        logp = token_logprobs(model, batch, temperature)
        width = logp.shape[1]
        mask = b["response_mask"][:, :width].bool()
        rollout, versions = b["rollout_log_probs"][:, :width], b["weight_versions"][:, :width]
        checked, diff = check_logprobs(
            logp, rollout, mask & (versions == version), self.cfg.logprob_tol, f"step at version {version}"
        )
        stale = mask & (versions != version)
        for old in sorted(set(versions[stale].tolist())):  # the continuous form: older weights, kept
            rows = (stale & (versions == old)).any(1).nonzero().squeeze(1)[: self.cfg.check_rows]
            with torch.no_grad():
                past = token_logprobs(model, batch, temperature, rows, self.past[old])
            where = (versions[rows, : past.shape[1]] == old) & mask[rows, : past.shape[1]]
            n, d = check_logprobs(
                past, rollout[rows, : past.shape[1]], where, self.cfg.logprob_tol, f"tokens of version {old}"
            )
            checked, diff = checked + n, max(diff, d)
        # The ratio's denominator: for tokens the current weights made, the trainer's own recomputation (as verl's
        # recomputed old_log_prob), so the update depends on the tokens alone; the engine's values for the same
        # tokens vary with how its requests happened to be batched (up to the check's tolerance), and Adam turns
        # such noise in near-zero gradients into full-size steps, so a run would depend on the engine's timing
        # (an evaluation between steps changed every later step). Older weights' tokens keep rollout_log_probs.
        old = torch.where(versions == version, logp.detach(), rollout)
        loss, clipped = clipped_loss(logp, old, adv, mask.float(), self.cfg.clip)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        stale_share = float(stale.sum() / mask.sum())
        return float(reward.mean()), float(loss.detach()), clipped, stale_share, checked, diff

    def rows(self, batch) -> int:
        return int(batch.batch.batch_size[0])

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of the trainer's parameters (tied ones once), for functional calls."""
        return {name: p.detach().clone() for name, p in self.policy.named_parameters()}

    def sync(self) -> int:
        """The trainer's weights to the engine, as the next version; keep this version's for the check."""
        version = self.engine.update_weights_from_tensor(named_tensors=self.policy.state_dict())
        if self.cfg.mode == "continuous":
            self.past[version] = self.weights()
            for old in [v for v in self.past if v < version - self.cfg.max_staleness]:
                del self.past[old]
        return version

    def batches(self) -> Iterator[tuple[object, int]]:
        """(batch, version its trainer holds) per step: rolled out now (sync), or taken from the stream."""
        cfg = self.cfg
        if cfg.mode == "sync":
            for step in range(cfg.steps):
                batch = self.engine.generate_sequences(self.prompts(step), self.sampling(step), n=cfg.group)
                yield batch, self.engine.weight_version
            return
        self.past[0] = self.weights()
        self.engine.submit(self.prompts(0), cfg.group, self.sampling(0))
        for step in range(cfg.steps):
            batch = self.engine.take(cfg.prompts, max_staleness=cfg.max_staleness, stale="rerun")
            if step + 1 < cfg.steps:  # step s+1 rolls out while step s trains
                self.engine.submit(self.prompts(step + 1), cfg.group, self.sampling(step + 1))
            yield batch, self.engine.weight_version

    def evaluate(self, version: int) -> float:
        """Held-out accuracy of the trainer's weights, the training engine paused meanwhile."""
        if self.cfg.mode == "continuous":
            self.engine.pause("in_place")
        try:
            return self.accuracy(version)
        finally:
            if self.cfg.mode == "continuous":
                self.engine.resume()

    def run(self) -> list[StepLog]:
        cfg, logs = self.cfg, []
        start = time.monotonic()
        self.before = before = self.evaluate(0)
        session = cfg.advantages == "session"  # the table then also shows the rows (segments) trained on
        on = f" on {self.engine.agent.name}, session advantages" if session else ""
        self.log(
            f"GRPO ({cfg.mode}){on} from {cfg.init.name}: {cfg.prompts} prompts x {cfg.group} samples per step, "
            f"lr {cfg.lr:g}; held-out sampled accuracy before: {before:.1%}"
        )
        header = "step  version  reward  held-out  loss     clipped  stale  checked  max|dlogp|  step_s"
        self.log(header + ("  rows" if session else ""))
        eval_s, t0 = 0.0, time.monotonic()
        for step, (batch, version) in enumerate(self.batches()):
            result = self.train_on(batch, version)
            self.sync()
            step_s = time.monotonic() - t0
            last = step == cfg.steps - 1
            accuracy = None
            if last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                e0 = time.monotonic()
                accuracy = self.evaluate(version + 1)
                eval_s += time.monotonic() - e0
            reward, loss, clipped, stale, checked, diff = result
            rows = self.rows(batch)
            s = StepLog(
                step + 1, version, reward, accuracy, loss, clipped, stale, checked, diff, step_s, rows
            )
            logs.append(s)
            held = f"{accuracy:8.1%}" if accuracy is not None else "       -"
            self.log(
                f"{s.step:4d}  {s.version:7d}  {s.reward:6.3f}  {held}  {s.loss:+.4f}  {s.clipped:7.3f}  "
                f"{s.stale_tokens:5.2f}  {s.checked:7d}  {s.max_diff:10.2e}  {s.step_s:6.2f}"
                + (f"  {s.rows:4d}" if session else "")
            )
            t0 = time.monotonic()
        wall = time.monotonic() - start
        train_s = sum(s.step_s for s in logs)
        self.log(
            f"held-out sampled accuracy {before:.1%} -> {logs[-1].accuracy:.1%} in {cfg.steps} steps; "
            f"{train_s:.0f} s training ({train_s / cfg.steps:.2f} s/step), {eval_s:.0f} s evaluating, "
            f"{wall:.0f} s wall; largest |recomputed - rollout| log-prob "
            f"{max(s.max_diff for s in logs):.1e} over {sum(s.checked for s in logs)} tokens"
        )
        if cfg.mode == "continuous":
            stats = self.engine.stream_stats
            self.log(
                f"groups taken by staleness {stats['staleness']}, re-run for staleness {stats['stale_rerun']}"
            )
        return logs


CHOICES = {"mode": ["sync", "continuous"], "advantages": ["row", "session", "siblings"]}


def main(argv: list[str] | None = None) -> list[StepLog]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, default in vars(Config()).items():
        kind = type(default) if not isinstance(default, Path) else Path
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            default=default,
            **({"choices": CHOICES[name]} if name in CHOICES else {}),
        )
    cfg = Config(**vars(parser.parse_args(argv)))
    if not math.isfinite(cfg.lr) or cfg.steps < 1:
        parser.error("--lr must be finite and --steps >= 1")
    trainer = trainer_for(cfg, parser.error)
    try:
        return trainer.run()
    finally:
        trainer.close()


def trainer_for(cfg: Config, error: Callable[[str], object]) -> GRPO:
    """The trainer for `cfg`: a tree spec's (examples/grpo_tree.py) or the linear one."""
    from examples.grpo_tree import TREE_SPECS, tree_trainer

    if cfg.spec in TREE_SPECS or cfg.advantages == "siblings":
        return tree_trainer(cfg, error)
    return GRPO(cfg)


if __name__ == "__main__":
    main()
