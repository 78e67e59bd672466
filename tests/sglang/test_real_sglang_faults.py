"""Edges against real SGLang 0.5.23 (CPU engine, tiny model): a turn the context cuts (issue 26 item 8) and a
`retract` pause across a weight update (item 9). The session's server (tests/sglang/conftest.py) is reused;
every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from backends.sglang import SGLangBackend
from backends.tiny import EARLY_DIR
from tests.conftest import ASSETS
from tests.sglang.test_real_sglang import LONG, client, req, running

pytestmark = pytest.mark.sglang


async def _used_tokens(c: SGLangBackend) -> int:
    _, body = await c._call("GET", "/v1/loads")
    return int(body["loads"][0]["num_used_tokens"])


async def test_a_turn_the_context_cuts_says_so(sglang):
    """A 4,079-token prompt in a 4,096-token context: the client clamps the turn and SGLang cuts it further;
    the result says the context cut it."""
    async with client(sglang.url) as c:
        cut = await c.generate(req("ctx_t00", 64, prompt=[5] * 4079))
        whole = await c.generate(req("ctx_t01", 8))
        assert await c.flush_cache()  # a long context in the prefix cache slows the CPU engine down
    assert cut.finish_reason == "length" and 0 < len(cut.token_ids) < 17
    assert cut.extra["context_cut"] == 4096
    assert whole.finish_reason == "length" and len(whole.token_ids) == 8 and "context_cut" not in whole.extra


async def test_retract_keeps_the_tokens_made_before_it(sglang):
    """`pause_generation("retract")` puts a running request back in the queue with the tokens it made; after a
    weight update and continue it goes on from them: one turn, tokens of both versions, in order."""
    async with client(sglang.url) as c:
        turn = asyncio.ensure_future(c.generate(req("rtr_t00", LONG, ignore_eos=True)))
        await running(c)
        start = await _used_tokens(c)
        deadline = time.monotonic() + 120
        while await _used_tokens(c) < start + 8:  # some tokens made before the retraction
            assert time.monotonic() < deadline, "the request made no tokens"
            await asyncio.sleep(0.05)
        await c.pause_generation("retract")
        try:
            await c.update_weights_from_disk(str(EARLY_DIR), weight_version="301")
        finally:
            await c.continue_generation()
        out = await turn
        await c.update_weights_from_disk(str(ASSETS), weight_version="302")
    versions = out.extra["token_versions"]
    assert out.finish_reason == "length" and len(out.token_ids) == LONG
    made_before = versions.index("301")
    assert made_before >= 1 and set(versions[:made_before]) == {versions[0]} and versions[0] != "301"
    assert set(versions[made_before:]) == {"301"}  # the rest, after continue, by the new weights
