"""Tree runs (docs/trees.md) through SkyRL's real classes (in .venv-skyrl: bash .ci/skyrl_env.sh): the shipped
fork and planner/solver specs on the tiny model, every turn through SkyRL's InferenceEngineClient, the output
made into training tensors and advantages by SkyRL's own trainer code in step-wise mode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("skyrl_train", reason="runs in .venv-skyrl (bash .ci/skyrl_env.sh)")

from skyrl_train.generators.utils import prepare_generator_input  # noqa: E402
from skyrl_train.inference_engines.inference_engine_client import InferenceEngineClient  # noqa: E402
from skyrl_train.trainer import RayPPOTrainer  # noqa: E402
from skyrl_train.training_batch import TrainingInputBatch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from backends.hf import HFBackend  # noqa: E402
from fsm.adapters.skyrl import FSMGenerator  # noqa: E402
from specs.calculator import make_prompts  # noqa: E402
from tests.conftest import ASSETS  # noqa: E402
from tests.skyrl.test_skyrl import N, TinyEngine, _skyrl_cfg, vllm_sampling  # noqa: E402

pytestmark = pytest.mark.slow


def _input(rows: list[dict]):
    sampling = vllm_sampling()
    prompts = [
        {
            "prompt": r["raw_prompt"],
            "env_class": None,
            "uid": f"row{i}",
            "env_extras": {
                "reward_spec": {"method": "rule", "ground_truth": r["reward_model"]["ground_truth"]}
            },
        }
        for i, r in enumerate(rows)
    ]
    return prepare_generator_input(prompts, N, sampling, "gsm8k", "train", global_step=1)


async def _generate(spec: str, rows: list[dict], **kwargs):
    tok = AutoTokenizer.from_pretrained(ASSETS)
    cfg = _skyrl_cfg(True)
    gen_input, _ = _input(rows)
    async with HFBackend(ASSETS) as backend:
        client = InferenceEngineClient([TinyEngine(backend)], tok, cfg)
        generator = FSMGenerator(spec, tok, client, step_wise=True, **kwargs)
        out = await generator.generate(gen_input)
    await generator.engine.aclose()
    return tok, cfg, gen_input, out


def _advantages(tok, cfg, out):
    """SkyRL's own step-wise path: per-token rewards, training tensors, advantages (GRPO on the last steps)."""
    one_rank = SimpleNamespace(actor_infos=[SimpleNamespace(rank=SimpleNamespace(dp_size=1))])
    trainer = SimpleNamespace(
        cfg=cfg, all_metrics={}, tokenizer=tok, policy_model=one_rank, critic_model=None, ref_model=None
    )
    trainer.pad_batch = lambda batch: RayPPOTrainer.pad_batch(trainer, batch)
    uids = [t.instance_id for t in out["trajectory_ids"]]
    rewards = list(out["rewards"])
    out = RayPPOTrainer.postprocess_generator_output(trainer, out, uids)
    data = RayPPOTrainer.convert_to_training_input(trainer, out, uids)
    assert isinstance(data, TrainingInputBatch)
    data["values"] = None
    data = RayPPOTrainer.compute_advantages_and_returns(trainer, data)
    on = data["response_mask"].bool() & data["loss_mask"].bool()
    return rewards, [data["advantages"][i][on[i]] for i in range(len(rewards))]


def test_a_tree_spec_needs_step_wise_training():
    tok = AutoTokenizer.from_pretrained(ASSETS)
    with pytest.raises(
        ValueError,
        match=r"^FSMGenerator: spec 'fork_calculator' makes trees \(a fork at GENERATING\).*step_wise",
    ):
        FSMGenerator("specs/fork_calculator.yaml", tok, None)


