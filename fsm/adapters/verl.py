"""Run an agentfsm spec as a verl 0.9.1 agent loop: `agent_name: fsm_agent` (docs/verl.md: the entry, a row, and
where each setting comes from).

verl's AgentLoopWorker builds one loop instance per sample with `hydra.utils.instantiate(entry,
trainer_config=..., server_manager=..., tokenizer=..., processor=..., hf_model_type=..., dataset_cls=...,
data_config=..., tools=...)` and awaits `run(sampling_params, **row)`. `FSMAgentLoop` is that loop: it drives
the spec's compiled machine with verl's own server manager as the backend, verl's tokenizer and (when the
spec declares no tools) verl's tools, and returns verl's `AgentLoopOutput`. This is the only module of
agentfsm that imports verl; `import fsm` never does.

Importing this module also registers the class as `fsm_agent` when no entry of that name is loaded: a
process that imports it can use `agent_name: fsm_agent` without an entry, and then runs
specs/tool_agent.yaml (verl's ToolAgentLoop as a spec). A loaded entry is never replaced (`_register_default`).
Text only: multimodal prompts and tool images are not supported.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from uuid import uuid4

from omegaconf import DictConfig, ListConfig, OmegaConf
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    ToolListWrap,
    register,
)
from verl.utils.rollout_trace import rollout_trace_op

from backends.base import BaseBackend, GenerateRequest, GenerateResult
from fsm.adapters.bridge import SEGMENTS_ELSEWHERE, TREES_ELSEWHERE, one_row
from fsm.families import Codec, codec_for
from fsm.run.compile import CompiledAgent, compile_spec
from fsm.run.runtime import Runner
from fsm.run.trajectory import Trajectory
from fsm.spec.loader import load_spec
from fsm.spec.model import SPECS_DIR, LimitsSpec, ToolPolicySpec
from fsm.tools.base import BoundTool, FunctionTool, ToolSet, tool_retry
from fsm.tools.isolation import InlineLane

logger = logging.getLogger("agentfsm.verl")

DEFAULT_SPEC = SPECS_DIR / "tool_agent.yaml"  # verl's ToolAgentLoop as a spec
_BATCH_SHAPES = ("prompt_length", "response_length")
# Sampling keys the engine takes from verl's sampling_params (vLLM's max_tokens is its max_new_tokens);
# anything else goes to verl's server unchanged.
_ENGINE_SAMPLING = frozenset(
    "temperature top_p top_k repetition_penalty min_p frequency_penalty presence_penalty stop_token_ids seed "
    "logprobs max_new_tokens".split()
)
_LIFECYCLE = ("create", "execute", "calc_reward", "release")
_SPEC_DECODE_KEYS = ("spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_verify_steps")


# --- per-process caches: nothing below is built per sample -----------------------------------------------

_lock = threading.Lock()
# spec path -> the loaded spec; (spec path, limit and tool_policy overrides, P, R) -> compiled agent
_loaded: dict[str, Any] = {}
_agents: dict[tuple, CompiledAgent] = {}
# (agent id, tool ids) -> (agent with verl's tools, the tools: kept alive so their ids stay theirs)
_with_tools: dict[tuple, tuple[CompiledAgent, list]] = {}
# (tokenizer id, template kwargs) -> (tokenizer, codec)
_codecs: dict[tuple, tuple[Any, Codec]] = {}
_warned: set[str] = set()
_checked: set[tuple[int, int]] = set()  # (id of verl's multi_turn config, id of the agent) already compared


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def resolve_spec_path(spec: str | Path) -> Path:
    """A spec path as written in the config entry: absolute, relative to the cwd, or to the checkout."""
    path = Path(spec).expanduser()
    for candidate in (path, SPECS_DIR.parent / path, SPECS_DIR / path):
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(
        f"fsm_agent: spec {str(spec)!r} not found (tried it as given, relative to the cwd, "
        f"and under {SPECS_DIR.parent})"
    )


def compiled_agent(
    spec: str | Path,
    limits: Mapping[str, Any],
    prompt_length: int,
    response_length: int,
    tool_policy: Mapping[str, Any] | None = None,
) -> CompiledAgent:
    """The spec compiled once per process with verl's batch shapes, its prompt policy and the entry's overrides."""
    policy = dict(tool_policy or {})
    # the spec as written (and the cwd it is relative to): resolving the path is left to a miss
    overrides = json.dumps([dict(limits), policy], sort_keys=True, default=str)
    key = (str(spec), os.getcwd(), overrides, prompt_length, response_length)
    with _lock:
        agent = _agents.get(key)
        if agent is None:
            path = resolve_spec_path(spec)
            loaded = _loaded.get(str(path)) or _loaded.setdefault(str(path), load_spec(path))
            merged = {
                **loaded.spec.limits.model_dump(),
                "prompt_overflow": "truncate_left",
                **limits,
                "prompt_length": prompt_length,
                "response_length": response_length,
            }
            update = {
                "limits": LimitsSpec.model_validate(merged),
                "tool_policy": ToolPolicySpec.model_validate(
                    {**loaded.spec.tool_policy.model_dump(), **policy}
                ),
            }
            spec = loaded.spec.model_copy(update=update)
            agent = _agents[key] = compile_spec(dataclasses.replace(loaded, spec=spec))
        return agent


def agent_with_verl_tools(agent: CompiledAgent, tools: list) -> CompiledAgent:
    """The agent with verl's tool list as its ToolSet (for specs that declare no tools of their own)."""
    key = (id(agent), tuple(id(t) for t in tools))
    with _lock:
        hit = _with_tools.get(key)
        if hit is None:
            derived = copy.copy(agent)  # shares the machine, edges and actions; only the tools differ
            derived.tools = ToolSet([_bind_verl_tool(t) for t in tools], agent.limits, agent.spec.tool_policy)
            hit = _with_tools[key] = (derived, list(tools))
        return hit[0]


