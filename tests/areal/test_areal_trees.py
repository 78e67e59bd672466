"""Tree runs (docs/trees.md) through AReaL's real classes (in .venv-areal: bash .ci/areal_env.sh): the shipped
fork and planner/solver specs, every episode run by AReaL's own RemoteSGLangEngine (`rollout_batch`) against
agentfsm's dev server over the tiny model, batched by its concat_padded_tensors, and the fork's rows checked
against the log-probs AReaL's actor recomputes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("areal", reason="runs in .venv-areal (bash .ci/areal_env.sh)")

from areal.api.cli_args import GenerationHyperparameters  # noqa: E402
from areal.utils.data import concat_padded_tensors  # noqa: E402
from areal.utils.functional import gather_logprobs  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from fsm.adapters.areal import FSMWorkflow  # noqa: E402
from specs.calculator import compute_score, make_prompts  # noqa: E402
from tests.areal.test_areal import TEMPERATURE, VERSION, areal_engine, tiny_server  # noqa: E402, F401
from tests.conftest import ASSETS  # noqa: E402

pytestmark = pytest.mark.slow


def _episodes(server: str, spec: str, rows: list[dict], **kwargs) -> list[dict]:
    engine = areal_engine(server, "trees")
    tok = AutoTokenizer.from_pretrained(ASSETS)
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=64, temperature=TEMPERATURE)
    workflow = FSMWorkflow(spec, tok, gconfig=gconfig, **kwargs)
    data = [{"messages": r["raw_prompt"], "answer": r["reward_model"]["ground_truth"]} for r in rows]
    try:
        return engine.rollout_batch(data, workflow=workflow)
    finally:
        engine.destroy()
        workflow.close()


def test_a_fork_is_one_episode_of_its_branches(tiny_server):  # noqa: F811
    tok = AutoTokenizer.from_pretrained(ASSETS)
    rows = make_prompts(2, seed=17)
    episodes = _episodes(tiny_server, "specs/fork_calculator.yaml", rows)
    assert len(episodes) == len(rows)
    for ep in episodes:
        tree = ep["tree"]
        assert [r["node"] for r in tree] == ["0.0", "0.1", "0.2", "0.3"] and len(
            {r["tree"] for r in tree}
        ) == 1
        assert ep["input_ids"].shape[0] == 4 and ep["weight"].tolist() == [0.25] * 4
        prompt = tok.decode(ep["input_ids"][0])  # which row: its question is in the rendered prompt
        truth = next(
            r["reward_model"]["ground_truth"] for r in rows if r["raw_prompt"][-1]["content"] in prompt
        )
        for i, r in enumerate(tree):
            n = int(ep["attention_mask"][i].sum())
            P = r["shared_prefix"]["length"]  # the prompt: the fork is at the first model turn
            ids, mask = ep["input_ids"][i, :n], ep["loss_mask"][i, :n]
            assert ids[:P].tolist() == ep["input_ids"][0, :P].tolist() and mask[:P].sum() == 0
            assert (ep["versions"][i, :n][mask == 1] == VERSION).all() and mask.sum() > 0
            assert ep["rewards"][i].item() == compute_score(tok.decode(ids[P:]), truth)
    batch = concat_padded_tensors(episodes)  # AReaL's batching: tensors along B, the tree list concatenated
    B = 4 * len(rows)
    assert batch["input_ids"].shape[0] == B and batch["weight"].shape == (B,) and len(batch["tree"]) == B
    # AReaL's actor's view (shifted by one) against the rollout's log-probs, on every branch's tokens
    loss_mask = torch.roll(batch["loss_mask"].float(), shifts=-1, dims=-1)
    old = torch.roll(batch["logprobs"], shifts=-1, dims=-1) * loss_mask
    model = AutoModelForCausalLM.from_pretrained(ASSETS, dtype=torch.float32).eval()
    ids = batch["input_ids"].long()
    with torch.no_grad():
        logits = model(ids, attention_mask=batch["attention_mask"].long()).logits.float()
    actor = gather_logprobs(logits, torch.roll(ids, shifts=-1, dims=-1), temperature=TEMPERATURE) * loss_mask
    on = loss_mask.bool()
    assert (actor[on] - old[on]).abs().max().item() < 1e-4


def test_planner_and_solver_rows_and_one_policy(tiny_server):  # noqa: F811
    rows = make_prompts(2, seed=19)
    episodes = _episodes(tiny_server, "specs/planner_solver.yaml", rows)
    kinds = [r["node_kind"] for ep in episodes for r in ep["tree"]]
    assert "child" in kinds, "the tiny model delegated nothing"
    for ep in episodes:
        tree = ep["tree"]
        assert tree[0]["node"] == "0" and tree[0]["policy"] == "planner"
        assert all(r["policy"] == "solver" and r["parent"] == "0" for r in tree[1:])
        assert ep["weight"].tolist() == pytest.approx([1 / len(tree)] * len(tree))
        assert ep["rewards"].unique().numel() == 1  # a child's row is scored with its tree's reward
    planner = _episodes(tiny_server, "specs/planner_solver.yaml", rows, policy="planner")
    assert all([r["policy"] for r in ep["tree"]] == ["planner"] for ep in planner)
