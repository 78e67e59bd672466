"""The run's journal: every durable step appended as it happens, so that `agentfsm run --resume OUT` goes on after
anything (SIGTERM, `kill -9`, the OOM killer, a power cut) with at most the turns in flight redone. `Writer`
appends records to the file, batched per loop turn and fsynced on its own thread; `Recorder` turns trajectories
into records, whole once, then the event of each state boundary; `Scan` reads them back, and fsm/run/fold.py
`rebuild` folds them. How a record encodes is fsm/run/codec.py; the records (`t`: run, format, resume, group, traj,
step, tool, taken, weights, end) and their fields are listed in docs/running.md ("The format").

A record is a line, `crc32hex json`: appended, never rewritten, and a record cut by a kill is plainly the last line
(dropped, with one line saying so). Why a log of our own rather than SQLite: the records are only ever appended
and read whole, in order, once; a line per record costs one `write` per loop turn (the records of one turn
batched), never a page rewrite; it also measured cheaper (docs/benchmarks.md). The writes reach the OS at the end
of the loop turn that made them (a `kill -9` loses none of them), and an fsync follows on its own thread as `sync`
says.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import stat
import tempfile
import threading
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsm.run.agent import CompiledAgent
from fsm.run.codec import FORMAT, JournalError, Mark, changes, mark, typed, whole
from fsm.run.signals import warn
from fsm.run.trajectory import Node, Trajectory
from fsm.run.treejournal import node_meta

JOURNAL = "journal.log"  # in the run directory
SYNCS = ("1s", "always", "off")  # durability: fsync at most a second later, after every batch, never
SYNC_EVERY_S = 1.0
MAX_RECORD = 256 * 1024 * 1024  # a bound for one line read back
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


def node_mark(node: Node) -> tuple[int, dict[str, int], bool, bool]:
    """What of a node changes between its boundaries (the journal writes its `n` again when it does)."""
    return len(node.nodes), dict(node.forks), node.forked, node.fresh


# --- the framing: a record per line ------------------------------------------------------------------------------


def frame(record: Mapping[str, Any]) -> bytes:
    """One record as its line: the CRC-32 of the JSON, then the JSON (strict: no NaN)."""
    body = json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def unframe(line: bytes) -> dict[str, Any] | None:
    """The record of one whole line (its newline stripped), or None when its checksum or JSON does not hold."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    try:
        if int(line[:8], 16) != zlib.crc32(line[9:]):
            return None
        rec = json.loads(line[9:])
    except (ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) else None


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
                if n == 1 and line[:1] == b"{":
                    raise JournalError(
                        f"{path}: a JSON snapshot of an agentfsm before snapshots were journals; this version "
                        "cannot restore it: restore it with the version that took it, or take it again"
                    )
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
        fsm/run/runtime.py), or its failure there (`failure`: kind, state, attempt, cause); `done`, its end (the
        reward). A rewrite that closed a segment, a tree node's first boundary and a trajectory's first after a
        resume write it whole."""
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
        elif traj.failure is not None and traj.failure is not was["failure"]:
            ev = "failure"  # its action failed: what it did, and the Failure (fsm/run/failures.py)
        else:
            ev = "begin"
        typed(ev, body, was, m.rest, traj.runs)
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

    def resumed(self, made_by: Mapping[str, Any], accepted: list[str], over: Iterable[str] = ()) -> None:
        """A resume goes on: the format of the records after it, in a record of its own (an agentfsm older than
        format 4 refuses that kind in one line, rather than fold them by its rules: tests/test_journal_older.py),
        then what it runs on, the changes it accepted and the roots whose trees start over (fsm/run/resume.py
        `Loaded.trees_over`: their nodes run again under the same session ids, so a reader lets the journaled ones
        go, fsm/run/fold.py)."""
        self.writer.append({"t": "format", "format": FORMAT})
        record = {"t": "resume", "made_by": dict(made_by), "accepted": accepted}
        self.writer.append({**record, "trees_over": list(over)} if over else record)


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
