"""HFBackend against a tiny random-init Qwen2 built here (no shared assets, no tokenizer, no network).

Every test that takes `backend` (or `device`) runs on each device present: the CPU always, CUDA when torch
sees a GPU. The model is far below SMALL_MODEL_PARAMS, so it runs in float32 by default on both, and logprobs
can be compared with a direct forward pass to 1e-4.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from backends.base import Backend, BackendRequestError, BackendUnavailable, GenerateRequest, GenerateResult
from backends.hf import HFBackend
from backends.hf_model import SMALL_MODEL_PARAMS, TINY_SERVED_NAME, default_dtype
from backends.hf_model import to_dtype as _dtype
from bench.hf import bench_hf, bench_rollout

VOCAB, CONTEXT = 600, 256
GREEDY = {"temperature": 0.0, "ignore_eos": True}
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_model(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
        initializer_range=0.3,  # peaky, varied logits: greedy picks are far from ties and do not repeat
        eos_token_id=1,
        pad_token_id=0,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def backend(model_dir: Path, device: str):
    async with HFBackend(model_dir, device=device, torch_threads=1, max_batch_size=32) as b:
        yield b


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(n)]


def req(ids: list[int], **params) -> GenerateRequest:
    return GenerateRequest(session_id="s", prompt_ids=ids, sampling_params={"max_new_tokens": 16, **params})


def reference_logprobs(model, ids: list[int], out: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each generated token, from one unpadded forward pass over prompt + output."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + out], device=model.device)).logits[0, len(ids) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).cpu()


@pytest.mark.parametrize("temperature", [0.0, 0.7])
async def test_logprobs_match_a_direct_forward_pass(backend: HFBackend, temperature: float):
    assert isinstance(backend, Backend) and backend.provider == "transformers"
    assert backend.context_length == CONTEXT and backend.dtype == torch.float32  # small: float32 everywhere
    ids = prompt(23, seed=1)
    res = await backend.generate(req(ids, temperature=temperature, sampling_seed=7, ignore_eos=True))
    assert len(res.token_ids) == len(res.logprobs) == 16 and res.finish_reason == "length"
    assert res.prompt_tokens == 23 and res.weight_version == "default"
    ref = reference_logprobs(backend.model, ids, res.token_ids, temperature or 1.0)
    chosen = ref.gather(-1, torch.tensor(res.token_ids)[:, None]).squeeze(-1)
    assert all(isinstance(lp, float) for lp in res.logprobs)
    assert torch.allclose(torch.tensor(res.logprobs), chosen, atol=1e-4, rtol=0)
    if temperature == 0.0:
        assert res.token_ids == ref.argmax(-1).tolist()


async def test_top_k_and_top_p_do_not_renormalise_logprobs(backend: HFBackend):
    ids = prompt(10, seed=2)
    greedy = await backend.generate(req(ids, **GREEDY))
    for cut in ({"top_k": 1}, {"top_p": 1e-6}):
        res = await backend.generate(req(ids, temperature=0.7, ignore_eos=True, **cut))
        assert res.token_ids == greedy.token_ids  # the cut leaves only the argmax
        ref = reference_logprobs(backend.model, ids, res.token_ids, 0.7)
        chosen = ref.gather(-1, torch.tensor(res.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(res.logprobs), chosen, atol=1e-4, rtol=0)


async def test_stop_ids_are_honoured_and_included(backend: HFBackend):
    ids = prompt(12, seed=3)
    free = (await backend.generate(req(ids, **GREEDY))).token_ids
    k = next(i for i in range(3, 16) if free[i] not in free[:i])
    res = await backend.generate(req(ids, stop_token_ids=[free[k]], **GREEDY))
    assert res.token_ids == free[: k + 1] and res.finish_reason == "stop" and len(res.logprobs) == k + 1
    # The model's eos ids stop too, unless ignore_eos.
    async with HFBackend(backend.model, device=backend.device, eos_token_ids=[free[k]]) as eos_backend:
        res = await eos_backend.generate(req(ids, temperature=0.0))
        assert res.token_ids == free[: k + 1] and res.finish_reason == "stop"
        res = await eos_backend.generate(req(ids, **GREEDY))
        assert res.token_ids == free and res.finish_reason == "length"


async def test_max_new_tokens_gives_length(backend: HFBackend):
    res = await backend.generate(req(prompt(5, seed=4), **{**GREEDY, "max_new_tokens": 3}))
    assert len(res.token_ids) == 3 and res.finish_reason == "length"
    res = await backend.generate(req(prompt(5, seed=4), **{**GREEDY, "max_new_tokens": 0}))
    assert res.token_ids == [] and res.logprobs == [] and res.finish_reason == "length"
    res = await backend.generate(
        GenerateRequest("s", prompt(5, seed=4), {"max_new_tokens": 2}, return_logprob=False)
    )
    assert len(res.token_ids) == 2 and res.logprobs is None


async def test_seeded_sampling_is_reproducible_and_batch_independent(backend: HFBackend):
    ids = prompt(9, seed=5)
    sampled = {"temperature": 1.0, "top_p": 0.95, "top_k": 50, "sampling_seed": 1234, "ignore_eos": True}
    alone = await backend.generate(req(ids, **sampled))
    others = [req(prompt(4 + i, seed=50 + i), temperature=0.8, sampling_seed=i) for i in range(6)]
    others += [req(prompt(30, seed=60), **GREEDY)]
    crowd = await asyncio.gather(
        backend.generate(req(ids, **sampled)), *(backend.generate(r) for r in others)
    )
    assert crowd[0].extra["batch_size"] == 8
    assert crowd[0].token_ids == alone.token_ids
    assert torch.allclose(torch.tensor(crowd[0].logprobs), torch.tensor(alone.logprobs), atol=1e-5)
    other_seed = await backend.generate(req(ids, **{**sampled, "sampling_seed": 4321}))
    assert other_seed.token_ids != alone.token_ids


async def test_batch_of_32_gives_the_same_greedy_tokens_as_batch_of_1(backend: HFBackend):
    prompts = [prompt(3 + 5 * i % 61, seed=100 + i) for i in range(32)]
    alone = [await backend.generate(req(p, **GREEDY)) for p in prompts]
    together = await asyncio.gather(*(backend.generate(req(p, **GREEDY)) for p in prompts))
    assert {r.extra["batch_size"] for r in together} == {32} and len(
        {r.extra["batch"] for r in together}
    ) == 1
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    for a, b in zip(alone, together, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


async def test_rows_finish_independently(backend: HFBackend):
    lengths = [1, 7, 3, 16]
    results = await asyncio.gather(
        *(backend.generate(req(prompt(6 + n, seed=n), **{**GREEDY, "max_new_tokens": n})) for n in lengths)
    )
    assert [len(r.token_ids) for r in results] == lengths and len({r.extra["batch"] for r in results}) == 1
    for n, r in zip(
        lengths, results, strict=True
    ):  # dropping finished rows mid-batch changes nothing for the rest
        assert (
            r.token_ids
            == (
                await backend.generate(req(prompt(6 + n, seed=n), **{**GREEDY, "max_new_tokens": n}))
            ).token_ids
        )


async def test_requests_arriving_during_a_batch_join_it(backend: HFBackend):
    """Continuous batching: requests that arrive while a batch decodes are prefilled together and join it
    between two steps (they do not wait for it to end), with the tokens they would get alone."""
    long = {**GREEDY, "max_new_tokens": 120}
    first = [asyncio.ensure_future(backend.generate(req(prompt(40, seed=i), **long))) for i in range(4)]
    ticks = 0
    while backend._queue or not backend._model_lock.locked():  # the worker has taken the first batch
        await asyncio.sleep(0)
    late = [asyncio.ensure_future(backend.generate(req(prompt(8, seed=10 + i), **GREEDY))) for i in range(3)]
    while not all(f.done() for f in late):  # the event loop stays free while the batch decodes in a thread
        ticks += 1
        await asyncio.sleep(0.001)
    assert not any(f.done() for f in first)  # the late ones ran beside the long ones, and ended first
    results: list[GenerateResult] = await asyncio.gather(*first, *late)
    assert ticks > 5
    assert all(len(r.token_ids) == (120 if i < 4 else 16) for i, r in enumerate(results))
    batches = [r.extra["batch"] for r in results]
    assert len(set(batches[:4])) == 1 and batches[4:] == [batches[0] + 1] * 3
    assert results[4].extra["batch_size"] == 3
    alone = [await backend.generate(req(prompt(8, seed=10 + i), **GREEDY)) for i in range(3)]
    assert [r.token_ids for r in results[4:]] == [r.token_ids for r in alone]
    for a, b in zip(alone, results[4:], strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


async def test_cancelled_request_leaves_the_batch(backend: HFBackend):
    long = {**GREEDY, "max_new_tokens": 100}
    doomed = asyncio.ensure_future(backend.generate(req(prompt(10, seed=1), **long)))
    kept = asyncio.ensure_future(backend.generate(req(prompt(10, seed=2), **long)))
    await asyncio.sleep(0.01)
    doomed.cancel()
    res = await kept
    assert len(res.token_ids) == 100 and doomed.cancelled()


async def test_bad_requests_are_refused(backend: HFBackend):
    with pytest.raises(BackendRequestError, match="context length"):
        await backend.generate(req(prompt(CONTEXT, seed=1)))
    res = await backend.generate(req(prompt(CONTEXT - 3, seed=1), **{**GREEDY, "max_new_tokens": 50}))
    assert len(res.token_ids) == 3 and res.finish_reason == "length"  # the budget is clamped to the context
    for params in (
        {"seed": 1},
        {"top_p": 0.0},
        {"top_k": 0},
        {"temperature": -1},
        {"repetition_penalty": 1.3},
    ):
        with pytest.raises(BackendRequestError) as info:
            await backend.generate(req(prompt(4, seed=1), **params))
        assert not info.value.retryable
    with pytest.raises(BackendRequestError):
        await backend.generate(req([VOCAB]))
    with pytest.raises(BackendRequestError):
        await backend.generate(req([]))


async def test_close_aborts_open_requests_and_stops_the_worker(model_dir: Path, device: str):
    backend = HFBackend(model_dir, device=device, max_batch_size=2)
    await backend.start()
    long = {**GREEDY, "max_new_tokens": 200}
    calls = [asyncio.ensure_future(backend.generate(req(prompt(20, seed=i), **long))) for i in range(3)]
    while not backend._model_lock.locked():
        await asyncio.sleep(0)
    await backend.close()
    assert backend._worker is not None and backend._worker.done()
    results = await asyncio.gather(*calls)
    assert [r.finish_reason for r in results] == ["abort"] * 3
    assert all(len(r.token_ids) < 200 for r in results) and results[2].token_ids == []
    await backend.close()  # idempotent
    with pytest.raises(BackendUnavailable):
        await backend.generate(req(prompt(4, seed=1)))


async def test_update_weights_from_disk(backend: HFBackend, tmp_path: Path):
    ids = prompt(15, seed=7)
    before = await backend.generate(req(ids, **GREEDY))
    await backend.update_weights_from_disk(str(make_model(tmp_path / "other", seed=1)), weight_version="v2")
    await backend.flush_cache()
    after = await backend.generate(req(ids, **GREEDY))
    assert after.weight_version == "v2" and after.token_ids != before.token_ids
    assert after.token_ids == reference_logprobs(backend.model, ids, after.token_ids, 1.0).argmax(-1).tolist()
    with pytest.raises(BackendRequestError):
        await backend.update_weights_from_disk(str(tmp_path / "missing"))


async def test_update_weights_from_tensor(backend: HFBackend, tmp_path: Path):
    ids = prompt(15, seed=7)
    before = await backend.generate(req(ids, **GREEDY))
    other = Qwen2ForCausalLM.from_pretrained(make_model(tmp_path / "other", seed=1))
    await backend.update_weights_from_tensor(
        named_tensors=list(other.state_dict().items()), weight_version="3"
    )
    after = await backend.generate(req(ids, **GREEDY))
    assert after.weight_version == "3" and after.extra["token_versions"] == ["3"] * len(after.token_ids)
    assert after.token_ids != before.token_ids
    assert after.token_ids == reference_logprobs(other, ids, after.token_ids, 1.0).argmax(-1).tolist()
    state = other.state_dict()
    for bad, match in [
        ({"nope.weight": state["lm_head.weight"]}, "no parameter 'nope.weight'"),
        ({"lm_head.weight": state["lm_head.weight"][:3]}, "has shape"),
        ({"serialized_named_tensors": ["x"]}, "not serialized_named_tensors"),
    ]:
        kwargs = bad if "serialized_named_tensors" in bad else {"named_tensors": bad}
        with pytest.raises(BackendRequestError, match=match):
            await backend.update_weights_from_tensor(**kwargs, weight_version="4")
    assert backend.weight_version == "3"  # a refused update moves nothing
    assert (await backend.generate(req(ids, **GREEDY))).token_ids == after.token_ids


async def test_a_model_object_is_decoded_as_is(model_dir: Path):
    model = Qwen2ForCausalLM.from_pretrained(model_dir)
    async with HFBackend(model, torch_threads=1) as b:
        assert b.model is model and b.model_name == model_dir.name
        ids = prompt(9, seed=3)
        out = await b.generate(req(ids, **GREEDY))
        assert out.token_ids == reference_logprobs(model, ids, out.token_ids, 1.0).argmax(-1).tolist()


def test_bench_hf(model_dir: Path, device: str):
    result = bench_hf(
        model_dir,
        batch_sizes=(1, 4),
        prompt_len=20,
        new_tokens=8,
        torch_threads=1,
        device=device,
        rollout_prompts=0,
    )
    assert set(result["tokens_per_s"]) == {1, 4} and all(v > 0 for v in result["tokens_per_s"].values())


def test_bench_rollout_against_one_batch():
    """The calculator rollout through the engine and the one batch generate the same number of tokens."""
    from backends.tiny import ASSET_DIR

    result = bench_rollout(ASSET_DIR, prompts=4, torch_threads=1, device="cpu", repeats=1)
    rollout, one = result["rollout"], result["one_batch"]
    assert rollout["generated_tokens"] == one["generated_tokens"] > 4 * 10
    assert result["ratio"] == round(rollout["tokens_per_s"] / one["tokens_per_s"], 3) > 0


def test_default_dtype_and_dtype_names():
    """float32 on CPU, and on CUDA below SMALL_MODEL_PARAMS; bfloat16 on CUDA above it or when unknown."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert default_dtype(cpu, None) == default_dtype(cpu, 10**11) == torch.float32
    assert default_dtype(cuda, 730_000) == default_dtype(cuda, SMALL_MODEL_PARAMS - 1) == torch.float32
    assert default_dtype(cuda, SMALL_MODEL_PARAMS) == default_dtype(cuda, None) == torch.bfloat16
    assert _dtype("bf16") == _dtype("bfloat16") == _dtype(torch.bfloat16) == torch.bfloat16
    assert _dtype("auto") is None and _dtype(None) is None and _dtype("float32") == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        _dtype("int8")


