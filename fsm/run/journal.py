"""The run's journal: every durable step appended as it happens, so that `agentfsm run --resume OUT` goes on after
anything (SIGTERM, `kill -9`, the OOM killer, a power cut) with at most the turns in flight redone. `Writer`
appends records to the file, batched per loop turn and fsynced on its own thread; `Recorder` turns trajectories
into records, whole once, then the event of each state boundary; `rebuild` folds them. How a record encodes is
fsm/run/codec.py; the records (`t`: run, resume, group, traj, step, tool, taken, weights, end) and their fields
are listed in docs/running.md ("The format").

Why a log of our own rather than SQLite: the records are only ever appended and read whole, in order, once; a
line per record costs one `write` per loop turn (the records of one turn batched), never a page rewrite, and a
record cut by a kill is plainly the last line; it also measured cheaper (docs/benchmarks.md). The writes reach
the OS at the end of the loop turn that made them (a `kill -9` loses none of them), and an fsync follows on its
own thread as `sync` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsm.run.agent import CompiledAgent
from fsm.run.codec import (
    FORMAT,
    FORMATS,
    MAX_RECORD,
    JournalError,
    Mark,
    Read,
    Scan,
    SnapshotError,
    apply_changes,
    changes,
    frame,
    from_whole,
    mark,
    open_regular,
    typed,
    unframe,
    whole,
)
from fsm.run.signals import warn
from fsm.run.trajectory import Node, Trajectory
from fsm.run.treejournal import node_meta

JOURNAL = "journal.log"  # in the run directory
SYNCS = ("1s", "always", "off")  # durability: fsync at most a second later, after every batch, never
SYNC_EVERY_S = 1.0
# what made a record, its `ev`: a step's event is its state's action's (a built-in's by this table, a rewrite's,
# else a user action's `action`), `begin` (the driver started it), `reward` (a row ended and was scored) or
# `child_ended` (a tree node ended); a whole `traj` record's is why it was written whole
ACTION_EVENTS = {
    "encode_prompt": "prompt",
    "generate": "model_turn",
    "call_tools": "tool_result",
    "interact": "interaction",
    "observe_error": "observation",
}
STEP_EVENTS = frozenset({*ACTION_EVENTS.values(), "rewrite", "action", "begin", "reward", "child_ended"})
TRAJ_EVENTS = frozenset({"start", "rewrite", "resume", "child_started", "fork", "snapshot"})


def node_mark(node: Node) -> tuple[int, dict[str, int], bool, bool]:
    """What of a node changes between its boundaries (the journal writes its `n` again when it does)."""
    return len(node.nodes), dict(node.forks), node.forked, node.fresh


# --- writing ---------------------------------------------------------------------------------------------------


class Writer:
    """Appends records to the journal file: batched per loop turn (`append` from the loop schedules one
    `flush`), fsynced per `sync` (see the module docstring) on its own thread, never on the loop: with
    "always" the thread fsyncs each batch as soon as it is written (in order: an fsync covers every write before
    it), with "1s" at most a second later; `sync` is the barrier that waits. Owns that thread; `close` stops it.

    A write the disk refuses (ENOSPC, EIO...) is said once in one line (`failed`): the journal is cut back to its
    last whole batch and takes nothing more, so it stays whole (resumable once there is room) and the run that
    owns it stops (fsm/output/keep.py) rather than making rows no journal holds."""

    def __init__(self, path: Path, sync: str = "1s", keep: int | None = None):
        if sync not in SYNCS:
            raise ValueError(f"journal sync must be one of {', '.join(SYNCS)}, not {sync!r}")
        self.path, self.sync_mode = Path(path), sync
        self._fd = self._open(keep or 0)
        self._at = keep or 0
        self._buf: list[bytes] = []
        self._lock = threading.Lock()
        self._scheduled = False
        self._dirty = threading.Event()
        self._closed = threading.Event()
        self.bytes = self.records = 0
        self.failed: str | None = None  # one line: why the journal takes no more records
        self._thread: threading.Thread | None = None
        if sync != "off":  # the thread's own descriptor: a close never pulls it from under an fsync
            sync_fd = os.dup(self._fd)
            self._thread = threading.Thread(
                target=self._syncer, args=(sync_fd,), name="agentfsm-journal-sync", daemon=True
            )
            self._thread.start()

    def _open(self, keep: int) -> int:
        """The journal file, ours alone, holding its first `keep` bytes (a resume keeps what it read; a torn last
        record goes). A new run's journal is a new file: the one a finished run left there is unlinked, never
        truncated, and a resumed one with other links (`cp -al runA runB`) is copied first, so that writing
        here never changes another directory's journal through a shared inode."""
        if not keep:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(os.lstat(self.path).st_mode):
                    os.unlink(self.path)
            return open_regular(self.path, os.O_WRONLY | os.O_CREAT)
        fd = open_regular(self.path, os.O_RDWR)
        try:
            if os.fstat(fd).st_nlink > 1:
                fd = self._own_copy(fd, keep)
            os.ftruncate(fd, keep)
        except OSError as exc:
            os.close(fd)
            raise JournalError(f"{self.path}: cannot write the journal ({exc.strerror or exc})") from None
        return fd

    def _own_copy(self, fd: int, keep: int) -> int:
        """A copy of the first `keep` bytes of `fd` put in the journal's place (the other links keep the old
        file); its descriptor, `fd` closed."""
        copy, tmp = tempfile.mkstemp(prefix=".journal-", dir=self.path.parent)
        try:
            os.fchmod(copy, 0o644)
            at = 0
            while at < keep:
                chunk = os.pread(fd, min(keep - at, 1 << 20), at)
                if not chunk:
                    break
                at += os.write(copy, chunk)  # a regular file: written whole
            os.fsync(copy)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(copy)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        return copy

    def append(self, record: Mapping[str, Any]) -> None:
        """Queue one record; written at the end of this loop turn (at once outside a loop); dropped once the
        journal has `failed`."""
        if self.failed is not None:
            return
        line = frame(record)
        if len(line) > MAX_RECORD:  # the reader would refuse it: the journal ends whole before it instead
            why = f"a record of {len(line):,} bytes, past the bound of one record ({MAX_RECORD:,})"
            self._fail(OSError(errno.EFBIG, why))
            return
        self.bytes += len(line)
        self.records += 1
        self._buf.append(line)
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._scheduled = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Hand the queued records to the OS (one write; the page cache: no wait for the disk), and wake the
        fsync thread. A write that fails cuts the file back to the batch's start and fails the journal."""
        with self._lock:
            self._scheduled = False
            if not self._buf or self._fd < 0 or self.failed is not None:
                self._buf.clear()
                return
            data = b"".join(self._buf)
            self._buf.clear()
            view, start = memoryview(data), self._at
            try:
                while view:
                    n = os.pwrite(self._fd, view, self._at)
                    self._at += n
                    view = view[n:]
            except OSError as exc:
                with contextlib.suppress(OSError):  # a part of a record would read as damage mid-journal
                    os.ftruncate(self._fd, start)
                self._at = start
                self._fail(exc)
                return
        self._dirty.set()

    def _fail(self, exc: OSError) -> None:
        if self.failed is None:
            self.failed = f"{self.path}: the journal cannot be written ({exc.strerror or exc})"
            warn(
                f"{self.failed}; the run stops here, its journal whole up to its last record (resume it "
                "once the cause is gone)"
            )

    def sync(self) -> None:
        """Everything queued, on disk now (a signal's stop: flush the journal, pause, exit): the barrier."""
        self.flush()
        with self._lock:
            if self._fd >= 0 and self.failed is None:
                os.fsync(self._fd)

    def _syncer(self, fd: int) -> None:
        """The fsync thread: after each batch ("always") or at most every SYNC_EVERY_S ("1s")."""
        wait = None if self.sync_mode == "always" else SYNC_EVERY_S
        try:
            while True:
                if wait is None:
                    self._dirty.wait()
                elif self._closed.wait(wait):
                    return
                if self._closed.is_set():
                    return
                if self._dirty.is_set():
                    self._dirty.clear()
                    try:
                        os.fsync(fd)
                    except OSError as exc:
                        self._fail(exc)
                        return
        finally:
            os.close(fd)

    def close(self, sync: bool = True) -> None:
        """Flush, fsync (unless `sync` is False: a journal about to be removed) and close."""
        with contextlib.suppress(OSError):
            self.sync() if sync else self.flush()
        self._closed.set()
        self._dirty.set()  # wakes an "always" thread to see it closed
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def group_record(uid: str, sampling: dict[str, Any], trajs: Iterable[Trajectory]) -> dict[str, Any]:
    """A `group` record: its sampling and its members (a run's journal and a snapshot write the same)."""
    return {"t": "group", "uid": uid, "sampling": sampling, "members": [t.session_id for t in trajs]}


