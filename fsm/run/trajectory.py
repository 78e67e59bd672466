"""Per-sample state, and the one place tokens are appended.

Tokens are append-only within a segment: generated tokens go in with mask 1 and the engine's logprobs;
everything else (observations, template scaffolding) with mask 0 and logprob 0.0. A trajectory is a sequence
of segments, each one training row with exactly the tokens the model was given and produced; a context
rewrite (a template that drops earlier reasoning, a summary, a window: fsm/run/rewrites.py) closes one and
starts the next (`start_segment`). The current segment lives in the trajectory's own fields (`prompt_ids`,
`response_ids`, ...), so a one-segment trajectory, the usual case, holds nothing more; closed segments are kept
in `closed`. Ids live in compact arrays (4 bytes per token), token runs in one array (12 bytes each) and weight
versions as runs (one per model turn), because 10,000 trajectories may be in flight at once.
"""

from __future__ import annotations

import sys
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field
from functools import cache, partial
from typing import TYPE_CHECKING, Any

from backends.base import PromptIds
from fsm.data.rows import encodable
from fsm.families.pieces import expand_runs, extend_array, to_array
from fsm.run.failures import Failure

if TYPE_CHECKING:
    from fsm.families.parsers import ToolCall
    from fsm.run.agent import Edge


@dataclass(slots=True)
class TokenRun:
    """A run of response tokens with one origin, for transcripts and spans: response_ids[start:end]. (Not a
    `Segment`, which is a whole training row, nor a codec's pieces of text between added tokens.)"""

    role: str  # "assistant" (mask 1), "tool" / "user" (observations), "template" (scaffolding, mask 0)
    start: int
    end: int


_ROLE_CODES: dict[str, int] = {"assistant": 0, "tool": 1, "user": 2, "template": 3}
_ROLE_NAMES: list[str] = list(_ROLE_CODES)


class TokenRuns:
    """A response's token runs as one array of (role code, start, end), not ~60 bytes of TokenRun a run, of which a
    tool-calling trajectory holds dozens; reads give TokenRun records."""

    __slots__ = ("_flat",)

    def __init__(self, runs: Iterable[TokenRun] = ()):
        self._flat = array("i")
        for run in runs:
            self.add(run.role, run.start, run.end)

    def add(self, role: str, start: int, end: int) -> None:
        code = _ROLE_CODES.get(role)
        if code is None:  # a role of a user action's own: coded once per process
            code = _ROLE_CODES[role] = len(_ROLE_NAMES)
            _ROLE_NAMES.append(role)
        self._flat.extend((code, start, end))

    def clear(self) -> None:
        del self._flat[:]

    def __len__(self) -> int:
        return len(self._flat) // 3

    def __getitem__(self, i: Any) -> Any:  # transcripts and tests only: the engine iterates or asks `last`
        return list(self)[i]

    def __iter__(self) -> Iterator[TokenRun]:
        f, names = self._flat, _ROLE_NAMES
        return (TokenRun(names[f[k]], f[k + 1], f[k + 2]) for k in range(0, len(f), 3))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenRuns):
            return self._flat == other._flat
        if isinstance(other, Sequence):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TokenRuns({list(self)!r})"

    def tokens_since(self, mark: int) -> tuple[int, int]:
        """(model tokens, other tokens) in the runs from index `mark` on."""
        f, ks = self._flat, range(3 * mark, len(self._flat), 3)
        model = sum(f[k + 2] - f[k + 1] for k in ks if f[k] == 0)  # role code 0: "assistant"
        return model, sum(f[k + 2] - f[k + 1] for k in ks) - model

    def last(self, role: str) -> TokenRun | None:
        """The last run of `role`, or None."""
        code, f = _ROLE_CODES.get(role), self._flat
        for k in range(len(f) - 3, -1, -3):
            if f[k] == code:
                return TokenRun(role, f[k + 1], f[k + 2])
        return None


@dataclass(slots=True, eq=False)
class Segment:
    """One training row of a trajectory: a prompt, then everything appended to it until the next rewrite.
    `messages` is its own conversation (the first `prompt_messages` render its prompt), so `--check-tokens`
    compares each segment with the template's render of it; `turn_rewards` sit at positions in its response."""

    index: int
    reason: str  # why it began: "prompt" (the first), "template", "summary", "rewrite" (window, function, after a summary)
    prompt_ids: array
    response_ids: array
    response_mask: array
    response_logprobs: array
    version_runs: array  # [start, version, ...] as Trajectory._version_runs
    runs: TokenRuns
    messages: list[dict[str, Any]]
    prompt_messages: int
    turns: int  # model turns in it
    turn_rewards: list[list[Any]]
    logprobs_missing: bool = False
    at: int = 0  # where in the trajectory's `path` it began: the state whose action started it

    def __post_init__(self) -> None:
        if not isinstance(self.runs, TokenRuns):  # a snapshot writes the runs as a list of records
            self.runs = TokenRuns(self.runs)

    @property
    def response_versions(self) -> array:
        return expand_runs(self.version_runs, len(self.response_ids))

    def context_ids(self) -> list[int]:
        return self.prompt_ids.tolist() + self.response_ids.tolist()


