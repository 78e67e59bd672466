"""OpenRLHF 0.11.2's real classes over `fsm.adapters.openrlhf` (in .venv-openrlhf: bash .ci/openrlhf_env.sh).

The agent file is loaded by OpenRLHF's own `--train.agent_func_path` loader, driven as its rollout actor drives
it (OpenRLHF's SamplingParams, a vLLM-contract engine over the tiny model answering with vLLM's own
RequestOutput), its answers turned into Experiences by OpenRLHF's own code, and those fed to its actor's
log-prob function and its PolicyLoss with the train/rollout mismatch correction on."""

from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("openrlhf", reason="runs in .venv-openrlhf (bash .ci/openrlhf_env.sh)")
pytest.importorskip("vllm", reason="runs in .venv-openrlhf (bash .ci/openrlhf_env.sh)")

import openrlhf  # noqa: E402
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402
from openrlhf.trainer.ray.vllm_engine import _load_agent_executor  # noqa: E402
from openrlhf.utils.agent import AgentExecutorBase  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.logprobs import Logprob  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402

from backends.base import GenerateRequest  # noqa: E402
from backends.hf import HFBackend  # noqa: E402
from specs.calculator import TOOL_SCHEMA, compute_score, make_prompts  # noqa: E402
from tests.conftest import ASSETS  # noqa: E402

# openrlhf/models/__init__ imports the actor, which needs flash-attn (CUDA only): the loss and the actor's
# log-prob function are loaded from their own modules, under the package path without its __init__.
_models = types.ModuleType("openrlhf.models")
_models.__path__ = [str(Path(openrlhf.__path__[0]) / "models")]
sys.modules.setdefault("openrlhf.models", _models)
from openrlhf.models.loss import PolicyLoss  # noqa: E402
from openrlhf.models.utils import log_probs_from_logits  # noqa: E402

AGENT_FILE = Path(__file__).with_name("agent.py")
TEMPERATURE = 0.8
MAX_LEN = 512


class TinyVLLM:
    """OpenRLHF's RolloutRayActor.generate contract (token ids and a vllm.SamplingParams in, vLLM's
    RequestOutput out) over the tiny model, since vLLM's engine does not run on CPU here."""

    def __init__(self, backend: HFBackend):
        self.backend = backend
        self.requests: list[SamplingParams] = []

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        self.requests.append(sampling_params)
        result = await self.backend.generate(
            GenerateRequest(
                session_id=f"s{len(self.requests)}",
                prompt_ids=list(prompt_token_ids),
                sampling_params={
                    "max_new_tokens": sampling_params.max_tokens,
                    "temperature": sampling_params.temperature,
                    "top_p": sampling_params.top_p,
                    "top_k": sampling_params.top_k,
                    "stop_token_ids": list(sampling_params.stop_token_ids or []),
                    "sampling_seed": sampling_params.seed,
                },
            )
        )
        logprobs = [{t: Logprob(lp, rank=1)} for t, lp in zip(result.token_ids, result.logprobs)]
        completion = CompletionOutput(
            0, "", result.token_ids, sum(result.logprobs), logprobs, finish_reason=result.finish_reason
        )
        return RequestOutput("r", None, list(prompt_token_ids), None, [completion], True)


