"""After a weight update the embedded model and the dev server serve exactly the checkpoint: a fixed probe's
tokens and logprobs equal those of a fresh model loaded from it (from disk and from tensors). The tiny model
ties its output head to the embedding, and the early checkpoint moves both, so a head left on the old
weights shows. tests/vllm and tests/sglang check the same on the real engines."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from backends.base import BackendRequestError, GenerateRequest, GenerateResult
from backends.devserver import DevServer
from backends.hf import HFBackend
from backends.sglang import SGLangBackend
from backends.tiny import ASSET_DIR, EARLY_DIR
from tests.sglang.scenarios import PROMPT


def probe(rid: str = "probe_t00") -> GenerateRequest:
    return GenerateRequest(
        "probe", list(PROMPT), {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}, rid=rid
    )


def same(a: GenerateResult, b: GenerateResult) -> None:
    assert a.token_ids == b.token_ids and a.logprobs is not None and b.logprobs is not None
    assert (
        max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    )  # float32 on one device: run-to-run equal


@pytest.fixture
async def fresh() -> GenerateResult:
    """The probe on a model loaded from the early checkpoint."""
    async with HFBackend(EARLY_DIR, device="cpu") as model:
        return await model.generate(probe())


def test_the_checkpoints_differ_in_the_tied_head():
    shipped, early = (
        AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in (ASSET_DIR, EARLY_DIR)
    )
    assert shipped.config.tie_word_embeddings and shipped.lm_head.weight is shipped.model.embed_tokens.weight
    assert not torch.equal(shipped.lm_head.weight, early.lm_head.weight)


async def test_the_embedded_model_updated_from_disk_or_tensors_serves_the_checkpoint(fresh):
    early = AutoModelForCausalLM.from_pretrained(EARLY_DIR, dtype=torch.float32).state_dict()
    async with HFBackend(ASSET_DIR, device="cpu") as model:
        before = await model.generate(probe())
        await model.update_weights_from_disk(str(EARLY_DIR), weight_version="1")
        same(await model.generate(probe()), fresh)
        await model.update_weights_from_disk(str(ASSET_DIR), weight_version="2")
        same(await model.generate(probe()), before)
        # a trainer's state dict without the tied head's own entry: the embedding moves the head with it
        await model.update_weights_from_tensor(
            named_tensors={k: v for k, v in early.items() if k != "lm_head.weight"}, weight_version="3"
        )
        same(await model.generate(probe()), fresh)
        # an untied head for a model that ties them: only one could serve, so nothing moves
        head = early["lm_head.weight"] + 1.0
        with pytest.raises(
            BackendRequestError,
            match="model.embed_tokens.weight and lm_head.weight, which the served "
            "model ties into one parameter",
        ):
            await model.update_weights_from_tensor(
                named_tensors={**early, "lm_head.weight": head}, weight_version="4"
            )
        assert model.weight_version == "3"
        same(await model.generate(probe()), fresh)


async def test_the_dev_server_updated_from_disk_serves_the_checkpoint(fresh):
    model = HFBackend(ASSET_DIR, device="cpu")
    try:
        async with DevServer(model, model_path=str(ASSET_DIR)) as dev, SGLangBackend(dev.url) as c:
            before = await c.generate(probe("dev_t00"))
            await c.update_weights_from_disk(str(EARLY_DIR), weight_version="5")
            after = await c.generate(probe("dev_t01"))
            assert after.weight_version == "5"
            same(after, fresh)
            await c.update_weights_from_disk(str(ASSET_DIR), weight_version="6")
            same(await c.generate(probe("dev_t02")), before)
    finally:
        await model.close()
