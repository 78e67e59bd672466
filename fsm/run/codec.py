"""The one durable form of a trajectory: how a trajectory, its sampling and the run journal's records encode and
decode. The journal (fsm/run/journal.py writes it and frames each record on disk; fsm/run/fold.py folds it back),
a snapshot (a journal compacted to one whole record per trajectory: fsm/run/stream.py `Stream.snapshot`), a Ray
actor's chunk journal (fsm/adapters/ray_journal.py) and the gateway's workers all go through this module; the
records and their fields are listed in docs/running.md ("The format").

A trajectory is written whole once (every slot, so slots added later come along, tagged where JSON has no type of
its own: arrays, sets, tuples, the few dataclasses a trajectory holds), then as the event of each state boundary:
the edge taken, the token runs appended, what the event implies as its payload (`typed`: the counters its runs
imply are left out), and the other slots by what changed (the slot classes below).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fsm.families.parsers import ToolCall
from fsm.run.context import Sampling
from fsm.run.failures import Failure
from fsm.run.trajectory import TRANSIENT, Metrics, Node, Segment, TokenRun, TokenRuns, Trajectory

# the journal's (a `run` record's `format`, and a `format` record's for the records after it: a resume's); 3: a
# model turn's finish reason and calls, a tool's rewards and scores and an interaction's score as slot diffs; 2: a
# step's counters, messages, times and reward as slot diffs too (before `typed`); 1: steps as slot diffs alone, no
# events; all read
FORMAT = 4
FORMATS = (1, 2, 3, FORMAT)
OBSERVED = frozenset({"tool_result", "interaction", "observation"})  # answers to the model: user turns
_TAGS = {"__array__", "__set__", "__tuple__", "__items__", "__dc__"}
_CLASSES = {cls.__name__: cls for cls in (TokenRun, Segment, Metrics, ToolCall, Failure)}

# slots written as deltas: token arrays (the appended part), append-only lists (the appended items)
_ARRAYS = ("prompt_ids", "response_ids", "response_mask", "response_logprobs", "_version_runs", "path_times")
_LISTS = (
    "messages",
    "path",
    "transitions_fired",
    "tool_rewards",
    "tool_scores",
    "turn_scores",
    "turn_rewards",
    "failures",
)
# slots set once (or replaced whole, a new object): compared by identity, written when replaced
_FIXED = ("index", "sample", "session_id", "uid", "row", "tool_schemas", "tools_kwargs", "interaction_kwargs")
# the rest, each compared as cheaply as its kind allows: scalars by value, tuples and lists that are only ever
# replaced (never changed in place) by identity, dicts changed in place by a shallow copy, metrics by its values
_SCALARS = (
    "interaction_started",
    "needs_tail",
    "logprobs_missing",
    "state",
    "assistant_turns",
    "user_turns",
    "last_finish_reason",
    "should_terminate",
    "observation_overflow",
    "termination_reason",
    "reward_score",
    "interaction_score",
    "token_check",
)
_REPLACED = ("segment_start", "partial_turn", "pending_calls", "failure")
_DICTS = ("extra", "extra_fields")
_REST = (*_SCALARS, *_REPLACED, *_DICTS, "metrics")
_PLAIN_LISTS = ("path", "transitions_fired", "tool_rewards", "tool_scores", "turn_scores", "turn_rewards")
_TOKENS = ("response_ids", "response_mask", "response_logprobs", "_version_runs", "runs")  # a step's `tok`
_EDGE = ("path", "transitions_fired")  # a step's `e`
assert set(_REST) | set(_ARRAYS) | set(_LISTS) | set(_FIXED) | {"runs", "closed", *TRANSIENT} == set(
    Trajectory.__slots__
)


class SnapshotError(Exception):
    """A snapshot that cannot be taken or restored here; the message says why and what to do."""


class JournalError(SnapshotError):
    """A journal that cannot be read or resumed here; one line naming the file and the record."""


# --- values ------------------------------------------------------------------------------------------------


_PLAIN = frozenset({str, int, float, bool, type(None)})  # JSON's own: written as they are


def encode_value(value: Any, where: str) -> Any:
    """`value` as JSON-ready data, tagged where JSON has no type of its own."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if type(value) is dict and all(type(k) is str for k in value) and not _TAGS & value.keys():
        return {k: v if type(v) in _PLAIN else encode_value(v, where) for k, v in value.items()}
    if isinstance(value, array):
        return {"__array__": value.typecode, "items": value.tolist()}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [encode_value(v, where) for v in sorted(value, key=repr)]}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v, where) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, where) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not _TAGS & value.keys():
            return {k: encode_value(v, where) for k, v in value.items()}
        return {"__items__": [[encode_value(k, where), encode_value(v, where)] for k, v in value.items()]}
    if isinstance(value, np.ndarray):
        return [encode_value(v, where) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, TokenRuns):  # written as the list of TokenRun records it reads as
        return [encode_value(run, where) for run in value]
    if dataclasses.is_dataclass(value) and type(value).__name__ in _CLASSES:
        fields = {f.name: encode_value(getattr(value, f.name), where) for f in dataclasses.fields(value)}
        return {"__dc__": type(value).__name__, "fields": fields}
    raise SnapshotError(f"{where}: a {type(value).__name__} cannot be written to a snapshot")


