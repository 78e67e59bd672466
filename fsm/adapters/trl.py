"""TRL: the engine as `GRPOTrainer(rollout_func=...)`, multi-turn agents with tools included (docs/trainers.md:
`rollout_func=TRLRollout(spec, dataset=...)`, `reward_funcs=[engine_reward]`).

TRL 1.x (`GRPOTrainer._generate`) hands over only the prompts, each repeated `num_generations` times, and takes
back per prompt `prompt_ids`, `completion_ids`, `logprobs` and any key for the reward functions (`env_mask`:
the tool mask). So each prompt is one trajectory, consecutive equal prompts one GRPO group, its dataset row
found in `dataset` by its prompt, and sampling uses the trainer's settings, so the logprobs TRL recomputes are
over the same distribution; by default the trainer's own model generates (the same module, no copy). A failed
row follows `failures.on_error` (docs/trainers.md); a step whose rows all failed stops the run
(AllRowsFailed). A spec that gives several rows per prompt (segments, trees) is refused when the adapter is
made: TRL takes one completion per prompt.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from fsm.adapters.bridge import one_row_per_sample
from fsm.api import RolloutEngine, SpecLike
from fsm.data.rows import normalize_record
from fsm.output.sample import Sample, SampleBatch

log = logging.getLogger("agentfsm.trl")
REWARD_KEY = "agentfsm_reward"
# trl 1.x GRPOTrainer._generate scores rollout_func's answers against its `inputs` (one per prompt) and groups
# the rewards by num_generations: one completion per prompt, so a trajectory's segments have no place.
TRL_ONE_ROW = "TRL's GRPOTrainer takes exactly one completion per prompt from rollout_func"


def engine_reward(
    completions: list[Any], agentfsm_reward: list[float | None], **kwargs: Any
) -> list[float | None]:
    """A TRL reward function: the spec's reward, as the rollout computed it (None: a failed row the spec's
    on_error drops)."""
    return list(agentfsm_reward)


def prompt_key(prompt: Any) -> str:
    """A prompt (chat messages or text) as a lookup key."""
    return json.dumps(prompt, sort_keys=True, default=str)


class TRLRollout:
    """`rollout_func` for trl's GRPOTrainer (see the module docstring).

    spec: the agent (path, shipped name, AgentSpec or CompiledAgent). dataset: the training (and eval) rows,
    to find each prompt's ground truth; `to_row` turns one dataset example into a verl row (default: `prompt`
    becomes `raw_prompt`, every other column kept, so `reward_model`, `extra_info`... reach the spec's reward).
    engine: a RolloutEngine to use instead of one over the trainer's model. engine_options: for that one
    (max_concurrency, tracer, check_tokens...).
    """

    def __init__(
        self,
        spec: SpecLike,
        *,
        dataset: Iterable[Mapping[str, Any]] | None = None,
        to_row: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None,
        engine: RolloutEngine | None = None,
        prompt_column: str = "prompt",
        **engine_options: Any,
    ):
        self.spec = spec if engine is not None else one_row_per_sample(spec, "TRLRollout", TRL_ONE_ROW)
        self.engine = engine
        if engine is not None:
            one_row_per_sample(engine.agent, "TRLRollout", TRL_ONE_ROW)
        self._own_engine = engine is None
        self._options = engine_options
        self._to_row = to_row or (lambda example: normalize_record(dict(example), prompt_column))
        self._rows: dict[str, dict[str, Any]] = {}
        self._prompt_column = prompt_column
        if dataset is not None:
            self.add_rows(dataset)
        self.calls = 0
        self.last: SampleBatch | None = None

    def add_rows(self, dataset: Iterable[Mapping[str, Any]]) -> None:
        """Index more dataset rows by their prompt (e.g. the eval set)."""
        for example in dataset:
            key = prompt_key(example[self._prompt_column])
            row = self._to_row(example)
            if self._rows.setdefault(key, row) is not row and self._rows[key] != row:
                log.warning(
                    "two dataset rows share a prompt; the first one's columns are used: %s", key[:120]
                )

    def __call__(self, prompts: Sequence[Any], trainer: Any) -> dict[str, list[Any]]:
        engine = self._engine_for(trainer)
        step = int(trainer.state.global_step)
        training = bool(trainer.model.training)  # TRL's mode: eval rollouts use the spec's val_sampling
        model = engine.backend.model if self._own_engine else None  # type: ignore[attr-defined]
        if model is not None:
            engine.backend.weight_version = str(step)  # type: ignore[attr-defined]  # each token's version
            model.eval()  # no dropout while sampling; TRL's mode is put back below
        try:
            batch = engine.generate_samples(
                self._rows_for(prompts, step),
                sampling_params=sampling_params(trainer.args),
                validate=not training,
            )
        finally:
            if model is not None:
                model.train(training)
        self.calls += 1
        self.last = batch  # the samples and meta_info behind the last answer (sampling, rollout_metrics)
        if batch.samples and all(s.failed for s in batch.samples):
            raise AllRowsFailed(step, batch.samples)
        log_metrics(trainer, batch.meta_info["rollout_metrics"], "train" if training else "eval")
        return to_trl(batch.samples, pad_id=engine.codec.pad_id)

    def _rows_for(self, prompts: Sequence[Any], step: int) -> list[dict[str, Any]]:
        rows, group = [], -1
        for i, prompt in enumerate(prompts):
            if i == 0 or prompt != prompts[i - 1]:
                group += 1
            row = dict(self._rows.get(prompt_key(prompt)) or normalize_record({"raw_prompt": prompt}))
            row["uid"] = f"trl-{step}-{self.calls}-{group}"
            rows.append(row)
        return rows

    def _engine_for(self, trainer: Any) -> RolloutEngine:
        if self.engine is None:
            from backends.hf import HFBackend

            model = trainer.accelerator.unwrap_model(trainer.model)
            training = model.training
            # the trainer's module itself: sampling always sees the current weights
            backend = HFBackend(model)
            model.train(training)
            self.engine = RolloutEngine(
                self.spec, tokenizer=trainer.processing_class, backend=backend, **self._options
            )
        return self.engine

    def close(self) -> None:
        """Close the engine this adapter built (one given to it stays the caller's)."""
        if self._own_engine and self.engine is not None:
            self.engine.close()
            self.engine = None


class AllRowsFailed(RuntimeError):
    """Every row of a step's rollout ended in error: there is nothing to train on (TRL would take a step on
    masked error rows, and a run whose every step does so ends 'successfully' having learnt nothing)."""

    def __init__(self, step: int, samples: Sequence[Sample]):
        reasons: dict[str, int] = {}
        for s in samples:
            reasons[s.termination_reason] = reasons.get(s.termination_reason, 0) + 1
        common = max(reasons, key=reasons.__getitem__)
        super().__init__(
            f"TRL step {step}: all {len(samples)} rows of the rollout ended in error, so there is "
            f"nothing to train on; the most common ({reasons[common]}): {common}"
        )


def sampling_params(args: Any) -> dict[str, Any]:
    """The trainer's sampling settings in SGLang's names: TRL divides the logits by `temperature` when it
    recomputes logprobs, so the engine must sample at the same one. TRL's top_k 0 / None means no cut."""
    params: dict[str, Any] = {"temperature": float(args.temperature), "top_p": float(args.top_p)}
    top_k = getattr(args, "top_k", None)
    params["top_k"] = int(top_k) if top_k else -1
    if getattr(args, "min_p", None) is not None:
        params["min_p"] = float(args.min_p)
    if getattr(args, "repetition_penalty", None) is not None:
        params["repetition_penalty"] = float(args.repetition_penalty)
    return params


def to_trl(samples: Sequence[Sample], *, pad_id: int) -> dict[str, list[Any]]:
    """Flat samples -> rollout_func's return value."""
    keys = ("prompt_ids", "completion_ids", "logprobs", "env_mask", REWARD_KEY, "termination_reason")
    out: dict[str, list[Any]] = {key: [] for key in (*keys, "num_turns", "turn_rewards")}
    for s in samples:
        ids, mask = s.response_ids, s.mask
        logprobs: Sequence[float | None] | None = s.logprobs
        if not ids:  # TRL reads completion_ids[-1]: a failed row is one masked pad token
            ids, mask, logprobs = [pad_id], [0], [None]
        out["prompt_ids"].append(s.prompt_ids)
        out["completion_ids"].append(ids)
        # None (NaN in TRL) where a server gave no logprob: never an invented 0.0
        out["logprobs"].append(list(logprobs) if logprobs is not None else [None] * len(ids))
        out["env_mask"].append(mask)
        out[REWARD_KEY].append(failed_reward(s) if s.failed else s.reward)
        out["termination_reason"].append(s.termination_reason)
        out["num_turns"].append(s.num_turns)
        out["turn_rewards"].append([tuple(r) for r in s.turn_rewards])
    return out


def failed_reward(sample: Sample) -> float | None:
    """A failed row's reward as the spec's on_error says: None (TRL leaves the row out of its group's baseline)
    for `drop`, 0.0 for `mask` and `zero_reward`."""
    return None if sample.on_error == "drop" else 0.0


def log_metrics(trainer: Any, metrics: Mapping[str, float], mode: str) -> None:
    """Into TRL's own metric buffers (averaged and logged with its rewards and losses at each logging step)."""
    buffers = getattr(trainer, "_metrics", None)
    if isinstance(buffers, Mapping) and mode in buffers:
        for key, value in metrics.items():
            buffers[mode][key].append(value)
