"""The surface every trainer adapter stands on: a Backend from a plain generate function, the flat sample,
the sampling and metrics in meta_info, the input's meta_info carried through, and rewards that see tools."""

from __future__ import annotations

import gc
import json
import logging
import warnings

import aiohttp
import numpy as np
import pytest
import torch

from backends.base import GenerateResult
from backends.function import FunctionBackend
from backends.scripted import scripted_servers
from fsm import RolloutEngine
from fsm.adapters import to_samples
from specs.calculator import SYSTEM_PROMPT
from tests.conftest import ASSETS, PARTS, SPECS, scripted, tool_turn

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def question(text: str = "What is 2 + 3?", truth: str = "5") -> dict:
    return {
        "raw_prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}],
        "reward_model": {"ground_truth": truth},
    }


def calc_script(tok):
    """Row r: a calculator call, then the answer '#### 5' (right on even rows, wrong on odd ones)."""
    call = tool_turn(tok, ("calculator", {"expression": "2 + 3"}))
    return lambda row, sample, turn, prompt: (
        call
        if turn == 0
        else tok.encode(f"#### {5 + row % 2}", add_special_tokens=False) + [tok.eos_token_id]
    )


class DataProto:  # verl's class by shape (fsm.data.rows.is_dataproto), as its trainer hands it
    def __init__(self, batch=None, non_tensor_batch=None, meta_info=None):
        self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor_batch or {}, meta_info or {}


# --- FunctionBackend ------------------------------------------------------------------------------------------


def test_function_backend_over_http_matches_the_sglang_client_and_closes_its_session(tok, caplog):
    """A trainer's own HTTP client as a generate function: the engine opens its session on the engine's loop
    and closes it on close(); the batch equals the one the built-in SGLang client gets from the same server."""
    sessions: list[aiohttp.ClientSession] = []
    rows = [question(), question("What is 7 * 6?", "42")]
    with scripted_servers(1) as (url,):

        async def start() -> None:
            sessions.append(aiohttp.ClientSession())

        async def close() -> None:
            await sessions[-1].close()

        async def generate(prompt_ids: list[int], sampling_params: dict) -> dict:
            body = {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True}
            async with sessions[-1].post(f"{url}/generate", json=body) as resp:
                resp.raise_for_status()
                return await resp.json()  # SGLang's /generate body, checked as the SGLang client checks it

        caplog.set_level(logging.ERROR, logger="asyncio")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            backend = FunctionBackend(generate, model_name="my-engine", start=start, close=close)
            with RolloutEngine("calculator", tokenizer=ASSETS, backend=backend) as engine:
                mine = engine.generate_sequences(rows, n=2)
            assert sessions and sessions[0].closed and len(sessions) == 1
            del engine, backend
            gc.collect()
        assert not [w for w in caught if "Unclosed" in str(w.message)]
        assert "Unclosed" not in caplog.text
        with RolloutEngine("calculator", tokenizer=ASSETS, servers=[url]) as engine:
            theirs = engine.generate_sequences(rows, n=2)
    for key in (
        "prompts",
        "responses",
        "response_mask",
        "rollout_log_probs",
        "attention_mask",
        "weight_versions",
    ):
        assert torch.equal(mine.batch[key], theirs.batch[key]), key
    assert mine.meta_info["rollout_metrics"]["rollout/samples"] == 4


async def test_function_backend_answers_in_plain_form(tok):
    """The plain answer form: ids and logprobs; finish_reason inferred from the stop ids; a GenerateResult too."""
    seen: list[dict] = []
    script = calc_script(tok)

    async def generate(prompt_ids: list[int], sampling_params: dict) -> dict | GenerateResult:
        seen.append(sampling_params)
        ids = script(0, 0, len(seen) - 1, prompt_ids)
        if len(seen) == 1:
            return {"token_ids": ids, "logprobs": [-0.25] * len(ids)}
        return GenerateResult(ids, [-0.5] * len(ids), "stop")

    async with RolloutEngine("calculator", tokenizer=ASSETS, backend=FunctionBackend(generate)) as engine:
        batch = await engine.agenerate_samples([question()])
    (s,) = batch.samples
    assert s.termination_reason == "done" and s.reward == 1.0 and not s.failed
    assert {lp for lp, m in zip(s.logprobs, s.mask) if m} == {-0.25, -0.5}
    assert seen[0]["stop_token_ids"] and seen[0]["max_new_tokens"] == 64  # SGLang names, the engine's cap