def decode_value(value: Any) -> Any:
    """What `encode_value` wrote, back."""
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__array__" in value:
        return array(value["__array__"], value["items"])
    if "__set__" in value:
        return {decode_value(v) for v in value["__set__"]}
    if "__tuple__" in value:
        return tuple(decode_value(v) for v in value["__tuple__"])
    if "__items__" in value:
        return {decode_value(k): decode_value(v) for k, v in value["__items__"]}
    if "__dc__" in value:
        cls = _CLASSES.get(value["__dc__"])
        if cls is None:
            raise SnapshotError(f"unknown record type {value['__dc__']!r}")
        return cls(**{k: decode_value(v) for k, v in value["fields"].items()})
    return {k: decode_value(v) for k, v in value.items()}


_UNSET = object()  # a slot an older trajectory never set


def encode_trajectory(traj: Trajectory) -> dict[str, Any]:
    """Every slot of `traj` as JSON-ready values (the weight versions expanded, one per token)."""
    names = [n for n in type(traj).__slots__ if n != "_version_runs" and n not in TRANSIENT] + [
        "response_versions"
    ]
    out = {}
    for name in names:  # each read once: `response_versions` expands the runs each time it is read
        value = getattr(traj, name, _UNSET)
        if value is not _UNSET:
            out[name] = encode_value(value, f"trajectory {traj.session_id}: {name}")
    return out


def decoded(traj: Trajectory) -> dict[str, Any]:
    """The snapshot form of a trajectory read back already (a journal's, fsm/run/resume.py): `decode_trajectory`
    gives this one back rather than a copy (a resume holds each trajectory once, as the run that wrote it did)."""
    _clock_here(traj)
    return {"__traj__": traj}


def _clock_here(traj: Trajectory) -> None:
    """Its state times moved to end now (durations kept, this process's clock)."""
    if len(traj.path_times):
        shift = time.perf_counter() - traj.path_times[-1]
        traj.path_times = array("d", (t + shift for t in traj.path_times))
        if len(traj.path_times) == len(traj.path):  # the driver's begin() records the current state's entry
            traj.path_times.pop()


