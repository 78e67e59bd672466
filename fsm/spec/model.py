"""Agent specs: the YAML format as pydantic models, and its JSON Schema (`json_schema`); loader.py reads files.

A spec is data: guards, actions, tools, interactions and reward functions are named (built-ins or registered)
or given as import paths `package.module:attr`, which `fsm.validate` resolves. This module only knows the
shape of a spec.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from fsm.spec.base import MAX_SECONDS, MAX_TOKENS, MAX_TRANSITIONS, MAX_TURNS, Strict
from fsm.spec.contexts import ContextSpec
from fsm.spec.failures import MAX_ATTEMPTS, MAX_CALL_RUNS, MAX_WAIT_S, FailuresSpec, StateFailures

STANDARD_STATES = ("PENDING", "GENERATING", "PROCESSING_TOOLS", "INTERACTING", "TERMINATED")
DEFAULT_TOOL_WORKERS = 8  # ToolSpec.workers


# A guard expression: a name ("has_tool_calls"), a name with a parameter ({max_assistant_turns: 5}),
# or a combination ({all: [...]}, {any: [...]}, {not: ...}). Kept as plain data; fsm.spec.registry compiles it.
GuardExpr = Union[str, dict[str, Any]]


class TransitionSpec(Strict):
    """One outgoing edge. Edges of a state are tried in order; the first whose guard holds fires."""

    to: str = Field(description="Destination state.")
    when: GuardExpr | None = Field(
        default=None,
        description="Guard: a name, {name: param}, {all: [...]}, {any: [...]} or {not: ...}. "
        "Omitted means always (the default edge, which must come last).",
    )
    reason: str | None = Field(
        default=None, description="Recorded as the trajectory's termination_reason when this edge fires."
    )


class ForkSpec(Strict):
    """A state's fork into branches (docs/trees.md)."""

    branches: int = Field(ge=2, le=64, description="K: the branches the trajectory splits into.")
    times: int | None = Field(
        default=1,
        ge=1,
        le=64,
        description="Forks at this state along one path (a branch inherits its parent's count); null: on every "
        "entry, which `validate` refuses when the state is on a cycle.",
    )


class StateSpec(StateFailures):  # retry, catch, timeout_s, heartbeat_s, on_error: fsm/spec/failures.py
    action: str | None = Field(
        default=None,
        description="encode_prompt | generate | call_tools | interact | a registered name | module:function.",
    )
    final: bool = Field(default=False, description="A final state ends the trajectory; it has no action.")
    next: list[TransitionSpec] = Field(default_factory=list, description="Outgoing edges, tried in order.")
    description: str | None = None
    # trees (docs/trees.md): which policy generates here, and a fork into branches on entry
    policy: str | None = Field(
        default=None,
        description="The policy (a name under `policies:`) whose model generates in this state. Every generating "
        "state of one spec names the same one (start a child machine for another); default: the spec's default "
        "policy. Not context.policy, which says how a turn's context is built.",
    )
    fork: ForkSpec | None = Field(
        default=None,
        description="On entering this state the trajectory forks into `branches` that share every token so far "
        "and each run this state's action on their own.",
    )


class RetrySpec(Strict):
    """A tool's own retry of one call (fsm/tools/base.py `tool_retry`): `execute` again after any exception or
    timeout, bounded as a state's retry is (fsm/spec/failures.py)."""

    max_attempts: int = Field(
        default=1,
        ge=1,
        le=MAX_ATTEMPTS,
        description="Runs of the tool for one call, the first included (1 never retries; Step Functions' "
        "MaxAttempts counts retries only). A state's retry runs the whole tool round again, each time with "
        f"these runs: the two multiply, and validate refuses more than {MAX_CALL_RUNS} runs of one call.",
    )
    backoff_s: float = Field(
        default=0.0,
        ge=0,
        le=MAX_WAIT_S,
        description=f"Sleep before run k is backoff_s * 2**(k-2), no jitter, and never more than {MAX_WAIT_S:g} s.",
    )


