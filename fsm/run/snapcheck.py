"""A journal read back (a run's or a snapshot's: fsm/run/resume.py `load` replays it) checked before anything is
restored, as strictly as a server's answer whatever its checksums say (they are unkeyed: anyone can forge one):
the spec and tokenizer it was written with, every field's type, states of this agent, token arrays of consistent
sizes within the limits, ids in the vocabulary, finite logprobs <= 0."""

from __future__ import annotations

import dataclasses
import math
from array import array
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, InstanceOf, TypeAdapter, ValidationError

from fsm.data.rows import score_fault
from fsm.families.parsers import ToolCall
from fsm.run.agent import CompiledAgent
from fsm.run.codec import SnapshotError, decode_sampling, decode_trajectory, other_tokenizer
from fsm.run.failures import Failure
from fsm.run.trajectory import Metrics, Segment, TokenRuns, Trajectory

MAX_GROUPS = 10_000_000  # a bound for a count read from a snapshot


# --- each field's type, checked strictly ---------------------------------------------


def _typecodes(*codes: str) -> AfterValidator:
    def typed(value: array) -> array:
        if value.typecode not in codes:
            raise ValueError(f"an array of typecode {value.typecode!r}, not {' or '.join(map(repr, codes))}")
        return value

    return AfterValidator(typed)


_Ids = Annotated[InstanceOf[array], _typecodes("i", "l", "q")]
_Mask = Annotated[InstanceOf[array], _typecodes("b", "B")]
_Logprobs = Annotated[InstanceOf[array], _typecodes("f", "d")]
_Times = Annotated[InstanceOf[array], _typecodes("d")]
_REWARD = TypeAdapter(tuple[Literal["tool", "interaction"], int, float])


def _reward_entry(value: list[Any]) -> list[Any]:
    """[source, position, value], as Trajectory.turn_rewards holds them (a list: JSON has no tuple)."""
    _REWARD.validate_python(tuple(value), strict=True)
    return value


class _Fields(BaseModel):
    """A restored trajectory's slots as the engine uses them (Trajectory.__init__): a forged value of another
    type (`row: 5`) would otherwise run the whole rollout and fail at output, far from the file."""

    model_config = ConfigDict(strict=True, arbitrary_types_allowed=True, extra="ignore")
    index: int
    sample: int
    session_id: str
    uid: str
    row: dict[str, Any]
    messages: list[dict[str, Any]]
    tool_schemas: list[dict[str, Any]] | None
    tools_kwargs: dict[str, Any]
    interaction_kwargs: dict[str, Any] | None
    interaction_started: bool
    prompt_ids: _Ids
    response_ids: _Ids
    response_mask: _Mask
    response_logprobs: _Logprobs
    runs: InstanceOf[TokenRuns]
    closed: list[InstanceOf[Segment]] | tuple[()]
    segment_start: tuple[str, int, int, int]
    needs_tail: bool
    partial_turn: tuple[list[int], list[float] | None, list[int]] | None
    logprobs_missing: bool
    state: str
    path: list[str]
    path_times: _Times
    transitions_fired: list[int]
    assistant_turns: int
    user_turns: int
    pending_calls: list[InstanceOf[ToolCall]]
    last_finish_reason: str | None
    should_terminate: bool
    observation_overflow: bool
    termination_reason: str | None
    failure: InstanceOf[Failure] | None
    failures: list[InstanceOf[Failure]]
    reward_score: float | None
    tool_rewards: list[float]
    tool_scores: list[float]
    turn_scores: list[float]
    turn_rewards: list[Annotated[list[Any], AfterValidator(_reward_entry)]]
    interaction_score: float | None
    token_check: str | None
    metrics: InstanceOf[Metrics]
    extra: dict[str, Any]
    extra_fields: dict[str, Any]


def _typed(model: type[BaseModel], values: dict[str, Any], where: str) -> None:
    """One line naming the first field whose value is not of its type."""
    try:
        model.model_validate(values)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = ".".join(map(str, first["loc"]))
        raise SnapshotError(f"{where}: field {field!r}: {first['msg']}") from None


def _check_fields(traj: Trajectory, where: str) -> None:
    _typed(
        _Fields, {name: getattr(traj, name) for name in _Fields.model_fields if hasattr(traj, name)}, where
    )


class _SegmentFields(BaseModel):
    """A closed segment's fields as the batch reads them (fsm/run/trajectory.py `Segment`)."""

    model_config = ConfigDict(strict=True, arbitrary_types_allowed=True, extra="forbid")
    index: int
    reason: str
    prompt_ids: _Ids
    response_ids: _Ids
    response_mask: _Mask
    response_logprobs: _Logprobs
    version_runs: _Ids
    runs: InstanceOf[TokenRuns]
    messages: list[dict[str, Any]]
    prompt_messages: int
    turns: int
    turn_rewards: list[Annotated[list[Any], AfterValidator(_reward_entry)]]
    logprobs_missing: bool
    at: int


# --- the file and its content ---------------------------------------------------------------------------


