"""AReaL: the engine as a `RolloutWorkflow`, over AReaL's own inference engine: `FSMWorkflow(spec, tokenizer,
gconfig=config.gconfig)` wherever AReaL takes a workflow (`rollout_batch(data, workflow=...)`, docs/trainers.md).

AReaL 1.0's `arun_episode(engine, data)` runs one row as one trajectory: each model turn is one `agenerate` on
the episode's loop, under the trajectory's own rid (AReaL keeps a rid on one server), and every token keeps
the version AReaL reported for it (its staleness control reads them). The episode is AReaL's dict of [1, L]
tensors, or [B, L] for a trajectory of several rows (segments, a tree), as AReaL batches its own
multi-completion episodes, each row with its reward (a tree's also `weight` and `tree`); a failed episode, or
one without logprobs, is rejected (None). AReaL's group-level advantage normalization assumes a fixed number
of rows per prompt: with segments, normalize per batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import torch

from backends.base import GenerateRequest
from backends.function import FunctionBackend
from fsm.adapters.bridge import on_loop, tree_parts
from fsm.api import RolloutEngine, SpecLike, load_tokenizer
from fsm.output.sample import Sample

log = logging.getLogger("agentfsm.areal")
try:  # AReaL's own base class where it is installed; the adapter is usable (and testable) without it
    from areal.api.workflow_api import RolloutWorkflow as _WorkflowBase
except ImportError:  # pragma: no cover - without areal
    _WorkflowBase = object


class FSMWorkflow(_WorkflowBase):
    """AReaL's RolloutWorkflow running `spec` (see the module docstring). gconfig: AReaL's
    GenerationHyperparameters (temperature, top_p, top_k, greedy); None: the spec's sampling."""

    def __init__(
        self,
        spec: SpecLike,
        tokenizer: Any,
        gconfig: Any = None,
        *,
        policy: str | None = None,
        **engine_options: Any,
    ):
        self.spec, self.gconfig, self.options, self.policy = spec, gconfig, engine_options, policy
        self.tokenizer = load_tokenizer(tokenizer)
        self.engine: RolloutEngine | None = None
        self._areal: Any = None  # AReaL's inference engine, and the episode loop it is awaited on
        self._loop: asyncio.AbstractEventLoop | None = None

    async def arun_episode(self, engine: Any, data: Mapping[str, Any]) -> dict[str, Any] | None:
        self._areal, self._loop = engine, asyncio.get_running_loop()
        if self.engine is None:
            backend = FunctionBackend(self._generate, model_name="areal", provider="areal")
            self.engine = RolloutEngine(self.spec, tokenizer=self.tokenizer, backend=backend, **self.options)
        batch = await self.engine.agenerate_samples([to_row(data)], sampling_params=self._sampling())
        # one per segment of each row node of the episode's tree (one unless rewritten, forked or delegating)
        samples = [s for s in batch.samples if self.policy is None or s.tree["policy"] == self.policy]
        if any(s.logprobs is None for s in samples):  # AReaL's loss divides by them: never invented ones
            log.warning("episode rejected: AReaL's engine returned no logprobs (row %s)", samples[0].uid)
            return None
        trees = tree_parts(self.engine.agent) is not None
        if trees:  # a failed child or branch was an error observation for its parent: no row to train on
            samples = [s for s in samples if not s.failed]
        if not samples or samples[0].failed:
            return None
        if len(samples) == 1:
            return to_areal(samples[0], tree=trees)
        # AReaL's own batching, as for its multi-completion episodes
        from areal.utils.data import concat_padded_tensors

        return concat_padded_tensors([to_areal(s, tree=trees) for s in samples])

    def _sampling(self) -> dict[str, Any]:
        g = self.gconfig
        if g is None:
            return {}
        top_k = int(getattr(g, "top_k", -1))
        assert self.engine is not None  # built by arun_episode before it asks
        return {
            "temperature": 0.0 if getattr(g, "greedy", False) else float(g.temperature),
            "top_p": float(g.top_p),
            "top_k": top_k if 0 < top_k < self.engine.codec.vocab_size else -1,
        }

    async def _generate(
        self, prompt_ids: list[int], params: dict[str, Any], request: GenerateRequest
    ) -> dict[str, Any]:
        """One model turn on AReaL's engine, in AReaL's own request type."""
        from areal.api import ModelRequest
        from areal.api.cli_args import GenerationHyperparameters

        base = self.gconfig if self.gconfig is not None else GenerationHyperparameters()
        temperature = float(params.get("temperature", 1.0))
        gconfig = base.new(
            n_samples=1,
            max_new_tokens=int(params["max_new_tokens"]),
            min_new_tokens=0,
            greedy=temperature == 0.0,
            temperature=temperature,
            top_p=float(params.get("top_p", 1.0)),
            top_k=int(params["top_k"]) if params.get("top_k", -1) > 0 else int(1e8),
            stop_token_ids=list(params.get("stop_token_ids") or []),
            stop=None,
            max_tokens=len(prompt_ids) + int(params["max_new_tokens"]),
        )
        req = ModelRequest(
            rid=request.session_id, input_ids=list(prompt_ids), gconfig=gconfig, tokenizer=self.tokenizer
        )
        resp = await on_loop(self._areal.agenerate(req), self._loop)
        finish = {"tool_calls": "stop"}.get(resp.stop_reason, resp.stop_reason)
        return {
            "token_ids": list(resp.output_tokens),
            "logprobs": list(resp.output_logprobs),
            "finish_reason": finish if finish in ("stop", "length", "abort") else None,
            "versions": list(resp.output_versions),
        }

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def to_row(data: Mapping[str, Any]) -> dict[str, Any]:
    """An AReaL dataset row as a verl row."""
    row = dict(data)
    if "raw_prompt" not in row and "prompt" not in row and "messages" in row:
        row["raw_prompt"] = row.pop("messages")
    if "reward_model" not in row and row.get("answer") is not None:
        row["reward_model"] = {"ground_truth": row["answer"]}
    return row