def traj_record(traj: Trajectory, ev: str, done: bool = False) -> dict[str, Any]:
    """A `traj` record: the trajectory whole, why (`ev`), its place in a tree, and `done` when it has finished."""
    record: dict[str, Any] = {"t": "traj", "s": traj.session_id, "ev": ev, "d": whole(traj)}
    if not traj.node.alone:
        record["n"] = node_meta(traj.node)
    if done:
        record["done"] = True
    return record


class Recorder:
    """Turns trajectories into journal records: whole once, then the event of each state boundary."""

    def __init__(
        self,
        writer: Writer,
        tool_results: Mapping[str, dict[str, Any]] | None = None,
        takes: bool = True,
    ):
        """`takes`: record the groups a consumer takes (`taken`); False for a kept run, which takes its own."""
        self.writer = writer
        self.takes = takes
        self._marks: dict[str, Mark] = {}
        # side-effecting tools' results already journaled (a resumed run's): key -> CallOutcome fields
        self.tool_results: dict[str, dict[str, Any]] = dict(tool_results or {})

    def header(self, identity: Mapping[str, Any]) -> None:
        self.writer.append({"t": "run", "format": FORMAT, "weight_updates": True, **identity})

    def weights(self, version: int, policy: str | None = None) -> None:
        """New weights, `version`, are served (for `policy`, None: the root policy): their tokens may carry it."""
        self.writer.append({"t": "weights", "v": version, **({"policy": policy} if policy else {})})

    def group(self, uid: str, sampling: dict[str, Any], trajs: Iterable[Trajectory], reruns: int = 0) -> None:
        trajs = list(trajs)
        record = group_record(uid, sampling, trajs)
        if reruns:
            record["reruns"] = reruns
        self.writer.append(record)
        for t in trajs:
            self.whole(t, "start")

    def whole(self, traj: Trajectory, ev: str, done: bool = False) -> None:
        record = traj_record(traj, ev, done)
        if done:
            self._marks.pop(traj.session_id, None)
        else:
            self._marks[traj.session_id] = mark(traj, node_mark(traj.node))
        self.writer.append(record)

    def step(self, traj: Trajectory, agent: CompiledAgent | None = None, done: bool = False) -> None:
        """The event that changed `traj` since its last record, named (`ev`) and with its payload (codec.py
        `changes`): at a state boundary, the action of the state `traj` was in (of `agent`, its compiled agent)
        and the edge it took (the last one, into a final state, when the runner's `_finish` begins:
        fsm/run/runtime.py); `done`, its end (the reward). A rewrite that closed a segment, a tree node's first
        boundary and a trajectory's first after a resume write it whole."""
        m = self._marks.get(traj.session_id)
        if m is None or len(traj.closed) != m.closed:
            kind = traj.node.kind
            if m is not None:
                ev = "rewrite"
            elif kind == "branch" and traj.node.fresh:
                ev = "fork"
            else:
                ev = "child_started" if kind == "child" and not traj.transitions_fired else "resume"
            self.whole(traj, ev, done)
            return
        source, was = m.rest["state"], m.rest
        body = changes(traj, m, done)
        if done:
            ev = "reward" if traj.node.kind == "root" else "child_ended"
        elif "e" in body:
            assert agent is not None, "a step that took an edge names the agent whose state it left"
            ref = agent.spec.states[source].action or ""  # a state without one: "action"
            ev = ACTION_EVENTS.get(ref) or ("rewrite" if ref in agent.spec.context.rewrites else "action")
        else:
            ev = "begin"
        typed(ev, body, was, m.rest)
        record: dict[str, Any] = {"t": "step", "s": traj.session_id, "ev": ev, **body}
        if not traj.node.alone and (node := node_mark(traj.node)) != m.node:
            record["n"] = node_meta(traj.node)
            m.node = node
        if done:
            record["done"] = True
            self._marks.pop(traj.session_id, None)
        elif len(record) == 3:  # nothing changed
            return
        self.writer.append(record)

    def tool(self, key: str, outcome: dict[str, Any]) -> None:
        """A side-effecting tool's call, journaled as soon as it returns. A success is the call's result, never
        executed again for `key`; a failure is an attempt only (what failed), so a state's retry or a resume
        runs the tool again rather than replaying the failure."""
        if outcome.get("error") is None:
            self.tool_results[key] = outcome
            self.writer.append({"t": "tool", "k": key, "o": outcome})
        else:  # what failed: its error, the tool's runs and the start of its text
            text = outcome.get("text")
            attempt = {"error": outcome.get("error"), "attempts": outcome.get("attempts", 0)}
            attempt["text"] = text[:500] if isinstance(text, str) else None
            self.writer.append({"t": "tool", "k": key, "attempt": attempt})

    def end(self, status: str) -> None:
        self.writer.append({"t": "end", "status": status})

    def taken(self, sessions: list[str]) -> None:
        """Groups handed to a consumer (each by its first trajectory's session id): never handed out again."""
        if self.takes and sessions:
            self.writer.append({"t": "taken", "s": sessions})
            self.writer.flush()  # in the OS before `take` returns: a kill -9 after it never hands them out twice

    def resumed(self, made_by: Mapping[str, Any], accepted: list[str]) -> None:
        """A resume goes on: what it runs on, and the changes it accepted (fsm/run/resume.py)."""
        self.writer.append({"t": "resume", "format": FORMAT, "made_by": dict(made_by), "accepted": accepted})


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