class ToolSpec(Strict):
    """A tool: a plain function (`function:`) or a verl-style BaseTool class (`class:`)."""

    name: str | None = Field(default=None, description="Defaults to the schema's function name.")
    function: str | None = Field(default=None, description="module:function, async or sync.")
    class_: str | None = Field(
        default=None, alias="class", description="module:Class with the verl lifecycle."
    )
    config: dict[str, Any] = Field(default_factory=dict, description="Passed to the class constructor.")
    schema_: dict[str, Any] | str | None = Field(
        default=None,
        alias="schema",
        description="OpenAI function schema, inline or as module:NAME (keep it exactly what the model was "
        "trained on); inferred from a function's signature and docstring if omitted.",
    )
    timeout_s: float | None = Field(
        default=None, gt=0, description="Per attempt; a timeout becomes an observation."
    )
    retry: RetrySpec = Field(default_factory=RetrySpec)
    isolation: Literal["none", "thread", "process"] = Field(
        default="thread",
        description="Where the tool's code runs. thread: a sync function in the tool's own daemon threads, a "
        "coroutine on the tool's own event-loop thread; a call past timeout_s is abandoned and its thread "
        "written off. process: worker processes (function tools only); a call past timeout_s kills its "
        "worker, which is replaced. Use process for CPU-bound or crash-prone tools. none: coroutines (async "
        "functions, or a class whose lifecycle methods are all async) awaited on the run's own event loop, no "
        "hand-off; for tools that only await (an HTTP sandbox), which must let a cancellation through, or only "
        "compute briefly (specs/calculator.yaml's bounded parse: a hand-off costs more than its work). Three "
        "of its last 20 steps within a minute that hold the loop 50 ms each move the tool to its own loop thread, "
        "with a warning.",
    )
    workers: int = Field(
        default=DEFAULT_TOOL_WORKERS,
        gt=0,
        description="Calls of this tool running at once: threads of a sync function, or worker processes; "
        "more calls wait their turn. Coroutines on the tool's own loop are not limited.",
    )

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("isolation")
    @classmethod
    def _isolation(cls, v: str, info: ValidationInfo) -> str:
        if v == "process" and info.data.get("class_"):
            # A class tool is one stateful object shared by every trajectory (create/release keyed by
            # instance id) whose execute gets the live trajectory: neither crosses a process boundary, and
            # killing the worker at one call's timeout would destroy every other trajectory's instance.
            raise ValueError(
                "isolation: process runs function tools only; a class tool keeps state shared by all "
                "trajectories and receives the live trajectory. Put the CPU-bound part in a function tool "
                "with isolation: process, or have the class start its own subprocess"
            )
        return v


class ToolPolicySpec(Strict):
    """How calls are checked and answered. The defaults are agentfsm's; `specs/tool_agent.yaml` sets verl's."""

    validate_arguments: bool = Field(
        default=True,
        description="Check arguments against the tool's JSON schema (required, unknown and wrongly typed "
        "arguments) and answer a mismatch with an error instead of running the tool. verl: false (the tool runs).",
    )
    parse_string_arguments: bool = Field(
        default=True,
        description='Arguments sent as a JSON string ("arguments": "{...}") are parsed before the call. '
        "verl: false (the tool receives the string).",
    )
    truncate_errors: bool = Field(
        default=True,
        description="Error text of a failed execution (a raising tool, a timeout) is cut to "
        "limits.max_tool_response_length like a result. verl: false (only results are cut).",
    )


