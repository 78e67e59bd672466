"""Snapshots: trajectories as JSON, taken between states, restored into the same compiled agent.

A trajectory is whole only between states: an action in progress may have appended a model turn and not yet
fired the edge that follows it. So a snapshot parks every running trajectory at its next state boundary
(`Boundary`, awaited by `Runner.drive` before each action), waits until every running one has parked or
finished, writes them all, and lets them go. Trajectories still queued behind the concurrency gate are in
their initial state, which is whole too.

What is written: every slot of `Trajectory` (so slots added later come along), tagged where JSON has no
type of its own (arrays, sets, the few dataclasses a trajectory holds). Tool instances need nothing: an
instance lives inside one `call_tools` action (create, execute, release), so none is alive at a boundary.
An interaction's per-session state is not written: a running trajectory whose interaction has started is
written as it was before its first action, and runs again on restore (fsm/run/stream.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import stat
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, InstanceOf, TypeAdapter, ValidationError

from fsm.families.parsers import ToolCall
from fsm.run.agent import CompiledAgent
from fsm.run.context import Sampling
from fsm.run.trajectory import _FIRST, TRANSIENT, Metrics, Segment, TokenRun, TokenRuns, Trajectory

FORMAT = 2  # 2: the tokenizer is recorded (and checked on restore)
MAX_GROUPS = 10_000_000  # a bound for a count read from a snapshot
RECOUNT_S = 0.5  # how often a snapshot waiting at the boundary counts again without news
_TAGS = {"__array__", "__set__", "__tuple__", "__items__", "__dc__"}
_CLASSES = {cls.__name__: cls for cls in (TokenRun, Segment, Metrics, ToolCall)}


class SnapshotError(Exception):
    """A snapshot that cannot be taken or restored here; the message says why and what to do."""


# --- values ------------------------------------------------------------------------------------------------


def _encode(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, array):
        return {"__array__": value.typecode, "items": value.tolist()}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [_encode(v, where) for v in sorted(value, key=repr)]}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, where) for v in value]}
    if isinstance(value, list):
        return [_encode(v, where) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not _TAGS & value.keys():
            return {k: _encode(v, where) for k, v in value.items()}
        return {"__items__": [[_encode(k, where), _encode(v, where)] for k, v in value.items()]}
    if isinstance(value, np.ndarray):
        return [_encode(v, where) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, TokenRuns):  # written as the list of TokenRun records it reads as
        return [_encode(run, where) for run in value]
    if dataclasses.is_dataclass(value) and type(value).__name__ in _CLASSES:
        fields = {f.name: _encode(getattr(value, f.name), where) for f in dataclasses.fields(value)}
        return {"__dc__": type(value).__name__, "fields": fields}
    raise SnapshotError(f"{where}: a {type(value).__name__} cannot be written to a snapshot")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__array__" in value:
        return array(value["__array__"], value["items"])
    if "__set__" in value:
        return {_decode(v) for v in value["__set__"]}
    if "__tuple__" in value:
        return tuple(_decode(v) for v in value["__tuple__"])
    if "__items__" in value:
        return {_decode(k): _decode(v) for k, v in value["__items__"]}
    if "__dc__" in value:
        cls = _CLASSES.get(value["__dc__"])
        if cls is Segment and "role" in value["fields"]:
            cls = TokenRun  # written before token runs had their own name
        if cls is None:
            raise SnapshotError(f"unknown record type {value['__dc__']!r}")
        return cls(**{k: _decode(v) for k, v in value["fields"].items()})
    return {k: _decode(v) for k, v in value.items()}


def encode_trajectory(traj: Trajectory) -> dict[str, Any]:
    """Every slot of `traj` as JSON-ready values (the weight versions expanded, one per token)."""
    names = [n for n in type(traj).__slots__ if n != "_version_runs" and n not in TRANSIENT] + [
        "response_versions"
    ]
    return {
        name: _encode(getattr(traj, name), f"trajectory {traj.session_id}: {name}")
        for name in names
        if hasattr(traj, name)
    }


def decode_trajectory(data: dict[str, Any]) -> Trajectory:
    """A trajectory from `encode_trajectory`'s output; its state times are moved to end now (durations kept,
    this process's clock)."""
    traj = Trajectory.__new__(Trajectory)
    traj.partial_turn = None  # older snapshots have no such slots
    traj.turn_rewards = []
    traj.heartbeat_at, traj.node = 0.0, None  # TRANSIENT
    for name in Trajectory.__slots__:
        if name in data and name not in TRANSIENT:
            setattr(traj, name, _decode(data[name]))
    traj.runs = TokenRuns(
        _decode(data["segments"]) if "runs" not in data and "segments" in data else getattr(traj, "runs", ())
    )
    traj.closed = getattr(traj, "closed", None) or ()
    start = tuple(getattr(traj, "segment_start", _FIRST))
    traj.segment_start = start + (0,) * (4 - len(start))  # older snapshots: no path index
    traj._version_runs = array("i")
    versions = _decode(data.get("response_versions", []))
    if len(versions) != len(traj.response_ids):
        raise SnapshotError(f"trajectory {traj.session_id!r}: its response arrays differ in length")
    traj.response_versions = versions
    if not isinstance(traj.metrics, Metrics):
        traj.metrics = Metrics(**traj.metrics)
    if len(traj.path_times):
        shift = time.perf_counter() - traj.path_times[-1]
        traj.path_times = array("d", (t + shift for t in traj.path_times))
        if len(traj.path_times) == len(traj.path):  # the driver's begin() records the current state's entry
            traj.path_times.pop()
    return traj