# --- reading ---------------------------------------------------------------------------------------------------


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
    taken: set[str] = field(default_factory=set)  # groups a consumer took, by their first session id
    # its `resume` records, in order, each with `finished_before`: the trajectories finished before it
    resumes: list[dict[str, Any]] = field(default_factory=list)
    # the weight versions a token may carry (the run's and its `weights` records'); None: a journal from before
    # they were recorded, whose versions are bounded only by the newest a token carries
    versions: set[int] | None = None
    shared: dict[tuple[str, Any], Any] = field(default_factory=dict)  # see `_share`
    format: int = FORMAT  # of the records read now: the `run` record's, then the last `resume` record's


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
    if first is None or first.get("t") != "run" or first.get("format") not in FORMATS:
        raise JournalError(f"{read.path}: not an agentfsm journal of format {FORMAT} (no 'run' record first)")
    out = Rebuilt(first, [], {}, {}, format=first["format"])
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
        _event(out, rec, TRAJ_EVENTS, where)
        traj = from_whole(rec["d"])
        if traj.session_id != sid:
            raise JournalError(f"{where}: a trajectory record of {sid!r} holds {traj.session_id!r}")
        _share(out, traj)
        out.first.setdefault(sid, rec["d"])
        out.trajs[sid] = traj
        _node(out, rec, sid, where)
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
        _event(out, rec, STEP_EVENTS, where)
        apply_changes(traj, rec, where, out.format)
        _node(out, rec, sid, where)
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
        if rec.get("format") in FORMATS:  # the records after it are this version's (none: format 2's too)
            out.format = rec["format"]
    elif kind == "run":
        raise JournalError(f"{where}: a second 'run' record (two runs in one journal)")
    else:
        raise JournalError(f"{where}: unknown record kind {kind!r}")


def _event(out: Rebuilt, rec: dict[str, Any], known: frozenset[str], where: str) -> None:
    """A record's event is one this reader folds (a journal of format 1 names none: its steps are slots alone)."""
    ev = rec.get("ev")
    if ev not in known and (ev is not None or out.format != 1):
        raise JournalError(
            f"{where}: unknown event {ev!r} (known: {', '.join(sorted(known))}); written by another agentfsm "
            "version, or forged: resume it with the version that wrote it"
        )


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