def decode_trajectory(data: dict[str, Any]) -> Trajectory:
    """A trajectory from `encode_trajectory`'s output (or `decoded`'s: that one), on this process's clock."""
    if isinstance(known := data.get("__traj__"), Trajectory):
        return known
    traj = Trajectory.__new__(Trajectory)
    traj.failures = []  # a journal written before they were kept has none
    traj.failure = Failure.legacy(data.get("error"), data.get("state"), data.get("extra"))
    traj.heartbeat_at, traj.turn_deadline = 0.0, None  # TRANSIENT
    for name in Trajectory.__slots__:
        if name in data and name not in TRANSIENT:
            setattr(traj, name, decode_value(data[name]))
    traj.runs = TokenRuns(traj.runs)
    traj.node = Node(traj.session_id, route=traj.session_id)  # TRANSIENT: its tree is put back by the caller
    traj.closed = getattr(traj, "closed", None) or ()
    traj._version_runs = array("i")
    versions = decode_value(data.get("response_versions", []))
    if len(versions) != len(traj.response_ids):
        raise SnapshotError(f"trajectory {traj.session_id!r}: its response arrays differ in length")
    traj.response_versions = versions
    if not isinstance(traj.metrics, Metrics):
        traj.metrics = Metrics(**traj.metrics)
    _clock_here(traj)
    return traj


def encode_sampling(sampling: Sampling) -> dict[str, Any]:
    return {
        "params": encode_value(dict(sampling.params), "sampling"),
        "seed": sampling.seed,
        "logprobs": sampling.logprobs,
        "max_new_tokens": sampling.max_new_tokens,
    }


def decode_sampling(data: dict[str, Any]) -> Sampling:
    return Sampling(decode_value(data["params"]), data["seed"], data["logprobs"], data["max_new_tokens"])


def other_tokenizer(recorded: Any, codec: Any) -> tuple[str | None, str] | None:
    """(the recorded tokenizer's name, this codec's) when `recorded` (a `tokenizer_id`) is not this codec's
    tokenizer; None when it is. Snapshots and the run journal (fsm/run/resume.py) both refuse the first case."""
    ours = tokenizer_id(codec)
    if isinstance(recorded, dict) and recorded.get("digest") == ours["digest"]:
        return None
    return (recorded.get("name") if isinstance(recorded, dict) else None), ours["name"]


def tokenizer_id(codec: Any) -> dict[str, Any]:
    """What identifies the tokenizer a snapshot's token ids belong to: its name, size, and a digest of its
    vocabulary and chat template (a ChatML prompt continued by a Llama tokenizer is refused on restore)."""
    tok = getattr(codec, "tokenizer", codec)
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
    h = hashlib.sha256()
    for piece, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{i}\x00{piece}\x01".encode("utf-8", "surrogatepass"))
    h.update(str(getattr(tok, "chat_template", None) or "").encode("utf-8", "surrogatepass"))
    return {
        "name": str(getattr(tok, "name_or_path", "") or type(tok).__name__),
        "size": len(vocab),
        "digest": h.hexdigest(),
    }


# --- a trajectory's records: whole, then the event of each state boundary -----------------------------------------


def whole(traj: Trajectory) -> dict[str, Any]:
    """A `traj` record's `d`: every slot, the weight versions as their runs, the state times as they are."""
    data = encode_trajectory(traj)
    data["_version_runs"] = traj._version_runs.tolist()
    data["path_times"] = traj.path_times.tolist()
    return data


def from_whole(d: dict[str, Any]) -> Trajectory:
    """The trajectory of a `traj` record's `d`."""
    traj = decode_trajectory(d)
    traj._version_runs = array("i", d["_version_runs"])
    traj.path_times = array("d", d["path_times"])
    return traj


@dataclass
class Mark:
    """What the journal holds of one trajectory: the objects and lengths its next step continues from."""

    objs: dict[str, Any]
    lens: dict[str, int]
    rest: dict[str, Any]
    closed: int
    node: Any = None  # fsm/run/journal.py node_mark: what of its tree node the journal holds


def _values(traj: Trajectory) -> dict[str, Any]:
    """What a step compares the rest against (see _REST)."""
    rest: dict[str, Any] = {n: getattr(traj, n) for n in _SCALARS}
    for n in _REPLACED:
        rest[n] = getattr(traj, n)
    for n in _DICTS:
        rest[n] = dict(getattr(traj, n))
    m = traj.metrics
    rest["metrics"] = tuple(getattr(m, f) for f in m.__slots__)
    return rest


