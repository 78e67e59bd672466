"""The run's journal: every durable step appended as it happens (fsm/run/recorder.py writes it), so that
`agentfsm run --resume OUT` goes on after anything (SIGTERM, `kill -9`, the OOM killer, a power cut) with at most
the turns in flight redone. This module holds its format and reads it back; the records (`t`: run, resume, group,
traj, step, tool, taken, weights, end) and their fields are listed in docs/running.md ("The format").

Why a log of our own rather than SQLite: the records are only ever appended and read whole, in order, once; a
line per record, `crc32hex json`, costs one `write` per loop turn (the records of one turn batched), never a
page rewrite, and a record cut by a kill is plainly the last line (dropped, with one line saying so); it also
measured cheaper (docs/benchmarks.md). The writes reach the OS at the end of the loop turn that made them (a
`kill -9` loses none of them), and an fsync follows on its own thread as `sync` says (fsm/run/recorder.py).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import zlib
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsm.run.segments import TokenRuns
from fsm.run.snapshot import SnapshotError, _decode, decode_trajectory
from fsm.run.trajectory import TRANSIENT, Failure, Metrics, Trajectory

JOURNAL = "journal.log"  # in the run directory
FORMAT = 1
SYNCS = ("1s", "always", "off")  # durability: fsync at most a second later, after every batch, never
SYNC_EVERY_S = 1.0
MAX_RECORD = 256 * 1024 * 1024  # a bound for one line read back

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
assert set(_REST) | set(_ARRAYS) | set(_LISTS) | set(_FIXED) | {"runs", "closed", *TRANSIENT} == set(
    Trajectory.__slots__
)


class JournalError(SnapshotError):
    """A journal that cannot be read or resumed here; one line naming the file and the record."""


def frame(record: Mapping[str, Any]) -> bytes:
    """One record as its line: the CRC-32 of the JSON, then the JSON (strict: no NaN)."""
    body = json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


# --- reading -------------------------------------------------------------------------------------------------


@dataclass
class Read:
    """A journal as read back: its records, the bytes they fill, and what a torn last record lost."""

    path: Path
    records: list[dict[str, Any]]
    good_bytes: int
    torn: str | None = None  # one line: what was dropped


def open_regular(path: str | Path, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A descriptor of the journal file at `path`, never blocking and never following a link: a FIFO, a device or a
    directory planted in its place is refused (JournalError) before a byte is read or written (opening a FIFO
    blocks until someone opens its other end; reading one, until someone writes)."""
    path = Path(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except FileNotFoundError:
        raise JournalError(f"{path}: no journal there") from None
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO with no reader, a directory
            raise JournalError(f"{path}: not a regular file; remove it") from None
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        raise JournalError(f"{path}: cannot open it ({why})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise JournalError(f"{path}: not a regular file; remove it")
    os.set_blocking(fd, True)
    return fd


class Scan:
    """The records of the journal at `path`, read one line at a time (a journal is never in memory whole: a resume
    holds the trajectories it rebuilds, not the records that built them), each line checked (CRC-32 and JSON)
    and bounded by MAX_RECORD. A last line cut mid-way (no newline, or its checksum does not match) is a write a
    kill interrupted: dropped, and said in `torn`. Anything else that does not check is a JournalError naming
    the file and the record's number. `good_bytes`: where the records read so far end."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.good_bytes = 0
        self.torn: str | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        path, n = self.path, 0
        with os.fdopen(open_regular(path), "rb") as f:
            while line := f.readline(MAX_RECORD + 1):
                n += 1
                end = line.endswith(b"\n")
                if len(line) > MAX_RECORD:
                    raise JournalError(
                        f"{path}: record {n} is longer than {MAX_RECORD >> 20} MiB, the bound of one record "
                        "(damaged or forged); the run cannot be resumed from it"
                    )
                body = line[9:-1] if end else b""
                ok = end and len(line) > 10 and line[8:9] == b" "
                if ok:
                    try:
                        ok = int(line[:8], 16) == zlib.crc32(body)
                    except ValueError:
                        ok = False
                if not ok:
                    if not end or not f.peek(1):  # the last line
                        self.torn = (
                            f"{path}: record {n}, the last, was cut mid-way ({len(line)} bytes, a write a kill "
                            "interrupted); dropped"
                        )
                        return
                    raise JournalError(
                        f"{path}: record {n}: its checksum does not match (damaged or edited); the run cannot be "
                        "resumed from it"
                    )
                try:
                    rec = json.loads(body)
                except (ValueError, RecursionError):
                    raise JournalError(
                        f"{path}: record {n}: not JSON (forged: its checksum matches)"
                    ) from None
                if not isinstance(rec, dict) or not isinstance(rec.get("t"), str):
                    raise JournalError(f"{path}: record {n}: not a journal record (no kind 't')")
                self.good_bytes += len(line)
                yield rec


def records(path: str | Path) -> Read:
    """Every record of the journal at `path`, as `Scan` reads them, in a list (for a small journal or a test)."""
    scan = Scan(path)
    out = list(scan)
    return Read(scan.path, out, scan.good_bytes, scan.torn)


def begun(path: str | Path) -> bool:
    """Whether the journal holds a record past its `run` record: False for a run killed before its first group
    was recorded (nothing of it was done: a new run may take the directory, a resume has nothing to go on
    with); True for a damaged one (not ours to drop). JournalError for a file that cannot be a journal (see
    `open_regular`)."""
    os.close(open_regular(path))
    try:
        for k, _ in enumerate(Scan(path)):
            if k:
                return True
    except JournalError:
        return True
    return False


@dataclass
class Rebuilt:
    """A journal replayed into the run it describes: its identity, groups, trajectories, and what was done."""

    identity: dict[str, Any]
    groups: list[dict[str, Any]]  # uid, sampling, members (session ids), in submission order
    trajs: dict[str, Trajectory]  # session id -> as it last was
    first: dict[str, dict[str, Any]]  # session id -> its first whole record (before any action)
    done: set[str] = field(default_factory=set)
    nodes: dict[str, Any] = field(default_factory=dict)  # session id -> its last tree record `n`
    tool_results: dict[str, dict[str, Any]] = field(default_factory=dict)
    ended: str | None = None  # "completed": its files are written
    steps: int = 0
    taken: set[str] = field(default_factory=set)  # groups a consumer took, by their first session id
    # its `resume` records, in order, each with `finished_before`: the trajectories finished before it
    resumes: list[dict[str, Any]] = field(default_factory=list)
    # the weight versions a token may carry (the run's and its `weights` records'); None: a journal from before
    # they were recorded, whose versions are bounded only by the newest a token carries
    versions: set[int] | None = None
    shared: dict[tuple[str, Any], Any] = field(default_factory=dict)  # see `_share`


def _whole(d: dict[str, Any]) -> Trajectory:
    traj = decode_trajectory(d)
    traj._version_runs = array("i", d["_version_runs"])
    traj.path_times = array("d", d["path_times"])
    return traj


def _share(out: Rebuilt, traj: Trajectory) -> None:
    """A row is one object in a run, shared by its samples and tree nodes, and so are a spec's tool schemas; read
    back, each record holds its own copy (2 KB each for the calculator's, half of what a trajectory held): an
    equal one read before is shared again."""
    for name in ("row", "tool_schemas"):
        value = getattr(traj, name)
        key = (name, traj.index if name == "row" else None)
        held = out.shared.get(key)
        if held is not None and held == value:
            setattr(traj, name, held)
        else:
            out.shared[key] = value


def _extend(traj: Trajectory, n: str, at: int, items: list[Any], where: str) -> None:
    target = traj.runs._flat if n == "runs" else getattr(traj, n)
    if not isinstance(at, int) or at != len(target) or not isinstance(items, list):
        raise JournalError(f"{where}: {n} continues at {at!r}, but it holds {len(target)}")
    if n in _LISTS:
        target.extend(_decode(items))
    else:
        target.extend(items)


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
        setattr(traj, n, _decode(v))
    else:
        raise JournalError(f"{where}: {n!r} is not a slot a step replaces")


def rebuild(read: Read | Scan) -> Rebuilt:
    """Replay the records: each trajectory as its last record left it. JournalError (naming the record) for
    one that does not fit: no `run` record first, a step of an unknown trajectory, a delta that does not
    continue where the last left off, a slot that is not the trajectory's. The content is then checked as a
    snapshot's is (fsm/run/snapshot.py `_check`, by the caller)."""
    recs = iter(read.records if isinstance(read, Read) else read)
    first = next(recs, None)
    if first is None or first.get("t") != "run" or first.get("format") != FORMAT:
        raise JournalError(f"{read.path}: not an agentfsm journal of format {FORMAT} (no 'run' record first)")
    out = Rebuilt(first, [], {}, {})
    if first.get("weight_updates") is True:
        out.versions = {first.get("weight_version", 0)}
        _version(first.get("weight_version", 0), f"{read.path}: record 1: weight_version")
    for k, rec in enumerate(recs, start=2):
        where = f"{read.path}: record {k}"
        try:
            _apply(out, rec, where)
        except JournalError:
            raise
        except SnapshotError as exc:  # a value the snapshot encoding refuses (an unknown record type)
            raise JournalError(f"{where}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
            raise JournalError(
                f"{where}: malformed {rec.get('t')!r} record ({type(exc).__name__}: {exc})"
            ) from None
    return out


def _apply(out: Rebuilt, rec: dict[str, Any], where: str) -> None:
    kind = rec["t"]
    if kind == "group":
        if not isinstance(rec["uid"], str) or not isinstance(rec["members"], list):
            raise JournalError(f"{where}: a group without uid or members")
        group = {"uid": rec["uid"], "sampling": rec["sampling"], "members": list(rec["members"])}
        reruns = rec.get("reruns", 0)
        if not reruns:
            out.groups.append(group)
            return
        # a stale group run again: its new trajectories take the place of the last group of that uid
        at = next((i for i in reversed(range(len(out.groups))) if out.groups[i]["uid"] == rec["uid"]), None)
        if type(reruns) is not int or reruns < 1 or at is None:
            raise JournalError(
                f"{where}: a rerun ({reruns!r}) of group {rec['uid']!r}, which no record started"
            )
        gone = set(out.groups[at]["members"])  # the stale trajectories and their tree nodes (`<root>:<path>`)
        for sid in [s for s in out.trajs if s.split(":", 1)[0] in gone]:
            del out.trajs[sid]
            out.first.pop(sid, None)
            out.nodes.pop(sid, None)
        out.groups[at] = {**group, "reruns": reruns}
    elif kind == "traj":
        sid = rec["s"]
        if sid in out.done:
            raise JournalError(f"{where}: trajectory {sid!r} again after it finished (a row twice)")
        traj = _whole(rec["d"])
        if traj.session_id != sid:
            raise JournalError(f"{where}: a trajectory record of {sid!r} holds {traj.session_id!r}")
        _share(out, traj)
        out.first.setdefault(sid, rec["d"])
        out.trajs[sid] = traj
        _node(out, rec, sid, where)
        out.steps += 1
        if rec.get("done"):
            _finished(out, traj, sid, where)
    elif kind == "step":
        sid = rec["s"]
        found = out.trajs.get(sid)
        if found is None:
            raise JournalError(f"{where}: a step of trajectory {sid!r}, which no record started")
        traj = found
        if sid in out.done:
            raise JournalError(f"{where}: a step of trajectory {sid!r} after it finished")
        for n, v in rec.get("r", {}).items():
            _replace(traj, n, v, where)
        for n, (at, items) in rec.get("a", {}).items():
            if n not in (*_ARRAYS, "runs", *_LISTS):
                raise JournalError(f"{where}: {n!r} is not an array or list of a trajectory")
            _extend(traj, n, at, items, where)
        for n, v in rec.get("v", {}).items():
            if n == "error":  # written before `Failure`
                n, v = "failure", Failure.legacy(v, traj.state, traj.extra)
            elif n not in _REST:
                raise JournalError(f"{where}: {n!r} is not a slot a step changes")
            if n == "metrics":
                if not isinstance(v, dict) or not set(v) <= set(Metrics.__slots__):
                    raise JournalError(f"{where}: metrics is not a trajectory's metrics")
                v = Metrics(**v)
            setattr(traj, n, _decode(v))
        _node(out, rec, sid, where)
        out.steps += 1
        if rec.get("done"):
            _finished(out, traj, sid, where)
    elif kind == "tool":
        outcome = rec.get("o", rec.get("attempt"))
        if not isinstance(rec["k"], str) or not isinstance(outcome, dict):
            raise JournalError(f"{where}: a tool record without key or outcome")
        if "o" in rec and outcome.get("error") is None:  # a failure (an older journal's too) is no result
            out.tool_results[rec["k"]] = outcome
    elif kind == "weights":
        _version(rec["v"], f"{where}: a weights record's version")
        if out.versions is not None:
            out.versions.add(rec["v"])
    elif kind == "end":
        out.ended = str(rec["status"])
    elif kind == "taken":
        sessions = rec["s"]
        if not isinstance(sessions, list) or not all(s in out.trajs for s in sessions):
            raise JournalError(f"{where}: a taken record of trajectories no record started")
        out.taken.update(sessions)
    elif kind == "resume":
        if not isinstance(rec.get("made_by"), dict) or not isinstance(rec.get("accepted"), list):
            raise JournalError(f"{where}: a resume record without made_by or accepted")
        out.resumes.append({**rec, "finished_before": len(out.done)})
    elif kind == "run":
        raise JournalError(f"{where}: a second 'run' record (two runs in one journal)")
    else:
        raise JournalError(f"{where}: unknown record kind {kind!r}")


def _version(value: Any, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
        raise JournalError(f"{what} {value!r} is not a weight version (an int32 >= 0)")


def _node(out: Rebuilt, rec: dict[str, Any], sid: str, where: str) -> None:
    """A record's tree place `n` (checked against its tree by fsm/run/treejournal.py `tree_form`)."""
    if "n" in rec:
        if not isinstance(rec["n"], dict):
            raise JournalError(f"{where}: its tree record 'n' is not an object")
        out.nodes[sid] = rec["n"]


def _finished(out: Rebuilt, traj: Trajectory, sid: str, where: str) -> None:
    """A record saying a trajectory finished must hold a finished one: its row goes out as written. Its first
    record is let go: only an unfinished one starts over from it, and a journal of finished rows held them all
    (a fifth of what reading one back took)."""
    if not isinstance(traj.termination_reason, str) or not traj.termination_reason:
        raise JournalError(f"{where}: trajectory {sid!r} finished without a termination reason")
    out.done.add(sid)
    out.first.pop(sid, None)


def ended(path: str | Path) -> str | None:
    """The status of the journal's `end` record when it is the last record (its files written), else None;
    read from the file's tail only (None too for a file that cannot be a journal: `open_regular` says why)."""
    try:
        fd = open_regular(path)
    except JournalError:
        return None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(size - 4096, 0))
        tail = f.read()
    lines = tail.split(b"\n")
    last = lines[-2] if len(lines) >= 2 and lines[-1] == b"" else b""
    if len(last) < 10 or last[8:9] != b" ":
        return None
    try:
        if int(last[:8], 16) != zlib.crc32(last[9:]):
            return None
        rec = json.loads(last[9:])
    except ValueError:
        return None
    return str(rec.get("status")) if isinstance(rec, dict) and rec.get("t") == "end" else None
