"""Per-sample state, and the one place tokens are appended.

Tokens are append-only: generated tokens go in with mask 1 and the engine's logprobs; everything else
(observations, template scaffolding) with mask 0 and logprob 0.0. Ids live in compact arrays (4 bytes per
token) because 10,000 trajectories may be in flight at once.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsm.rows import encodable

if TYPE_CHECKING:
    from fsm.agent import Edge
    from fsm.parsers import ToolCall


@dataclass(slots=True)
class Segment:
    """A run of response tokens with one origin, for transcripts: response_ids[start:end]."""

    role: str  # "assistant" (mask 1), "tool" / "user" (observations), "template" (scaffolding, mask 0)
    start: int
    end: int


@dataclass(slots=True)
class Metrics:
    """verl's AgentLoopMetrics plus engine counters. Times are seconds summed over turns."""

    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    compute_score: float = 0.0
    num_preempted: int = 0  # aborted model turns resumed (verl: -1 when unknown; the engine always knows)
    cached_tokens: int = 0
    prompt_tokens_sent: int = 0
    num_tool_calls: int = 0  # calls run (each answered, failed or not); dropped ones are not among them
    tool_errors: int = 0
    dropped_calls: int = 0
    retries: int = 0

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.__slots__}


class Trajectory:
    """One rollout: identity, conversation, tokens, counters and outcome."""

    __slots__ = (
        # identity
        "index", "sample", "session_id", "uid", "row",
        # conversation
        "messages", "tool_schemas", "tools_kwargs", "interaction_kwargs", "interaction_started",
        # tokens
        "prompt_ids", "response_ids", "response_mask", "response_logprobs", "response_versions", "segments",
        "needs_tail", "partial_turn",
        "logprobs_missing",
        # machine
        "state", "path", "path_times", "transitions_fired",
        # counters used by guards
        "assistant_turns", "user_turns", "pending_calls", "last_finish_reason", "should_terminate",
        "observation_overflow",
        # outcome
        "termination_reason", "error", "reward_score", "tool_rewards", "tool_scores", "turn_scores", "turn_rewards",
        "interaction_score", "token_check", "metrics", "extra", "extra_fields",
    )  # fmt: skip

    def __init__(self, index: int, sample: int, session_id: str, uid: str, row: dict[str, Any], initial: str):
        self.index, self.sample, self.session_id, self.uid, self.row = index, sample, session_id, uid, row
        self.messages: list[dict[str, Any]] = []
        self.tool_schemas: list[dict[str, Any]] | None = None
        self.tools_kwargs: dict[str, Any] = {}
        self.interaction_kwargs: dict[str, Any] | None = None
        self.interaction_started = False
        self.prompt_ids = array("i")
        self.response_ids = array("i")
        self.response_mask = array("b")
        self.response_logprobs = array("f")
        self.response_versions = array("i")  # the weight version that produced each token; -1 on mask 0
        self.segments: list[Segment] = []
        self.needs_tail = False  # the last turn was the model's: the template's turn closer is still owed
        # (ids, logprobs, versions) of a model turn that a pause aborted, while it waits at the engine's gate:
        # a snapshot taken then keeps them, and the turn goes on from them (fsm/actions.py)
        self.partial_turn: tuple[list[int], list[float] | None, list[int]] | None = None
        self.logprobs_missing = False  # logprobs were asked for and a server gave none: response_logprobs
        # then holds placeholders, and the batch carries no rollout_log_probs
        self.state = initial
        self.path: list[str] = [initial]
        self.path_times = array("d")  # perf_counter() when the driver entered each state of `path`
        self.transitions_fired: list[int] = []  # global edge indices, in order
        self.assistant_turns = 0
        self.user_turns = 0
        self.pending_calls: list[ToolCall] = []
        self.last_finish_reason: str | None = None
        self.should_terminate = False
        self.observation_overflow = False
        self.termination_reason: str | None = None
        self.error: str | None = None
        self.reward_score: float | None = None
        self.tool_rewards: list[float] = []
        self.tool_scores: list[float] = []
        self.turn_scores: list[float] = []
        # every tool reward and interaction turn score, with the response position of the last token of the
        # model turn it judges: [source ("tool" | "interaction"), position (-1: before any model token), value]
        self.turn_rewards: list[list[Any]] = []
        self.interaction_score: float | None = None
        self.token_check: str | None = None
        self.metrics = Metrics()
        self.extra: dict[str, Any] = {}
        # verl's agent_data.extra_fields: what tools (and, through fsm_agent, verl's server) put there;
        # exported with the trajectory's extra fields, and as batch columns, as verl exports them
        self.extra_fields: dict[str, Any] = {}

    # --- machine ----------------------------------------------------------------------------------------

    def begin(self) -> None:
        """The driver starts this trajectory: its initial state is entered now (not when it was queued)."""
        self.path_times.append(time.perf_counter())

    def enter(self, edge: Edge) -> None:
        """`edge` fired: the one place the state, the path, its times, fired edges and the reason change."""
        self.state = edge.dest
        self.path.append(edge.dest)
        self.path_times.append(time.perf_counter())
        self.transitions_fired.append(edge.index)
        if edge.reason is not None:
            self.termination_reason = edge.reason

    # --- tokens -----------------------------------------------------------------------------------------

    def append_generated(
        self, ids: list[int], logprobs: list[float] | None, version: int | list[int] = -1
    ) -> None:
        """The model's own tokens: mask 1, with the engine's logprobs (placeholders 0.0 when there are none:
        not asked for, or `logprobs_missing`; never read as values then) and the weight version that produced
        them (one for all, or one per token: a turn resumed across a weight update has two)."""
        start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.response_mask.extend(b"\x01" * len(ids))
        self.response_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.response_versions.extend([version] * len(ids) if isinstance(version, int) else version)
        self.segments.append(Segment("assistant", start, len(self.response_ids)))

    def append_context(self, ids: list[int], role: str) -> None:
        """Tokens the model did not generate (observations, template scaffolding): mask 0, logprob 0.0."""
        if not ids:
            return
        start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.response_mask.extend(bytes(len(ids)))
        self.response_logprobs.extend([0.0] * len(ids))
        self.response_versions.extend([-1] * len(ids))
        self.segments.append(Segment(role, start, len(self.response_ids)))

    def messages_with_turns(
        self, view: Callable[[dict[str, Any], list[int]], dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """`messages` with each model turn's message replaced by view(message, its token ids): what a tool
        (verl's form) or a user simulator reads. The model's turns are the last assistant messages, one per
        assistant segment (a prompt may hold assistant messages of its own)."""
        turns = [seg for seg in self.segments if seg.role == "assistant"]
        out = list(self.messages)
        k = len(turns)
        for i in range(len(out) - 1, -1, -1):
            if k == 0:
                break
            if out[i]["role"] == "assistant":
                k -= 1
                seg = turns[k]
                out[i] = view(out[i], self.response_ids[seg.start : seg.end].tolist())
        return out

    def add_turn_reward(self, source: str, value: float) -> None:
        """A reward for the model turn just taken (a tool's, an interaction turn's): kept with its position."""
        position = next((seg.end - 1 for seg in reversed(self.segments) if seg.role == "assistant"), -1)
        self.turn_rewards.append([source, position, float(value)])

    def context_ids(self) -> list[int]:
        """Everything the model has seen so far: the next request's input_ids."""
        return self.prompt_ids.tolist() + self.response_ids.tolist()

    def weight_versions(self) -> tuple[int, int] | None:
        """(min, max) weight version over the generated tokens; None when there are none."""
        seen = [v for v in self.response_versions if v >= 0]
        return (min(seen), max(seen)) if seen else None

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fail(self, reason: str) -> None:
        """Record a failure: the row keeps its place in the batch with an empty response and mask 0. The reason
        may quote a server or a tool, so it is made encodable (fsm/rows.py) before it reaches any output."""
        reason = encodable(reason)
        self.error = reason
        self.termination_reason = reason if reason.startswith("error:") else f"error: {reason}"
        del self.response_ids[:], self.response_mask[:], self.response_logprobs[:], self.response_versions[:]
        self.segments.clear()
        self.turn_rewards.clear()  # no tokens left to place them on (tool_rewards / turn_scores keep the values)
        self.logprobs_missing = False  # nothing left to lack them

    @property
    def num_turns(self) -> int:
        """verl's count: user turns + assistant turns + 1 (the prompt)."""
        return self.user_turns + self.assistant_turns + 1

    # --- export -----------------------------------------------------------------------------------------

    def to_output(self) -> dict[str, Any]:
        """verl AgentLoopOutput fields (plain lists) plus agentfsm's own."""
        return {
            "prompt_ids": self.prompt_ids.tolist(),
            "response_ids": self.response_ids.tolist(),
            "response_mask": self.response_mask.tolist(),
            "response_logprobs": None if self.logprobs_missing else self.response_logprobs.tolist(),
            "reward_score": self.reward_score,
            "num_turns": self.num_turns,
            "metrics": self.metrics.as_dict(),
            "extra_fields": {
                **self.extra_fields,
                "turn_scores": list(self.turn_scores),
                "tool_rewards": list(self.tool_rewards),
                "tool_scores": list(self.tool_scores),
                "interaction_score": self.interaction_score,
                "termination_reason": self.termination_reason,
                "state_path": list(self.path),
                "response_versions": self.response_versions.tolist(),  # weight version per token, -1: mask 0
            },
        }
