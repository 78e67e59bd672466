"""The gateway's tests: harnesses from PyPI (and plain SDK loops) driven by a scripted model that writes the
family's tool-call format, so each harness really runs its tool and loops."""

from __future__ import annotations

from typing import Any

import pytest

from backends.scripted import ScriptedBackend
from fsm.api import load_tokenizer, tiny_model_dir

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>'
ANSWER = "The answer is 3.\n#### 3"


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return load_tokenizer(tiny_model_dir())


def scripted(tokenizer: Any, turns: list[str] | None = None) -> ScriptedBackend:
    """Every session: a calculator call, then the answer (each ending with eos), as the model would write them."""
    texts = turns or [CALL, ANSWER]
    ids = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]

    def turn(session: str, k: int, prompt: list[int]) -> list[int]:
        return ids[min(k, len(ids) - 1)]

    return ScriptedBackend(turn)


def row(question: str = "What is 1 + 2?", answer: str = "3") -> dict[str, Any]:
    return {
        "raw_prompt": [{"role": "user", "content": question}],
        "reward_model": {"ground_truth": answer},
        "data_source": "calculator",
    }


def assert_token_exact(traj: Any, backend: ScriptedBackend) -> None:
    """The row is exactly what the backend was given and gave: each request's prompt is the row's context up to
    that turn, and the row ends with the last answer's tokens."""
    requests = [r for r in backend.requests if r.session_id == traj.session_id]
    assert requests, "the backend saw no request for this row"
    context = traj.prompt_ids.tolist() + traj.response_ids.tolist()
    starts = [s for s in traj.runs if s.role == "assistant"]
    assert len(starts) == len(requests)
    for request, run in zip(requests, starts):
        assert request.prompt_ids == context[: len(traj.prompt_ids) + run.start]
    mask = traj.response_mask.tolist()
    for run in traj.runs:
        assert set(mask[run.start : run.end]) == ({1} if run.role == "assistant" else {0})
