"""GRPO on trees (docs/trees.md): sibling-relative advantages on a forking spec, and two policies trained together.

    python -m examples.grpo --spec fork_calculator --advantages siblings --group 1
    python -m examples.grpo --spec planner_solver

`fork_calculator` forks at its first model turn into 4 branches that share the prompt. A branch's reward is its
trajectory's (the answer after `####`, summed over its rows: one row here, the last segment's where a spec with
rewrites gives a branch several). Siblings are the branches of one fork (rows with the same `tree` and `parent`);
a branch's advantage is its reward normalised among its siblings, and every row (segment) of the branch gets it.
Every branch weighs 1/K (`weight`), the same for all, so the token mean of linear GRPO is kept. Held-out accuracy
is the policy's on the linear calculator spec (the fork only multiplies samples).

`planner_solver`: the planner (the root machine) hands each expression to a solver child machine
(specs/calculator.yaml). Each policy is its own model copy with its own optimizer and its own backend in the
engine (`RolloutEngine(policies={"solver": backend})`), trains on its own batch (the engine gives
{policy: batch}), and its new weights go to its own backend (`update_weights_from_tensor(policy="solver")`), whose
version its tokens then record. The planner's reward is the tree's (the root's final answer against the question);
the solver's is the same root reward: a solver row is credited with the outcome of the tree it served (its own
answer only reaches the question through the planner), normalised among the solver rows handed the same task
(`root_credit`).
Held-out accuracy is the root's reward on planner_solver.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from backends.tiny import ASSET_DIR, load_model
from examples.grpo import GRPO, Config, advantages, make_optimizer
from fsm.api import RolloutEngine, make_backend

TREE_SPECS = ("fork_calculator", "planner_solver")
SOLVER = "solver"


def sibling_advantages(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(reward per branch, advantage per row). A branch is a trajectory (`trajectory_id`; several rows when its
    context is rewritten): its reward is the sum of its rows' rewards. Its siblings share its fork (`tree`,
    `parent`); its reward normalised among them (a fork of equal rewards gives 0) goes to every one of its rows."""
    nt = batch.non_tensor_batch
    reward = batch.batch["rm_scores"].sum(-1)
    branches, first, inverse = np.unique(
        np.asarray(nt["trajectory_id"]), return_index=True, return_inverse=True
    )
    per_branch = torch.zeros(len(branches), dtype=reward.dtype)
    per_branch.index_add_(0, torch.from_numpy(inverse), reward)
    fork = np.array([f"{nt['tree'][i]}\0{nt['parent'][i]}" for i in first])
    adv = torch.zeros_like(per_branch)
    for key in np.unique(fork):
        idx = torch.from_numpy(np.flatnonzero(fork == key))
        r = per_branch[idx]
        adv[idx] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    return per_branch, adv[torch.from_numpy(inverse)]


def prompt_keys(batch) -> np.ndarray:
    """Each row's prompt: its group (`uid`) and its prompt tokens, as one string per row."""
    b, uids = batch.batch, batch.non_tensor_batch["uid"]
    P = b["prompts"].shape[1]
    attn = b["attention_mask"][:, :P].bool()
    return np.array([f"{u}\0{b['prompts'][i][attn[i]].tolist()}" for i, u in enumerate(uids)])


def root_credit(solver, planner) -> tuple[torch.Tensor, torch.Tensor]:
    """(reward per solver row, advantage per row): each solver row gets the reward of the planner row of its tree,
    normalised among the solver rows given the same prompt (the same task from the same question): a GRPO group
    is samples of one prompt. Normalised over the question's group instead, a solver that solved the wrong task
    it was handed (the planner miscopied the expression) would be scored against solvers that got the right one,
    and that noise, at full Adam step size, drove the solver off its format within a few steps at 8 samples x 4
    (docs/trainers.md)."""
    nt, pnt = solver.non_tensor_batch, planner.non_tensor_batch
    root_reward = planner.batch["rm_scores"].sum(-1)
    by_tree = {t: float(r) for t, r in zip(pnt["tree"], root_reward)}
    reward = torch.tensor([by_tree[t] for t in nt["tree"]], dtype=root_reward.dtype)
    keys, adv = prompt_keys(solver), torch.zeros_like(reward)
    for key in np.unique(keys):
        idx = torch.from_numpy(np.flatnonzero(keys == key))
        r = reward[idx]
        adv[idx] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    return reward, adv