@cache
def first_segment(prompt_messages: int) -> tuple[str, int, int, int]:
    """The first segment's `segment_start` for a prompt of that many messages: one shared tuple per count."""
    return ("prompt", prompt_messages, 0, 0)


_FIRST = first_segment(0)


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


@dataclass(slots=True)
class TreeCount:
    """A node count against a bound: one tree's (`tree.max_nodes`), or its run's in flight (`tree.max_run_nodes`)."""

    nodes: int = 1
    run: int = 0  # of them, charged to the run's `tree.max_run_nodes` (released when the root ends)


@dataclass(eq=False, slots=True)
class Node:
    """A node of a tree: where its rows sit (`fields`: the row fields of docs/trees.md) and the nodes it made. Every
    trajectory has one (a linear row's is a root alone, so nothing asks whether there is a tree): the one model of
    the engine's trees (fsm/run/tree.py) and of the gateway's session trees (fsm/gateway/tree.py)."""

    tree: str  # the root trajectory's session id: unique per sample
    node: str = "0"  # "0" the root, "0.1" its second child or branch, ...
    parent: str | None = None
    kind: str = "root"  # "root" | "child" | "branch" (the gateway's auxiliary calls: their kind, "title" ...)
    branch_offset: int = 0  # tokens of the parent (prompt + response) before this node began
    policy: str = "default"
    depth: int = 0
    # children and branches, in creation order: their trajectories in the engine, their nodes in the gateway
    nodes: list[Any] = field(default_factory=list)
    origin: str | None = None  # what made it: its child machine's name, or the state that forked
    # --- the engine's run state ---
    shared_length: int = 0  # tokens this node's row shares exactly with its parent's
    route: str = ""  # the sticky routing key: a branch keeps its parent's, so it goes to the same server
    agent: Any = None  # the CompiledAgent this node runs (a root's: bound once its tree grows)
    count: TreeCount = field(default_factory=TreeCount)
    ordinal: int = 0  # the node's number in its tree, creation order (distinct sampling seeds)
    forks: dict[str, int] = field(default_factory=dict)  # state -> forks there along this path
    forked: bool = False  # it split into branches: its tokens live on in theirs, it has no row of its own
    root_agent: Any = None  # the root's CompiledAgent: its `tree:` bounds the whole tree
    # a resumed tree (fsm/run/treejournal.py): nodes the journal holds that were made after this node's last
    # state boundary, by path, for its re-run action to take back instead of making them again; and whether
    # this node had finished (taken back as it is, never run again)
    pending: dict[str, Any] | None = None  # path -> its Trajectory
    finished: bool = False
    # a branch at the entry it was copied at: it runs that state's action, it does not fork there again (each copy
    # would fork anew, 2 + 4 + 8 ... nodes where `branches: 2` was declared); journaled, so a resume knows it too
    fresh: bool = False

    def fields(self, shared: int = 0) -> dict[str, Any]:
        """Its rows' place in the tree (docs/trees.md, Rows, but `weight`), for a row whose first `shared` tokens are
        its parent's."""
        return {
            "tree": self.tree,
            "node": self.node,
            "parent": self.parent,
            "node_kind": self.kind,
            "branch_offset": self.branch_offset,
            "policy": self.policy,
            "depth": self.depth,
            "shared_prefix": {"length": shared, "node": self.parent if shared else None},
        }

    @property
    def alone(self) -> bool:
        """A linear row's tree: a root that has made no node and met no fork (the journal keeps no place for it)."""
        return self.kind == "root" and not (self.nodes or self.forks or self.forked or self.pending)


# Slots that live only while a process drives the trajectory, never journaled: the last tool heartbeat, a model
# turn's deadline, the tree node (it links live objects) and the kept context (built again from the ids).
TRANSIENT = ("heartbeat_at", "turn_deadline", "node", "_context")
# references to a kept context while `Trajectory.context` looks at it: the trajectory's own, the local name and
# getrefcount's argument. More: someone else holds it (a request kept past its call), so it is not grown in place.
_UNSHARED = 3


