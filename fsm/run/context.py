"""What actions share during one run: the agent, the backend, the chat codec, the resolved sampling, tools
and tracing. It sits below the actions (fsm/run/actions.py and user actions import it) and above nothing they
use, so a model call and a tool call each have one path: an action asks the context, the context asks the
backend or the tool set and, when the trajectory is traced, wraps the call in a span.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from backends.base import GREEDY_BELOW, Backend, GenerateRequest, GenerateResult
from fsm.families import Codec, codec_for, make_parser, parser_name
from fsm.families.parsers import PARSERS, ToolCall
from fsm.run.agent import CompiledAgent
from fsm.run.tracer import Tracer
from fsm.run.trajectory import Trajectory, TreeCount
from fsm.spec.model import check_sampling
from fsm.tools.base import CallOutcome

# The root span of the trajectory this task runs, when it is traced. The model and tool calls of one that
# is not (tracing off, or sampled out) call no tracer hook.
TRACED: contextvars.ContextVar[Any] = contextvars.ContextVar("agentfsm_traced", default=None)


@dataclass(frozen=True, slots=True)
class Sampling:
    """A run's sampling, resolved once from the spec's `sampling` (or `val_sampling`), the call site's
    overrides, and the stop tokens the codec and parser need. Every request and the batch read it here."""

    params: Mapping[str, Any]  # sent with every request (SGLang names), stop_token_ids included
    seed: int | None  # base seed: sample (index, k) draws with seed + index * 1000 + k
    logprobs: bool  # ask for logprobs; the batch carries rollout_log_probs only then
    max_new_tokens: int | None  # per-turn cap: the call site's, else the spec's limit, else the budget

    @classmethod
    def resolve(
        cls,
        agent: CompiledAgent,
        codec: Codec,
        overrides: Mapping[str, Any] | None = None,
        *,
        validate: bool = False,
        base_spec: Any = None,
    ) -> Sampling:
        """`overrides`: SGLang sampling names, plus `seed` and `logprobs`; `validate` picks val_sampling;
        `base_spec` (a policy's SamplingSpec) replaces the spec's."""
        spec = agent.spec
        base = (base_spec or (spec.val_sampling if validate else spec.sampling)).model_dump()
        overrides = check_sampling(dict(overrides or {}))
        seed = overrides.pop("seed", base.pop("seed"))
        logprobs = bool(overrides.pop("logprobs", base.pop("logprobs")))
        outside = [
            t
            for t in (*base["stop_token_ids"], *overrides.get("stop_token_ids", ()))
            if t >= codec.vocab_size
        ]
        if outside:
            raise ValueError(
                f"sampling parameter stop_token_ids: {outside[0]} is not a token id of this model "
                f"(vocabulary of {codec.vocab_size})"
            )
        parser_stops = PARSERS[parser_name(spec.parser, codec)](codec.tokenizer).stop_token_ids
        stops = sorted(
            {codec.eos_id, *parser_stops, *base.pop("stop_token_ids"), *overrides.pop("stop_token_ids", [])}
        )
        cap = overrides.pop("max_new_tokens", agent.limits.max_new_tokens)
        params = {**base, **overrides, "stop_token_ids": stops}
        return cls(params, seed, logprobs, cap)

    def describe(self, vocab_size: int) -> dict[str, Any]:
        """What produced the logprobs, for a trainer that recomputes them (the batch's meta_info["sampling"]):
        each is log_softmax(logits / logprob_temperature) over all `vocab_size` ids, as SGLang and the
        embedded model report them; top_k / top_p cut what is drawn, never renormalise the logprob."""
        temperature = float(self.params.get("temperature", 1.0))
        greedy = temperature < GREEDY_BELOW
        top_k = int(self.params.get("top_k", -1))
        return {
            "temperature": temperature,
            "top_p": float(self.params.get("top_p", 1.0)),
            "top_k": top_k,  # -1: the whole vocabulary
            "vocab_size": vocab_size,
            "greedy": greedy,
            "logprob_temperature": 1.0 if greedy else temperature,
            "logprobs_over": "full_vocabulary",
            "repetition_penalty": float(self.params.get("repetition_penalty", 1.0)),
            "seed": self.seed,
            "logprobs": self.logprobs,
        }

    def for_turn(self, traj: Trajectory, budget: int) -> dict[str, Any]:
        """The request's sampling params for one turn of `traj` with `budget` tokens left (> 0)."""
        max_new = budget if self.max_new_tokens is None else min(budget, self.max_new_tokens)
        params = {**self.params, "max_new_tokens": max_new}
        if self.seed is not None:
            node = traj.node.ordinal  # branches of one fork draw apart
            params["sampling_seed"] = self.seed + traj.index * 1000 + traj.sample + 7919 * node
        return params


# How long a snapshot that aborted the turns in flight waits for their partial output before it takes each row as
# it was before its turn (a server that answers neither /pause_generation nor /abort_request)
TURN_GRACE_S = 10.0


class PauseGate:
    """The engine's pause switch and weight-version counter, shared by every run of one engine.

    Every model request passes `wait()` first, so a paused engine issues none: a new turn waits here, and so
    does a turn that the pause aborted, before it is resumed. `epoch` counts pauses, which tells an abort the
    pause caused (not counted against limits.max_resumes) from one the server chose.
    """

    def __init__(self) -> None:
        self._open = asyncio.Event()  # bound to a loop on first wait: the engine's
        self._open.set()
        self.epoch = 0
        self.version = 0  # the weights the servers hold now (RolloutEngine.weight_version)
        # model turns waiting here now (and rows awaiting a rewrite): whole, as at a boundary
        self._waiting = 0
        self.in_flight = 0  # model requests sent and not answered yet
        self._closed_at: float | None = None  # monotonic time the gate closed
        self.on_wait: Callable[[], None] | None = None  # told when one starts or stops waiting (snapshots)

    @property
    def waiting(self) -> int:
        """Trajectories that are whole while they wait: at this gate, inside a rewrite, and, once the gate has
        been closed for TURN_GRACE_S, inside a model request (a server that can neither pause nor abort keeps
        it forever; until its answer, the trajectory is as it was before its turn, which runs again on restore)."""
        closed = self._closed_at is not None and time.monotonic() - self._closed_at >= TURN_GRACE_S
        return self._waiting + (self.in_flight if closed else 0)

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def close(self) -> None:
        if not self.paused:
            self.epoch += 1
            self._open.clear()
            self._closed_at = time.monotonic()

    def open(self) -> None:
        self._open.set()
        self._closed_at = None

    async def wait(self) -> float:
        """Return once the gate is open: the seconds spent waiting (0.0 when it was)."""
        if self._open.is_set():
            return 0.0
        t0 = time.monotonic()
        self._count(1)
        try:
            await self._open.wait()
        finally:
            self._count(-1)
        return time.monotonic() - t0

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """A trajectory awaits something that leaves it as it was before its action (a rewrite function, which
        changes it only once it returns): a snapshot counts it as parked, as it does a turn waiting here, and
        never waits for it (a hung rewrite would hold Ctrl-C until its deadline)."""
        self._count(1)
        try:
            yield
        finally:
            self._count(-1)

    def _count(self, step: int) -> None:
        self._waiting += step
        if self.on_wait is not None:
            self.on_wait()

    def version_of(self, reported: str | None, fallback: int | None = None) -> int:
        """The weight version a response reports, as an int. When it reports none, a name ("default") or a
        number the engine did not count (a timestamp a trainer set, a negative): `fallback`, the engine's
        counter when the request was sent (the weights it was sent to), else the counter now. Versions are
        stored as int32 next to the tokens, so a reported version is taken only when it fits."""
        text = str(reported) if reported is not None else ""
        if 0 < len(text) <= 10 and text.isascii() and text.isdigit() and int(text) < 2**31:
            return int(text)
        return self.version if fallback is None else fallback


@dataclass(slots=True)
class Policy:
    """One policy at run time (the spec's `policies:`): its backend (None: the run's) and its codec."""

    name: str
    backend: Backend | None
    codec: Codec | None  # None: the run's codec, read with the generating spec's model family
    sampling: Any = None  # its SamplingSpec, or None: the generating spec's
    # A policy with a backend of its own has its own gate: its pause and its weight version (what its tokens
    # record) are its own (fsm/run/control.py `policy=`); None: the run's, with the run's backend
    gate: PauseGate | None = None


def node_sampling(
    policy: Policy, run_codec: Codec, run: Sampling, agent: CompiledAgent
) -> tuple[Codec, Sampling]:
    """The codec and sampling a node of `agent` generating with `policy` (not the root's) uses: the policy's own
    codec, else the run's tokenizer read with `agent`'s model family; the policy's `sampling:`, else `agent`'s
    spec's, with the run's seed. One answer for the run (RunContext.for_node) and for the policy's batch, whose
    meta_info["sampling"] a trainer recomputes logprobs with (fsm/output/engine.py)."""
    codec = policy.codec
    if codec is None:
        model = agent.spec.model
        codec = codec_for(
            run_codec.tokenizer,
            model.family,
            model.chat_template_kwargs,
            model.special_tokens_in_observations,
        )
    return codec, Sampling.resolve(agent, codec, {"seed": run.seed}, base_spec=policy.sampling)


class RunContext:
    """What actions share during one run: the agent, the backend, the codec, sampling, tools, tracing."""

    def __init__(
        self,
        agent: CompiledAgent,
        backend: Backend,
        codec: Codec,
        sampling: Sampling,
        *,
        tracer: Tracer | None = None,
        gate: PauseGate | None = None,
    ):
        self.agent = agent
        self.backend = backend
        self.codec = codec
        self.parser = make_parser(agent.spec.parser, codec, agent.tools.schemas)
        self.sampling = sampling
        self.tracer = tracer
        self.gate = gate if gate is not None else PauseGate()  # the engine's, shared by its runs
        interaction = agent.spec.interaction  # set whenever interaction_cls is
        self.interaction = (
            agent.interaction_cls(dict(interaction.config, name=interaction.name or agent.spec.name))
            if agent.interaction_cls and interaction is not None
            else None
        )
        # Samples of a group share one prompt encoding: uid -> [(messages, tool schemas), ids, samples served],
        # kept until the group's `group_size` samples have it (None: a group size the run does not know, so
        # until the run ends; 1: nobody shares, nothing kept)
        self.prompt_cache: dict[str, list[Any]] = {}
        self.journal: Any = None  # a kept run's fsm/run/journal.py Recorder: side-effecting tools' results
        self.group_size: int | None = None
        # trees (fsm/run/tree.py): the run's policies by name, the root's agent, the contexts of other (agent,
        # policy) pairs its child machines run in, shared by every context of the run
        self.policies: dict[str, Policy] = {}
        self.root_agent = agent
        self.policy = agent.spec.policy
        self.drive: Callable[[RunContext, Trajectory], Any] | None = None  # Runner.drive, for children
        # the run's own backend, codec and gate, where a node whose policy has none of its own generates (not
        # the root policy's: a root whose policy has a checkpoint or servers runs there, its children need not)
        self.run_parts: tuple[Backend, Codec, PauseGate] = (backend, codec, self.gate)
        # the children and branches of the run's trees in flight, against `tree.max_run_nodes` (fsm/run/tree.py
        # charges them as they are made, releases them when their root ends); shared by every context of the run
        self.run_nodes = TreeCount(0)
        self._nodes: dict[tuple[int, str], RunContext] = {(id(agent), self.policy): self}
        self._child_agents: dict[tuple[int, str], CompiledAgent] = {}

    def child_agent(self, name: str) -> CompiledAgent:
        """The compiled spec of this agent's child machine `name` (compiled once per run, on first use)."""
        key = (id(self.agent), name)
        agent = self._child_agents.get(key)
        if agent is None:
            agent = self._child_agents[key] = self.agent.child_agent(name)
        return agent

    def for_node(self, agent: CompiledAgent, policy: str) -> RunContext:
        """The context a node of `agent` generating with `policy` runs in: that policy's backend, codec and
        sampling (made once per run and pair; the run's own for the root's pair)."""
        ctx = self._nodes.get((id(agent), policy))
        if ctx is not None:
            return ctx
        known = self.policies.get(policy) or Policy(policy, None, None)
        run_backend, run_codec, run_gate = self.run_parts
        codec, sampling = node_sampling(known, run_codec, self.sampling, agent)
        ctx = RunContext(
            agent,
            known.backend or run_backend,
            codec,
            sampling,
            tracer=self.tracer,
            gate=known.gate or run_gate,
        )
        ctx.run_parts, ctx.run_nodes = self.run_parts, self.run_nodes
        ctx.policies, ctx.root_agent, ctx.policy, ctx.drive = (
            self.policies,
            self.root_agent,
            policy,
            self.drive,
        )
        ctx._nodes, ctx._child_agents = self._nodes, self._child_agents
        ctx.journal = self.journal  # a node's side-effecting tools: journaled as the root's are
        self._nodes[(id(agent), policy)] = ctx
        return ctx

    async def call_backend(self, traj: Trajectory, request: GenerateRequest) -> GenerateResult:
        if self.tracer is None or TRACED.get() is None:
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
        self, traj: Trajectory, call: ToolCall, instance_id: str, active: list[str] | None
    ) -> CallOutcome:
        """One call; `instance_id` (session, turn, call) is its idempotency key, the same after a resume and on a
        retry. A tool declared with side effects (`side_effects = True` on its class or function) is never
        executed again for a call whose successful result the journal holds: that result is its answer. A failed
        call is journaled as an attempt only, so a state's retry or a resume runs it again."""
        journal = self.journal
        tool = self.agent.tools.by_name.get(call.name or "") if journal is not None else None
        if tool is None or not has_side_effects(tool.tool):
            return await self._run_tool(traj, call, instance_id, active)
        kept = journal.tool_results.get(instance_id)
        if kept is not None and kept.get("error") is None:
            return CallOutcome(**kept)
        outcome = await self._run_tool(traj, call, instance_id, active)
        journal.tool(instance_id, outcome_record(outcome))
        return outcome

    async def _run_tool(
        self, traj: Trajectory, call: ToolCall, instance_id: str, active: list[str] | None
    ) -> CallOutcome:
        tools = self.agent.tools
        if self.tracer is None or TRACED.get() is None:
            return await tools.call(call, instance_id, traj.tools_kwargs, traj, active, self._tool_view(traj))
        span = self.tracer.tool_call(traj, call, tools.by_name.get(call.name or ""))  # started, and current
        if span is None:  # a call outside the trajectory's trace
            return await tools.call(call, instance_id, traj.tools_kwargs, traj, active, self._tool_view(traj))
        try:
            outcome = await tools.call(
                call, instance_id, traj.tools_kwargs, traj, active, self._tool_view(traj)
            )
        except BaseException as exc:
            span.fail(exc)
            raise
        span.done(outcome)
        return outcome

    def _tool_view(self, traj: Trajectory) -> Callable[[], list[dict[str, Any]]]:
        """agent_data.messages for a tool, built when it reads them: the model's turns in verl's form."""
        codec, parser, limit = self.codec, self.parser, self.agent.limits.max_parallel_calls
        return lambda: traj.messages_with_turns(lambda m, ids: codec.verl_message(m, ids, parser, limit))

    def add_observation(
        self, traj: Trajectory, messages: list[dict[str, Any]], *, role: str, overflow: str = "drop"
    ) -> bool:
        """Append tool/user turns as mask-0 tokens; False (nothing appended) if they overflow the budget.

        The template's turn closer owed after a model turn is appended first, also with mask 0 (unless the
        spec says `turn_closer: none`). As in verl, an observation that does not fit in response_length is
        not appended and the budget counts as spent; `overflow="cut"` appends it cut at the budget instead
        (verl 0.7.1's user replies).
        """
        owed = traj.needs_tail and self.agent.spec.turn_closer == "template"
        closer, ids = self.codec.observation(
            messages, traj.response_ids[-1:].tolist() if owed else None, traj.messages
        )
        room = self.agent.limits.response_length - len(traj.response_mask)
        if len(closer) + len(ids) >= room:
            if overflow != "cut":
                traj.observation_overflow = True
                return False
            closer, ids = closer[:room], ids[: max(room - len(closer), 0)]
        traj.append_context(closer, "template")
        traj.append_context(ids, role)
        traj.needs_tail = False
        traj.messages.extend(messages)
        return True


def has_side_effects(tool: Any) -> bool:
    """A tool declared with side effects: `side_effects = True` on its class, or on its function."""
    return bool(
        getattr(tool, "side_effects", False) or getattr(getattr(tool, "fn", None), "side_effects", False)
    )


def outcome_record(outcome: CallOutcome) -> dict[str, Any]:
    """A call's outcome as the journal keeps it (its metrics only when they are JSON)."""
    record = dataclasses.asdict(outcome)
    try:
        json.dumps(record["metrics"], allow_nan=False)
    except (TypeError, ValueError):
        record["metrics"] = {}
    return record