def to_areal(sample: Sample, tree: bool = False) -> dict[str, Any]:
    """A flat sample as AReaL's episode: [1, L] tensors over prompt + response (with `tree`, also its `weight`
    [1] and its place in its tree, `tree`: [dict]). A sample without logprobs is refused (ValueError): AReaL's
    loss divides by them, and zeros would read as probability 1."""
    P = len(sample.prompt_ids)
    logprobs = sample.logprobs
    if logprobs is None or len(logprobs) != len(sample.response_ids):
        what = (
            "no logprobs"
            if logprobs is None
            else f"{len(logprobs)} logprobs for {len(sample.response_ids)} tokens"
        )
        raise ValueError(
            f"row {sample.uid}: the sample has {what}; AReaL's episode needs one per response token"
        )
    out = {
        "input_ids": torch.tensor(sample.prompt_ids + sample.response_ids, dtype=torch.int32),
        "logprobs": torch.tensor(
            [0.0] * P + [lp if m else 0.0 for lp, m in zip(logprobs, sample.mask)], dtype=torch.float32
        ),
        "loss_mask": torch.tensor([0] * P + sample.mask, dtype=torch.int32),
        "versions": torch.tensor([-1] * P + sample.versions, dtype=torch.int32),
        "rewards": torch.tensor(0.0 if sample.reward is None else sample.reward, dtype=torch.float32),
        "attention_mask": torch.ones(P + len(sample.response_ids), dtype=torch.bool),
    }
    episode: dict[str, Any] = {k: v.unsqueeze(0) for k, v in out.items()}
    if tree:
        episode["weight"] = torch.tensor([sample.tree["weight"]], dtype=torch.float32)
        episode["tree"] = [dict(sample.tree)]
    return episode
