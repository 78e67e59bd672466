"""Aborted generations are resumed, never taken as output; a row is exactly right or an error row.

Real HTTP on loopback: dev servers (backends/devserver.py) behind the fault proxy (backends/faults.py), the
SGLang client and the router. HashLM, a deterministic autoregressive toy model, stands in for greedy decoding
(a resumed turn must equal an uninterrupted one token for token); the tiny model checks the same for real.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import torch

from backends.base import BaseBackend, GenerateRequest, GenerateResult
from backends.devserver import FAULT_HEADER, DevServer
from backends.faults import FaultProxy
from backends.router import Router
from backends.scripted import HashLM
from backends.sglang import SGLangBackend
from fsm.api import RolloutEngine
from fsm.output.batch import fault_summary
from tests.conftest import ASSETS, scripted, tool_turn, until, user_row

RESUME_SPEC = """
    name: resume
    extends: {specs}/single_turn.yaml
    limits:
      prompt_length: 64
      response_length: 48
      max_resumes: %d
"""


def hashlm(**kw: Any) -> HashLM:
    return HashLM(vocab=516, eos=2, stop_every=kw.pop("stop_every", 30), **kw)  # the tiny tokenizer's ids


def rows(n: int) -> list[dict]:
    return [user_row(f"What is {i} + {2 * i}?") for i in range(n)]


def router(*urls: str, **client_kw: Any) -> Router:
    clients = [SGLangBackend(u, **{"max_retries": 2, "backoff_s": 0.01, **client_kw}) for u in urls]
    return Router(clients, health_interval_s=0, cooldown_s=0.05, retry_window_s=0)


async def run(agent_or_spec: Any, tok: Any, backend: Any, data: list[dict], **kw: Any):
    """(trajectories, padded batch, backend stats) of one run; the engine owns and closes the backend."""
    async with RolloutEngine(agent_or_spec, tok, backend=backend) as engine:
        sampling = engine.sampling({"temperature": 0.0, **kw})
        trajs = await engine.arun(data, sampling=sampling)
        batch = engine.to_batch(trajs, sampling)
        stats = backend.stats() if hasattr(backend, "stats") else {}
    return trajs, batch, stats


def assert_same_rows(batch, ref, *, atol: float = 0.0) -> None:
    for key in ("prompts", "responses", "response_mask", "attention_mask"):
        assert torch.equal(batch.batch[key], ref.batch[key]), key
    assert torch.allclose(batch.batch["rollout_log_probs"], ref.batch["rollout_log_probs"], atol=atol, rtol=0)


# --- the dev server's abort shapes ---------------------------------------------------------------------


async def test_dev_server_aborts_on_demand_in_sglang_shapes():
    prompt = [5, 6, 7]
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": 40}}
    async with DevServer(hashlm()) as dev, aiohttp.ClientSession() as http:

        async def post(rid: str, fault: str | None = None) -> dict:
            headers = {FAULT_HEADER: fault} if fault else {}
            async with http.post(dev.url + "/generate", json={**body, "rid": rid}, headers=headers) as r:
                assert r.status == 200
                return await r.json()

        full = await post("a_t00")
        assert len(full["output_ids"]) > 4 and full["meta_info"]["finish_reason"]["type"] == "stop"
        waiting = await post("b_t00", "abort_waiting")
        assert waiting["output_ids"] == []
        assert set(waiting["meta_info"]) == {
            "id",
            "finish_reason",
            "weight_version",
            "e2e_latency",
            "weight_versions",
            "response_sent_to_client_ts",
            "input_token_logprobs",
            "output_token_logprobs",
            "output_token_logprobs_length",
            "completion_tokens",
        }
        assert waiting["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        running = await post("c_t00", "abort_running:4")
        meta = running["meta_info"]
        assert running["output_ids"] == full["output_ids"][:4]  # what it had generated when aborted
        assert meta["output_token_logprobs"] == full["meta_info"]["output_token_logprobs"][:4]
        assert meta["finish_reason"] == {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }
        assert meta["prompt_tokens"] == 3 and "cached_tokens" in meta and meta["completion_tokens"] == 4


# --- resumption ------------------------------------------------------------------------------------------


async def test_resumed_turns_equal_uninterrupted_ones(tok, compile_yaml):
    agent = compile_yaml(RESUME_SPEC % 20)  # about half the requests are aborted: no row may run out
    data = rows(12)
    async with DevServer(hashlm()) as dev:
        _, ref, _ = await run(agent, tok, router(dev.url), data)
        async with FaultProxy(dev.url, every={"abort_waiting": 3, "abort_running": 2}) as proxy:
            trajs, batch, stats = await run(agent, tok, router(proxy.url), data)
        rids = [entry["rid"] for entry in dev.log]
    injected = proxy.injected["abort_waiting"] + proxy.injected["abort_running"]
    assert proxy.injected["abort_waiting"] >= 3 and proxy.injected["abort_running"] >= 1
    assert all(t.termination_reason in ("done", "response_length") for t in trajs)
    assert_same_rows(batch, ref)  # tokens, mask 1 and logprobs: as if never aborted
    assert sum(t.metrics.num_preempted for t in trajs) == injected == stats["resumes"]
    assert batch.meta_info["timing"]["agent_loop/num_preempted/max"] >= 1  # verl's key, the real count
    assert stats["faults"]["aborts_waiting"] == proxy.injected["abort_waiting"]
    assert stats["faults"]["aborts_running"] == proxy.injected["abort_running"]
    summary = fault_summary(trajs, stats)
    assert (summary["resumes"], summary["error_rows"]) == (injected, 0)
    assert len(set(rids)) == len(rids) and any("_t00_r1" in rid for rid in rids)  # a fresh rid per resume


@pytest.mark.skipif(not (ASSETS / "model.safetensors").exists(), reason="the tiny model is not trained")
async def test_tiny_model_resumed_greedy_turns_equal_uninterrupted_ones(tok):
    from backends.hf import HFBackend
    from specs.calculator import make_prompts

    data = make_prompts(4, seed=3)
    model = HFBackend(ASSETS, torch_threads=1)
    try:
        async with DevServer(model) as dev:
            trajs_ref, ref, _ = await run("calculator", tok, router(dev.url), data)
            async with FaultProxy(dev.url, every={"abort_running": 2}) as proxy:
                trajs, batch, stats = await run("calculator", tok, router(proxy.url), data)
    finally:
        await model.close()
    assert (
        proxy.injected["abort_running"] >= 1
        and stats["faults"]["aborts_running"] == proxy.injected["abort_running"]
    )
    assert sum(t.metrics.num_preempted for t in trajs) == proxy.injected["abort_running"]
    assert [t.termination_reason for t in trajs] == [t.termination_reason for t in trajs_ref]
    assert max(t.assistant_turns for t in trajs) >= 2  # tool turns too
    assert_same_rows(batch, ref, atol=1e-4)


async def test_past_the_resume_budget_the_row_is_an_error(tok, compile_yaml):
    agent = compile_yaml(RESUME_SPEC % 1)
    async with DevServer(hashlm()) as dev:
        async with FaultProxy(dev.url, script=["abort_waiting", "abort_waiting"]) as proxy:
            (traj,), batch, stats = await run(agent, tok, router(proxy.url), rows(1))
    assert traj.failed and traj.termination_reason.startswith(
        "error: aborted: model turn 0 was aborted 2 times"
    )
    assert "past limits.max_resumes 1" in traj.termination_reason and proxy.url in traj.termination_reason
    assert (
        len(traj.response_ids) == 0 and int(batch.batch["response_mask"].sum()) == 0
    )  # never a short "done"
    assert traj.metrics.num_preempted == 1 and stats["faults"]["aborts_waiting"] == 2


@pytest.mark.parametrize("how", ["pause_generation", "update_weights"])
async def test_server_side_aborts_mid_batch_lose_nothing(tok, compile_yaml, how):
    """/pause_generation in abort mode, and a weight update with abort_all_requests, abort for real."""
    agent = compile_yaml(RESUME_SPEC % 3)
    data = rows(8)
    async with DevServer(hashlm(latency_s=0.3)) as dev:
        _, ref, _ = await run(agent, tok, router(dev.url), data)
        control = SGLangBackend(dev.url)
        async with control:

            async def disrupt() -> None:
                await until(
                    lambda: any(r.started for r in dev._live.values()), "a turn running at the server"
                )
                if how == "pause_generation":
                    await control.pause_generation("abort")
                    await asyncio.sleep(0.1)
                    await control.continue_generation()
                else:
                    await control.update_weights_from_disk(
                        "/ckpt/step-2", weight_version="step-2", abort_all_requests=True
                    )

            (trajs, batch, stats), _ = await asyncio.gather(run(agent, tok, router(dev.url), data), disrupt())
    # every abort is one preemption, resumed: at least the running one waited for, and any request the abort found
    # still waiting (a turn that reached the server a moment before it: CI of 64a5c84, under load)
    faults = stats["faults"]
    assert sum(t.metrics.num_preempted for t in trajs) == faults["aborts_running"] + faults["aborts_waiting"]
    assert faults["aborts_running"] >= 1
    assert all(t.termination_reason in ("done", "response_length") for t in trajs)
    assert_same_rows(batch, ref)


class _AbortsWithoutLogprobs(BaseBackend):
    """First call: an abort that carries 3 tokens but no logprob payload; then HashLM."""

    def __init__(self) -> None:
        self.model = hashlm()
        self.requests: list[GenerateRequest] = []
        self.model_name = "test"

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        if len(self.requests) == 1:
            return GenerateResult([11, 12, 13], None, "abort", abort_message="Aborted")
        return await self.model.generate(request)


async def test_partial_tokens_without_their_logprobs_are_regenerated(tok, compile_yaml):
    agent = compile_yaml(RESUME_SPEC % 3)
    backend = _AbortsWithoutLogprobs()
    (traj,), batch, _ = await run(agent, tok, backend, rows(1))
    first, second = backend.requests
    assert second.prompt_ids == first.prompt_ids and second.resumed == 1  # nothing kept, nothing invented
    assert second.sampling_params["max_new_tokens"] == first.sampling_params["max_new_tokens"]
    assert second.rid == first.rid + "_r1"
    expected = await hashlm().generate(first)
    assert traj.response_ids.tolist() == expected.token_ids
    assert traj.response_logprobs.tolist() == pytest.approx(expected.logprobs)


class _NoLogprobs(BaseBackend):
    """HashLM that never returns logprobs for the sessions of `rows_without`."""

    def __init__(self, rows_without: set[int]) -> None:
        self.model, self.rows_without, self.model_name = hashlm(), rows_without, "test"

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        result = await self.model.generate(request)
        if int(request.session_id.rsplit("-", 2)[1]) in self.rows_without:
            result.logprobs = None
        return result


async def test_logprobs_asked_for_and_not_returned_are_never_invented(tok, compile_yaml):
    agent = compile_yaml(RESUME_SPEC % 3)
    trajs, batch, _ = await run(agent, tok, _NoLogprobs({1}), rows(3))
    assert "rollout_log_probs" not in batch.batch.keys()  # as verl, when a sample lacks them
    assert batch.meta_info["rollout_log_probs_missing"] == [1]
    assert [t.logprobs_missing for t in trajs] == [False, True, False]
    assert trajs[1].to_output()["response_logprobs"] is None and trajs[0].to_output()["response_logprobs"]
    assert all(not t.failed and len(t.response_ids) > 0 for t in trajs)  # the tokens themselves are right
    _, full, _ = await run(agent, tok, _NoLogprobs(set()), rows(3))
    assert "rollout_log_probs" in full.batch.keys() and "rollout_log_probs_missing" not in full.meta_info


async def test_sglang_client_reports_missing_logprobs_instead_of_zeros():
    from backends.sglang import parse_generate

    body = {
        "output_ids": [5, 6],
        "meta_info": {"id": "x", "finish_reason": {"type": "stop", "matched": 6}, "prompt_tokens": 3},
    }
    result = parse_generate(body, server="s", return_logprob=True)
    assert result.logprobs is None and result.extra["logprobs_missing"]


# --- user code that raises BaseException ----------------------------------------------------------------


async def cancelling(text: str) -> str:
    """A broken tool: raises CancelledError although nobody cancelled it.

    Args:
        text: Ignored.
    """
    raise asyncio.CancelledError("from the tool")


class Abandon(BaseException):
    """What a library might raise to unwind (a BaseException that is not cancellation)."""


async def abandoning(text: str) -> str:
    """A broken tool: raises a BaseException.

    Args:
        text: Ignored.
    """
    raise Abandon("gave up")


async def exit_if_asked(ctx, traj) -> None:
    """A user action that calls sys.exit, or raises CancelledError, for rows whose extra_info says so."""
    ask = (traj.row.get("extra_info") or {}).get("do")
    if ask == "exit":
        raise SystemExit(3)
    if ask == "cancel":
        raise asyncio.CancelledError("nobody cancelled me")


TOOLS_SPEC = """
    name: broken_tools
    extends: {specs}/tool_agent.yaml
    tools:
      - function: tests.test_aborts:cancelling
      - function: tests.test_aborts:abandoning