class InteractionSpec(Strict):
    class_: str = Field(alias="class", description="module:Class implementing the interaction protocol.")
    name: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    final_reply: Literal["keep_out", "append"] = Field(
        default="keep_out",
        description="The reply that ends the conversation (should_terminate): kept out of the response (in "
        "extra final_feedback; the model never answers it), or appended with mask 0 and counted as a user turn "
        "(verl 0.7.1).",
    )
    reply_overflow: Literal["drop", "cut"] = Field(
        default="drop",
        description="A reply that does not fit in the response budget: not appended and the budget counts as "
        "spent (as a tool result, in verl 0.9.1 too), or appended cut at the budget (verl 0.7.1).",
    )

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class RewardSpec(Strict):
    function: str = Field(description="module:function(data_source, solution_str, ground_truth, extra_info).")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    isolation: Literal["none", "thread"] = Field(
        default="thread",
        description="Where a sync reward function runs. thread: its own daemon threads; a call past "
        "limits.reward_timeout_s is abandoned. none: called on the run's own event loop, no hand-off, for a "
        "function that only computes briefly (a regex, a comparison); nothing can interrupt it there, and three of "
        "its last 20 calls within a minute that hold the loop 50 ms each move it to threads of its own, with a "
        "warning. A coroutine function always runs on the run's loop.",
    )


def _check_top_k(v: int | None) -> int | None:
    if v is not None and v != -1 and v < 1:
        raise ValueError("top_k must be -1 (whole vocabulary) or >= 1")
    return v


class SamplingSpec(Strict):
    """Defaults sent to the backend (SGLang names). Call-site parameters override them."""

    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, description="-1 means the whole vocabulary.")
    repetition_penalty: float = Field(default=1.0, gt=0, le=2)
    logprobs: bool = Field(default=True, description="Ask for logprobs (rollout_log_probs).")
    seed: int | None = Field(default=None, description="Base seed; sample k of a batch uses seed + k.")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, description="In addition to eos and the parser's."
    )

    _top_k = field_validator("top_k")(_check_top_k)


