"""GRPO on trees (examples/grpo_tree.py) and the engine's per-policy weights and pause it relies on."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backends.tiny import ASSET_DIR, MID_DIR, load_model
from examples.grpo import Config, main, token_logprobs
from examples.grpo_tree import SOLVER, root_credit, sibling_advantages
from fsm.api import RolloutEngine, make_backend
from specs.calculator import make_prompts


def rows(rm: list[list[float]], **fields: list) -> SimpleNamespace:
    """A hand-made batch: rm_scores per row and the non-tensor fields given."""
    return SimpleNamespace(
        batch={"rm_scores": torch.tensor(rm)},
        non_tensor_batch={k: np.array(v, dtype=object) for k, v in fields.items()},
    )


def test_sibling_advantages_are_relative_to_the_branches_of_one_fork():
    # tree t1 forks at node 0 into 4 branches; branch 0.0 has two segments (its reward on the last); tree t2's
    # fork has equal rewards (no signal)
    batch = rows(
        [[0.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]],
        trajectory_id=["t1:0.0", "t1:0.0", "t1:0.1", "t1:0.2", "t1:0.3", "t2:0.0", "t2:0.1"],
        tree=["t1"] * 5 + ["t2"] * 2,
        parent=["0"] * 7,
    )
    reward, adv = sibling_advantages(batch)
    assert reward.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]  # per branch, in trajectory_id order
    top, rest = (
        0.75 / np.sqrt(0.1875),
        -0.25 / np.sqrt(0.1875),
    )  # rewards [1, 0, 0, 0]: mean 1/4, std sqrt(3)/4
    expected = [top, top, rest, rest, rest, 0.0, 0.0]  # both rows of branch 0.0 get its advantage
    assert torch.allclose(adv, torch.tensor(expected, dtype=adv.dtype), atol=1e-5)


def test_siblings_are_grouped_by_tree_and_parent_not_by_prompt():
    # two trees of one prompt: each fork is its own group, so a fork that all failed gives 0 although the other won
    batch = rows(
        [[1.0], [1.0], [0.0], [0.0]],
        trajectory_id=["a:0.0", "a:0.1", "b:0.0", "b:0.1"],
        tree=["a", "a", "b", "b"],
        parent=["0"] * 4,
    )
    assert sibling_advantages(batch)[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def solver_rows(rm: list[list[float]], prompts: list[list[int]], **fields: list) -> SimpleNamespace:
    """Hand-made solver rows: `rows` with left-padded prompt tokens (0 is the pad)."""
    batch = rows(rm, **fields)
    width = max(len(p) for p in prompts)
    padded = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    batch.batch.update(prompts=padded, attention_mask=(padded != 0).long())
    return batch


def test_the_solver_is_credited_with_its_trees_root_reward():
    planner = rows([[1.0], [0.0], [0.0]], tree=["a", "b", "c"], uid=["q", "q", "q"])
    # tree c delegated nothing; the three solver rows were handed the same task
    solver = solver_rows([[0.0]] * 3, [[5, 6]] * 3, tree=["a", "a", "b"], uid=["q", "q", "q"])
    reward, adv = root_credit(solver, planner)
    assert reward.tolist() == [1.0, 1.0, 0.0]
    mean, std = 2 / 3, np.sqrt(2 / 9)
    expected = [(1 - mean) / std, (1 - mean) / std, -mean / std]
    assert torch.allclose(adv, torch.tensor(expected, dtype=adv.dtype), atol=1e-5)


def test_solver_rows_are_compared_with_those_handed_the_same_task():
    # one question, four trees: the planners of a and b handed over the question's expression (task [5, 6]), those
    # of c and d a miscopied one ([5, 7], whose trees cannot be right); only a's tree came out right
    planner = rows([[1.0], [0.0], [0.0], [0.0]], tree=["a", "b", "c", "d"], uid=["q"] * 4)
    solver = solver_rows(
        [[0.0]] * 4, [[5, 6], [5, 6], [5, 7], [3, 5, 7]], tree=["a", "b", "c", "d"], uid=["q"] * 4
    )
    reward, adv = root_credit(solver, planner)
    assert reward.tolist() == [1.0, 0.0, 0.0, 0.0]
    # a against b only; c and d (different tasks) are not pushed down for a planner's miscopy
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=adv.dtype), atol=1e-5)


@pytest.fixture(scope="module")
def two_policies():
    engine = RolloutEngine(
        "planner_solver",
        model=load_model(MID_DIR),
        tokenizer=ASSET_DIR,
        max_batch_size=64,
        policies={SOLVER: make_backend(model=load_model(MID_DIR), max_batch_size=64)},
    )
    yield engine
    engine.close()


@pytest.mark.slow
def test_a_push_to_the_solver_changes_the_solver_alone(two_policies):
    engine = two_policies
    new = load_model(ASSET_DIR)  # other weights than the engine's (mid)
    version = engine.update_weights_from_tensor(named_tensors=new.state_dict(), policy=SOLVER)
    assert (version, engine.policy_version(SOLVER), engine.weight_version) == (1, 1, 0)
    out = engine.generate_sequences(make_prompts(6, seed=3), {"seed": 5}, n=1)
    planner, solver = out["planner"], out[SOLVER]
    assert len(solver) > 0, "no planner delegated: nothing to check"
    for batch, want, model, temperature in ((solver, 1, new, 0.7), (planner, 0, load_model(MID_DIR), 1.0)):
        b = batch.batch
        mask = b["response_mask"].bool()
        assert set(b["weight_versions"][mask].tolist()) == {want}
        with torch.no_grad():
            logp = token_logprobs(model.eval(), batch, temperature)
        width = logp.shape[1]
        diff = (logp - b["rollout_log_probs"][:, :width])[mask[:, :width]].abs().max()
        assert float(diff) < 5e-4, f"{batch.non_tensor_batch['policy'][0]}: {float(diff)}"


@pytest.mark.slow
def test_pause_and_refusals_per_policy(two_policies):
    engine = two_policies
    controls = engine._local.controls
    solver_gate = engine.runner.policies[SOLVER].gate
    engine.pause("in_place", policy=SOLVER)
    assert solver_gate.paused and not engine.paused  # the solver alone
    engine.resume(policy=SOLVER)
    assert not solver_gate.paused
    engine.pause("in_place")  # every policy
    assert solver_gate.paused and engine.paused
    engine.resume()
    assert not solver_gate.paused and not engine.paused
    with pytest.raises(ValueError, match=r"policy='critic': not a policy of spec planner_solver"):
        engine.update_weights_from_tensor(named_tensors={}, policy="critic")
    with pytest.raises(ValueError, match="policy='critic'"):
        engine.pause(policy="critic")
    assert controls.version("planner") == engine.weight_version


@pytest.mark.slow
def test_a_policy_on_the_engines_backend_has_no_weights_of_its_own():
    engine = RolloutEngine("planner_solver", model=load_model(MID_DIR), tokenizer=ASSET_DIR)
    try:
        with pytest.raises(ValueError, match=r"policy='solver' generates on the engine's own backend"):
            engine.update_weights_from_tensor(named_tensors={}, policy=SOLVER)
        assert engine.policy_version(SOLVER) == engine.weight_version == 0
    finally:
        engine.close()


SMALL = ["--steps", "2", "--prompts", "2", "--eval-prompts", "4", "--eval-samples", "1", "--eval-every", "0"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [["--spec", "fork_calculator", "--advantages", "siblings", "--group", "1"], ["--spec", "planner_solver"]],
)
def test_two_real_steps_of_each_tree_spec(argv):
    logs = main(argv + SMALL + ["--group", "2"] if "planner_solver" in argv else argv + SMALL)
    assert [s.version for s in logs] == [0, 1]
    assert all(s.checked > 0 and s.max_diff <= Config().logprob_tol for s in logs)


def test_tree_trainers_refuse_what_they_do_not_train(capsys):
    with pytest.raises(SystemExit):
        main(["--spec", "fork_calculator", "--advantages", "row"])
    assert "--spec fork_calculator trains with --advantages siblings" in capsys.readouterr().err