def by_policy(batch) -> dict:
    """The engine's batches by policy: a step whose rows are all one policy's (no tree delegated) gives that
    policy's batch alone, not a dict."""
    if isinstance(batch, dict):
        return batch
    return {str(batch.non_tensor_batch["policy"][0]): batch}


class SiblingGRPO(GRPO):
    """GRPO on fork_calculator: advantages relative to sibling branches, evaluated on the linear spec."""

    def eval_spec(self) -> str:
        return "calculator"

    def advantages(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        return sibling_advantages(batch)


class TwoPolicyGRPO(GRPO):
    """GRPO on planner_solver: the planner is `policy` (the root's backend), the solver `solver` (its own)."""

    def __init__(self, cfg: Config, log: Callable[[str], None] = print):
        super().__init__(cfg, log)
        self.solver = load_model(cfg.init).train()
        self.solver_optimizer = make_optimizer(self.solver, cfg.lr)
        solver_spec = self.engine.agent.spec.policies[SOLVER].sampling
        self.solver_temperature = solver_spec.temperature if solver_spec is not None else self.temperature
        self.solver_version = 0

    def make_engine(self, spec: str) -> RolloutEngine:
        solver = make_backend(model=load_model(self.cfg.init), max_batch_size=64)
        return RolloutEngine(
            spec,
            model=load_model(self.cfg.init),
            tokenizer=ASSET_DIR,
            max_batch_size=64,
            policies={SOLVER: solver},
        )

    def rows(self, batch) -> int:
        return sum(int(b.batch.batch_size[0]) for b in by_policy(batch).values())

    def train_on(self, batch, version: int, *_: object, **__: object):  # type: ignore[override]
        """One step of each policy on its own batch; (root reward, summed loss, clipped, stale, checked, diff)."""
        batch = by_policy(batch)
        planner, solver = batch["planner"], batch.get(SOLVER)
        out = super().train_on(planner, version, rewards=advantages(planner))
        if solver is None or len(solver) == 0:  # no tree delegated this step: the solver has nothing to learn
            return out
        s = super().train_on(
            solver,
            self.solver_version,
            self.solver,
            self.solver_optimizer,
            self.solver_temperature,
            root_credit(solver, planner),
        )
        return out[0], out[1] + s[1], max(out[2], s[2]), max(out[3], s[3]), out[4] + s[4], max(out[5], s[5])

    def sync(self) -> int:
        version = super().sync()
        self.solver_version = self.engine.update_weights_from_tensor(
            named_tensors=self.solver.state_dict(), policy=SOLVER
        )
        return version

    def accuracy(self, version: int) -> float:
        self.evaluator.update_weights_from_tensor(
            weight_version=version, named_tensors=self.policy.state_dict()
        )
        self.evaluator.update_weights_from_tensor(
            weight_version=self.solver_version, named_tensors=self.solver.state_dict(), policy=SOLVER
        )
        out = self.evaluator.generate_sequences(
            self.held_out, {"seed": self.cfg.eval_seed}, n=self.cfg.eval_samples
        )
        return float((by_policy(out)["planner"].batch["rm_scores"].sum(-1) == 1).float().mean())


def tree_trainer(cfg: Config, error: Callable[[str], object]) -> GRPO:
    """The trainer for a tree spec; `error` (one line) for a combination it does not train."""
    if cfg.mode != "sync":
        error(f"--spec {cfg.spec}: trees train in --mode sync only")
    if cfg.spec == "fork_calculator":
        if cfg.advantages != "siblings":
            error("--spec fork_calculator trains with --advantages siblings")
        return SiblingGRPO(cfg)
    if cfg.spec == "planner_solver":
        if cfg.advantages != "row":
            error("--spec planner_solver: each policy's advantages are its own (leave --advantages row)")
        return TwoPolicyGRPO(cfg)
    error(f"--advantages siblings needs a forking spec ({', '.join(TREE_SPECS[:1])}), not {cfg.spec}")
    raise SystemExit(2)