class SamplingParams(Strict):
    """A call site's sampling overrides (SGLang names, plus `seed` and `logprobs`), checked here once for every
    engine: vLLM would read top_k -2 as "off" and SGLang refuse it, so no engine sees a value none accepts."""

    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    min_p: float | None = Field(default=None, ge=0, le=1)
    max_new_tokens: int | None = Field(default=None, gt=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    sampling_seed: int | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: int | None = None
    logprobs: bool | None = None

    _top_k = field_validator("top_k")(_check_top_k)


def check_sampling(params: dict[str, Any]) -> dict[str, Any]:
    """`params` checked as SamplingParams (the set ones, as their types); a bad one raises ValueError, one
    line naming the parameter."""
    unknown = sorted(set(params) - set(SamplingParams.model_fields))
    if unknown:
        raise ValueError(
            f"unknown sampling parameter(s) {unknown}; known: {', '.join(SamplingParams.model_fields)}"
        )
    try:
        checked = SamplingParams.model_validate(params)
    except ValidationError as e:
        err = e.errors()[0]
        name = ".".join(str(p) for p in err["loc"])
        key = str(err["loc"][0])
        msg = err["msg"].removeprefix("Value error, ")
        raise ValueError(f"sampling parameter {name}: {msg} (got {key}={params[key]!r})") from None
    return checked.model_dump(exclude_none=True)


class LimitsSpec(Strict):
    prompt_length: int = Field(
        default=1024, gt=0, le=MAX_TOKENS, description="P: prompts are left-padded to this."
    )
    response_length: int = Field(
        default=1024, gt=0, le=MAX_TOKENS, description="R: the whole trajectory's response budget."
    )
    max_new_tokens: int | None = Field(
        default=None, gt=0, le=MAX_TOKENS, description="Per model turn; default: remaining budget."
    )
    max_assistant_turns: int | None = Field(default=None, gt=0, le=MAX_TURNS)
    max_user_turns: int | None = Field(default=None, gt=0, le=MAX_TURNS)
    max_transitions: int = Field(
        default=10_000,
        gt=0,
        le=MAX_TRANSITIONS,
        description="Transitions one trajectory may take; past it the row ends 'error: max_transitions ...'. "
        "Bounds any cycle, including one whose states never consume budget. At most 100,000: every transition "
        "is kept in the trajectory's path (its snapshot and trajectories.jsonl), ~20 bytes each.",
    )
    max_parallel_calls: int = Field(default=1, gt=0, le=1024)
    extra_calls: Literal["error", "drop"] = Field(
        default="error",
        description="Calls beyond max_parallel_calls: 'error' answers each with an error observation; "
        "'drop' ignores them (verl's behaviour), counted in metrics.",
    )
    max_tool_response_length: int = Field(default=256, gt=0, le=1 << 24, description="Characters, as verl.")
    tool_response_truncate_side: Literal["left", "right", "middle"] = Field(
        default="middle", description="verl >= 0.8 meaning: left keeps the tail, right keeps the head."
    )
    prompt_overflow: Literal["error", "truncate_left"] = Field(
        default="error", description="A prompt longer than prompt_length: fail the row, or keep its tail."
    )
    action_timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_SECONDS,
        description="Wall-clock limit for any one action (a model call, a tool round).",
    )
    reward_timeout_s: float | None = Field(
        default=300.0,
        gt=0,
        le=MAX_SECONDS,
        description="Wall-clock limit for the reward function on one trajectory; past it the row ends "
        "'error: reward ...' (a sync function's thread is written off). null: none.",
    )
    rewrite_timeout_s: float | None = Field(
        default=60.0,
        gt=0,
        le=MAX_SECONDS,
        description="Wall-clock limit for one call of a rewrite function (context.rewrites ... function); past it "
        "the row ends 'error: rewrite ...' (a sync function runs in threads of its own and its thread is written "
        "off). null: none.",
    )
    max_resumes: int = Field(
        default=3,
        ge=0,
        le=1000,
        description="A model turn the server aborts (preemption, weight update, drain) is resumed from the tokens "
        "it produced, at most this many times per turn; past it the row ends 'error: aborted ...'.",
    )
    request_timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_SECONDS,
        description="Deadline of one generate request to a server (per attempt); past it the request is aborted "
        "at the server and retried on another. Default: the backend's (300 s for SGLang); the CLI's "
        "--request-timeout overrides it.",
    )
    turn_timeout_s: float | None = Field(
        default=1200.0,
        gt=0,
        le=MAX_SECONDS,
        description="Deadline of one model turn, its retries, failovers and resumes included, and a state's "
        "retries of it; past it the row ends 'error: timeout: ...'. null: none.",
    )


class TrustSpec(Strict):
    """What the spec's author vouches for. A spec is code; this only lifts agentfsm's guard-rail."""

    allow_modules: list[str] = Field(
        default_factory=list,
        description="Standard-library modules agentfsm refuses in import paths by default (all but the few "
        "that only compute, fsm.spec.registry.SAFE_STDLIB: os, subprocess, sys, socket, _socket, pickle, distutils, "
        "imp, ...) that this spec may use anyway, e.g. [os] for `function: os:getcwd`. A tool's arguments are "
        "chosen by the model.",
    )


class ModelSpec(Strict):
    """The model family: its tool-call parser, reasoning and observation rendering (fsm/families)."""

    family: str = Field(
        default="auto",
        description="qwen2.5 | qwen3 | qwen3_coder | gpt_oss | glm45 | kimi_k2 | deepseek_v3 | llama3_1 | seed_oss "
        "| a registered family; auto: from the tokenizer's chat template (qwen2.5 when none matches).",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed to every chat-template render, e.g. {enable_thinking: false}.",
    )
    special_tokens_in_observations: Literal["text", "allow"] = Field(
        default="text",
        description="text: special-token strings (<|im_end|>...) in tool results and user turns are tokenized as "
        "text, so an observation cannot plant a turn of its own; allow: they become the control tokens they spell.",
    )