def _bind_verl_tool(tool: Any) -> BoundTool:
    """A verl tool as an engine tool, run where verl runs it: coroutines on the worker's event loop (with the
    engine's check that a step never holds the loop: one that does moves to a loop thread of its own), a sync
    @function_tool in threads (verl: asyncio.to_thread). verl has no timeouts or retries, so none are added."""
    schema = tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)  # as verl renders it
    if callable(getattr(tool, "execute", None)):  # a BaseTool: create -> execute -> calc_reward -> release
        impl = tool
        awaits = all(inspect.iscoroutinefunction(getattr(tool, m, None)) for m in _LIFECYCLE)
        lane = InlineLane(tool.name) if awaits else None  # None: its own loop thread (BoundTool's default)
    elif callable(getattr(tool, "fn", None)):  # a @function_tool: a plain function, no lifecycle
        impl = FunctionTool(
            tool.fn, schema, InlineLane(tool.name) if inspect.iscoroutinefunction(tool.fn) else None
        )
        lane = None  # the FunctionTool's own
    else:
        raise TypeError(f"fsm_agent: verl tool {tool!r} has neither execute() nor fn")
    return BoundTool(tool.name, impl, schema, timeout_s=None, retry=tool_retry(1, 0.0), lane=lane)


def chat_codec(
    tokenizer: Any, template_kwargs: Mapping[str, Any], family: str = "auto", special_tokens: str = "text"
) -> Codec:
    kwargs = dict(template_kwargs)
    key = (id(tokenizer), json.dumps(kwargs, sort_keys=True, default=str), family, special_tokens)
    with _lock:
        hit = _codecs.get(key)
        if hit is None:
            codec = codec_for(tokenizer, family, kwargs, special_tokens)
            hit = _codecs[key] = (tokenizer, codec)
        return hit[1]


