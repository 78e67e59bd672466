"""fsm.adapters.areal.to_areal without AReaL installed (the adapter's episode layout; AReaL's own classes run in
tests/areal): every [1, L] tensor spans the same prompt + response, and a sample without logprobs is refused
in one line instead of coming back with a logprobs tensor shorter than input_ids (issue 27.19)."""

from __future__ import annotations

import pytest

from backends.function import FunctionBackend
from fsm.adapters.areal import to_areal
from fsm.api import RolloutEngine
from tests.conftest import model_turn, tool_turn, user_row


def samples(tok, with_logprobs: bool):
    """Real samples of the calculator (a tool call, its result, the answer) from a backend that does or does not
    send logprobs."""
    turns = [
        tool_turn(tok, ("calculator", {"expression": "1 + 2"})),
        model_turn(tok, "The answer is 3.\n#### 3"),
    ]

    async def generate(prompt_ids, params):
        ids = turns[generate.k % 2]  # the call first, the answer after the tool's result
        generate.k += 1
        return {"token_ids": ids, "logprobs": [-0.5] * len(ids) if with_logprobs else None}

    generate.k = 0
    with RolloutEngine("calculator", tok, backend=FunctionBackend(generate)) as engine:
        return engine.generate_samples([user_row(uid="row-1", reward_model={"ground_truth": "3"})]).samples


@pytest.mark.parametrize("with_logprobs", [True, False])
def test_every_tensor_spans_the_whole_sequence_or_the_sample_is_refused(tok, with_logprobs):
    (sample,) = samples(tok, with_logprobs)
    assert not sample.failed and sample.num_turns >= 3 and 0 in sample.mask  # the tool's answer: mask 0
    if not with_logprobs:
        assert sample.logprobs is None
        with pytest.raises(ValueError, match="row row-1: the sample has no logprobs"):
            to_areal(sample)
        return
    ep = to_areal(sample)
    L = len(sample.prompt_ids) + len(sample.response_ids)
    assert {k: tuple(v.shape) for k, v in ep.items()} == {
        "input_ids": (1, L),
        "logprobs": (1, L),
        "loss_mask": (1, L),
        "versions": (1, L),
        "attention_mask": (1, L),
        "rewards": (1,),
    }
    on = ep["loss_mask"][0] == 1
    assert (ep["logprobs"][0][on] == -0.5).all() and (ep["logprobs"][0][~on] == 0).all()
