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
written as it was before its first action, and runs again on restore (fsm/run/stream.py). A snapshot read back
is checked before it is restored by fsm/run/snapcheck.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import stat
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fsm.families.parsers import ToolCall
from fsm.run.agent import CompiledAgent
from fsm.run.context import Sampling
from fsm.run.segments import _FIRST, Segment, TokenRun, TokenRuns
from fsm.run.trajectory import TRANSIENT, Failure, Metrics, Node, Trajectory

FORMAT = 2  # 2: the tokenizer is recorded (and checked on restore)
RECOUNT_S = 0.5  # how often a snapshot waiting at the boundary counts again without news
_TAGS = {"__array__", "__set__", "__tuple__", "__items__", "__dc__"}
_CLASSES = {cls.__name__: cls for cls in (TokenRun, Segment, Metrics, ToolCall, Failure)}


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
            out[name] = _encode(value, f"trajectory {traj.session_id}: {name}")
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
    traj.partial_turn = None  # older snapshots have no such slots
    traj.turn_rewards, traj.failures = [], []
    traj.failure = Failure.legacy(data.get("error"), data.get("state"), data.get("extra"))
    traj.heartbeat_at, traj.turn_deadline = 0.0, None  # TRANSIENT
    for name in Trajectory.__slots__:
        if name in data and name not in TRANSIENT:
            setattr(traj, name, _decode(data[name]))
    traj.runs = TokenRuns(
        _decode(data["segments"]) if "runs" not in data and "segments" in data else getattr(traj, "runs", ())
    )
    traj.node = Node(traj.session_id, route=traj.session_id)  # TRANSIENT: its tree is put back by the caller
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
    _clock_here(traj)
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
        # a leftover of a killed writer, or a link someone planted: the link goes, not its target
        os.unlink(tmp)
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