def check_identity(
    path: str | Path,
    recorded: dict[str, Any],
    agent: CompiledAgent,
    codec: Any,
    error: type[Exception],
    made: str,
) -> None:
    """Refuse a file `made` ("taken", "written") by another spec or tokenizer than this engine's: its tokens
    would continue another machine or vocabulary. A snapshot and the run journal (fsm/run/resume.py) both ask."""
    if recorded.get("spec_hash") != agent.hash:
        raise error(
            f"{path}: {made} with agent {recorded.get('agent')!r} (spec hash {recorded.get('spec_hash')}), but "
            f"this engine runs {agent.name!r} (spec hash {agent.hash}); resume with the spec it was {made} with "
            f"({recorded.get('spec')})"
        )
    if codec is not None and (names := other_tokenizer(recorded.get("tokenizer"), codec)) is not None:
        raise error(
            f"{path}: {made} with the tokenizer {names[0]!r}, but this engine's is {names[1]!r} "
            f"(another vocabulary or chat template); resume with the tokenizer it was {made} with"
        )


def _check(data: dict[str, Any], agent: CompiledAgent, vocab_size: int | None) -> None:
    """What a restore relies on, checked before anything is restored: every group once, every
    trajectory once and in one group, every row's place (index, sample) once, and every segment of every
    trajectory, the closed ones as the current one (`_check_segment`)."""
    groups = data["groups"]
    if not isinstance(groups, list) or len(groups) > MAX_GROUPS:
        raise SnapshotError("'groups' is not a list of groups")
    for key in ("weight_version", "next_index"):
        if not _count(data.get(key, 0)):
            raise SnapshotError(f"{key!r} is not a count")
    newest = data.get("weight_version", 0)  # no token was made by weights newer than the run's last ones
    uids: set[str] = set()
    sessions: dict[str, str] = {}  # session id -> its group's uid
    places: dict[tuple[int, int], str] = {}  # (index, sample) -> the session id of its root
    for g in groups:
        if (
            not isinstance(g, dict)
            or g["status"] not in ("ready", "running")
            or not isinstance(g["uid"], str)
        ):
            raise SnapshotError(f"group {g.get('uid') if isinstance(g, dict) else g!r}: bad status or uid")
        if g["uid"] in uids:
            raise SnapshotError(f"group {g['uid']!r}: a second group of that uid (its rows would come twice)")
        uids.add(g["uid"])
        if not all(_count(g[k]) for k in ("reruns", "version_min", "version_max")):
            raise SnapshotError(f"group {g['uid']!r}: reruns and versions must be counts")
        if not g["version_min"] <= g["version_max"] <= newest:
            raise SnapshotError(
                f"group {g['uid']!r}: weight versions {g['version_min']}..{g['version_max']} are not a span "
                f"up to the run's weight version {newest}"
            )
        sampling = decode_sampling(g["sampling"])
        if (
            not isinstance(sampling.params, dict)
            or not isinstance(sampling.logprobs, bool)
            or not (sampling.seed is None or (isinstance(sampling.seed, int) and abs(sampling.seed) < 2**63))
            or not (sampling.max_new_tokens is None or _count(sampling.max_new_tokens))
        ):
            raise SnapshotError(f"group {g['uid']!r}: malformed sampling")
        if not isinstance(g["trajectories"], list) or not g["trajectories"]:
            raise SnapshotError(f"group {g['uid']!r}: no trajectories")
        for td in g["trajectories"]:
            traj = decode_trajectory(td)
            where = f"trajectory {traj.session_id!r}"
            _check_trajectory(traj, td, g, where, agent, vocab_size, newest)
            if traj.session_id in sessions:
                raise SnapshotError(
                    f"{where}: in group {sessions[traj.session_id]!r} and again in group {g['uid']!r}"
                )
            sessions[traj.session_id] = g["uid"]
            place = (traj.index, traj.sample)
            if traj.index < 0 or traj.sample < 0 or traj.index >= data.get("next_index", traj.index + 1):
                raise SnapshotError(
                    f"{where}: index {traj.index}, sample {traj.sample} is no row of the run (indices 0 to "
                    f"{data.get('next_index', 0) - 1})"
                )
            root = traj.session_id.split(":", 1)[
                0
            ]  # a tree's nodes (`<root>:<path>`) share their root's place
            if places.setdefault(place, root) != root:
                raise SnapshotError(
                    f"{where}: row index {traj.index}, sample {traj.sample} is trajectory {places[place]!r}'s "
                    "already (a row twice)"
                )


