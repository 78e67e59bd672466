"""A kept continuous run across a real weight update on the suite's vLLM server (the early checkpoint), killed
with -9, then resumed: refused while vLLM serves another version, resumed with every token's version kept once
it serves the journal's again (tests/test_journal_weights.py). The server is left on its shipped weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backends.vllm import VLLMBackend
from tests.conftest import ASSETS
from tests.test_journal_weights import kill_across_an_update

pytestmark = pytest.mark.vllm


def test_a_resume_keeps_versions_across_a_real_update_and_refuses_another(vllm, tmp_path):
    def set_version(checkpoint: Path, version: int) -> None:
        async def update() -> None:
            async with VLLMBackend(vllm.url, max_retries=1, backoff_s=0.01) as c:
                await c.update_weights_from_disk(str(checkpoint), weight_version=str(version))

        asyncio.run(update())

    kill_across_an_update(
        tmp_path, vllm.url, ASSETS, vllm.model, vllm.early, set_version, v0=700, opt_in=False
    )