def _plain(value: Any) -> Any:
    """DictConfig/ListConfig (what hydra passes for nested entry keys) and numpy values -> plain Python."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()  # numpy arrays (verl's object columns) and numpy scalars
    return value


# --- the backend: verl's server manager behind the engine's Backend protocol -------------------------------


class VerlServerBackend(BaseBackend):
    """`server_manager.generate(request_id=..., prompt_ids=..., sampling_params=...) -> TokenOutput` as a Backend.

    One per trajectory, like verl's own loop: `request_id` is the sticky routing key for every turn, and the
    per-turn TokenOutput bookkeeping (num_preempted, extra_fields) is merged the way ToolAgentLoop merges it.
    """

    provider = "verl"

    def __init__(
        self,
        server_manager: Any,
        request_id: str,
        *,
        rollout_name: str | None = None,
        extra_params: Mapping[str, Any] | None = None,
        model_name: str = "verl",
    ):
        self.server_manager = server_manager
        self.request_id = request_id
        self.rollout_name = rollout_name
        self.extra_params = dict(extra_params or {})
        self.model_name = model_name
        self.num_preempted: int | None = None
        self.extra_fields: dict[str, Any] = {}  # the trajectory's own dict (verl's agent_data.extra_fields)
        self.logprobs_missing = False  # a turn with tokens came back without (matching) logprobs

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        params = {**self.extra_params, **request.sampling_params, "logprobs": request.return_logprob}
        if "sampling_seed" in params and self.rollout_name != "sglang":
            params["seed"] = params.pop("sampling_seed")  # vLLM's name for a per-request seed
        max_new = params.get("max_new_tokens")
        out = await self.server_manager.generate(
            request_id=self.request_id, prompt_ids=request.prompt_ids, sampling_params=params
        )
        self._account(out)
        ids = list(out.token_ids)
        logprobs = list(out.log_probs) if request.return_logprob and out.log_probs is not None else None
        if request.return_logprob and (logprobs is None or len(logprobs) != len(ids)):
            logprobs = None
            if ids:
                self.logprobs_missing = True
                _warn_once(
                    "fsm_agent: the server returned tokens without logprobs (or a different number of "
                    "them); such trajectories come back with response_logprobs=None"
                )
        return GenerateResult(
            token_ids=ids,
            logprobs=logprobs,
            finish_reason=_finish_reason(out.stop_reason, ids, max_new, params.get("stop_token_ids") or ()),
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=(out.extra_fields or {}).get("num_cached_tokens"),
            server=self.rollout_name,
        )

    def _account(self, out: Any) -> None:
        """verl's merge: num_preempted summed (-1 when unknown); extra_fields from the first turn that has
        any, then only max_global_steps and the speculative-decoding counters move."""
        n = out.num_preempted
        if self.num_preempted is None:
            self.num_preempted = n if n is not None else -1
        else:
            self.num_preempted += n or 0
        fields = dict(out.extra_fields or {})
        if not self.extra_fields:
            self.extra_fields.update(fields)
            return
        if fields.get("max_global_steps"):
            self.extra_fields["max_global_steps"] = fields["max_global_steps"]
        for key in _SPEC_DECODE_KEYS:
            if key in fields and key in self.extra_fields:
                self.extra_fields[key] = int(self.extra_fields[key]) + int(fields[key])


def _finish_reason(stop_reason: str | None, ids: list[int], max_new: int | None, stops: Any) -> str:
    """TokenOutput.stop_reason ("completed", "aborted", SGLang's "stop"/"length"...) -> stop|length|abort."""
    if stop_reason in ("aborted", "abort"):
        return "abort"
    if stop_reason == "length":
        return "length"
    if max_new is not None and len(ids) >= max_new and not (ids and ids[-1] in set(stops)):
        return "length"  # vLLM reports a cut turn as "completed" too
    return "stop"


# --- the agent loop --------------------------------------------------------------------------------------


class FSMAgentLoop(AgentLoopBase):
    """verl agent loop that runs an agentfsm spec. Entry kwargs: `spec` (a path), `limits` and `tool_policy`
    (overrides)."""

    def __init__(
        self,
        *args: Any,
        spec: str | None = None,
        limits: Mapping[str, Any] | None = None,
        tool_policy: Mapping[str, Any] | None = None,
        tools: ToolListWrap | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)  # verl's config, server manager, tokenizer, CT builder; `name` too
        rollout = self.rollout_config
        overrides = dict(_plain(limits) or {})
        shaped = sorted(set(overrides) & set(_BATCH_SHAPES))
        if shaped:
            raise ValueError(
                f"fsm_agent: limits.{shaped[0]} is verl's batch shape: set "
                f"actor_rollout_ref.rollout.{shaped[0]} instead of overriding it in the entry"
            )
        self.prompt_length = int(rollout.prompt_length)
        self.response_length = int(rollout.response_length)
        agent = compiled_agent(
            spec or DEFAULT_SPEC, overrides, self.prompt_length, self.response_length, _plain(tool_policy)
        )
        one_row(  # verl 0.9.1's worker takes exactly one AgentLoopOutput per input row
            agent,
            "fsm_agent",
            "verl 0.9.1's agent-loop worker takes one output per input",
            f"{TREES_ELSEWHERE}, or RolloutEngine.generate_sequences (one row per node)",
            f"{SEGMENTS_ELSEWHERE}, or RolloutEngine.generate_sequences (one row per segment)",
        )
        dropping = [f"state {n}" for n, st in agent.spec.states.items() if st.on_error == "drop"]
        if agent.spec.failures.on_error == "drop":
            dropping.insert(0, "failures")
        if dropping:  # the worker returns one output per input row: a failed row cannot be left out
            raise ValueError(
                f"fsm_agent: spec {agent.name!r} sets on_error: drop ({dropping[0]}), but verl's agent-loop "
                "worker returns one output per input row: use on_error: mask or zero_reward under verl"
            )
        verl_tools = list(tools.tools) if tools is not None else []
        if verl_tools and not agent.tools.by_name:
            agent = agent_with_verl_tools(agent, verl_tools)
        elif verl_tools:
            _warn_once(
                f"fsm_agent: spec {agent.name!r} declares its own tools; verl's tool list "
                f"({', '.join(t.name for t in verl_tools)}) is not used"
            )
        self.agent = agent
        model = agent.spec.model  # verl's apply_chat_template_kwargs, then the spec's on top
        self.codec = chat_codec(
            self.tokenizer,
            {**(self.apply_chat_template_kwargs or {}), **model.chat_template_kwargs},
            model.family,
            model.special_tokens_in_observations,
        )
        self.full_determinism = bool(_setting(rollout, "full_determinism", False))
        self.rollout_name = _setting(rollout, "name")
        _check_multi_turn(_setting(rollout, "multi_turn"), agent)

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any) -> AgentLoopOutput:
        row = {key: _plain(value) for key, value in kwargs.items()}
        engine_params, extra_params = _split_sampling(sampling_params)
        request_id = f"det-{priority}" if self.full_determinism else uuid4().hex  # as verl's ToolAgentLoop
        backend = VerlServerBackend(
            self.server_manager, request_id, rollout_name=self.rollout_name, extra_params=extra_params
        )
        runner = Runner(self.agent, backend, self.codec)
        # validate=False: when validating, verl has already put its val_kwargs into sampling_params
        ctx = runner.make_context(engine_params, validate=False)
        (traj,) = runner.trajectories([row])
        traj.session_id = request_id  # what tools read as agent_data.request_id, as in verl
        # one dict for the server's fields and the tools', as in verl
        backend.extra_fields = traj.extra_fields
        await runner.drive(ctx, traj)
        if traj.failed:
            logger.warning(
                "fsm_agent: trajectory failed (%s); it stays in the batch with an empty response",
                traj.termination_reason,
            )
        return self._output(traj, backend, logprobs=ctx.sampling.logprobs and not backend.logprobs_missing)

    def _output(self, traj: Trajectory, backend: VerlServerBackend, *, logprobs: bool) -> AgentLoopOutput:
        R = self.response_length
        metrics = traj.metrics
        return AgentLoopOutput(
            prompt_ids=traj.prompt_ids.tolist(),
            response_ids=traj.response_ids.tolist()[:R],
            response_mask=traj.response_mask.tolist()[:R],
            # None when not asked for or not returned (see the module docstring); a list even when empty (verl
            # gives None there, and its batch cat then fails on mixed rows).
            response_logprobs=traj.response_logprobs.tolist()[:R] if logprobs else None,
            reward_score=traj.reward_score,
            num_turns=traj.num_turns,
            metrics=AgentLoopMetrics(
                generate_sequences=metrics.generate_sequences,
                tool_calls=metrics.tool_calls,
                compute_score=metrics.compute_score,
                num_preempted=backend.num_preempted if backend.num_preempted is not None else -1,
            ),
            extra_fields={
                **traj.extra_fields,
                "turn_scores": list(traj.turn_scores),
                "tool_rewards": list(traj.tool_rewards),
                "tool_scores": list(traj.tool_scores),
                "termination_reason": traj.termination_reason,
            },
        )


