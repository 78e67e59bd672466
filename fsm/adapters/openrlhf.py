"""OpenRLHF: the engine as the `AgentExecutor` of `--train.agent_func_path`, over OpenRLHF's own vLLM engines: the
agent file is `AgentExecutor = agent_executor("specs/calculator.yaml")` (docs/trainers.md).

OpenRLHF 0.11 awaits `execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)` once per
sample and makes one Experience of the answer (`observation_tokens`, `action_ranges` of the model turns,
`rollout_log_probs`, the reward), so one trajectory runs per `execute`: the prompt is the row's chat messages
when it is a JSON list of them, the label the ground truth (or the row's columns, when a JSON object), and
every model turn goes to `llm_engine.generate` on the actor's loop with OpenRLHF's sampling parameters. A spec
whose trajectories may give several rows (segments, trees) is refused: `execute` answers one.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import Mapping
from typing import Any

from backends.function import FunctionBackend
from fsm.adapters.bridge import on_loop, one_row_per_sample
from fsm.api import RolloutEngine, SpecLike
from fsm.output.sample import Sample

log = logging.getLogger("agentfsm.openrlhf")
# OpenRLHF 0.11: each execute() answers with one dict that becomes one Experience, and its advantages group
# n_samples_per_prompt Experiences per prompt; a trajectory's segments would have no place.
OPENRLHF_ONE_ROW = "OpenRLHF's AgentExecutor.execute answers one sample with exactly one sequence"


def agent_executor(spec: SpecLike, **engine_options: Any) -> type:
    """An `AgentExecutor` class (a subclass of OpenRLHF's AgentExecutorBase) that runs `spec`."""
    spec = one_row_per_sample(spec, "agent_executor", OPENRLHF_ONE_ROW)
    from openrlhf.utils.agent import AgentExecutorBase  # the trainer's own class: imported where it runs

    class AgentExecutor(OpenRLHFRollout, AgentExecutorBase):  # OpenRLHF builds it without arguments
        def __init__(self) -> None:
            super().__init__(spec, **engine_options)

    return AgentExecutor


class OpenRLHFRollout:
    """One engine per rollout actor, built on the first `execute` (it needs OpenRLHF's tokenizer and engine)."""

    def __init__(self, spec: SpecLike, **engine_options: Any):
        self.spec = one_row_per_sample(spec, "OpenRLHFRollout", OPENRLHF_ONE_ROW)
        self.options = engine_options
        self.engine: RolloutEngine | None = None
        self._llm: Any = None  # OpenRLHF's rollout actor (its `generate`), and the loop it lives on
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sampling: Any = None  # the latest vllm.SamplingParams OpenRLHF sent: each request's template
        self._warned = False

    async def execute(
        self,
        prompt: Any,
        label: Any,
        sampling_params: Any,
        max_length: int,
        hf_tokenizer: Any,
        llm_engine: Any,
        images: Any = None,
    ) -> dict[str, Any]:
        if images:
            raise ValueError("agentfsm's OpenRLHF executor takes text prompts; this one came with images")
        self._llm, self._loop, self._sampling = llm_engine, asyncio.get_running_loop(), sampling_params
        if self.engine is None:
            backend = FunctionBackend(self._generate, model_name="openrlhf-vllm", provider="vllm")
            self.engine = RolloutEngine(self.spec, tokenizer=hf_tokenizer, backend=backend, **self.options)
        limits = self.engine.agent.limits
        if limits.prompt_length + limits.response_length > max_length and not self._warned:
            self._warned = True
            log.warning(
                "the spec's prompt_length + response_length (%d) exceed OpenRLHF's max_len %d: OpenRLHF "
                "cuts longer samples",
                limits.prompt_length + limits.response_length,
                max_length,
            )
        params = {
            "temperature": float(sampling_params.temperature),
            "top_p": float(sampling_params.top_p),
            "top_k": int(sampling_params.top_k) if (sampling_params.top_k or 0) > 0 else -1,
        }
        batch = await self.engine.agenerate_samples([to_row(prompt, label)], sampling_params=params)
        return to_openrlhf(
            batch.samples[0], prompt, label, with_logprobs=sampling_params.logprobs is not None
        )

    async def _generate(self, prompt_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """One model turn on OpenRLHF's engine, awaited on the actor's loop (the engine's own runs elsewhere)."""
        request = copy.deepcopy(self._sampling)
        request.max_tokens = int(params["max_new_tokens"])
        request.temperature, request.top_p = params["temperature"], params["top_p"]
        request.top_k = params.get("top_k", -1)
        request.stop_token_ids = list(params.get("stop_token_ids") or [])
        request.logprobs = 1  # the sampled token's logprob, always: the engine checks and keeps them
        request.min_tokens = 0  # the engine's turns may end at once (a stop id is a valid answer)
        if params.get("sampling_seed") is not None:
            request.seed = int(params["sampling_seed"])
        output = await on_loop(self._llm.generate(prompt_ids, request), self._loop)
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        logprobs = (
            [completion.logprobs[i][t].logprob for i, t in enumerate(ids)] if completion.logprobs else None
        )
        finish = completion.finish_reason if completion.finish_reason in ("stop", "length", "abort") else None
        return {"token_ids": ids, "logprobs": logprobs, "finish_reason": finish}


def to_row(prompt: Any, label: Any) -> dict[str, Any]:
    """OpenRLHF's (prompt, label) as a verl row."""
    messages: Any = prompt
    if isinstance(prompt, str) and prompt.lstrip().startswith("["):
        try:
            messages = json.loads(prompt)
        except ValueError:
            messages = prompt
    row: dict[str, Any] = {"raw_prompt": messages}
    fields = None
    if isinstance(label, str) and label.lstrip().startswith("{"):
        try:
            fields = json.loads(label)
        except ValueError:
            fields = None
    if isinstance(fields, Mapping):
        row.update(fields)
    elif label is not None:
        row["reward_model"] = {"ground_truth": label}
    return row


def action_ranges(mask: list[int], offset: int) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in `mask`, shifted by `offset` (the prompt's length)."""
    ranges: list[tuple[int, int]] = []
    start = None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            ranges.append((offset + start, offset + i))
            start = None
    return ranges


def to_openrlhf(sample: Sample, prompt: Any, label: Any, *, with_logprobs: bool) -> dict[str, Any]:
    """A flat sample as MultiTurnAgentExecutor's answer."""
    P = len(sample.prompt_ids)
    logprobs = None
    if with_logprobs and sample.logprobs is not None:
        logprobs = [0.0] * P + [lp if m else 0.0 for lp, m in zip(sample.logprobs, sample.mask)]
    reward = 0.0 if sample.failed else sample.reward
    return {
        "prompt": prompt,
        "label": label,
        "images": None,
        "mm_train_inputs": None,
        "reward": reward,
        "scores": reward,
        "observation_tokens": sample.prompt_ids + sample.response_ids,
        "action_ranges": action_ranges(sample.mask, P),
        "rollout_log_probs": logprobs,
        "truncated": sample.truncated,
        "extra_logs": {
            "num_turns": float(sample.num_turns),
            "tool_calls": float(sample.metrics["num_tool_calls"]),
            "failed": float(sample.failed),
        },
    }