class PolicySpec(Strict):
    """One model that generates in some states or child machines (docs/trees.md). Its backend is the one the API
    or CLI gives for its name, else `servers`, else `checkpoint`, else the run's own backend."""

    servers: list[str] = Field(
        default_factory=list, description="SGLang/vLLM base URLs serving this policy's model (a Router)."
    )
    checkpoint: str | None = Field(
        default=None, description="A model directory for the embedded backend (relative to the spec file)."
    )
    sampling: SamplingSpec | None = Field(
        default=None, description="This policy's sampling; default: the sampling of the spec that generates."
    )
    model: ModelSpec | None = Field(
        default=None,
        description="This policy's model family and template kwargs; default: the spec's `model:`.",
    )


class ChildSpec(Strict):
    """A child machine started by a tool call of the same name: its final answer is that call's observation."""

    spec: str = Field(
        description="`self` (this spec), a shipped spec's name, or a spec file's path relative to this one."
    )
    policy: str | None = Field(
        default=None, description="The policy generating in the child; default: the child spec's own."
    )
    input: str = Field(
        default="task", description="The tool argument whose text becomes the child's user message."
    )
    description: str = Field(
        default="Hand a sub-task to a sub-agent; returns its final answer.",
        description="The tool's description, as the parent's model reads it.",
    )
    system: str | None = Field(default=None, description="A system message put before the child's task.")
    task: str = Field(
        default="{input}",
        description="The child's user message: `{input}` stands for the argument's text (default: the text "
        "itself), e.g. `What is {input}?` for a child trained on questions.",
    )
    answer: str | None = Field(
        default=None,
        description="A regular expression over the child's final message: its first group (else the whole "
        "match) is the answer the parent sees; no match: the whole message. Default: the whole message.",
    )
    schema_: dict[str, Any] | str | None = Field(
        default=None,
        alias="schema",
        description="The tool schema the parent's model sees, inline or module:NAME (it must take `input`); "
        "default: one string argument `input` with `description`.",
    )

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("answer")
    @classmethod
    def _answer(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"answer is not a regular expression: {exc}") from None
        return v

    @field_validator("task")
    @classmethod
    def _task(cls, v: str) -> str:
        if "{input}" not in v:
            raise ValueError("task must contain {input} (where the argument's text goes)")
        return v


class TreeSpec(Strict):
    """Bounds on a tree of child machines and branches, and how its rows are weighted (docs/trees.md)."""

    max_depth: int | None = Field(
        default=3,
        ge=1,
        le=32,
        description="Deepest node (the root is depth 0); a child past it is refused with an error observation, "
        "a fork past it is skipped. null: none, which `validate` refuses for a recursive child machine.",
    )
    max_children: int = Field(
        default=8, ge=1, le=1024, description="Child machines and branches one node may start."
    )
    max_nodes: int = Field(default=64, ge=1, le=100_000, description="Nodes of one tree, the root included.")
    max_run_nodes: int = Field(
        default=10_000,
        ge=1,
        le=1_000_000,
        description="Children and branches of all the trees a run has in flight (the root spec's): a fork or "
        "child bomb within each tree's bounds (100,000 nodes: gigabytes) ends the row that would pass it as an "
        "error instead of taking the machine's memory. `validate` says how many nodes one tree can reach.",
    )
    weight: Literal["per_root", "per_row"] = Field(
        default="per_root",
        description="The batch's `weight` column: per_root splits 1.0 evenly over a root's rows (segments, "
        "children and branches included); per_row gives every row 1.0.",
    )


