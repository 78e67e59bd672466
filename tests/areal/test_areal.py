"""AReaL 1.0.4's real classes over `fsm.adapters.areal` (in .venv-areal: bash .ci/areal_env.sh).

AReaL's own `RemoteSGLangEngine` runs the episodes (`rollout_batch` with the workflow, its WorkflowExecutor and
its HTTP client) against an SGLang-protocol server: agentfsm's dev server over the tiny model, in a
subprocess. The episodes are batched by AReaL's `concat_padded_tensors`, and checked against what its PPO
actor reads: tokens, loss mask, per-token versions, rewards, and its own recomputed log-probs (`gather_logprobs`,
shifted as its actor shifts them) against the rollout's, through `ppo_actor_loss_fn` with token-level
rejection sampling (nothing rejected)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

pytest.importorskip("areal", reason="runs in .venv-areal (bash .ci/areal_env.sh)")

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, RejectionSamplingConfig  # noqa: E402
from areal.api.workflow_api import RolloutWorkflow  # noqa: E402
from areal.engine.sglang_remote import RemoteSGLangEngine  # noqa: E402
from areal.utils.data import concat_padded_tensors  # noqa: E402
from areal.utils.functional import gather_logprobs, ppo_actor_loss_fn  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from fsm.adapters.areal import FSMWorkflow  # noqa: E402
from specs.calculator import TOOL_SCHEMA, compute_score, make_prompts  # noqa: E402
from tests.conftest import ASSETS  # noqa: E402

TEMPERATURE = 1.5  # high enough that the logprobs are far from 0, so comparing them means something
VERSION = 3


@pytest.fixture(scope="module")
def tiny_server():
    """agentfsm's SGLang-protocol dev server over the tiny model, as AReaL's engine expects a server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends.devserver", "--model", str(ASSETS), "--port", str(port)]
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the dev server did not start"
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def areal_engine(server: str, trial: str) -> RemoteSGLangEngine:
    """AReaL's own remote engine over `server`, at VERSION."""
    engine = RemoteSGLangEngine(
        InferenceEngineConfig(
            experiment_name="agentfsm",
            trial_name=trial,
            backend="sglang:d1",
            max_concurrent_rollouts=4,
            consumer_batch_size=4,
            setup_timeout=60,
        )
    )
    engine.initialize(addr=[server])
    engine.set_version(VERSION)
    return engine