def mark(traj: Trajectory, node: Any = None) -> Mark:
    objs = {n: getattr(traj, n) for n in _ARRAYS + _LISTS + _FIXED}
    objs["runs"] = traj.runs
    lens = {n: len(objs[n]) for n in _ARRAYS + _LISTS}
    lens["runs"] = len(traj.runs._flat)  # TokenRuns: compared as its flat array
    return Mark(objs, lens, _values(traj), len(traj.closed), node)


def changes(traj: Trajectory, m: Mark, done: bool) -> dict[str, Any]:
    """A `step` record's body since `m`, which moves on to `traj` as it is now: `e` the edges fired, `tok` the
    response tokens appended (`appended_runs`), and the rest as slots: `a` appended parts, `r` slots replaced
    whole, `v` other slots that changed."""
    out: dict[str, Any] = {}
    grown: dict[str, list[Any]] = {}
    replaced: dict[str, Any] = {}
    for n in _FIXED:
        v = getattr(traj, n)
        if v is not m.objs[n]:
            replaced[n] = encode_value(v, n)
            m.objs[n] = v
    if (tok := appended_runs(traj, m)) is not None:
        out["tok"] = tok
    k = len(traj.transitions_fired) - m.lens["transitions_fired"]
    if k > 0 and len(traj.path) - m.lens["path"] == k and all(getattr(traj, n) is m.objs[n] for n in _EDGE):
        out["e"] = [[i, d] for i, d in zip(traj.transitions_fired[-k:], traj.path[-k:])]
    for n in (*_ARRAYS, "runs", *_LISTS):
        v = getattr(traj, n)
        a = v._flat if n == "runs" else v
        was = m.objs[n]
        if n in _EDGE and "e" in out or n in _TOKENS and tok is not None:
            pass  # in `e`, in `tok`
        elif v is not was or len(a) < m.lens[n]:
            replaced[n] = [a.typecode, a.tolist()] if n in _ARRAYS or n == "runs" else encode_value(a, n)
        elif len(a) > m.lens[n]:
            tail = a[m.lens[n] :]
            if n in _PLAIN_LISTS:
                grown[n] = [m.lens[n], tail]
            else:
                grown[n] = [m.lens[n], encode_value(tail, n) if n in _LISTS else tail.tolist()]
        m.objs[n], m.lens[n] = v, len(a)
    rest, was = _values(traj), m.rest
    changed: dict[str, Any] = {}
    for n in _SCALARS:
        if rest[n] != was[n] or type(rest[n]) is not type(was[n]):
            changed[n] = rest[n]
    if "e" in out and changed.get("state", traj.path[-1]) == traj.path[-1]:
        changed.pop("state", None)  # the last edge's
    for n in _REPLACED:
        if rest[n] is not was[n]:
            changed[n] = encode_value(rest[n], n)
    for n in _DICTS:  # whole at the end: a value changed deep inside is written then
        if done or rest[n] != was[n]:
            changed[n] = encode_value(getattr(traj, n), n)
    if rest["metrics"] != was["metrics"]:  # the fields that changed
        fields = zip(Metrics.__slots__, rest["metrics"], was["metrics"])
        changed["metrics"] = {f: x for f, x, y in fields if x != y or type(x) is not type(y)}
    m.rest = rest
    for key, part in (("a", grown), ("r", replaced), ("v", changed)):
        if part:
            out[key] = part
    return out


