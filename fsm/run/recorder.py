"""Writing the run's journal (its format and reading it back: fsm/run/journal.py): `Writer` appends records to
the file, batched per loop turn and fsynced on its own thread; `Recorder` turns trajectories into records, whole
once, then the deltas of each state boundary."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fsm.run.codec import FORMAT, MAX_RECORD, JournalError, Mark, changes, frame, mark, open_regular, whole
from fsm.run.journal import SYNC_EVERY_S, SYNCS
from fsm.run.signals import warn
from fsm.run.trajectory import Trajectory
from fsm.run.treejournal import node_mark, node_meta


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


class Recorder:
    """Turns trajectories into journal records: whole once, then the deltas of each state boundary."""

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
        record: dict[str, Any] = {
            "t": "group",
            "uid": uid,
            "sampling": sampling,
            "members": [t.session_id for t in trajs],
        }
        if reruns:
            record["reruns"] = reruns
        self.writer.append(record)
        for t in trajs:
            self.whole(t)

    def whole(self, traj: Trajectory, done: bool = False) -> None:
        record: dict[str, Any] = {"t": "traj", "s": traj.session_id, "d": whole(traj)}
        if not traj.node.alone:
            record["n"] = node_meta(traj.node)
        if done:
            record["done"] = True
            self._marks.pop(traj.session_id, None)
        else:
            self._marks[traj.session_id] = mark(traj, node_mark(traj.node))
        self.writer.append(record)

    def step(self, traj: Trajectory, done: bool = False) -> None:
        """What `traj` changed since its last record: the appended part of each array and list, whatever was
        replaced (a new object: the conversation after encode_prompt) whole, the other slots that changed. A
        rewrite that closed a segment writes the trajectory whole."""
        m = self._marks.get(traj.session_id)
        if m is None or len(traj.closed) != m.closed:
            self.whole(traj, done)
            return
        record: dict[str, Any] = {"t": "step", "s": traj.session_id, **changes(traj, m, done)}
        if not traj.node.alone and (node := node_mark(traj.node)) != m.node:
            record["n"] = node_meta(traj.node)
            m.node = node
        if done:
            record["done"] = True
            self._marks.pop(traj.session_id, None)
        elif len(record) == 2:  # nothing changed (the boundary before the first action)
            return
        self.writer.append(record)

    def tool(self, key: str, outcome: dict[str, Any]) -> None:
        """A side-effecting tool's call, journaled as soon as it returns. A success is the call's result, never
        executed again for `key`; a failure is an attempt only (what failed), so a state's retry or a resume
        runs the tool again rather than replaying the failure."""
        if outcome.get("error") is None:
            self.tool_results[key] = outcome
            self.writer.append({"t": "tool", "k": key, "o": outcome})
        else:
            self.writer.append({"t": "tool", "k": key, "attempt": attempt_record(outcome)})

    def end(self, status: str) -> None:
        self.writer.append({"t": "end", "status": status})

    def taken(self, sessions: list[str]) -> None:
        """Groups handed to a consumer (each by its first trajectory's session id): never handed out again."""
        if self.takes and sessions:
            self.writer.append({"t": "taken", "s": sessions})
            self.writer.flush()  # in the OS before `take` returns: a kill -9 after it never hands them out twice

    def resumed(self, made_by: Mapping[str, Any], accepted: list[str]) -> None:
        """A resume goes on: what it runs on, and the changes it accepted (fsm/run/provenance.py)."""
        self.writer.append({"t": "resume", "made_by": dict(made_by), "accepted": accepted})


def attempt_record(outcome: Mapping[str, Any]) -> dict[str, Any]:
    """What the journal keeps of a failed call: its error, the tool's runs and the start of its text."""
    text = outcome.get("text")
    return {
        "error": outcome.get("error"),
        "attempts": outcome.get("attempts", 0),
        "text": text[:500] if isinstance(text, str) else None,
    }
