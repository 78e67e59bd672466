"""The embedded backend's KV handling (backends/hf_model.py): a trajectory's KV kept between its turns, and rows
joining and leaving a running batch. Everything is checked against a backend that keeps nothing (every turn
prefilled whole) and against a direct forward pass."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from backends.base import GenerateRequest, GenerateResult
from backends.hf import HFBackend
from backends.hf_model import SlotLayer
from tests.test_hf_backend import GREEDY, VOCAB, make_model, prompt, reference_logprobs

SAMPLED = {"temperature": 0.7, "top_p": 0.9, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture
async def backend(model_dir: Path):
    async with HFBackend(model_dir, device="cpu", torch_threads=1, max_batch_size=16) as b:
        yield b


@pytest.fixture
async def plain(model_dir: Path):
    """The same model, keeping no KV between turns."""
    async with HFBackend(
        model_dir, device="cpu", torch_threads=1, max_batch_size=16, session_kv_bytes=0
    ) as b:
        yield b


def turn(session: str, ids: list[int], n: int = 12, **params) -> GenerateRequest:
    return GenerateRequest(
        session, ids, {"max_new_tokens": n, **(params or GREEDY)}, rid=f"{session}-{len(ids)}"
    )


async def two_turns(
    b: HFBackend, session: str, first: list[int], observation: list[int], **params
) -> tuple[GenerateResult, GenerateResult, list[int]]:
    one = await b.generate(turn(session, first, **params))
    context = first + one.token_ids + observation
    return one, await b.generate(turn(session, context, **params)), context


def same(a: GenerateResult, b: GenerateResult) -> None:
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("params", [GREEDY, {**SAMPLED, "sampling_seed": 5}])
async def test_a_next_turn_prefills_only_its_new_tokens_and_matches_a_full_prefill(
    backend: HFBackend, plain: HFBackend, params: dict
):
    first, observation = prompt(30, seed=1), prompt(7, seed=2)
    one, two, context = await two_turns(backend, "traj", first, observation, **params)
    assert one.cached_tokens == 0 and two.cached_tokens == len(first) + len(one.token_ids) - 1
    _, again, _ = await two_turns(plain, "traj", first, observation, **params)
    assert again.cached_tokens == 0
    same(two, again)
    temperature = params.get("temperature") or 1.0
    ref = reference_logprobs(backend.model, context, two.token_ids, temperature)
    chosen = ref.gather(-1, torch.tensor(two.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(two.logprobs), chosen, atol=1e-4, rtol=0)
    if params is GREEDY:
        assert two.token_ids == ref.argmax(-1).tolist()


async def test_many_trajectories_join_with_kept_kv_of_different_lengths(backend: HFBackend, plain: HFBackend):
    """Rows that join together kept different amounts and add different amounts (some compute part of what
    they kept again, so every row's columns stay contiguous); each gets what a full prefill gives."""
    firsts = [prompt(5 + 9 * i, seed=10 + i) for i in range(6)]
    observations = [prompt(1 + 4 * i % 13, seed=20 + i) for i in range(6)]

    async def run(b: HFBackend) -> list[GenerateResult]:
        ones = await asyncio.gather(*(b.generate(turn(f"t{i}", f)) for i, f in enumerate(firsts)))
        return await asyncio.gather(
            *(
                b.generate(turn(f"t{i}", f + o.token_ids + obs, 20))
                for i, (f, o, obs) in enumerate(zip(firsts, ones, observations, strict=True))
            )
        )

    kept, full = await run(backend), await run(plain)
    assert all(r.cached_tokens > 0 for r in kept) and all(r.cached_tokens == 0 for r in full)
    for a, b in zip(kept, full, strict=True):
        same(a, b)


async def test_next_turns_join_a_running_batch_with_their_kept_kv(backend: HFBackend, plain: HFBackend):
    """Rows prefill into the running batch's own slots, their kept KV first, beside a row that keeps running."""
    long = asyncio.ensure_future(backend.generate(turn("long", prompt(30, seed=7), 200)))
    while not backend._model_lock.locked():
        await asyncio.sleep(0)
    firsts, observations = (
        [prompt(9 + 7 * i, seed=30 + i) for i in range(3)],
        [[4, 5, 6], [7], [8, 9, 10, 11, 12]],
    )
    runs = [
        asyncio.gather(*(two_turns(b, f"t{i}", f, o) for i, (f, o) in enumerate(zip(firsts, observations))))
        for b in (backend, plain)
    ]
    kept, full = await runs[0], await runs[1]
    assert not long.done() and all(two.cached_tokens > 0 for _, two, _ in kept)
    for (one_a, two_a, _), (one_b, two_b, _) in zip(kept, full, strict=True):
        same(one_a, one_b)
        same(two_a, two_b)
    same(await long, await plain.generate(turn("long", prompt(30, seed=7), 200)))


async def test_a_prompt_that_does_not_extend_the_kept_tokens_is_prefilled_whole(
    backend: HFBackend, plain: HFBackend
):
    first = prompt(25, seed=3)
    one = await backend.generate(turn("traj", first))
    edited = first[:10] + [(first[10] + 1) % VOCAB] + first[11:] + one.token_ids + [5, 6, 7]
    res = await backend.generate(turn("traj", edited))
    assert res.cached_tokens == 0 and backend.sessions.misses == 1
    same(res, await plain.generate(turn("traj", edited)))
    shorter = await backend.generate(turn("traj", edited[:20]))  # a prompt inside what was kept: whole too
    assert shorter.cached_tokens == 0
    same(shorter, await plain.generate(turn("traj", edited[:20])))


async def test_kept_kv_is_bounded_and_released(model_dir: Path):
    async with HFBackend(model_dir, device="cpu", torch_threads=1) as b:
        await b.generate(turn("a", prompt(20, seed=1)))
        per_turn = b.sessions.nbytes
        assert len(b.sessions) == 1 and per_turn > 0
    async with HFBackend(model_dir, device="cpu", torch_threads=1, session_kv_bytes=int(per_turn * 2.5)) as b:
        for i in range(6):
            await b.generate(turn(f"s{i}", prompt(20, seed=i)))
            assert b.sessions.nbytes <= b.sessions.max_bytes
        assert len(b.sessions) == 2  # the least recently used went first
        res = await b.generate(turn("s0", prompt(20, seed=0) + [3] * 15))
        assert res.cached_tokens == 0
        await b.release("s5")
        assert len(b.sessions) == 1
        await b.flush_cache()
        assert len(b.sessions) == 0 and b.sessions.nbytes == 0
        await b.generate(turn("big", prompt(200, seed=9)))  # more than the bound on its own: not kept
        assert len(b.sessions) == 0


async def test_weight_updates_drop_kept_kv(backend: HFBackend, tmp_path: Path):
    first, observation = prompt(20, seed=4), prompt(5, seed=5)
    one = await backend.generate(turn("traj", first))
    other = Qwen2ForCausalLM.from_pretrained(make_model(tmp_path / "other", seed=1))
    await backend.update_weights_from_tensor(named_tensors=other.state_dict(), weight_version="2")
    assert len(backend.sessions) == 0
    context = first + one.token_ids + observation
    two = await backend.generate(turn("traj", context))
    assert two.cached_tokens == 0  # nothing of the old weights' KV is used
    assert two.token_ids == reference_logprobs(other, context, two.token_ids, 1.0).argmax(-1).tolist()
    await backend.update_weights_from_disk(str(make_model(tmp_path / "third", seed=2)))
    assert len(backend.sessions) == 0


async def test_a_row_that_crosses_a_weight_update_keeps_no_kv(backend: HFBackend, tmp_path: Path):
    """An in-place pause lets the weights change under a running row: its KV mixes two models, so it is not
    kept for the trajectory's next turn."""
    other = Qwen2ForCausalLM.from_pretrained(make_model(tmp_path / "other", seed=1))
    running = asyncio.ensure_future(backend.generate(turn("traj", prompt(20, seed=6), 150)))
    while not backend._model_lock.locked():
        await asyncio.sleep(0.001)
    await backend.pause_generation("in_place")
    await backend.update_weights_from_tensor(named_tensors=other.state_dict(), weight_version="2")
    await backend.continue_generation()
    res = await running
    assert len(res.token_ids) == 150 and res.extra["token_versions"][-1] == "2"
    assert len(backend.sessions) == 0


async def test_rows_joining_and_leaving_at_random_match_rows_decoded_alone(
    backend: HFBackend, plain: HFBackend, monkeypatch: pytest.MonkeyPatch
):
    """Requests arriving at random moments with different prompt and output lengths: rows join the running
    batch, leave it, move into the places others left, and the buffers grow (little spare room here);
    every row gets the tokens it gets alone."""
    monkeypatch.setattr(SlotLayer, "SPARE_COLUMNS", 3)
    rng = random.Random(0)
    jobs = [(prompt(rng.randrange(3, 60), seed=100 + i), rng.randrange(1, 40)) for i in range(24)]

    async def late(i: int, ids: list[int], n: int) -> GenerateResult:
        await asyncio.sleep(rng.random() * 0.05)
        return await backend.generate(turn(f"r{i}", ids, n))

    results = await asyncio.gather(*(late(i, ids, n) for i, (ids, n) in enumerate(jobs)))
    assert len({r.extra["batch"] for r in results}) > 2  # they did arrive apart
    for (ids, n), res in zip(jobs, results, strict=True):
        same(res, await plain.generate(turn("alone", ids, n)))


async def test_a_sliding_window_model_batches_whole_and_keeps_nothing(tmp_path: Path):
    """A cache that is not plain K/V per position (here a sliding-window layer) cannot take rows mid-batch or
    be kept: requests arriving during a batch wait for the next one, every turn is prefilled whole, and the
    tokens are still those of a direct forward pass."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        initializer_range=0.3,
        eos_token_id=1,
        pad_token_id=0,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = Qwen2ForCausalLM(config)
    async with HFBackend(model, device="cpu", torch_threads=1) as b:
        assert not b._joinable and b.sessions.max_bytes == 0
        first = [asyncio.ensure_future(b.generate(turn(f"f{i}", prompt(12, seed=i), 60))) for i in range(2)]
        while b._queue or not b._model_lock.locked():
            await asyncio.sleep(0)
        late = await b.generate(turn("late", prompt(6, seed=9), 8))
        assert all(f.done() for f in first)  # it waited for the batch to end
        results = [*(await asyncio.gather(*first)), late]
        assert late.extra["batch"] == results[0].extra["batch"] + 1
        for ids, res in zip(
            [prompt(12, seed=0), prompt(12, seed=1), prompt(6, seed=9)], results, strict=True
        ):
            assert res.cached_tokens == 0
            assert res.token_ids == reference_logprobs(model, ids, res.token_ids, 1.0).argmax(-1).tolist()
        await b.generate(turn("f0", prompt(12, seed=0) + results[0].token_ids + [4, 5]))
        assert len(b.sessions) == 0


@pytest.mark.parametrize("params", [GREEDY, {**SAMPLED, "sampling_seed": 3}])
async def test_exact_logprobs_do_not_depend_on_the_batch_or_the_kept_kv(model_dir: Path, params: dict):
    """`exact_logprobs=True` (issue 46): trajectories decoded together, each second turn on its kept KV, give
    the same bits as each decoded alone with every turn prefilled whole (what a resume does), and the tokens
    of the default mode. Without it, these logprobs differ by ~1e-6 to 1e-5 (float sums in another order)."""
    starts = [(prompt(10 + 9 * i, seed=40 + i), prompt(3 + i, seed=60 + i)) for i in range(6)]

    async def turns(b: HFBackend, together: bool) -> list[GenerateResult]:
        pairs = (
            await asyncio.gather(*(two_turns(b, f"t{i}", f, o, **params) for i, (f, o) in enumerate(starts)))
            if together
            else [await two_turns(b, f"t{i}", f, o, **params) for i, (f, o) in enumerate(starts)]
        )
        return [r for one, two, _ in pairs for r in (one, two)]

    def engine(exact: bool, kept: int) -> HFBackend:
        return HFBackend(
            model_dir, device="cpu", torch_threads=1, session_kv_bytes=kept, exact_logprobs=exact
        )

    async with engine(True, 1 << 20) as b, engine(True, 0) as alone, engine(False, 1 << 20) as default:
        batched, single, sampled = await turns(b, True), await turns(alone, False), await turns(default, True)
    assert any(r.cached_tokens for r in batched) and not any(r.cached_tokens for r in single)
    assert all(r.extra["batch_size"] > 1 for r in batched) and all(r.extra["batch_size"] == 1 for r in single)
    for a, s, d in zip(batched, single, sampled, strict=True):
        assert a.token_ids == s.token_ids == d.token_ids
        assert a.logprobs == s.logprobs  # bit for bit
        same(a, d)  # the same logprobs as sampled, to float noise