async def test_function_backend_bad_answers_are_server_faults(tok):
    """Ids outside the vocabulary are malformed (retried, counted), never a turn; an exception names the
    backend in the row's error."""
    calls = {"bad": 0}

    async def out_of_vocab(prompt_ids: list[int], sampling_params: dict) -> dict:
        calls["bad"] += 1
        return {"token_ids": [10**6], "logprobs": [-0.1]}

    async def raising(prompt_ids: list[int], sampling_params: dict) -> dict:
        raise RuntimeError("engine fell over")

    async with RolloutEngine("calculator", tokenizer=ASSETS, backend=FunctionBackend(out_of_vocab)) as engine:
        out = await engine.agenerate_sequences([question()])
    assert calls["bad"] == 3  # the default policy: three attempts
    (reason,) = out.non_tensor_batch["termination_reason"]
    assert reason.startswith("error: backend:") and "outside the vocabulary" in reason
    metrics = out.meta_info["rollout_metrics"]
    assert metrics["rollout/faults/bad_ids"] == 3 and metrics["rollout/retries"] == 2
    assert metrics["rollout/failed"] == 1 and metrics["rollout/termination/error_backend"] == 1
    async with RolloutEngine(
        "calculator", tokenizer=ASSETS, backend=FunctionBackend(raising, model_name="eng")
    ) as engine:
        batch = await engine.agenerate_samples([question()])
    assert batch.samples[0].failed
    assert (
        "eng: generate function raised RuntimeError: engine fell over" in batch.samples[0].termination_reason
    )


# --- the flat sample and the batch's meta_info -------------------------------------------------------------


async def test_samples_match_the_padded_batch_field_by_field(tok):
    """Sample is the unpadded form of the batch: every field equals the batch's row, cut to its length."""
    rows = [question(), question("What is 1 + 4?")]
    async with RolloutEngine("calculator", tokenizer=ASSETS, backend=scripted(calc_script(tok))) as engine:
        trajs = await engine.arun(rows, n=2)
        batch = engine.to_batch(trajs, engine.sampling())
    samples = to_samples(trajs)
    b = batch.batch
    P = b["prompts"].shape[1]
    assert [s.uid for s in samples] == list(batch.non_tensor_batch["uid"])
    assert [(s.index, s.sample) for s in samples] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        assert b["prompts"][i, P - p :].tolist() == s.prompt_ids and b["attention_mask"][i, :P].sum() == p
        assert b["responses"][i, :r].tolist() == s.response_ids
        assert b["response_mask"][i, :r].tolist() == s.mask and b["response_mask"][i, r:].sum() == 0
        assert b["rollout_log_probs"][i, :r].tolist() == s.logprobs
        assert b["weight_versions"][i, :r].tolist() == s.versions
        assert b["rm_scores"][i].sum().item() == s.reward == (1.0 if s.index < 2 else 0.0)
        assert s.termination_reason == batch.non_tensor_batch["termination_reason"][i] == "done"
        assert s.num_turns == batch.non_tensor_batch["__num_turns__"][i] == 4
        assert s.ids == s.prompt_ids + s.response_ids
        # the calculator's reward (0.0 for a plain function) sits on the last token of the call's turn
        (tr,) = s.turn_rewards
        assert tr.source == "tool" and tr.value == 0.0
        assert s.mask[tr.position] == 1 and s.mask[tr.position + 1] == 0
        assert s.response_ids[tr.position] == tok.eos_token_id
        assert s.metrics["num_tool_calls"] == 1
        assert [m["role"] for m in s.messages][-3:] == ["assistant", "tool", "assistant"]


