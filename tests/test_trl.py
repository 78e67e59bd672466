"""TRL's real GRPOTrainer, for a few real steps on CPU, over the embedded tiny model through `TRLRollout`: every
field TRL's loss reads is checked against the engine's samples, and TRL's own recomputed logprobs against the
rollout's."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import extra  # noqa: E402

trl = extra("trl", "trl")
datasets = extra("datasets", "trl")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from fsm.adapters.trl import TRLRollout, engine_reward  # noqa: E402
from specs.calculator import make_prompts  # noqa: E402
from tests.conftest import ASSETS  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
G = 4  # num_generations


def spread(completions: list, **kwargs) -> list[float]:
    """A second TRL reward function beside the spec's, giving each group a spread: the tiny model answers
    these right nearly always, and a group of equal rewards has no advantage, so the step no gradient."""
    return [-(i % G) / 10 for i in range(len(completions))]


@pytest.mark.slow
def test_grpo_trainer_trains_on_the_engines_samples(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(ASSETS)
    model = AutoModelForCausalLM.from_pretrained(ASSETS, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # a TRL dataset: `prompt` holds the chat messages; the other columns are what the spec's reward reads
    rows = [{"prompt": r["raw_prompt"], "reward_model": r["reward_model"]} for r in make_prompts(4, seed=5)]
    dataset = datasets.Dataset.from_list(rows)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        max_steps=2,
        per_device_train_batch_size=2 * G,
        num_generations=G,
        learning_rate=1e-4,
        temperature=0.9,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_completion_length=160,
    )
    rollout = TRLRollout("calculator", dataset=dataset)
    trainer = trl.GRPOTrainer(
        model=model,
        processing_class=tok,
        args=args,
        train_dataset=dataset,
        reward_funcs=[engine_reward, spread],
        rollout_func=rollout,
    )
    seen: list[dict] = []
    original = trainer._generate_and_score_completions

    def capture(inputs):
        out = original(inputs)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        with torch.no_grad():  # what compute_loss computes as per_token_logps, on the weights that sampled
            logps, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, out["completion_ids"].size(1), batch_size=2 * G
            )[:2]
        seen.append(
            {
                "out": out,
                "logps": logps,
                "batch": rollout.last,
                "step": trainer.state.global_step,
                "prompts": [x["prompt"] for x in inputs],
            }
        )
        return out

    monkeypatch.setattr(trainer, "_generate_and_score_completions", capture)
    try:
        trainer.train()
    finally:
        rollout.close()

    assert [s["step"] for s in seen] == [0, 1] and rollout.calls == 2
    for step in seen:
        out, batch = step["out"], step["batch"]
        samples = batch.samples
        assert len(samples) == 2 * G
        # TRL hands over each prompt G times; the adapter makes each run of equal prompts one group
        assert [s.row["raw_prompt"] for s in samples] == step["prompts"]
        assert len({s.uid for s in samples}) == 2 and all(
            samples[i].uid == samples[i - i % G].uid for i in range(2 * G)
        )
        assert all(s.row["reward_model"]["ground_truth"] for s in samples)  # found in the dataset by prompt
        assert batch.meta_info["sampling"]["temperature"] == 0.9  # the trainer's: what TRL divides logits by
        loss_mask = out["completion_mask"] * out["tool_mask"]
        P = out["prompt_ids"].size(1)
        for i, s in enumerate(samples):
            p, r = len(s.prompt_ids), len(s.response_ids)
            assert not s.failed and r > 0
            assert out["prompt_ids"][i, P - p :].tolist() == s.prompt_ids and out["prompt_mask"][i].sum() == p
            assert (
                out["completion_ids"][i, :r].tolist() == s.response_ids
                and out["completion_mask"][i].sum() == r
            )
            assert (
                loss_mask[i, :r].tolist() == s.mask and loss_mask[i, r:].sum() == 0
            )  # observations not trained
            assert out["sampling_per_token_logps"][i, :r].tolist() == pytest.approx(s.logprobs, abs=0)
            assert set(s.versions) - {-1} == {step["step"]}  # sampled by the weights of this very step
        # TRL's recomputed logprobs (its loss's per_token_logps) match the rollout's on every trained token
        on = loss_mask.bool()
        diff = (step["logps"][on] - out["sampling_per_token_logps"][on]).abs().max().item()
        print(f"step {step['step']}: max |TRL logp - rollout logp| on trained tokens {diff:.1e}")
        # fp32 noise between the rollout's cached decode and TRL's full forward: 1e-6 to 8e-6 alone, 1.8e-4 once
        # late in a full suite (tests/sglang/test_real_sglang.py: a stale output head moves them by ~2.5)
        assert diff < 1e-3, diff
        # advantages: TRL's group normalisation of the spec's reward (plus spread's)
        rewards = torch.tensor([s.reward - (i % G) / 10 for i, s in enumerate(samples)]).view(-1, G)
        expected = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
        assert out["advantages"].tolist() == pytest.approx(expected.flatten().tolist(), abs=1e-5)
    logged = [h for h in trainer.state.log_history if "rollout/samples" in h]
    assert len(logged) == 2 and all(h["rollout/samples"] == 2 * G for h in logged)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # the optimizer stepped


def test_a_step_whose_rows_all_fail_stops_the_run_loudly(tmp_path, monkeypatch):
    """A dataset without the ground truth the spec's reward reads: every row is an error row; TRL once trained
    on them, step after step, and exited 0."""
    from fsm.adapters.trl import AllRowsFailed

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tok = AutoTokenizer.from_pretrained(ASSETS)
    model = AutoModelForCausalLM.from_pretrained(ASSETS, dtype=torch.float32)
    dataset = datasets.Dataset.from_list([{"prompt": r["raw_prompt"]} for r in make_prompts(2, seed=5)])
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        max_steps=2,
        per_device_train_batch_size=G,
        num_generations=G,
        learning_rate=1e-4,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_completion_length=160,
    )
    rollout = TRLRollout("calculator", dataset=dataset)
    trainer = trl.GRPOTrainer(
        model=model,
        processing_class=tok,
        args=args,
        train_dataset=dataset,
        reward_funcs=[engine_reward],
        rollout_func=rollout,
    )
    try:
        with pytest.raises(
            AllRowsFailed,
            match=r"TRL step 0: all 4 rows of the rollout ended in error, so there "
            r"is nothing to train on; the most common \(4\): error: reward: "
            r".*has no reward_model.ground_truth",
        ):
            trainer.train()
    finally:
        rollout.close()
    assert rollout.calls == 1


def test_a_segmenting_spec_is_refused_when_the_adapter_is_made():
    """TRL's GRPOTrainer scores one completion per prompt: a spec whose trajectories give several rows is
    refused in one line, whether given as a spec or through an engine."""
    from fsm.api import RolloutEngine
    from tests.fixtures.compacting import SPEC, compact_backend

    message = r"TRLRollout: spec 'calculator_compact' rewrites its context.*one completion per prompt"
    with pytest.raises(ValueError, match=message):
        TRLRollout(SPEC)
    with pytest.raises(
        ValueError, match=r"spec 'qwen3_thinking' rewrites its context \(context.policy 'template'"
    ):
        TRLRollout("qwen3_thinking")
    tok = AutoTokenizer.from_pretrained(ASSETS)
    with (
        RolloutEngine(SPEC, tok, backend=compact_backend(tok)) as engine,
        pytest.raises(ValueError, match=message),
    ):
        TRLRollout(SPEC, engine=engine)
    TRLRollout("calculator").close()  # append, no rewrites: accepted


@pytest.mark.parametrize("on_error", ["mask", "zero_reward", "drop"])
def test_a_failed_row_follows_the_specs_on_error(tok, compile_yaml, on_error):
    """A real failing tool (tests/fixtures/flaky.py: raises on every call, retried once) fails row 0; what
    TRLRollout hands TRL follows `failures.on_error`: mask is one masked token with reward 0.0, zero_reward the
    model's turn kept (trained on, env_mask 1) with reward 0.0, drop one masked token with reward None (TRL leaves
    it out of the group's baseline). Row 1 answers and keeps its reward."""
    from collections import defaultdict
    from types import SimpleNamespace

    from fsm.api import RolloutEngine
    from tests.conftest import model_turn, scripted, tool_turn, user_row
    from tests.fixtures import flaky
    from tests.test_state_failures import RETRY_ONCE, script, spec

    flaky.reset(fail_first=10)
    agent = compile_yaml(spec(RETRY_ONCE, top=f"failures: {{on_error: {on_error}}}"))
    rows = [user_row("What is 1 + 2?"), user_row("What is 2 + 2?")]
    backend = scripted({0: script(tok), 1: [model_turn(tok, "done")]})
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=0),
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(temperature=1.0, top_p=1.0, top_k=None, min_p=None, repetition_penalty=None),
        _metrics={"train": defaultdict(list)},
    )
    try:
        with RolloutEngine(agent, tok, backend=backend) as engine:
            rollout = TRLRollout(agent, engine=engine, dataset=[{"prompt": r["raw_prompt"]} for r in rows])
            out = rollout([r["raw_prompt"] for r in rows], trainer)
    finally:
        flaky.RELEASE.set()
    assert flaky.CALLS == {"flaky": 2}
    bad, good = rollout.last.samples
    assert bad.failed and bad.on_error == on_error and not good.failed and good.on_error is None
    assert out["termination_reason"][0].startswith("error: tool.exception in PROCESSING_TOOLS")
    turn = tool_turn(tok, ("flaky", {"text": "hi"}))
    if on_error == "zero_reward":
        assert out["completion_ids"][0] == turn and out["env_mask"][0] == [1] * len(turn)
    else:
        assert out["completion_ids"][0] == [tok.pad_token_id] and out["env_mask"][0] == [0]
    assert out["agentfsm_reward"] == [None if on_error == "drop" else 0.0, 1.0]
    assert engine_reward(out["completion_ids"], out["agentfsm_reward"]) == out["agentfsm_reward"]


def test_a_tree_spec_is_refused_in_one_line():
    """TRL takes one completion per prompt: a fork or a child machine (several rows per sample, of several
    policies) is refused when the adapter is made, naming the spec and where trees can train."""
    with pytest.raises(ValueError) as fork:
        TRLRollout("specs/fork_calculator.yaml")
    assert str(fork.value) == (
        "TRLRollout: spec 'fork_calculator' makes trees (a fork at GENERATING), so a sample gives several rows, "
        "each tagged with its policy (docs/trees.md); TRL's GRPOTrainer takes exactly one completion per prompt "
        "from rollout_func: train trees with SkyRL (FSMGenerator(step_wise=True)) or AReaL (FSMWorkflow), or "
        "use a spec without forks and child machines here"
    )
    with pytest.raises(
        ValueError,
        match=r"^TRLRollout: spec 'planner_solver' makes trees \(child machines calculator; policies planner, "
        r"solver\)",
    ):
        TRLRollout("specs/planner_solver.yaml")