@dataclass(eq=False, repr=False, slots=True)
class Trajectory:
    """One rollout: identity, conversation, tokens, counters and outcome. Constructed from its identity and initial
    state; every other field starts empty. Slots, in this order, are what the journal's codec walks."""

    # identity
    index: int
    sample: int
    session_id: str
    uid: str
    row: dict[str, Any]
    initial: InitVar[str]
    _: KW_ONLY
    # conversation
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_schemas: list[dict[str, Any]] | None = None
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    interaction_kwargs: dict[str, Any] | None = None
    interaction_started: bool = False
    # tokens
    prompt_ids: array = field(default_factory=partial(array, "i"))
    response_ids: array = field(default_factory=partial(array, "i"))
    response_mask: array = field(default_factory=partial(array, "b"))
    response_logprobs: array = field(default_factory=partial(array, "f"))
    # each token's weight version (-1 on mask 0) as runs [start, version, ...], each up to the next run's start
    _version_runs: array = field(default_factory=partial(array, "i"))
    runs: TokenRuns = field(default_factory=TokenRuns)
    # segments: those a rewrite closed (a shared empty tuple until one does; the current one is the fields above),
    # and how the current one began: (reason, prompt messages, model turns before it, its state's index in `path`)
    closed: list[Segment] | tuple[()] = ()
    segment_start: tuple[str, int, int, int] = _FIRST
    needs_tail: bool = False  # the last turn was the model's: the template's turn closer is still owed
    # (ids, logprobs, versions) of a model turn that a pause aborted, while it waits at the engine's gate:
    # a snapshot taken then keeps them, and the turn goes on from them (fsm/run/actions.py)
    partial_turn: tuple[list[int], list[float] | None, list[int]] | None = None
    # logprobs asked for and none given: placeholders, and the batch carries no rollout_log_probs
    logprobs_missing: bool = False
    # machine
    state: str = field(init=False)
    path: list[str] = field(init=False)
    path_times: array = field(default_factory=partial(array, "d"))  # perf_counter() at each state of `path`
    transitions_fired: list[int] = field(default_factory=list)  # global edge indices, in order
    # counters used by guards
    assistant_turns: int = 0
    user_turns: int = 0
    pending_calls: list[ToolCall] = field(default_factory=list)
    heartbeat_at: float = 0.0  # time.monotonic() of the last tool heartbeat (a state's heartbeat_s)
    # (rid, the state's entry in `path`, the loop's time it ends): a state's retry of a turn keeps its deadline
    turn_deadline: tuple[str, int, float | None] | None = None
    last_finish_reason: str | None = None
    should_terminate: bool = False
    observation_overflow: bool = False
    # outcome
    termination_reason: str | None = None
    failure: Failure | None = None  # what ended the row, when something did
    failures: list[Failure] = field(default_factory=list)  # what a state's retry or catch handled, in order
    reward_score: float | None = None
    tool_rewards: list[float] = field(default_factory=list)
    tool_scores: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    # every tool reward and interaction turn score, with the response position of the last token of the
    # model turn it judges: [source ("tool" | "interaction"), position (-1: before any model token), value]
    turn_rewards: list[list[Any]] = field(default_factory=list)
    interaction_score: float | None = None
    token_check: str | None = None
    metrics: Metrics = field(default_factory=Metrics)
    extra: dict[str, Any] = field(default_factory=dict)
    # verl's agent_data.extra_fields: what tools (and, through fsm_agent, verl's server) put there;
    # exported with the trajectory's extra fields, and as batch columns, as verl exports them
    extra_fields: dict[str, Any] = field(default_factory=dict)
    # its place in its tree (`Node`): a linear row's is a root alone
    node: Node = field(init=False)
    # (context, the prompt array, its length, the response array, the context's length) as `context` last
    # left them; None: not yet
    _context: tuple[PromptIds, array, int, array, int] | None = None

    def __post_init__(self, initial: str) -> None:
        self.state, self.path = initial, [initial]
        self.node = Node(self.session_id, route=self.session_id)

    @property
    def row_name(self) -> str:
        """The row as every message names it: its uid (else its number in the batch), and the data file's line
        it was read from, when it came from one (`bad row q7 (data.jsonl:12): ...`)."""
        return self.extra.get("row_name") or self.uid

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
        extend_array(self.response_ids, ids)
        self.response_mask.extend(b"\x01" * len(ids))
        extend_array(self.response_logprobs, logprobs if logprobs is not None else [0.0] * len(ids))
        if ids:
            if isinstance(version, int):
                self._version_from(start, version)
            elif len(version) != len(ids):
                raise ValueError(f"{len(version)} weight versions for {len(ids)} tokens")
            elif version.count(version[0]) == len(version):  # one version for the whole turn: the usual case
                self._version_from(start, version[0])
            else:
                for i, v in enumerate(version):
                    self._version_from(start + i, v)
        self.runs.add("assistant", start, len(self.response_ids))

    def append_context(self, ids: list[int], role: str) -> None:
        """Tokens the model did not generate (observations, template scaffolding): mask 0, logprob 0.0."""
        if not ids:
            return
        start = len(self.response_ids)
        extend_array(self.response_ids, ids)
        self.response_mask.extend(bytes(len(ids)))
        self.response_logprobs.frombytes(bytes(self.response_logprobs.itemsize * len(ids)))  # 0.0: zero bytes
        self._version_from(start, -1)
        self.runs.add(role, start, len(self.response_ids))

    def _version_from(self, start: int, version: int) -> None:
        """Tokens from `start` on were made by `version` (until the next run)."""
        runs = self._version_runs
        if not runs or runs[-1] != version:
            runs.extend((start, version))

    @property
    def response_versions(self) -> array:
        """The weight version that produced each response token, -1 on mask 0 (expanded from the runs)."""
        return expand_runs(self._version_runs, len(self.response_ids))

    @response_versions.setter
    def response_versions(self, versions: Iterable[int]) -> None:
        versions = list(versions)
        if len(versions) != len(self.response_ids):
            raise ValueError(f"{len(versions)} weight versions for {len(self.response_ids)} response tokens")
        del self._version_runs[:]
        for i, v in enumerate(versions):
            self._version_from(i, v)

    def messages_with_turns(
        self, view: Callable[[dict[str, Any], list[int]], dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """`messages` with each model turn's message replaced by view(message, its token ids): what a tool
        (verl's form) or a user simulator reads. The model's turns are the last assistant messages, one per
        assistant run of the current segment (a prompt may hold assistant messages of its own)."""
        turns = [run for run in self.runs if run.role == "assistant"]
        out = list(self.messages)
        places = [i for i, m in enumerate(out) if m["role"] == "assistant"]
        for i, run in zip(reversed(places), reversed(turns)):  # paired from the last
            out[i] = view(out[i], self.response_ids[run.start : run.end].tolist())
        return out

    def add_turn_reward(self, source: str, value: float) -> None:
        """A reward for the model turn just taken (a tool's, an interaction turn's): kept with its position."""
        last = self.runs.last("assistant")
        position = last.end - 1 if last is not None else -1
        self.turn_rewards.append([source, position, float(value)])

    # --- segments ---------------------------------------------------------------------------------------

    @property
    def num_segments(self) -> int:
        return len(self.closed) + 1

    def current_segment(self) -> Segment:
        """The current segment as a Segment record over the trajectory's own arrays (no copy)."""
        reason, prompt_messages, turns_before, at = self.segment_start
        return Segment(
            len(self.closed),
            reason,
            self.prompt_ids,
            self.response_ids,
            self.response_mask,
            self.response_logprobs,
            self._version_runs,
            self.runs,
            self.messages,
            prompt_messages,
            self.assistant_turns - turns_before,
            self.turn_rewards,
            self.logprobs_missing,
            at,
        )

    @property
    def segments(self) -> list[Segment]:
        """Every segment in order, the current one last (a view over the live arrays)."""
        return [*self.closed, self.current_segment()]

    def start_segment(
        self, prompt_ids: Iterable[int], reason: str, messages: list[dict[str, Any]] | None = None
    ) -> None:
        """A rewrite: the current segment is closed and a new one starts whose prompt is `prompt_ids`, the
        render of `messages` (the new conversation; None: `self.messages` as they are now). The closed segment
        ends with its last model turn (one with none is kept whole): observations after it were never in a context
        the model saw there, so they are cut, with their messages, and the row is what the model was given and
        produced."""
        done = self.current_segment()
        last = self.runs.last("assistant")
        kept = list(self.messages)
        if last is not None and last.end < len(self.response_ids):
            end = last.end
            done.response_ids, done.response_mask = self.response_ids[:end], self.response_mask[:end]
            done.response_logprobs = self.response_logprobs[:end]
            runs = self._version_runs
            done.version_runs = array(
                "i", [x for k in range(0, len(runs), 2) if runs[k] < end for x in (runs[k], runs[k + 1])]
            )
            done.runs = TokenRuns(r for r in self.runs if r.end <= end)
            final = max(i for i, m in enumerate(kept) if m.get("role") == "assistant")
            kept = kept[: final + 1]
        done.messages = kept
        if isinstance(self.closed, tuple):
            self.closed = []
        self.closed.append(done)
        if messages is not None:
            self.messages = messages
        self.prompt_ids = array("i", prompt_ids)
        self.response_ids, self.response_mask = array("i"), array("b")
        self.response_logprobs, self._version_runs, self.runs = array("f"), array("i"), TokenRuns()
        self.turn_rewards = []
        self.needs_tail = False
        self.segment_start = (reason, len(self.messages), self.assistant_turns, len(self.path) - 1)

    def segment_starts(self) -> list[tuple[str, int]]:
        """(reason, index in `path` of the state whose action started it) of every segment after the first:
        where the rewrites happened (fsm/output/rundir.py counts them per state and per edge into it)."""
        if not self.closed:
            return []
        reason, _, _, at = self.segment_start
        return [(seg.reason, seg.at) for seg in self.closed[1:]] + [(reason, at)]

    def all_turn_rewards(self) -> list[tuple[int, list[Any]]]:
        """(segment index, [source, position, value]) for every turn reward of every segment."""
        return [(seg.index, r) for seg in self.segments for r in seg.turn_rewards]

    def context_ids(self) -> list[int]:
        """Everything the model has seen so far in the current segment: the next request's input_ids (a list of
        the caller's own)."""
        return list(self.context())

    def set_prompt(self, ids: list[int]) -> None:
        """The segment's prompt, `context()` made from the list, not from the array (a
        list of 30k ids read back from an array is 2 ms: the gateway's first call, docs/gateway.md)."""
        self.prompt_ids = to_array(ids)
        self._context = (PromptIds(ids), self.prompt_ids, len(ids), self.response_ids, len(ids))

    def context(self) -> PromptIds:
        """`context_ids()` kept from call to call and grown by the tokens appended since (O(new tokens) per model
        call, with its JSON kept: backends/base.py), because rebuilding 238k ids per call made the client's cost
        grow with the context (issue 49). Read it, never change it: it is the trajectory's. A list someone still
        holds when the trajectory has grown (a request kept past its call) is left as it was: the trajectory goes
        on with a copy. Built again when the segment's arrays were replaced or cut, or the list's length changed
        (a backend that appended to the prompt it was given)."""
        prompt, response = self.prompt_ids, self.response_ids
        kept = getattr(self, "_context", None)  # a restored trajectory has none yet
        if (
            kept is not None
            and kept[1] is prompt
            and kept[2] == len(prompt)
            and kept[3] is response
            and kept[4] == len(kept[0])
        ):
            ctx = kept[0]
            done = len(ctx) - len(prompt)
            if done == len(response):
                return ctx
            if done < len(response):
                if sys.getrefcount(ctx) > _UNSHARED:
                    ctx = ctx.copy()
                ctx.extend(response[done:].tolist())
                self._context = (ctx, prompt, len(prompt), response, len(ctx))
                return ctx
        ctx = PromptIds(prompt.tolist())
        ctx.extend(response.tolist())
        self._context = (ctx, prompt, len(prompt), response, len(ctx))
        return ctx

    def weight_versions(self) -> tuple[int, int] | None:
        """(min, max) weight version over the generated tokens; None when there are none."""
        runs = (
            self._version_runs if not self.closed else [v for seg in self.segments for v in seg.version_runs]
        )
        seen = [v for v in runs[1::2] if v >= 0]  # every run holds at least one token
        return (min(seen), max(seen)) if seen else None

    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def error(self) -> str | None:
        """Why the row failed, as `termination_reason` quotes it; None when it did not."""
        return None if self.failure is None else self.failure.cause

    def fail(self, reason: str, kind: str = "error", attempt: int = 1, on_error: str = "mask") -> None:
        """Record the failure that ends the row, of `kind` in its current state: the row keeps its place in the
        batch with an empty response and mask 0 (`on_error: zero_reward`: with the tokens it had). The reason
        may quote a server or a tool, so it is made encodable (fsm/data/rows.py) before it reaches any output."""
        reason = encodable(reason)
        self.failure = Failure(kind, self.state, reason, attempt, on_error=on_error)
        self.termination_reason = reason if reason.startswith("error:") else f"error: {reason}"
        if on_error == "zero_reward":
            return
        del self.response_ids[:], self.response_mask[:], self.response_logprobs[:], self._version_runs[:]
        self._context = None
        self.runs.clear()
        self.closed, self.segment_start = (), _FIRST  # one row: the failed one
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