def encode_sampling(sampling: Sampling) -> dict[str, Any]:
    return {
        "params": _encode(dict(sampling.params), "sampling"),
        "seed": sampling.seed,
        "logprobs": sampling.logprobs,
        "max_new_tokens": sampling.max_new_tokens,
    }


def decode_sampling(data: dict[str, Any]) -> Sampling:
    return Sampling(_decode(data["params"]), data["seed"], data["logprobs"], data["max_new_tokens"])


# --- what a restore relies on: each field's type, checked strictly ---------------------------------------------


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
    error: str | None
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


def _check_fields(traj: Trajectory, where: str) -> None:
    """One line naming the first field whose value is not of its type."""
    values = {name: getattr(traj, name) for name in _Fields.model_fields if hasattr(traj, name)}
    try:
        _Fields.model_validate(values)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = ".".join(map(str, first["loc"]))
        raise SnapshotError(f"{where}: field {field!r}: {first['msg']}") from None


# --- files -------------------------------------------------------------------------------------------------


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


def header(agent: CompiledAgent, codec: Any = None) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "agent": agent.name,
        "spec_hash": agent.hash,
        "spec": str(agent.path) if agent.path else None,
        "tokenizer": tokenizer_id(codec) if codec is not None else None,
    }


def _digest(data: dict[str, Any]) -> str:
    body = {k: v for k, v in data.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def write(path: str | Path, data: dict[str, Any]) -> None:
    """Write atomically (a snapshot file is always whole), with a checksum: an edited snapshot is refused.
    The temporary file is made afresh (O_EXCL, never through a link planted in its place; a leftover one is
    removed first) and removed again when writing fails (a full disk): OSError passes through."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.writing")
    text = json.dumps({**data, "checksum": _digest(data)}, ensure_ascii=False, allow_nan=False).encode()
    try:
        os.unlink(
            tmp
        )  # a leftover of a killed writer, or a link someone planted: the link goes, not its target
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        os.replace(tmp, path)  # replaces a link at `path` itself, never its target
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_text(path: Path) -> str:
    """The file's text, never through a link (O_NOFOLLOW), and only a regular file's."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path}: not a regular file")
        return f.read().decode()


def read(
    path: str | Path, agent: CompiledAgent, vocab_size: int | None = None, codec: Any = None
) -> dict[str, Any]:
    """A snapshot file, checked against `agent` (same format, same spec hash), the tokenizer (`codec`'s, when
    given: the one it was taken with), its checksum, and its content, as strictly as a server's answer,
    whatever the checksum says (it is unkeyed: anyone can forge one): states of this agent, token arrays of
    consistent sizes within the limits, token ids below `vocab_size`, masks of 0 and 1, finite logprobs <= 0,
    counts within bounds. Every refusal is a SnapshotError of one line."""
    try:
        data = json.loads(_read_text(Path(path)))
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no snapshot there") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = "it is a symbolic link" if getattr(exc, "errno", None) == errno.ELOOP else str(exc)
        raise SnapshotError(f"{path}: cannot read it ({why})") from None
    except json.JSONDecodeError as exc:
        raise SnapshotError(f"{path}: not a snapshot (bad JSON: {exc.msg}, line {exc.lineno})") from None
    except RecursionError:
        raise SnapshotError(f"{path}: not a snapshot (nested too deeply)") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SnapshotError(f"{path}: not an agentfsm snapshot of format {FORMAT}")
    try:
        digest = _digest(data)
    except (RecursionError, ValueError, TypeError):
        raise SnapshotError(f"{path}: not a snapshot (nested too deeply)") from None
    if data.get("checksum") != digest:
        raise SnapshotError(
            f"{path}: its checksum does not match its content (edited or damaged); it cannot be "
            "resumed, start the run again"
        )
    if data.get("spec_hash") != agent.hash:
        raise SnapshotError(
            f"{path}: taken with agent {data.get('agent')!r} (spec hash {data.get('spec_hash')}), "
            f"but this engine runs {agent.name!r} (spec hash {agent.hash}); restore it with the "
            f"spec it was taken with ({data.get('spec')})"
        )
    if codec is not None and (names := other_tokenizer(data.get("tokenizer"), codec)) is not None:
        named, ours = names
        raise SnapshotError(
            f"{path}: taken with the tokenizer {named!r}, but this engine's is {ours!r} "
            "(another vocabulary or chat template); resume with the tokenizer it was taken with"
        )
    try:
        _check(data, agent, vocab_size)
    except SnapshotError as exc:
        raise SnapshotError(f"{path}: {exc}") from None
    except (
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
        IndexError,
        OverflowError,
        RecursionError,
    ) as exc:
        raise SnapshotError(f"{path}: malformed snapshot ({type(exc).__name__}: {exc})") from None
    return data