async def test_dtype_option(model_dir: Path, device: str):
    """dtype= casts the weights; in half precision on CUDA decoding avoids the cuDNN attention kernel (it
    plans every new shape); float32 needs no such choice."""
    async with HFBackend(model_dir, device=device, dtype="bfloat16") as b:
        assert b.dtype == torch.bfloat16 and next(b.model.parameters()).dtype == torch.bfloat16
        assert (b._attention is not None) == (device == "cuda")
        res = await b.generate(req(prompt(12, seed=8), **GREEDY))
        assert len(res.token_ids) == 16 and all(math.isfinite(lp) for lp in res.logprobs)
    async with HFBackend(model_dir, device=device) as b:
        assert b.dtype == torch.float32 and b._attention is None


async def test_served_model_name(model_dir: Path):
    """Spans and /model_info name the model by its served name: the argument, else the bundled model's name,
    else the model folder's; an in-process model answers from no server."""
    async with HFBackend(model_dir, device="cpu") as b:
        assert b.model_name == model_dir.name
        res = await b.generate(req(prompt(4, seed=1), **{**GREEDY, "max_new_tokens": 1}))
        assert res.server is None
    async with HFBackend(model_dir, device="cpu", served_model_name="my-model") as b:
        assert b.model_name == "my-model"
    from backends.tiny import ASSET_DIR

    async with HFBackend(ASSET_DIR, device="cpu") as b:
        assert b.model_name == TINY_SERVED_NAME == "agentfsm-tiny-calculator"