def _check_trajectory(
    traj: Trajectory,
    td: dict[str, Any],
    g: dict[str, Any],
    where: str,
    agent: CompiledAgent,
    vocab_size: int | None,
    newest: int,
) -> None:
    _check_fields(traj, where)
    if not isinstance(td["done"], bool) or traj.state not in agent.spec.states:
        raise SnapshotError(f"{where}: state {traj.state!r} is not one of the agent's")
    if td["done"] and not isinstance(traj.termination_reason, str):
        raise SnapshotError(f"{where}: finished without a termination reason")
    if g["status"] == "ready" and not td["done"]:  # a ready group is taken as it is: every row finished
        raise SnapshotError(
            f"group {g['uid']!r}: its status is 'ready' but its trajectory {traj.session_id!r} "
            "has not finished ('done' false)"
        )
    scores: list[tuple[str, list[float | None]]] = [
        ("reward_score", [traj.reward_score]),
        ("interaction_score", [traj.interaction_score]),
        ("tool_rewards", list(traj.tool_rewards)),
        ("tool_scores", list(traj.tool_scores)),
        ("turn_scores", list(traj.turn_scores)),
    ]
    for name, values in scores:
        for value in values:
            if value is not None and (fault := score_fault(value)):
                raise SnapshotError(f"{where}: field {name!r}: {value!r} is {fault}")
    for name, value in traj.metrics.as_dict().items():
        if not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise SnapshotError(f"{where}: field 'metrics.{name}': {value!r} is not a finite count >= 0")
    closed = list(traj.closed)
    for k, seg in enumerate(closed):
        at = f"{where}: closed segment {k}"
        _typed(_SegmentFields, {f.name: getattr(seg, f.name) for f in dataclasses.fields(seg)}, at)
        if seg.index != k:
            raise SnapshotError(f"{at}: field 'index': {seg.index!r}, not its place {k}")
        _check_segment(at, seg, agent.limits, vocab_size, newest)
    partial = traj.partial_turn or ((), (), ())
    current = traj.current_segment()
    _check_segment(where, current, agent.limits, vocab_size, newest, partial[0], partial[1] or ())
    versions = [v for seg in [*closed, current] for v in seg.version_runs[1::2] if v >= 0]
    if versions != sorted(versions):
        raise SnapshotError(f"{where}: field 'response_versions': weight versions that go back ({versions})")


def _check_segment(
    where: str,
    seg: Segment,
    limits: Any,
    vocab_size: int | None,
    newest: int,
    more_ids: Any = (),
    more_logprobs: Any = (),
) -> None:
    """One training row's tokens, as strictly as a server's answer: masks of 0 and 1, finite logprobs <= 0, ids
    in the vocabulary, arrays of one length within the limits, weight versions that cover the response (-1 on
    mask 0, else a version up to `newest`) and turn rewards at its positions. `more_*`: a partial model turn."""
    n = len(seg.response_ids)
    if not (len(seg.response_mask) == len(seg.response_logprobs) == n):
        raise SnapshotError(
            f"{where}: its response arrays differ in length (response_ids {n}, response_mask "
            f"{len(seg.response_mask)}, response_logprobs {len(seg.response_logprobs)})"
        )
    if n > limits.response_length or len(seg.prompt_ids) > limits.prompt_length:
        raise SnapshotError(
            f"{where}: more tokens than limits.prompt_length/response_length ({len(seg.prompt_ids)} prompt, "
            f"{n} response; at most {limits.prompt_length} and {limits.response_length})"
        )
    if any(m not in (0, 1) for m in seg.response_mask):
        raise SnapshotError(f"{where}: response_mask holds values other than 0 and 1")
    lps = [*seg.response_logprobs, *more_logprobs]
    if any(not isinstance(x, (int, float)) or not math.isfinite(x) or x > 0 for x in lps):
        raise SnapshotError(f"{where}: logprobs that are not finite numbers <= 0")
    ids = [*seg.prompt_ids, *seg.response_ids, *more_ids]
    if ids and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
        raise SnapshotError(f"{where}: token ids outside the tokenizer's vocabulary ({vocab_size})")
    check_version_runs(where, seg.version_runs, n)
    for version, mask in zip(seg.response_versions, seg.response_mask):
        if (version != -1) if mask == 0 else not -1 <= version <= newest:
            raise SnapshotError(
                f"{where}: field 'response_versions': weight version {version} on a token of mask {mask} (-1 on "
                f"mask 0; on mask 1 a version up to the run's {newest}, or -1 when unknown)"
            )
    for _, position, value in seg.turn_rewards:  # typed by `_Fields` and `_SegmentFields`
        if not -1 <= position < max(n, 1) or (fault := score_fault(value)):
            why = f"position {position} of {n}" if not -1 <= position < max(n, 1) else f"{value!r} is {fault}"
            raise SnapshotError(f"{where}: field 'turn_rewards': {why}")


def check_version_runs(where: str, runs: Any, n: int) -> None:
    """Weight version runs [start, version, ...] that cover `n` response tokens: pairs, the first at 0, at
    increasing starts inside the response (every run holds a token)."""
    starts = list(runs[0::2])
    if (
        len(runs) % 2
        or (n and starts[:1] != [0])
        or starts != sorted(set(starts))
        or any(s >= n for s in starts)
    ):
        raise SnapshotError(
            f"{where}: field 'version_runs': {list(runs)[:8]} is not [start, version, ...] over its {n} tokens"
        )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31