def appended_runs(traj: Trajectory, m: Mark) -> list[Any] | None:
    """The response tokens appended since `m`, `[offset, runs]`: each run as `Trajectory.append_context` took it,
    `[role, ids]`, or `append_generated`, `[role, ids, logprobs, weight version(s)]`, so that a fold calls them
    again. None when none was, or the arrays were replaced or cut (a failed row's emptied response: slots)."""
    at = m.lens["response_ids"]
    if len(traj.runs._flat) <= m.lens["runs"] or any(getattr(traj, n) is not m.objs[n] for n in _TOKENS):
        return None
    runs, versions = [], traj.response_versions
    for run in traj.runs[m.lens["runs"] // 3 :]:
        if run.start != at:
            return None
        ids, at = traj.response_ids[run.start : run.end].tolist(), run.end
        if run.role != "assistant":
            runs.append([run.role, ids])
            continue
        v = versions[run.start : run.end]
        one = v and v.count(v[0]) == len(v)
        runs.append(
            [run.role, ids, traj.response_logprobs[run.start : run.end].tolist(), v[0] if one else v.tolist()]
        )
    return [m.lens["response_ids"], runs] if at == len(traj.response_ids) else None


def implied(ev: str, tok: list[Any] | None, was: Mapping[str, Any]) -> dict[str, Any]:
    """The counters a step's event implies from its token runs (`tok`) and their values before it (`was`): each
    model run is an assistant turn and leaves the template's turn closer owed (`needs_tail`); a run after the
    model's pays it; an answer to the model (a tool's, a user's: OBSERVED) is a user turn. Nothing without runs."""
    runs = tok[1] if tok is not None else ()
    if not runs:
        return {}
    out = {
        "assistant_turns": was["assistant_turns"] + sum(r[0] == "assistant" for r in runs),
        "needs_tail": runs[-1][0] == "assistant",
    }
    if ev in OBSERVED:
        out["user_turns"] = was["user_turns"] + 1
    return out


def typed(
    ev: str, body: dict[str, Any], was: Mapping[str, Any], now: Mapping[str, Any], runs: Any = None
) -> None:
    """`body` (a step's, from `changes`; `was` and `now` its scalars before and after; `runs` the trajectory's
    token runs now) as its event's payload: the counters its runs imply (`implied`) left out, or stated in `v`
    where they differ; the messages appended as `msg`; each edge with the time its state was entered (`e`:
    [index, state, time]), a begin with its start (`at`); a reward's value and the row's end as `reward` and
    `reason`; a failure's fields as `failure` (format 3); a model turn's finish reason and calls, a tool's rewards
    and scores, an interaction's score (`named`, format 4)."""
    v = body.setdefault("v", {})
    named(ev, body, v, now, runs)
    for n, value in implied(ev, body.get("tok"), was).items():
        if now[n] == value and type(now[n]) is type(value):
            v.pop(n, None)
        else:
            v[n] = now[n]
    if (a := body.get("a")) is not None:
        if "messages" in a:
            body["msg"] = a.pop("messages")[1]
        times = a.get("path_times")
        if times is not None and "e" in body and len(times[1]) == len(body["e"]):
            body["e"] = [[i, d, t] for (i, d), t in zip(body["e"], a.pop("path_times")[1])]
        elif times is not None and ev == "begin" and "e" not in body and len(times[1]) == 1:
            body["at"] = a.pop("path_times")[1][0]
        if not a:
            del body["a"]
    if ev in ("reward", "child_ended"):
        for key, n in (("reward", "reward_score"), ("reason", "termination_reason")):
            if n in v:
                body[key] = v.pop(n)
    elif ev == "failure" and "failure" in v:
        body["failure"] = v.pop("failure")["fields"]
    if not v:
        del body["v"]


def no_calls(ev: str, tok: list[Any] | None) -> bool:
    """Whether the event leaves no pending calls (format 4 writes `calls` only where it does): a tool round
    answers them (fsm/run/actions.py `call_tools`, `observe_error`), a model turn's run that asked for none."""
    return ev in ("tool_result", "observation") or (
        ev == "model_turn" and tok is not None and any(r[0] == "assistant" for r in tok[1])
    )


# format 4: an event's rewards and scores, `key: (slot, the turn rewards' source)` (see `named`)
_SCORES = {
    "rewards": ("tool_rewards", "tool"),
    "scores": ("tool_scores", None),
    "score": ("turn_scores", "interaction"),
}


def named(ev: str, body: dict[str, Any], v: dict[str, Any], now: Mapping[str, Any], runs: Any) -> None:
    """Format 4: slots an event sets, as its payload. `finish`: a model turn's finish reason (whenever the model
    ran, and wherever it changed); `calls`: the calls it asked for (their fields; none is implied, `no_calls`);
    `rewards` and `scores`: a tool round's tool rewards (each also a turn reward at the last model token) and
    scores; `score`: an interaction's turn score (a turn reward too). What does not fit stays a slot diff."""
    none = no_calls(ev, body.get("tok"))
    if "last_finish_reason" in v or ev == "model_turn" and none:
        v.pop("last_finish_reason", None)
        body["finish"] = now["last_finish_reason"]
    if "pending_calls" in v or none and now["pending_calls"]:
        v.pop("pending_calls", None)
        if now["pending_calls"] or not none:
            body["calls"] = [_call(c) for c in now["pending_calls"]]
    a = body.get("a")
    if not a or runs is None or ev not in ("tool_result", "interaction"):
        return
    last = runs.last("assistant")
    turn_at = last.end - 1 if last is not None else -1  # Trajectory.add_turn_reward's position
    for key in ("rewards", "scores") if ev == "tool_result" else ("score",):
        slot, source = _SCORES[key]
        got, turns = a.get(slot), a.get("turn_rewards") if source else None
        if got is None or not all(_number(x) for x in got[1]) or key == "score" and len(got[1]) != 1:
            continue
        if source is not None:  # each value a turn reward too, as Trajectory.add_turn_reward keeps it
            if turns is None or turns[1] != [[source, turn_at, float(x)] for x in got[1]]:
                continue
            if not all(type(t[2]) is float for t in turns[1]):
                continue
            del a["turn_rewards"]
        body[key] = a.pop(slot)[1] if key != "score" else a.pop(slot)[1][0]
    if not a:
        del body["a"]


def _call(call: ToolCall) -> dict[str, Any]:
    """A tool call's fields (`id` and `error` only when set)."""
    fields = encode_value(call, "calls")["fields"]
    return {k: x for k, x in fields.items() if x is not None or k not in ("id", "error")}


_CALL_FIELDS = frozenset(f.name for f in dataclasses.fields(ToolCall))


def _named_back(traj: Trajectory, rec: dict[str, Any], where: str, fmt: int) -> None:
    """What `named` wrote, applied (after the step's token runs: a turn reward sits at the last model token)."""
    if fmt >= 4 and no_calls(rec.get("ev", ""), rec.get("tok")):
        traj.pending_calls = []
    if "finish" in rec:
        if not isinstance(rec["finish"], (str, type(None))):
            raise JournalError(f"{where}: its finish reason {rec['finish']!r} is not a string")
        traj.last_finish_reason = rec["finish"]
    if (calls := rec.get("calls")) is not None:
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and set(c) <= _CALL_FIELDS for c in calls
        ):
            raise JournalError(f"{where}: its calls are not a list of tool calls")
        traj.pending_calls = [ToolCall(**{k: decode_value(x) for k, x in c.items()}) for c in calls]
    for key, (slot, source) in _SCORES.items():
        if key not in rec:
            continue
        values = [rec[key]] if key == "score" else rec[key]
        if not isinstance(values, list) or not all(_number(x) for x in values):
            raise JournalError(f"{where}: its {key} {rec[key]!r} is not a number or a list of numbers")
        for x in values:
            getattr(traj, slot).append(x)
            if source is not None:
                traj.add_turn_reward(source, x)