def _check(data: dict[str, Any], agent: CompiledAgent, vocab_size: int | None) -> None:
    """What a restore relies on, checked before anything is restored (see `read`)."""
    limits, states = agent.limits, agent.spec.states
    groups = data["groups"]
    if not isinstance(groups, list) or len(groups) > MAX_GROUPS:
        raise SnapshotError("'groups' is not a list of groups")
    for key in ("weight_version", "next_index"):
        if not _count(data.get(key, 0)):
            raise SnapshotError(f"{key!r} is not a count")
    for g in groups:
        if (
            not isinstance(g, dict)
            or g["status"] not in ("ready", "running")
            or not isinstance(g["uid"], str)
        ):
            raise SnapshotError(f"group {g.get('uid') if isinstance(g, dict) else g!r}: bad status or uid")
        if not all(_count(g[k]) for k in ("reruns", "version_min", "version_max")):
            raise SnapshotError(f"group {g['uid']!r}: reruns and versions must be counts")
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
            _check_fields(traj, where)
            if not isinstance(td["done"], bool) or traj.state not in states:
                raise SnapshotError(f"{where}: state {traj.state!r} is not one of the agent's")
            if td["done"] and not isinstance(traj.termination_reason, str):
                raise SnapshotError(f"{where}: finished without a termination reason")
            if (
                g["status"] == "ready" and not td["done"]
            ):  # a ready group is taken as it is: every row finished
                raise SnapshotError(
                    f"group {g['uid']!r}: its status is 'ready' but its trajectory {traj.session_id!r} "
                    "has not finished ('done' false)"
                )
            if any(m not in (0, 1) for m in traj.response_mask):
                raise SnapshotError(f"{where}: response_mask holds values other than 0 and 1")
            lps = [*traj.response_logprobs, *((traj.partial_turn or ((), (), ()))[1] or ())]
            if any(not isinstance(x, (int, float)) or not math.isfinite(x) or x > 0 for x in lps):
                raise SnapshotError(f"{where}: logprobs that are not finite numbers <= 0")
            n = len(traj.response_ids)
            if not (len(traj.response_mask) == len(traj.response_logprobs) == n):
                raise SnapshotError(f"{where}: its response arrays differ in length")
            if n > limits.response_length or len(traj.prompt_ids) > limits.prompt_length:
                raise SnapshotError(f"{where}: more tokens than limits.prompt_length/response_length")
            partial = traj.partial_turn or ((), (), ())
            ids = [*traj.prompt_ids, *traj.response_ids, *partial[0]]
            if ids and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
                raise SnapshotError(f"{where}: token ids outside the tokenizer's vocabulary ({vocab_size})")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


# --- the boundary --------------------------------------------------------------------------------------------


class Boundary:
    """Where `Runner.drive` waits before each action while a snapshot is being taken."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._moved = asyncio.Event()
        self.parked = 0

    async def __call__(self, traj: Trajectory) -> None:
        if self._open.is_set():
            return
        self.parked += 1
        self._moved.set()
        try:
            await self._open.wait()
        finally:
            self.parked -= 1

    def moved(self) -> None:
        """A trajectory started or finished: the closer re-counts."""
        self._moved.set()

    async def close(
        self, running: Callable[[], int], timeout_s: float | None = None, held: Callable[[], int] = lambda: 0
    ) -> None:
        """Hold every trajectory at its next boundary; return once the `running()` ones have all parked, here
        or (`held()` of them) waiting elsewhere while whole (a model turn at a paused engine's gate)."""
        self._open.clear()
        try:
            async with asyncio.timeout(timeout_s):
                while self.parked + held() < running():
                    self._moved.clear()
                    with contextlib.suppress(
                        TimeoutError
                    ):  # `held()` also grows with time (PauseGate.waiting)
                        await asyncio.wait_for(self._moved.wait(), RECOUNT_S)
        except BaseException:
            self._open.set()
            raise

    def open(self) -> None:
        self._open.set()
