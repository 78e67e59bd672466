"""SkyRL: the engine as a `GeneratorInterface` over SkyRL's own inference engines (docs/trainers.md: a
`BasePPOExp.get_generator` that returns `FSMGenerator(spec, tokenizer, inference_engine_client)`).

`generate(GeneratorInput)` runs each prompt (already repeated `n_samples_per_prompt` times) as one trajectory
with its `env_extras` as the row, grouped by `trajectory_ids[i].instance_id`, every model turn sent to SkyRL's
client (token in, token out, on the trainer's loop), and returns a `GeneratorOutput` in order. A failed row is
one masked token with reward 0.0: SkyRL reads the last response token. A spec whose trajectories give several
rows (segments, trees) needs SkyRL's step-wise training (`generator.step_wise_trajectories: true` and
`step_wise=True`: each segment one row, `is_last_step` on the last; trees: docs/trainers.md), and is refused
without it when the generator is made.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from backends.function import FunctionBackend
from fsm.adapters.bridge import on_loop, one_row_per_sample
from fsm.api import RolloutEngine, SpecLike
from fsm.output.sample import Sample

log = logging.getLogger("agentfsm.skyrl")
try:  # SkyRL's own base class where it is installed; the adapter is usable (and testable) without it
    from skyrl_train.generators.base import GeneratorInterface as _GeneratorBase
except ImportError:  # pragma: no cover - without skyrl_train
    _GeneratorBase = object


class FSMGenerator(_GeneratorBase):
    """SkyRL's GeneratorInterface running `spec` (see the module docstring)."""

    def __init__(
        self,
        spec: SpecLike,
        tokenizer: Any,
        inference_engine_client: Any,
        *,
        step_wise: bool = False,
        policy: str | None = None,
        **engine_options: Any,
    ):
        if not step_wise:
            spec = one_row_per_sample(
                spec,
                "FSMGenerator",
                "SkyRL takes one response per prompt unless "
                "generator.step_wise_trajectories is set (then pass step_wise=True)",
                trees="each node's rows are then SkyRL steps",
            )
        self.step_wise, self.policy = step_wise, policy
        self.client = inference_engine_client
        self._loop: asyncio.AbstractEventLoop | None = None  # the trainer's loop, where the client is awaited
        self._request: dict[str, Any] = {}  # SkyRL's sampling params of the batch in flight
        backend = FunctionBackend(self._generate, model_name="skyrl", provider="skyrl")
        self.engine = RolloutEngine(spec, tokenizer=tokenizer, backend=backend, **engine_options)

    async def generate(self, input_batch: Mapping[str, Any]) -> dict[str, Any]:
        self._loop = asyncio.get_running_loop()
        self._request = dict(input_batch.get("sampling_params") or {})
        meta = input_batch.get("batch_metadata")
        phase = getattr(meta, "training_phase", "train")
        ids = input_batch.get("trajectory_ids")
        extras = input_batch.get("env_extras") or [None] * len(input_batch["prompts"])
        rows = [
            to_row(p, e, ids[i].instance_id if ids else None)
            for i, (p, e) in enumerate(zip(input_batch["prompts"], extras))
        ]
        params = engine_sampling(self._request)
        batch = await self.engine.agenerate_samples(rows, sampling_params=params, validate=phase == "eval")
        samples = batch.samples
        if self.policy is not None:
            samples = [s for s in samples if s.tree["policy"] == self.policy]
        steps = trajectory_steps(samples, ids) if self.step_wise else None
        if steps is not None:
            samples = [samples[k] for k, _, _ in steps]
        out = to_skyrl(samples, pad_id=self.engine.codec.pad_id, with_logprobs=params.get("logprobs", True))
        out["rollout_metrics"] = batch.meta_info["rollout_metrics"]
        out["trajectory_ids"] = ids
        if steps is not None:  # one row per step: each names its trajectory, the last of them says so
            out["trajectory_ids"] = [t for _, t, _ in steps] if ids else None
            out["is_last_step"] = [last for _, _, last in steps]
            out["tree_rows"] = [dict(s.tree) for s in samples]
        return out

    async def _generate(self, prompt_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """One model turn through SkyRL's client, in the names of SkyRL's backend (vllm or sglang)."""
        request = {
            k: v for k, v in self._request.items() if k not in ("stop", "min_tokens", "min_new_tokens")
        }
        sglang = "max_new_tokens" in request and "max_tokens" not in request
        request["max_new_tokens" if sglang else "max_tokens"] = int(params["max_new_tokens"])
        for key in ("temperature", "top_p", "top_k"):
            request[key] = params[key]
        request["stop_token_ids"] = list(params.get("stop_token_ids") or [])
        if params.get("sampling_seed") is not None:
            request["sampling_seed" if sglang else "seed"] = int(params["sampling_seed"])
        output = await on_loop(
            self.client.generate(
                {
                    "prompts": None,
                    "prompt_token_ids": [prompt_ids],
                    "sampling_params": request,
                    "session_ids": None,
                }
            ),
            self._loop,
        )
        logprobs = output.get("response_logprobs")
        finish = output["stop_reasons"][0]
        return {
            "token_ids": list(output["response_ids"][0]),
            "logprobs": list(logprobs[0]) if logprobs else None,
            "finish_reason": finish if finish in ("stop", "length", "abort") else None,
        }

    def close(self) -> None:
        self.engine.close()


def engine_sampling(request: Mapping[str, Any]) -> dict[str, Any]:
    """SkyRL's sampling params -> the engine's overrides. Logprobs only when SkyRL asks for them (vLLM's
    `logprobs` set; SkyRL's sglang backend returns none)."""
    top_k = request.get("top_k")
    return {
        "temperature": float(request.get("temperature", 1.0)),
        "top_p": float(request.get("top_p", 1.0)),
        "top_k": int(top_k) if top_k and top_k > 0 else -1,
        "logprobs": request.get("logprobs") is not None,
    }


def to_row(prompt: Any, extras: Mapping[str, Any] | None, uid: str | None) -> dict[str, Any]:
    """A SkyRL prompt and its env_extras as a verl row."""
    row: dict[str, Any] = {k: v for k, v in (extras or {}).items()}
    row["raw_prompt"] = prompt
    if "reward_model" not in row and isinstance(row.get("reward_spec"), Mapping):
        row["reward_model"] = dict(row["reward_spec"])
    if uid is not None:
        row["uid"] = str(uid)
    return row


def trajectory_steps(samples: Sequence[Sample], ids: Sequence[Any] | None) -> list[tuple[int, Any, bool]]:
    """SkyRL's step-wise order: (sample index, its TrajectoryID, is_last_step) per row. A trajectory is a root
    that did not fork or a branch (see the module docstring); a child's rows join the trajectory that started it,
    placed before that one's own rows, so every trajectory's rows are contiguous and end with its last step."""
    where = {(s.tree["tree"], s.tree["node"]): s.tree for s in samples}

    def owner(t: Mapping[str, Any]) -> str:  # the node whose trajectory a row belongs to
        while t["node_kind"] == "child" and (t["tree"], t["parent"]) in where:
            t = where[(t["tree"], t["parent"])]
        return str(t["node"])

    groups: dict[tuple[str, str], list[int]] = {}
    for k, s in enumerate(samples):  # preorder: a trajectory's node comes before the children it started
        key = (s.tree["tree"], owner(s.tree))
        groups.setdefault(key, []).append(k)
    fresh: dict[str, int] = {}  # instance -> the next repetition id no input trajectory has
    for given in ids or []:
        fresh[given.instance_id] = max(fresh.get(given.instance_id, 0), given.repetition_id + 1)
    out: list[tuple[int, Any, bool]] = []
    for (_, node), rows in groups.items():
        own = [k for k in rows if samples[k].tree["node"] == node]  # the trajectory's own segments, last
        rows = [k for k in rows if k not in own] + own
        tid: Any = None
        if ids:
            tid = ids[samples[rows[-1]].index]
            if node != "0":  # a branch (or an orphaned child): a repetition of its own in the same group
                tid = type(tid)(instance_id=tid.instance_id, repetition_id=fresh[tid.instance_id])
                fresh[tid.instance_id] += 1
        out += [(k, tid, i == len(rows) - 1) for i, k in enumerate(rows)]
    return out


def to_skyrl(samples: Sequence[Sample], *, pad_id: int, with_logprobs: bool) -> dict[str, Any]:
    """Flat samples -> GeneratorOutput's per-sample lists."""
    out: dict[str, Any] = {
        "prompt_token_ids": [],
        "response_ids": [],
        "rewards": [],
        "loss_masks": [],
        "stop_reasons": [],
        "rollout_logprobs": [] if with_logprobs else None,
    }
    for s in samples:
        ids, mask, logprobs = s.response_ids, s.mask, s.logprobs
        if not ids:  # SkyRL reads the last response token: a failed row is one masked pad token
            ids, mask, logprobs = [pad_id], [0], [0.0]
        out["prompt_token_ids"].append(s.prompt_ids)
        out["response_ids"].append(ids)
        out["loss_masks"].append(mask)
        out["rewards"].append(0.0 if s.failed or s.reward is None else float(s.reward))
        out["stop_reasons"].append("length" if s.truncated else "stop")
        if out["rollout_logprobs"] is not None:
            if logprobs is None:  # a server gave none: SkyRL then gets none at all, never invented values
                log.warning("rollout_logprobs left out: a sample's server returned no logprobs")
                out["rollout_logprobs"] = None
            else:
                out["rollout_logprobs"].append(list(logprobs))
    return out
