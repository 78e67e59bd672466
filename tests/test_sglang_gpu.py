"""The production path against a real `sglang.launch_server` (GPU hosts only; skipped cleanly elsewhere).

Launches SGLang on the shipped tiny model (or AGENTFSM_SGLANG_MODEL), runs the calculator spec through the
router, and checks the token contract end to end: real engine logprobs on mask-1 tokens only.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None, reason="needs sglang (pip install 'agentfsm[sglang]')"
    ),
]


async def test_calculator_through_real_sglang(tmp_path):
    from backends.launcher import SGLangLauncher
    from backends.router import Router
    from backends.sglang import SGLangBackend
    from backends.tiny import ASSET_DIR, load_tokenizer
    from fsm import Runner, collate, compile_spec
    from specs.calculator import make_prompts

    model = os.environ.get("AGENTFSM_SGLANG_MODEL", str(ASSET_DIR))
    agent = compile_spec("specs/calculator.yaml")
    async with SGLangLauncher(
        model, dp=1, base_port=31000, mem_fraction=0.3, log_dir=tmp_path, extra_args=["--skip-tokenizer-init"]
    ) as launcher:
        async with Router([SGLangBackend(url) for url in launcher.urls]) as router:
            runner = Runner(agent, router, load_tokenizer(), check_tokens=True)
            trajs = await runner.run(make_prompts(8, seed=7), n=2, sampling_params={"temperature": 0.0})
            stats = router.stats()
    assert all(t.error is None for t in trajs), [t.termination_reason for t in trajs]
    assert all(t.token_check is None for t in trajs)
    for t in trajs:
        mask, logprobs = list(t.response_mask), list(t.response_logprobs)
        assert all(lp <= 0.0 for m, lp in zip(mask, logprobs) if m == 1)
        assert all(lp == 0.0 for m, lp in zip(mask, logprobs) if m == 0)
    batch = collate(
        trajs,
        prompt_length=agent.limits.prompt_length,
        response_length=agent.limits.response_length,
        pad_token_id=0,
    )
    assert batch.batch["responses"].shape == (16, agent.limits.response_length)
    assert stats["sticky"] > 0