class AgentSpec(Strict):
    """The whole agent. `extends:` is resolved by the loader before this model is built."""

    name: str = Field(description="Agent name: spans are `invoke_agent {name}`.")
    description: str | None = None
    extends: str | None = Field(default=None, description="Base spec file, relative to this one.")
    imports: list[str] = Field(
        default_factory=list, description="Modules imported first (they may register guards)."
    )
    initial: str = "PENDING"
    states: dict[str, StateSpec]
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    val_sampling: SamplingSpec = Field(
        default_factory=lambda: SamplingSpec(temperature=0.0),
        description="Used by validate=True (verl val_kwargs).",
    )
    model: ModelSpec = Field(
        default_factory=ModelSpec, description="The model family (parser, reasoning, rendering)."
    )
    parser: str | None = Field(
        default=None, description="Tool-call parser name; default: the model family's."
    )
    tools: list[ToolSpec] = Field(default_factory=list)
    tool_policy: ToolPolicySpec = Field(default_factory=ToolPolicySpec)
    interaction: InteractionSpec | None = None
    turn_closer: Literal["template", "none"] = Field(
        default="template",
        description="Before an observation: the template's tokens owed after a model turn (Qwen's newline after "
        "<|im_end|>, and <|im_end|> itself after a turn cut without it), mask 0, as a re-render has them; "
        "'none': the observation follows the model's last token (verl 0.7.1).",
    )
    reward: RewardSpec | None = None
    context: ContextSpec = Field(
        default_factory=ContextSpec,
        description="Context policy and rewrites: how a trajectory becomes segments.",
    )
    demo_data: str | None = Field(
        default=None,
        description="module:function(n, seed) -> rows; `agentfsm run` uses it when no --data is given.",
    )
    trust: TrustSpec = Field(
        default_factory=TrustSpec, description="Opt-ins to what agentfsm refuses by default."
    )
    failures: FailuresSpec = Field(
        default_factory=FailuresSpec,
        description="What a failed row becomes and the run's failure budget (per-state rules: retry, catch).",
    )
    # trees (docs/trees.md)
    policies: dict[str, PolicySpec] = Field(
        default_factory=dict,
        description="Named models (policies). None declared: one implicit policy named `default`, the run's backend.",
    )
    children: dict[str, ChildSpec] = Field(
        default_factory=dict,
        description="Child machines, each started by a tool call of its name (a tool the model sees).",
    )
    tree: TreeSpec = Field(default_factory=TreeSpec, description="Bounds and row weights of trees.")

    @property
    def default_policy(self) -> str:
        """The policy of a generating state that names none: `default` when declared (or none are), else the
        first declared."""
        if not self.policies or "default" in self.policies:
            return "default"
        return next(iter(self.policies))

    @property
    def policy(self) -> str:
        """The policy that generates in this spec's states."""
        named = [st.policy for st in self.states.values() if st.policy is not None]
        return named[0] if named else self.default_policy

    @property
    def segmenting(self) -> bool:
        """A trajectory of this spec may have several segments (training rows): the template policy, or a state
        that runs a rewrite."""
        rewrites = self.context.rewrites
        return self.context.policy == "template" or any(st.action in rewrites for st in self.states.values())

    @property
    def final_states(self) -> list[str]:
        return [name for name, st in self.states.items() if st.final]


def json_schema() -> dict[str, Any]:
    """The JSON Schema editors use for completion (`# yaml-language-server: $schema=...`), of a spec file as
    written: a file with `extends:` may leave out anything its base says, so the keys AgentSpec requires, and
    those required inside the mappings it merges (`interaction`, `reward`), are required only of a file
    without `extends:`.
    """
    schema = AgentSpec.model_json_schema(by_alias=True)
    defs = schema["$defs"]
    merged: dict[str, Any] = {}
    for name, prop in schema["properties"].items():
        for ref in [p["$ref"] for p in prop.get("anyOf", [prop]) if "$ref" in p]:
            required = defs[ref.rsplit("/", 1)[-1]].pop("required", None)
            if required:
                merged[name] = {"required": required}
    standalone = {"required": schema.pop("required"), "properties": merged}
    schema["if"] = {"required": ["extends"]}
    schema["else"] = standalone
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "agentfsm agent spec"
    return schema


SPECS_DIR = Path(__file__).resolve().parents[2] / "specs"