def _setting(config: Any, key: str, default: Any = None) -> Any:
    """config.key, or `default` when it is absent, null or still "???" (verl's generated config has those)."""
    try:
        value = config.get(key, default)
    except Exception:  # omegaconf's MissingMandatoryValue
        return default
    return default if value is None else value


def _split_sampling(sampling_params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """verl's sampling_params -> (what the engine takes, what goes to the server unchanged)."""
    engine: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in sampling_params.items():
        key = "max_new_tokens" if key == "max_tokens" else key
        (engine if key in _ENGINE_SAMPLING else extra)[key] = value
    return engine, extra


def _check_multi_turn(multi_turn: Any, agent: CompiledAgent) -> None:
    """Name each verl multi_turn setting the spec overrides, once per worker config and agent."""
    seen = (id(multi_turn), id(agent))
    if multi_turn is None or seen in _checked:
        return
    _checked.add(seen)
    lim = agent.limits
    pairs: list[tuple[str, Any]] = [
        ("max_assistant_turns", lim.max_assistant_turns),
        ("max_user_turns", lim.max_user_turns),
        ("max_parallel_calls", lim.max_parallel_calls),
        ("max_tool_response_length", lim.max_tool_response_length),
        ("tool_response_truncate_side", lim.tool_response_truncate_side),
    ]
    if agent.spec.parser is not None:  # else the model family's parser, whatever verl's format says
        pairs.append(("format", agent.spec.parser))
    for key, ours in pairs:
        theirs = _setting(multi_turn, key)
        if theirs is not None and theirs != ours:
            _warn_once(
                f"fsm_agent: verl's multi_turn.{key}={theirs!r} is not used; spec {agent.name!r} has "
                f"{ours!r} (set it in the entry's `limits:` or in the spec)"
            )


def _register_default() -> None:
    """`agent_name: fsm_agent` without an entry: register the class, as verl's `@register` would. But hydra first
    imports this module while AgentLoopWorker instantiates an `fsm_agent` entry it loaded from
    agent_loop_config_path, and `register` would replace that entry with a bare `_target_`: from the next
    sample on, the entry's spec, limits and tool_policy would be gone. So an entry already there is kept."""
    from verl.experimental.agent_loop import agent_loop

    registry = getattr(agent_loop, "_agent_loop_registry", None)
    if registry is None or "fsm_agent" not in registry:
        register("fsm_agent")(FSMAgentLoop)


_register_default()
