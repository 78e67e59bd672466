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

import contextlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsm.run.codec import (
    FORMAT,
    JournalError,
    Read,
    Scan,
    SnapshotError,
    apply_changes,
    frame,
    from_whole,
    open_regular,
    unframe,
)
from fsm.run.trajectory import Trajectory

JOURNAL = "journal.log"  # in the run directory
SYNCS = ("1s", "always", "off")  # durability: fsync at most a second later, after every batch, never
SYNC_EVERY_S = 1.0


def records(path: str | Path) -> Read:
    """Every record of the journal at `path`, as `Scan` reads them, in a list (for a small journal or a test)."""
    scan = Scan(path)
    out = list(scan)
    return Read(scan.path, out, scan.good_bytes, scan.torn)


def write(path: str | Path, recs: Iterable[Mapping[str, Any]]) -> None:
    """A journal written whole at once (a snapshot: fsm/run/stream.py `Stream.snapshot`), atomically: the file is
    always whole. Its temporary is made afresh (O_EXCL, never through a link planted in its place; a leftover one
    is removed first) and removed again when writing fails (a full disk): OSError passes through."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.writing")
    with contextlib.suppress(FileNotFoundError):  # a leftover of a killed writer, or a planted link: it goes
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(frame(r) for r in recs))
        os.replace(tmp, path)  # replaces a link at `path` itself, never its target
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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


def rebuild(read: Read | Scan) -> Rebuilt:
    """Replay the records: each trajectory as its last record left it. JournalError (naming the record) for
    one that does not fit: no `run` record first, a step of an unknown trajectory, a delta that does not
    continue where the last left off, a slot that is not the trajectory's. The content is then checked as a
    snapshot's is (fsm/run/snapcheck.py `_check`, by the caller)."""
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
        if "held" in rec:  # a snapshot's: what its stream knew of the group (reruns, weight versions)
            group["held"] = rec["held"]
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
        traj = from_whole(rec["d"])
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
        apply_changes(traj, rec, where)
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
    rec = unframe(lines[-2]) if len(lines) >= 2 and lines[-1] == b"" else None
    return str(rec.get("status")) if rec is not None and rec.get("t") == "end" else None
