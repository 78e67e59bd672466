"""SkyRL's real classes over `fsm.adapters.skyrl` (in .venv-skyrl: bash .ci/skyrl_env.sh).

The generator input is made by SkyRL's `prepare_generator_input`, every model turn goes through SkyRL's own
`InferenceEngineClient` (over an InferenceEngineInterface on the tiny model, since vLLM does not run on CPU
here), the output is checked by SkyRL's `validate_generator_output`, turned into per-token rewards by its
trainer's `postprocess_generator_output` and into training tensors by `convert_prompts_responses_to_batch_
tensors`, and those are fed to its log-prob function and its PPO policy loss with truncated importance
sampling."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("skyrl_train", reason="runs in .venv-skyrl (bash .ci/skyrl_env.sh)")

from loguru import logger  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from skyrl_train.dataset.preprocess import convert_prompts_responses_to_batch_tensors  # noqa: E402
from skyrl_train.generators.base import GeneratorInterface  # noqa: E402
from skyrl_train.generators.utils import prepare_generator_input  # noqa: E402
from skyrl_train.inference_engines.base import InferenceEngineInterface  # noqa: E402
from skyrl_train.inference_engines.inference_engine_client import InferenceEngineClient  # noqa: E402
from skyrl_train.inference_engines.utils import get_sampling_params_for_backend  # noqa: E402
from skyrl_train.trainer import RayPPOTrainer  # noqa: E402
from skyrl_train.utils.ppo_utils import ppo_policy_loss  # noqa: E402
from skyrl_train.utils.torch_utils import logprobs_from_logits  # noqa: E402
from skyrl_train.utils.trainer_utils import validate_generator_output  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from backends.base import GenerateRequest  # noqa: E402
from backends.hf import HFBackend  # noqa: E402
from fsm.adapters.skyrl import FSMGenerator  # noqa: E402
from specs.calculator import compute_score, make_prompts  # noqa: E402
from tests.conftest import ASSETS  # noqa: E402

logger.remove()  # SkyRL logs every request at DEBUG
logger.add(lambda message: print(message, end=""), level="WARNING")
N = 2  # n_samples_per_prompt
TEMPERATURE = 0.8


class TinyEngine(InferenceEngineInterface):
    """An InferenceEngineInterface over the tiny model (vLLM's sampling names in, SkyRL's output out); only
    generation is served, which is all a generator uses."""

    def __init__(self, backend: HFBackend):
        self.backend = backend
        self.requests: list[dict] = []

    async def generate(self, input_batch):
        outs = {"responses": [], "response_ids": [], "stop_reasons": [], "response_logprobs": []}
        for k, prompt in enumerate(input_batch["prompt_token_ids"]):
            sp = input_batch["sampling_params"]
            self.requests.append(dict(sp))
            result = await self.backend.generate(
                GenerateRequest(
                    session_id=f"s{len(self.requests)}-{k}",
                    prompt_ids=list(prompt),
                    sampling_params={
                        "max_new_tokens": sp["max_tokens"],
                        "temperature": sp["temperature"],
                        "top_p": sp["top_p"],
                        "top_k": sp["top_k"],
                        "stop_token_ids": sp["stop_token_ids"],
                        "sampling_seed": sp.get("seed"),
                    },
                )
            )
            outs["responses"].append("")
            outs["response_ids"].append(result.token_ids)
            outs["stop_reasons"].append(result.finish_reason)
            outs["response_logprobs"].append(result.logprobs)
        return outs

    def _unused(self, *args, **kwargs):
        raise NotImplementedError("the test engine serves generate() only")

    chat_completion = completion = wake_up = sleep = init_weight_update_communicator = _unused
    update_named_weights = teardown = reset_prefix_cache = abort_generation = _unused

    def tp_size(self) -> int:
        return 1

    def pp_size(self) -> int:
        return 1

    def dp_size(self) -> int:
        return 1


async def test_generator_through_skyrl_client_trainer_tensors_and_loss():
    tok = AutoTokenizer.from_pretrained(ASSETS)
    cfg = OmegaConf.create(
        {
            "trainer": {
                "policy": {"model": {"path": str(ASSETS)}},
                "algorithm": {"zero_variance_filter": False},
            },
            "generator": {
                "backend": "vllm",
                "enable_http_endpoint": False,
                "http_endpoint_host": "127.0.0.1",
                "http_endpoint_port": 0,
                "step_wise_trajectories": False,
                "n_samples_per_prompt": N,
            },
        }
    )
    sampling = vllm_sampling()
    rows = make_prompts(2, seed=11)
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
    gen_input, uids = prepare_generator_input(prompts, N, sampling, "gsm8k", "train", global_step=3)
    async with HFBackend(ASSETS) as backend:
        engine = TinyEngine(backend)
        client = InferenceEngineClient([engine], tok, cfg)
        generator = FSMGenerator("calculator", tok, client)
        assert isinstance(generator, GeneratorInterface)
        out = await generator.generate(gen_input)
    await generator.engine.aclose()

    validate_generator_output(len(gen_input["prompts"]), out)  # SkyRL's own check of the output
    assert (
        out["trajectory_ids"] == gen_input["trajectory_ids"]
        and out["rollout_metrics"]["rollout/samples"] == 2 * N
    )
    assert all(
        r["temperature"] == TEMPERATURE
        and r["max_tokens"] <= 64
        and tok.eos_token_id in r["stop_token_ids"]
        and r["logprobs"] == 0
        for r in engine.requests
    )  # SkyRL's names and temperature; the spec's budget
    rewards = list(out["rewards"])
    for i, (response, truth) in enumerate(
        zip(out["response_ids"], [r["reward_model"]["ground_truth"] for r in rows for _ in range(N)])
    ):
        assert rewards[i] == compute_score(tok.decode(response), truth)
        assert sum(out["loss_masks"][i]) < len(
            response
        )  # the tool's result is in the response, out of the loss

    trainer = SimpleNamespace(cfg=cfg, all_metrics={})
    out = RayPPOTrainer.postprocess_generator_output(
        trainer, out, uids
    )  # per-token rewards, as the trainer does
    sequences, attention, action, token_rewards, loss_mask, rollout = (
        convert_prompts_responses_to_batch_tensors(
            tok,
            out["prompt_token_ids"],
            out["response_ids"],
            out["rewards"],
            out["loss_masks"],
            out["rollout_logprobs"],
        )
    )
    R = action.shape[1]
    for i, response in enumerate(out["response_ids"]):
        r = len(response)
        assert sequences[i, -R:][:r].tolist() == response and action[i].sum() == r
        assert loss_mask[i, :r].tolist() == out["loss_masks"][i] and loss_mask[i, r:].sum() == 0
        assert token_rewards[i, r - 1] == rewards[i] and token_rewards[i].sum() == rewards[i]
        assert rollout[i, :r].tolist() == pytest.approx(out["rollout_logprobs"][i], abs=0)
    # the policy's log-probs as SkyRL's model wrapper computes them, against the rollout's, on the loss tokens
    model = AutoModelForCausalLM.from_pretrained(ASSETS, dtype=torch.float32).eval()
    position = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = (
            model(sequences, attention_mask=attention, position_ids=position).logits.float() / TEMPERATURE
        )
    policy = logprobs_from_logits(logits[:, :-1], sequences[:, 1:])[:, -R:]
    on = loss_mask.bool()
    diff = (policy[on] - rollout[on]).abs().max().item()
    print(f"max |policy logp - rollout logp| on loss tokens {diff:.1e}")
    assert diff < 1e-4, diff
    # SkyRL's PPO loss with truncated importance sampling: the rollout/train ratio is 1, so TIS changes nothing
    loss_cfg = OmegaConf.create(
        {
            "policy_loss_type": "regular",
            "loss_reduction": "token_mean",
            "eps_clip_low": 0.2,
            "eps_clip_high": 0.2,
            "use_tis": True,
            "tis_imp_ratio_cap": 2.0,
            "max_seq_len": 1024,
        }
    )
    advantages = torch.randn_like(policy)
    with_tis, clip = ppo_policy_loss(policy, policy, advantages, loss_cfg, loss_mask.float(), rollout)
    loss_cfg.use_tis = False
    without, _ = ppo_policy_loss(policy, policy, advantages, loss_cfg, loss_mask.float(), rollout)
    assert (
        clip == 0 and torch.isfinite(with_tis) and with_tis.item() == pytest.approx(without.item(), rel=1e-3)
    )


class ScriptedEngine(TinyEngine):
    """TinyEngine over tests/fixtures/compacting.py's prompt-scripted model (a trajectory of three segments);
    of the trajectories of one prompt, the first to answer is right (#### 5), the others wrong (#### 4)."""

    def __init__(self, tok):
        from backends.scripted import ScriptedBackend
        from tests.fixtures.compacting import ANSWER, compact_turn

        answered: dict[str, int] = {}

        def turn(session, k, prompt):
            ids = compact_turn(tok, prompt)
            if tok.decode(ids[:-1]) != ANSWER:
                return ids
            key = tok.decode(list(prompt)).split("<|im_start|>user", 1)[1][:60]  # the task: one per prompt
            answered[key] = answered.get(key, 0) + 1
            return (
                ids
                if answered[key] == 1
                else tok.encode("#### 4", add_special_tokens=False) + [tok.eos_token_id]
            )

        super().__init__(ScriptedBackend(turn, logprob=-0.25))


def _skyrl_cfg(step_wise: bool):
    return OmegaConf.create(
        {
            "trainer": {
                "policy": {"model": {"path": str(ASSETS)}},
                "algorithm": {
                    "zero_variance_filter": False,
                    "advantage_estimator": "grpo",
                    "gamma": 1.0,
                    "lambd": 1.0,
                    "grpo_norm_by_std": True,
                    "use_tis": False,
                },
            },
            "generator": {
                "backend": "vllm",
                "enable_http_endpoint": False,
                "http_endpoint_host": "127.0.0.1",
                "http_endpoint_port": 0,
                "step_wise_trajectories": step_wise,
                "n_samples_per_prompt": N,
            },
        }
    )


def test_a_segmenting_spec_needs_step_wise_training():
    from tests.fixtures.compacting import SPEC

    tok = AutoTokenizer.from_pretrained(ASSETS)
    with pytest.raises(
        ValueError,
        match=r"FSMGenerator: spec 'calculator_compact' rewrites its context.*"
        r"step_wise_trajectories",
    ):
        FSMGenerator(SPEC, tok, None)


async def test_step_wise_segments_get_their_trajectorys_advantage():
    """specs/calculator_compact.yaml under SkyRL's step-wise training: one row per segment, each with its
    trajectory's id and `is_last_step` on the last; SkyRL's own trainer code turns them into training tensors
    and gives every segment its trajectory's GRPO advantage (computed on the last steps, grouped by instance)."""
    from skyrl_train.training_batch import TrainingInputBatch

    from tests.fixtures.compacting import SPEC, compact_row

    tok = AutoTokenizer.from_pretrained(ASSETS)
    cfg = _skyrl_cfg(True)
    sampling = vllm_sampling()
    rows = [compact_row(), compact_row("What is 2 + 3 exactly?")]
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
    gen_input, uids = prepare_generator_input(prompts, N, sampling, "gsm8k", "train", global_step=1)
    generator = FSMGenerator(
        SPEC, tok, InferenceEngineClient([ScriptedEngine(tok)], tok, cfg), step_wise=True
    )
    out = await generator.generate(gen_input)
    await generator.engine.aclose()

    n = len(gen_input["prompts"])
    assert len(out["response_ids"]) == 3 * n and out["is_last_step"] == [False, False, True] * n
    assert [t.to_string() for t in out["trajectory_ids"]] == [
        t.to_string() for t in gen_input["trajectory_ids"] for _ in range(3)
    ]
    one_rank = SimpleNamespace(
        actor_infos=[SimpleNamespace(rank=SimpleNamespace(dp_size=1))]
    )  # one data-parallel rank
    trainer = SimpleNamespace(
        cfg=cfg, all_metrics={}, tokenizer=tok, policy_model=one_rank, critic_model=None, ref_model=None
    )
    trainer.pad_batch = lambda batch: RayPPOTrainer.pad_batch(trainer, batch)
    step_uids = [
        t.instance_id for t in out["trajectory_ids"]
    ]  # what SkyRL's train loop does in step-wise mode
    out = RayPPOTrainer.postprocess_generator_output(trainer, out, step_uids)
    data = RayPPOTrainer.convert_to_training_input(trainer, out, step_uids)
    assert isinstance(data, TrainingInputBatch) and len(data["sequences"]) == 3 * n
    data["values"] = None
    data = RayPPOTrainer.compute_advantages_and_returns(trainer, data)
    adv = data["advantages"]
    on = data["response_mask"].bool()
    # SkyRL 0.3 gives each row a copy of its trajectory's last-step advantage row (trainer.py
    # `last_step_advantages[traj_ids]`): an earlier segment's tokens past the last segment's response length
    # get 0. On the others, every segment carries its trajectory's advantage.
    lengths = [len(r) for r in out["response_ids"]]
    rows_adv = []
    for i in range(3 * n):
        vals = adv[i][on[i]]
        last = 3 * (i // 3) + 2
        assert int((vals != 0).sum()) == min(lengths[i], lengths[last]), (i, vals)
        assert len(vals[vals != 0].unique()) == 1
        rows_adv.append(vals[0].item())
    for t in range(n):  # a trajectory's three segments share its advantage
        assert rows_adv[3 * t] == rows_adv[3 * t + 1] == rows_adv[3 * t + 2]
    # each prompt's first trajectory is right, its other wrong: GRPO's advantage is + on the one, - on the other
    rewards = [out["rewards"][3 * t + 2][-1] for t in range(n)]
    assert sorted(rewards) == [0.0, 0.0, 1.0, 1.0]
    assert all(
        (rows_adv[3 * t] > 0.5) == (rewards[t] == 1.0) and abs(rows_adv[3 * t]) > 0.5 for t in range(n)
    )


def vllm_sampling() -> Any:
    """SkyRL's sampling parameters for its vLLM backend, as its generator config gives them."""
    return get_sampling_params_for_backend(
        "vllm",
        OmegaConf.create(
            {
                "max_generate_length": 160,
                "temperature": TEMPERATURE,
                "top_p": 1.0,
                "top_k": -1,
                "min_p": 0.0,
                "logprobs": 0,
            }
        ),
    )