def apply_changes(traj: Trajectory, rec: dict[str, Any], where: str, fmt: int = FORMAT) -> None:
    """A `step` record's body (`changes`, `typed` from format 3 on) applied to `traj`; JournalError naming
    `where` when it does not fit."""
    for n, v in rec.get("r", {}).items():
        _replace(traj, n, v, where)
    for n, (at, items) in rec.get("a", {}).items():
        if n not in (*_ARRAYS, "runs", *_LISTS):
            raise JournalError(f"{where}: {n!r} is not an array or list of a trajectory")
        _extend(traj, n, at, items, where)
    for index, dest, *at in rec.get("e", ()):
        if type(index) is not int or not isinstance(dest, str) or at and not _number(at[0]) or len(at) > 1:
            raise JournalError(f"{where}: an edge that is not [index, state] or [index, state, time]")
        traj.transitions_fired.append(index)
        traj.path.append(dest)
        traj.state = dest
        traj.path_times.extend(at)
    if "at" in rec:
        if not _number(rec["at"]):
            raise JournalError(f"{where}: a begin's time {rec['at']!r} is not a number")
        traj.path_times.append(rec["at"])
    was = {"assistant_turns": traj.assistant_turns, "user_turns": traj.user_turns}
    if "tok" in rec:
        at, runs = rec["tok"]
        if at != len(traj.response_ids):
            raise JournalError(
                f"{where}: response_ids continues at {at!r}, but it holds {len(traj.response_ids)}"
            )
        for role, ids, *model in runs:  # lengths that do not match are refused by fsm/run/snapcheck.py
            if role == "assistant":
                traj.append_generated(ids, *model)
            else:
                traj.append_context(ids, role)
    if fmt >= 3:
        for n, value in implied(rec.get("ev", ""), rec.get("tok"), was).items():
            setattr(traj, n, value)
    _named_back(traj, rec, where, fmt)
    if "msg" in rec:
        if not isinstance(rec["msg"], list):
            raise JournalError(f"{where}: its messages 'msg' are not a list")
        traj.messages.extend(decode_value(rec["msg"]))
    for key, n in (("reward", "reward_score"), ("reason", "termination_reason")):
        if key in rec:
            setattr(traj, n, rec[key])
    if "failure" in rec:
        if not isinstance(rec["failure"], dict):
            raise JournalError(f"{where}: its failure is not an object")
        traj.failure = Failure(**rec["failure"])
    for n, v in rec.get("v", {}).items():
        if n == "error":  # written before `Failure`
            n, v = "failure", Failure.legacy(v, traj.state, traj.extra)
        elif n not in _REST:
            raise JournalError(f"{where}: {n!r} is not a slot a step changes")
        if n == "metrics":  # the fields that changed (a format 2 journal's: all of them)
            if not isinstance(v, dict) or not set(v) <= set(Metrics.__slots__):
                raise JournalError(f"{where}: metrics is not a trajectory's metrics")
            for field, value in v.items():
                setattr(traj.metrics, field, value)
            continue
        setattr(traj, n, decode_value(v))


def _number(t: Any) -> bool:
    return isinstance(t, (int, float)) and not isinstance(t, bool)


def _extend(traj: Trajectory, n: str, at: int, items: list[Any], where: str) -> None:
    target = traj.runs._flat if n == "runs" else getattr(traj, n)
    if not isinstance(at, int) or at != len(target) or not isinstance(items, list):
        raise JournalError(f"{where}: {n} continues at {at!r}, but it holds {len(target)}")
    target.extend(decode_value(items) if n in _LISTS else items)


def _replace(traj: Trajectory, n: str, v: Any, where: str) -> None:
    if n in _ARRAYS or n == "runs":
        code, items = v
        if code not in ("i", "l", "q", "b", "B", "f", "d") or not isinstance(items, list):
            raise JournalError(f"{where}: {n} is not an array record")
        a = array(code, items)
        if n == "runs":
            traj.runs = TokenRuns()
            traj.runs._flat = a
        else:
            setattr(traj, n, a)
    elif n in _LISTS or n in _FIXED:
        if n in ("session_id", "index", "sample"):
            raise JournalError(f"{where}: a step may not change a trajectory's {n}")
        setattr(traj, n, decode_value(v))
    else:
        raise JournalError(f"{where}: {n!r} is not a slot a step replaces")