def test_workflow_through_areal_engine_batch_and_actor_loss(tiny_server):
    tok = AutoTokenizer.from_pretrained(ASSETS)
    engine = areal_engine(tiny_server, "test")
    workflow = FSMWorkflow(
        "calculator",
        tok,
        gconfig=GenerationHyperparameters(n_samples=1, max_new_tokens=64, temperature=TEMPERATURE),
    )
    assert isinstance(workflow, RolloutWorkflow)
    rows = make_prompts(2, seed=13)
    data = [
        {"messages": r["raw_prompt"], "answer": r["reward_model"]["ground_truth"]}
        for r in rows
        for _ in range(2)
    ]
    try:
        episodes = engine.rollout_batch(data, workflow=workflow)  # AReaL runs every episode in its executor
    finally:
        engine.destroy()
        workflow.close()

    assert len(episodes) == len(data)
    tool_rounds = 0
    for ep in episodes:
        ids = ep["input_ids"][0].tolist()
        mask, logp, versions = ep["loss_mask"][0], ep["logprobs"][0], ep["versions"][0]
        assert ep["attention_mask"].all() and all(
            t.shape[1] == len(ids) for k, t in ep.items() if k != "rewards"
        )
        # which row: the rendered prompt (chat template with the tool schema) opens the sequence
        for row in data:
            prompt = tok.apply_chat_template(
                row["messages"],
                tools=[TOOL_SCHEMA],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            if ids[: len(prompt)] == prompt:
                break
        else:
            raise AssertionError("an episode that starts with none of the prompts")
        P = len(prompt)
        assert mask[:P].sum() == 0 and (versions[:P] == -1).all()
        assert (versions[mask == 1] == VERSION).all() and (
            versions[mask == 0] == -1
        ).all()  # AReaL's version per token
        assert (logp[mask == 0] == 0).all() and (logp[mask == 1] <= 0).all() and logp[mask == 1].sum() < 0
        turns = torch.nonzero(torch.diff(torch.cat([mask.new_zeros(1), mask])) == 1).numel()
        # a calculator call, then the answer, with the tool's result between them out of the mask; at T=1.5 the
        # model now and then answers at once (1 turn), which the same checks cover
        assert turns == 1 + tok.decode(ids[P:]).count("<tool_response>") and turns in (1, 2)
        assert ep["rewards"].item() == compute_score(tok.decode(ids[P:]), row["answer"])
        tool_rounds += turns - 1
    assert tool_rounds, "no episode called the calculator: the observation's mask was never checked"

    batch = concat_padded_tensors(episodes)  # AReaL's batching of episodes
    # the actor's view, as AReaL's PPO actor builds it: everything shifted by one (position i predicts token i+1)
    loss_mask = torch.roll(batch["loss_mask"].float(), shifts=-1, dims=-1)
    old_logp = torch.roll(batch["logprobs"], shifts=-1, dims=-1) * loss_mask
    model = AutoModelForCausalLM.from_pretrained(ASSETS, dtype=torch.float32).eval()
    ids = batch["input_ids"].long()
    with torch.no_grad():
        logits = model(ids, attention_mask=batch["attention_mask"].long()).logits.float()
    actor = gather_logprobs(logits, torch.roll(ids, shifts=-1, dims=-1), temperature=TEMPERATURE) * loss_mask
    on = loss_mask.bool()
    diff = (actor[on] - old_logp[on]).abs().max().item()
    print(
        f"max |actor logp - rollout logp| on loss tokens {diff:.1e} over {int(on.sum())} tokens; mean rollout logp {old_logp[on].mean():.3e}"
    )
    assert diff < 1e-4, diff
    rejection = RejectionSamplingConfig(
        level="token", action="mask", metric="ratio", upper=1.001, lower=0.999
    )
    loss, stat = ppo_actor_loss_fn(
        logprobs=actor,
        proximal_logprobs=actor,
        old_logprobs=old_logp,
        advantages=torch.randn_like(actor),
        eps_clip=0.2,
        loss_mask=on,
        rejection_sampling=rejection,
    )
    assert torch.isfinite(loss).all() and int(stat["behave_mask"].sum()) == int(on.sum())  # nothing rejected


def test_an_episode_without_logprobs_is_refused_and_one_with_them_batches_whole():
    """to_areal's tensors all span prompt + response, so AReaL's concat_padded_tensors batches them; a sample
    without logprobs is refused (the workflow rejects its episode) rather than given a short logprobs tensor."""
    from backends.function import FunctionBackend
    from fsm.adapters.areal import to_areal
    from fsm.api import RolloutEngine
    from tests.conftest import model_turn, user_row

    tok = AutoTokenizer.from_pretrained(ASSETS)
    episodes = []
    for logprobs in (True, False):
        answer = model_turn(tok, "#### 3")

        async def generate(prompt_ids, params, answer=answer, logprobs=logprobs):
            return {"token_ids": answer, "logprobs": [-0.25] * len(answer) if logprobs else None}

        with RolloutEngine("calculator", tok, backend=FunctionBackend(generate)) as engine:
            (sample,) = engine.generate_samples(
                [user_row(uid="r", reward_model={"ground_truth": "3"})]
            ).samples
        if logprobs:
            episodes += [to_areal(sample), to_areal(sample)]
        else:
            with pytest.raises(ValueError, match="row r: the sample has no logprobs"):
                to_areal(sample)
    batch = concat_padded_tensors(episodes)
    L = batch["input_ids"].shape[1]
    assert all(batch[k].shape == (2, L) for k in ("logprobs", "loss_mask", "versions", "attention_mask"))
    assert (batch["logprobs"][batch["loss_mask"] == 1] == -0.25).all()


def test_a_segmenting_spec_is_one_episode_of_a_row_per_segment():
    """specs/calculator_compact.yaml (tests/fixtures/compacting.py's model, answering through AReaL's own
    ModelRequest / ModelResponse): the episode holds one row per segment, batched by AReaL's
    concat_padded_tensors; each row is exactly its segment's tokens, its loss mask and versions, and carries
    the trajectory's reward (the spec's reward_placement: every)."""
    from areal.api import ModelRequest, ModelResponse

    from fsm.api import RolloutEngine
    from tests.fixtures.compacting import SPEC, compact_backend, compact_row, compact_turn

    tok = AutoTokenizer.from_pretrained(ASSETS)

    class Engine:  # what a workflow calls on AReaL's inference engine
        requests: list = []

        async def agenerate(self, req):
            assert isinstance(req, ModelRequest)
            self.requests.append(req)
            ids = compact_turn(tok, req.input_ids)
            return ModelResponse(
                input_tokens=req.input_ids,
                output_tokens=ids,
                output_logprobs=[-0.25] * len(ids),
                output_versions=[VERSION] * len(ids),
                stop_reason="stop",
            )

    row = compact_row()
    workflow = FSMWorkflow(SPEC, tok, gconfig=GenerationHyperparameters(temperature=1.0))

    async def run():
        try:
            return await workflow.arun_episode(Engine(), {"messages": row["raw_prompt"], "answer": "5"})
        finally:
            await workflow.engine.aclose()

    episode = asyncio.run(run())
    with RolloutEngine(SPEC, tok, backend=compact_backend(tok)) as engine:
        expected = engine.generate_samples([row]).samples
    assert len(expected) == 3 and len(Engine.requests) == 3
    L = max(len(s.ids) for s in expected)
    assert all(v.shape[0] == 3 for v in episode.values()) and episode["input_ids"].shape[1] == L
    for i, s in enumerate(expected):
        n, P = len(s.ids), len(s.prompt_ids)
        assert episode["input_ids"][i, :n].tolist() == s.ids and episode["attention_mask"][i].sum() == n
        assert episode["loss_mask"][i, :n].tolist() == [0] * P + s.mask
        assert episode["versions"][i, P:n][episode["loss_mask"][i, P:n] == 1].eq(VERSION).all()
        assert episode["rewards"][i].item() == 1.0