def test_meta_info_carries_the_input_and_says_how_logprobs_were_made(tok):
    rows = [question(), question("What is 1 + 4?")]
    columns = {
        "raw_prompt": np.array([r["raw_prompt"] for r in rows] + [None], dtype=object)[:2],
        "reward_model": np.array([r["reward_model"] for r in rows], dtype=object),
    }
    proto = DataProto(non_tensor_batch=columns, meta_info={"global_steps": 7, "validate": False})
    with RolloutEngine("calculator", tokenizer=ASSETS, backend=scripted(calc_script(tok))) as engine:
        out = engine.generate_sequences(proto, n=2, sampling_params={"temperature": 0.7, "top_k": 20})
        greedy = engine.generate_sequences(rows, sampling_params={"temperature": 0.0})
    assert type(out) is DataProto and out.meta_info["global_steps"] == 7
    vocab = json.loads((ASSETS / "config.json").read_text())[
        "vocab_size"
    ]  # the model's rows: what logits span
    assert vocab > len(tok)
    assert "metrics" not in out.meta_info  # per-sample list: popped, as verl's AgentLoopManager does
    assert out.meta_info["sampling"] == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 20,
        "vocab_size": vocab,
        "greedy": False,
        "logprob_temperature": 0.7,
        "logprobs_over": "full_vocabulary",
        "repetition_penalty": 1.0,
        "seed": None,
        "logprobs": True,
    }
    assert (
        greedy.meta_info["sampling"]["greedy"] and greedy.meta_info["sampling"]["logprob_temperature"] == 1.0
    )
    m = out.meta_info["rollout_metrics"]
    assert m["rollout/samples"] == 4 and m["rollout/termination/done"] == 4 and m["rollout/tool_calls"] == 4
    assert m["rollout/turns/mean"] == 4 and m["rollout/reward/mean"] == 0.5 and m["rollout/resumes"] == 0
    assert m["rollout/timing/batch_s"] > 0 and m["rollout/timing/generate_s/max"] >= 0
    assert all(isinstance(v, float) for v in m.values())  # wandb.log / add_scalar ready


async def test_reward_function_sees_tool_results_and_metrics(tok, compile_yaml):
    """A reward function that names `tool_results`, `metrics`, `trajectory` gets them; verl-style ones do not."""
    agent = compile_yaml(f"""
        name: sees_tools
        extends: {SPECS}/calculator.yaml
        reward:
          function: {PARTS}:reward_sees_tools
    """)
    async with RolloutEngine(agent, tokenizer=ASSETS, backend=scripted(calc_script(tok))) as engine:
        batch = await engine.agenerate_samples([question()])
    (s,) = batch.samples
    assert s.reward == 1.0  # one tool result
    assert s.reward_extra_info["tool_results"] == ["5"] and s.reward_extra_info["tool_calls"] == 1
    assert s.reward_extra_info["state_path"][-1] == "TERMINATED"
    assert agent.reward.extras == ("trajectory", "tool_results", "metrics")


async def test_function_backend_per_token_versions_and_the_request(tok):
    """`versions` gives each token's weight version (an engine that updated weights mid-request); a function
    that takes `request` gets the GenerateRequest (its session id: a key for sticky routing)."""
    script = calc_script(tok)
    sessions: list[str] = []

    async def generate(prompt_ids: list[int], sampling_params: dict, request) -> dict:
        sessions.append(request.session_id)
        ids = script(0, 0, len(sessions) - 1, prompt_ids)
        half = len(ids) // 2
        return {
            "token_ids": ids,
            "logprobs": [-0.5] * len(ids),
            "versions": [4] * half + [5] * (len(ids) - half),
        }

    async with RolloutEngine("calculator", tokenizer=ASSETS, backend=FunctionBackend(generate)) as engine:
        (s,) = (await engine.agenerate_samples([question()])).samples
    assert len(sessions) == 2 and sessions[0] == sessions[1]  # one trajectory, one session
    turns, start = [], None
    for i, m in enumerate([*s.mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            turns.append(s.versions[start:i])
            start = None
    assert len(turns) == 2 and all(v == [4] * (len(v) // 2) + [5] * (len(v) - len(v) // 2) for v in turns)
