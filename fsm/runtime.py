"""The driver: many trajectories of one compiled agent, concurrently, on one event loop.

For each trajectory the loop is:

    while the state is not final:
        await the state's action (a model call, tool calls, the user simulator...)
        fire the first outgoing edge whose guard holds (through the shared machine)

Each trajectory is one task; a semaphore bounds how many are in flight. A failure (bad row, dead server,
timeout, a user action raising) ends only that trajectory, with `termination_reason` "error: ...".
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from backends.base import Backend, BackendError, GenerateRequest, GenerateResult
from fsm.actions import RowError
from fsm.chat import ChatCodec
from fsm.compile import CompiledAgent
from fsm.parsers import PARSERS
from fsm.tools import CallOutcome
from fsm.tracing import Tracer
from fsm.trajectory import ToolCall, Trajectory

# The root span of the trajectory this task runs when it is traced (fsm/telemetry.py). The model and tool
# calls of one that is not (tracing off, or sampled out) call no tracer hook.
_TRACED: contextvars.ContextVar[Any] = contextvars.ContextVar("agentfsm_traced", default=None)

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p", "max_new_tokens", "stop_token_ids",
                  "sampling_seed", "frequency_penalty", "presence_penalty")  # fmt: skip


class RunContext:
    """What actions share during one run: the agent, the backend, the codec, sampling, tools, tracing."""

    def __init__(self, agent: CompiledAgent, backend: Backend, codec: ChatCodec, *, sampling: dict[str, Any],
                 seed: int | None, logprobs: bool, tracer: Tracer | None = None):  # fmt: skip
        self.agent = agent
        self.backend = backend
        self.codec = codec
        self.parser = PARSERS[agent.spec.parser](codec.tokenizer)
        self.logprobs = logprobs
        self.tracer = tracer
        stops = sorted({codec.eos_id, *self.parser.stop_token_ids, *sampling.pop("stop_token_ids", [])})
        self.sampling = {**sampling, "stop_token_ids": stops}
        self.seed = seed
        self.interaction = agent.interaction_cls(dict(agent.spec.interaction.config, name=agent.spec.interaction.name
                                                      or agent.spec.name)) if agent.interaction_cls else None  # fmt: skip
        # uid -> ((messages, tool schemas), prompt ids): samples of a group share one encoding
        self.prompt_cache: dict[str, tuple[tuple[Any, Any], list[int]]] = {}
        self.share_prompts = True

    def sampling_for(self, traj: Trajectory) -> dict[str, Any]:
        if self.seed is None:
            return self.sampling
        return {**self.sampling, "sampling_seed": self.seed + traj.index * 1000 + traj.sample}

    async def call_backend(self, traj: Trajectory, request: GenerateRequest) -> GenerateResult:
        if self.tracer is None or _TRACED.get() is None:
            return await self.backend.generate(request)
        span = self.tracer.model_call(traj, request, self.backend)  # started, and current
        if span is None:  # a call outside the trajectory's trace
            return await self.backend.generate(request)
        try:
            result = await self.backend.generate(request)
        except BaseException as exc:
            span.fail(exc)
            raise
        span.done(result)
        return result

    async def run_tool(
        self, traj: Trajectory, call: ToolCall, instance_id: str, active: set[str] | None
    ) -> CallOutcome:
        tools = self.agent.tools
        if self.tracer is None or _TRACED.get() is None:
            return await tools.call(call, instance_id, traj.tools_kwargs, traj, active)
        span = self.tracer.tool_call(traj, call, tools.by_name.get(call.name or ""))  # started, and current
        if span is None:  # a call outside the trajectory's trace
            return await tools.call(call, instance_id, traj.tools_kwargs, traj, active)
        try:
            outcome = await tools.call(call, instance_id, traj.tools_kwargs, traj, active)
        except BaseException as exc:
            span.fail(exc)
            raise
        span.done(outcome)
        return outcome

    def add_observation(self, traj: Trajectory, messages: list[dict[str, Any]], *, role: str) -> bool:
        """Append tool/user turns as mask-0 tokens; False (nothing appended) if they overflow the budget.

        The template's turn closer owed after a model turn is appended first, also with mask 0. As in verl,
        an observation that does not fit in response_length is not appended and the budget counts as spent.
        """
        closer = self.codec.closer_for(traj.response_ids[-1:].tolist()) if traj.needs_tail else []
        ids = self.codec.encode_observation(messages)
        if len(traj.response_mask) + len(closer) + len(ids) >= self.agent.limits.response_length:
            traj.observation_overflow = True
            return False
        traj.append_context(closer, "template")
        traj.append_context(ids, role)
        traj.needs_tail = False
        traj.messages.extend(messages)
        return True


class Runner:
    """Runs rows through a compiled agent. Reusable across batches; one per (agent, backend, tokenizer)."""

    def __init__(self, agent: CompiledAgent, backend: Backend, tokenizer: Any, *, max_concurrency: int = 512,
                 tracer: Tracer | None = None, check_tokens: bool = False):  # fmt: skip
        self.agent = agent
        self.backend = backend
        self.codec = tokenizer if isinstance(tokenizer, ChatCodec) else ChatCodec(tokenizer)
        self.max_concurrency = max_concurrency
        self.tracer = tracer
        self.check_tokens = check_tokens

    def make_context(self, sampling_params: Mapping[str, Any] | None, validate: bool) -> RunContext:
        spec = self.agent.spec
        base = (spec.val_sampling if validate else spec.sampling).model_dump()
        overrides = dict(sampling_params or {})
        if "seed" in overrides:
            base["seed"] = overrides.pop("seed")
        if "logprobs" in overrides:
            base["logprobs"] = bool(overrides.pop("logprobs"))
        unknown = set(overrides) - set(_SAMPLING_KEYS)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {sorted(unknown)}; known: {', '.join(_SAMPLING_KEYS)}"
            )
        seed, logprobs = base.pop("seed"), base.pop("logprobs")
        base["stop_token_ids"] = list(base["stop_token_ids"]) + list(overrides.pop("stop_token_ids", []))
        base.update(overrides)
        return RunContext(self.agent, self.backend, self.codec, sampling=base, seed=seed, logprobs=logprobs,
                          tracer=self.tracer)  # fmt: skip

    def trajectories(self, rows: Iterable[Mapping[str, Any]], n: int = 1) -> list[Trajectory]:
        """Rows -> one trajectory per (row, sample); samples of a row share its uid (a GRPO group)."""
        run_id = uuid.uuid4().hex[:8]
        out = []
        for i, row in enumerate(rows):
            row = dict(row) if isinstance(row, Mapping) else {"__bad_row__": row}
            uid = str(row.get("uid") or f"{run_id}-{i}")
            for k in range(n):
                traj = Trajectory(len(out), k, f"{run_id}-{i}-{k}", uid, row, self.agent.initial)
                self._bind_row(traj)
                out.append(traj)
        return out

    def _bind_row(self, traj: Trajectory) -> None:
        row, extra = traj.row, traj.row.get("extra_info") or {}
        extra = extra if isinstance(extra, Mapping) else {}
        traj.tools_kwargs = row.get("tools_kwargs") or extra.get("tools_kwargs") or {}
        kwargs = row.get("interaction_kwargs", extra.get("interaction_kwargs"))
        if self.agent.interaction_cls is not None and kwargs is not None:
            traj.interaction_kwargs = dict(kwargs)  # as verl: a row opts in to the interaction with its kwargs
        selection = extra.get("tool_selection")
        traj.tool_schemas = self.agent.tools.schemas_for(selection)
        if selection is not None:
            traj.extra["active_tools"] = set(selection)

    async def run(self, rows: Iterable[Mapping[str, Any]], *, n: int = 1, sampling_params: Mapping[str, Any] | None = None,
                  validate: bool = False, on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:  # fmt: skip
        """Run every row (n samples each); returns one finished trajectory per sample, in input order."""
        ctx = self.make_context(sampling_params, validate)
        trajs = self.trajectories(rows, n)
        gate = asyncio.Semaphore(self.max_concurrency)

        async def one(traj: Trajectory) -> None:
            async with gate:
                await self.drive(ctx, traj)
            if on_done is not None:
                on_done(traj)

        async with asyncio.TaskGroup() as tg:
            for traj in trajs:
                tg.create_task(one(traj))
        if self.tracer is not None:
            self.tracer.flush()
        return trajs

    async def drive(self, ctx: RunContext, traj: Trajectory) -> None:
        """Run one trajectory to a final state. Never raises for the trajectory's own failures."""
        agent, tracer = self.agent, self.tracer
        timeout = agent.limits.action_timeout_s
        root = traced = None
        if tracer is not None:
            root = tracer.trajectory(traj, ctx)  # None: sampled out
            if root is not None or _TRACED.get() is not None:  # a sampled-out one costs no ContextVar copy
                traced = _TRACED.set(root)
        traj.path_times.append(time.perf_counter())  # per-state durations for run statistics (viz.stats)
        try:
            while traj.state not in agent.final_states:
                source = traj.state
                try:
                    if timeout is None:
                        await agent.actions[source](ctx, traj)
                    else:
                        async with asyncio.timeout(timeout):
                            await agent.actions[source](ctx, traj)
                    edge = agent.advance(traj)
                except BaseException as exc:
                    if root is not None:
                        root.state_failed(exc)
                    raise
                traj.path.append(edge.dest)
                traj.path_times.append(time.perf_counter())
                if edge.reason is not None:
                    traj.termination_reason = edge.reason
                if root is not None:
                    root.transition(edge)  # ends this state's span, starts the next state's
        except RowError as exc:
            traj.fail(str(exc))
        except BackendError as exc:
            traj.fail(f"backend: {exc}")
        except TimeoutError:
            traj.fail(f"timeout: action of {traj.state} exceeded {agent.limits.action_timeout_s}s")
        except Exception as exc:  # a user action or guard bug ends this trajectory only
            traj.fail(f"{type(exc).__name__} in {traj.state}: {exc}")
        finally:
            try:
                await self._finish(ctx, traj)
            finally:  # the root span ends even when finishing is cancelled
                if root is not None:
                    root.finish()
                if traced is not None:
                    _TRACED.reset(traced)

    async def _finish(self, ctx: RunContext, traj: Trajectory) -> None:
        """Release the session, close the interaction, score, and (optionally) check the tokens."""
        if traj.termination_reason is None:
            traj.termination_reason = traj.state.lower()
        try:
            await ctx.backend.release(traj.session_id)
            if traj.interaction_started:
                traj.interaction_score = float(await ctx.interaction.calculate_score(traj.session_id))
                await ctx.interaction.finalize_interaction(traj.session_id)
            await self._score(ctx, traj)
        except Exception as exc:  # scoring/cleanup failures are recorded, never raised into the batch
            if traj.error is None:
                traj.fail(f"{type(exc).__name__} while finishing: {exc}")
        if self.check_tokens and not traj.failed and traj.prompt_ids:
            ended_on_observation = traj.segments[-1].role != "assistant" if traj.segments else True
            traj.token_check = self.codec.check(
                traj.messages, traj.tool_schemas, traj.context_ids(), ended_on_observation
            )

    async def _score(self, ctx: RunContext, traj: Trajectory) -> None:
        reward = self.agent.reward
        if reward is None:
            return
        if traj.failed:
            traj.reward_score = 0.0
            return
        row = traj.row
        kwargs = dict(
            data_source=row.get("data_source"),
            solution_str=self.codec.decode(traj.response_ids.tolist()),
            ground_truth=(row.get("reward_model") or {}).get("ground_truth"),
            extra_info=row.get("extra_info"),
            **reward.kwargs,
        )
        t0 = time.perf_counter()
        if inspect.iscoroutinefunction(reward.fn):
            score = await reward.fn(**kwargs)
        else:
            score = await asyncio.to_thread(reward.fn, **kwargs)
        traj.metrics.compute_score += time.perf_counter() - t0
        if isinstance(score, Mapping):
            traj.extra["reward_extra_info"] = dict(score)
            score = score["score"]
        traj.reward_score = float(score)