async def test_fork_branches_are_trajectories_grouped_with_their_siblings():
    """specs/fork_calculator.yaml: 4 branches per sample, each its own SkyRL trajectory (a fresh repetition of
    its prompt's instance), sharing the prompt exactly; SkyRL's GRPO normalises each branch's reward over its
    prompt's branches."""
    rows = make_prompts(2, seed=5)
    tok, cfg, gen_input, out = await _generate("specs/fork_calculator.yaml", rows)
    B = 4 * len(gen_input["prompts"])
    assert len(out["response_ids"]) == B and out["is_last_step"] == [True] * B
    ids = [t.to_string() for t in out["trajectory_ids"]]
    assert len(set(ids)) == B  # every branch its own trajectory
    assert [t.instance_id for t in out["trajectory_ids"]] == [
        t.instance_id for t in gen_input["trajectory_ids"] for _ in range(4)
    ]
    tree = out["tree_rows"]
    assert [r["node"] for r in tree] == ["0.0", "0.1", "0.2", "0.3"] * len(gen_input["prompts"])
    assert all(r["node_kind"] == "branch" and r["weight"] == 0.25 and r["parent"] == "0" for r in tree)
    for i in range(0, B, 4):  # one tree: the prompt and the prefix are shared exactly
        assert len({r["tree"] for r in tree[i : i + 4]}) == 1
        for k in range(i, i + 4):
            n = tree[k]["shared_prefix"]["length"]
            assert (
                n == len(out["prompt_token_ids"][k])
                and out["prompt_token_ids"][k] == out["prompt_token_ids"][i]
            )
    rewards, adv = _advantages(tok, cfg, out)
    for group in range(len(rows)):  # SkyRL groups by instance: the N samples' branches of one prompt
        idx = [i for i in range(B) if out["trajectory_ids"][i].instance_id == f"row{group}"]
        r = torch.tensor([rewards[i] for i in idx])
        expected = (r - r.mean()) / (r.std() + 1e-6)
        for i, e in zip(idx, expected.tolist()):
            assert adv[i].numel() > 0 and torch.allclose(adv[i], torch.full_like(adv[i], e), atol=1e-4)


async def test_child_rows_are_steps_of_the_trajectory_that_started_them():
    """specs/planner_solver.yaml: a solver child's rows come before its planner's row in the planner's
    trajectory (one TrajectoryID, is_last_step on the planner's row), so they get the planner's advantage;
    `policy=` keeps one policy's rows."""
    rows = make_prompts(2, seed=7)
    tok, cfg, gen_input, out = await _generate("specs/planner_solver.yaml", rows)
    tree = out["tree_rows"]
    assert {r["policy"] for r in tree} == {"planner", "solver"}
    children = [i for i, r in enumerate(tree) if r["node_kind"] == "child"]
    assert children, "the tiny model delegated nothing"
    last = out["is_last_step"]
    assert [r["node_kind"] == "root" for r in tree] == last  # each planner row closes its trajectory
    for i in children:  # the child's trajectory is its root's: the next root row below it, same tree
        j = next(k for k in range(i, len(tree)) if last[k])
        assert tree[j]["tree"] == tree[i]["tree"] and tree[j]["node"] == tree[i]["parent"]
        assert out["trajectory_ids"][i] == out["trajectory_ids"][j]
    assert [t for t, end in zip(out["trajectory_ids"], last) if end] == list(gen_input["trajectory_ids"])
    for r in tree:  # per_root: a tree's rows share its weight
        assert r["weight"] == pytest.approx(1 / sum(x["tree"] == r["tree"] for x in tree))
    rewards, adv = _advantages(tok, cfg, out)
    for i in children:
        j = next(k for k in range(i, len(tree)) if last[k])
        assert adv[i].numel() > 0 and torch.allclose(adv[i], adv[j][0].expand_as(adv[i]))

    _, _, _, solver = await _generate("specs/planner_solver.yaml", rows, policy="solver")
    assert {r["policy"] for r in solver["tree_rows"]} == {"solver"}
    assert all(solver["is_last_step"])  # without their planner's rows, each child is a trajectory of its own