async def test_agent_executor_through_openrlhf_loader_experience_and_loss():
    executor = _load_agent_executor(str(AGENT_FILE))  # OpenRLHF's loader for --train.agent_func_path
    assert isinstance(executor, AgentExecutorBase)
    tok = AutoTokenizer.from_pretrained(ASSETS)
    # what OpenRLHF's SamplesGenerator._dispatch_prompts_to_vllm builds, with the IS correction on (logprobs=1)
    sampling = SamplingParams(
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=-1,
        max_tokens=None,
        min_tokens=1,
        skip_special_tokens=False,
        logprobs=1,
    )
    rows = make_prompts(2, seed=7)
    prompts = [json.dumps(r["raw_prompt"]) for r in rows]  # the dataset's input_key: chat messages as JSON
    labels = [r["reward_model"]["ground_truth"] for r in rows]
    async with HFBackend(ASSETS) as backend:
        llm = TinyVLLM(backend)
        responses = await asyncio.gather(
            *(  # as RolloutRayActor.generate_responses: n samples per prompt, at once
                executor.execute(
                    prompt=p,
                    label=y,
                    sampling_params=sampling,
                    max_length=MAX_LEN,
                    hf_tokenizer=tok,
                    llm_engine=llm,
                )
                for p, y in zip(prompts, labels)
                for _ in range(2)
            )
        )
    await executor.engine.aclose()
    assert all(
        r.temperature == TEMPERATURE and r.max_tokens <= 64 and tok.eos_token_id in r.stop_token_ids
        for r in llm.requests
    )  # OpenRLHF's temperature; the spec's turn budget and stop ids

    experiences = [
        SamplesGenerator._process_response_into_experience(None, r, max_len=MAX_LEN) for r in responses
    ]
    model = AutoModelForCausalLM.from_pretrained(ASSETS, dtype=torch.float32).eval()
    tool_rounds = 0
    for k, (response, exp) in enumerate(zip(responses, experiences)):
        messages, label = json.loads(prompts[k // 2]), labels[k // 2]
        seq = exp.sequences[0].tolist()
        prompt_ids = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, tools=[TOOL_SCHEMA]
        )
        assert seq == response["observation_tokens"] and seq[: len(prompt_ids)] == prompt_ids
        action = exp.action_mask[0]  # [N-1]: action_mask[j] is token j+1
        assert action.shape[0] == len(seq) - 1 and action[: len(prompt_ids) - 1].sum() == 0
        turns = response["action_ranges"]
        response_text = tok.decode(seq[len(prompt_ids) :])
        # a calculator call, then the answer; at this temperature the model now and then answers at once
        assert len(turns) == 1 + response_text.count("<tool_response>") and len(turns) in (1, 2)
        for start, end in turns:
            assert action[start - 1 : end - 1].all() and seq[end - 1] == tok.eos_token_id
        assert int(action.sum()) == sum(end - start for start, end in turns)
        if len(turns) == 2:
            tool_rounds += 1
            between = tok.decode(seq[turns[0][1] : turns[1][0]])
            assert "<tool_response>" in between  # the tool's result: in the sequence, out of the action mask
        assert exp.rewards.item() == exp.scores.item() == compute_score(response_text, label)
        # the actor's log-probs, computed as OpenRLHF's Actor.forward does, against the rollout's
        rollout = exp.rollout_log_probs
        assert rollout.shape == exp.action_mask.shape and (rollout[0][action == 0] == 0).all()
        with torch.no_grad():
            logits = model(exp.sequences).logits.float() / TEMPERATURE
        actor = log_probs_from_logits(logits, torch.roll(exp.sequences, -1, 1))[:, :-1] * exp.action_mask
        diff = (actor - rollout)[exp.action_mask.bool()].abs().max().item()
        print(f"sample {k}: max |actor logp - rollout logp| on action tokens {diff:.1e}")
        assert diff < 1e-4, diff
        # OpenRLHF's PolicyLoss with token-level train/rollout correction: nothing filtered, no mismatch
        loss_fn = PolicyLoss(is_correction_level="token", is_correction_mode="mask")
        loss, clip_ratio, _, vllm_kl, filtered = loss_fn(
            actor, actor, torch.ones_like(actor), exp.action_mask, rollout
        )
        assert (
            torch.isfinite(loss)
            and clip_ratio.item() == 0
            and filtered.item() == 0
            and abs(vllm_kl.item()) < 1e-4
        )
    assert tool_rounds, "no sample called the calculator: the observation's mask was never checked"


def test_a_segmenting_spec_is_refused_when_the_executor_is_made():
    """OpenRLHF's execute() answers one sample with one sequence: a spec whose trajectories give several rows is
    refused in one line when the AgentExecutor class is made, before OpenRLHF runs anything."""
    from fsm.adapters.openrlhf import OpenRLHFRollout, agent_executor
    from tests.fixtures.compacting import SPEC

    message = r"spec 'calculator_compact' rewrites its context.*exactly one sequence"
    with pytest.raises(ValueError, match="agent_executor: " + message):
        agent_executor(SPEC)
    with pytest.raises(ValueError, match="OpenRLHFRollout: " + message):
        OpenRLHFRollout(SPEC)
    assert agent_executor("calculator").__name__ == "AgentExecutor"


def test_a_tree_spec_is_refused_when_openrlhf_loads_the_agent_file(tmp_path):
    """A fork or a child machine gives several rows per sample (docs/trees.md): OpenRLHF's own loader of
    --train.agent_func_path fails on the agent file with one line naming the adapter, the spec and where
    trees train."""
    agent = tmp_path / "agent.py"
    agent.write_text(
        'from fsm.adapters.openrlhf import agent_executor\n\nAgentExecutor = agent_executor("specs/fork_calculator.yaml")\n'
    )
    with pytest.raises(ValueError) as err:
        _load_agent_executor(str(agent))
    assert str(err.value) == (
        "agent_executor: spec 'fork_calculator' makes trees (a fork at GENERATING), so a sample gives several "
        "rows, each tagged with its policy (docs/trees.md); OpenRLHF's AgentExecutor.execute answers one sample "
        "with exactly one sequence: train trees with SkyRL (FSMGenerator(step_wise=True)) or AReaL "
        "(FSMWorkflow), or use a spec without forks and child machines here"
    )
    from fsm.adapters.openrlhf import OpenRLHFRollout

    with pytest.raises(
        ValueError, match=r"^OpenRLHFRollout: spec 'planner_solver' makes trees \(child machines"
    ):
        OpenRLHFRollout("specs/planner_solver.yaml")