@needs_cuda
async def test_a_seed_means_the_same_on_cpu_and_cuda(model_dir: Path):
    """Seeded rows draw their uniforms on the CPU whatever the device: the same seed gives the same tokens on
    CUDA as on the CPU (up to the devices' float differences in the logits, which could flip a draw that lands
    on a boundary: none here)."""
    sampled = {
        "temperature": 1.0,
        "top_p": 0.95,
        "sampling_seed": 99,
        "ignore_eos": True,
        "max_new_tokens": 24,
    }
    requests = [req(prompt(5 + i, seed=200 + i), **{**sampled, "sampling_seed": i}) for i in range(16)]
    runs = []
    for device in ("cpu", "cuda"):
        async with HFBackend(model_dir, device=device) as b:
            runs.append([r.token_ids for r in await asyncio.gather(*(b.generate(r) for r in requests))])
    assert runs[0] == runs[1]


# --- threads: the engine's loop keeps a core (issue 49 §3) ---------------------------------------------------

THREADS = """
import os, sys, torch
from backends.hf import HFBackend
from backends.tiny import ASSET_DIR
given = {"torch_threads": int(sys.argv[1])} if len(sys.argv) > 1 else {}
HFBackend(ASSET_DIR, device="cpu", **given)
print(torch.get_num_threads(), len(os.sched_getaffinity(0)))
"""


@pytest.mark.parametrize(
    "env, argv, want",
    [
        ({}, [], lambda cores: max(1, cores - 1)),  # all cores but one: the event loop keeps one
        ({"OMP_NUM_THREADS": "2"}, [], lambda cores: min(2, cores)),  # the user's, as torch reads it (capped)
        ({}, ["2"], lambda cores: 2),  # torch_threads= (agentfsm run --threads)
    ],
)
def test_the_embedded_model_leaves_the_event_loop_a_core(env, argv, want):
    """A real process loading the tiny model on the CPU, as `agentfsm run` and `agentfsm dev-server` do."""
    repo = Path(__file__).resolve().parents[1]
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run(
        [sys.executable, "-c", THREADS, *argv],
        env={**environ, **env, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    threads, cores = map(int, done.stdout.split())
    assert threads == want(cores), (threads, cores)