"""


async def test_a_tool_raising_base_exceptions_fails_its_row_only(tok, compile_yaml, turn):
    agent = compile_yaml(TOOLS_SPEC)
    script = {
        0: [tool_turn(tok, ("cancelling", {"text": "x"}))],
        1: [tool_turn(tok, ("abandoning", {"text": "x"}))],
        2: [turn("no tools needed")],
    }
    trajs, batch, _ = await run(agent, tok, scripted(script), rows(3))
    # the tool layer wraps what a tool raises (ToolCrashed); the row ends as an error naming it either way
    assert (
        trajs[0].termination_reason.startswith("error: ") and "CancelledError" in trajs[0].termination_reason
    )
    assert (
        "from the tool" in trajs[0].termination_reason and "PROCESSING_TOOLS" in trajs[0].termination_reason
    )
    assert trajs[1].termination_reason.startswith("error: ") and "Abandon" in trajs[1].termination_reason
    assert trajs[2].termination_reason == "done" and not trajs[2].failed
    assert [int(m.sum()) for m in batch.batch["response_mask"]][:2] == [0, 0]


async def test_a_user_action_raising_sys_exit_or_cancelled_error_fails_its_row_only(tok, compile_yaml, turn):
    agent = compile_yaml("""
        name: exits
        extends: {specs}/single_turn.yaml
        states:
          PENDING:
            action: encode_prompt
            next:
              - to: CHECKING
          CHECKING:
            action: tests.test_aborts:exit_if_asked
            next:
              - to: GENERATING
    """)
    data = [
        user_row("a"),
        user_row("b", extra_info={"do": "exit"}),
        user_row("c", extra_info={"do": "cancel"}),
    ]
    trajs, _, _ = await run(agent, tok, scripted([turn("ok")]), data)
    assert [t.termination_reason for t in trajs] == [
        "done",
        "error: SystemExit in CHECKING: 3",
        "error: CancelledError raised in CHECKING by the action, not by a cancellation of the run: nobody cancelled me",
    ]


async def test_a_real_cancellation_cancels_the_run_and_leaves_no_finished_looking_row(tok, compile_yaml):
    agent = compile_yaml(RESUME_SPEC % 3)

    class Hangs(BaseBackend):
        model_name = "hangs"

        async def generate(self, request: GenerateRequest) -> GenerateResult:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    async with RolloutEngine(agent, tok, backend=Hangs()) as engine:
        trajs = engine.runner.trajectories(rows(2))
        ctx = engine.runner.make_context({})
        task = asyncio.ensure_future(asyncio.gather(*(engine.runner.drive(ctx, t) for t in trajs)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    for t in trajs:  # cancelled mid-turn: an error row, never a row that looks finished
        assert t.termination_reason == "error: ended in GENERATING, which is not a final state"


async def test_the_resume_budget_and_deadlines_are_spec_limits(compile_yaml):
    agent = compile_yaml(RESUME_SPEC % 5)
    limits = agent.limits
    assert (limits.max_resumes, limits.request_timeout_s, limits.turn_timeout_s) == (5, None, 1200.0)
    with pytest.raises(Exception, match="max_resumes"):
        compile_yaml(RESUME_SPEC % -1)
