"""Every process a command harness starts ends with it: `python -S reaper.py FD ARGV...` runs ARGV as its child
and is a child subreaper (Linux `PR_SET_CHILD_SUBREAPER`), so every descendant of the harness that loses its
parent (a double fork, `setsid`, a daemon) is re-parented here rather than to PID 1 and cannot leave the tree.
The harness's pid is written to FD when it starts (`pid N`), and its exit status the moment it exits (`exit N`:
the gateway closes the session then, fsm/gateway/harness.py), then every descendant left is killed (SIGKILL,
whatever it ignores) and reaped, and the reaper exits with the harness's status. SIGTERM, SIGINT or SIGHUP to the
reaper (the row ended first), or its parent's death, kill the whole tree the same way.

Where Linux lets it (root, or an unprivileged user namespace), the harness is contained in a way it cannot undo:
it runs as PID 1 of a PID namespace of its own with its own /proc. It sees no process but its own tree (no other
harness's environment, key or base URL in /proc/PID/environ, no worker's), cannot signal the reaper (which is not in
its namespace: a SIGKILL or SIGSTOP to it once left a detached grandchild alive after the run), and the kernel kills
everything in the namespace the moment the harness exits or dies, the reaper's death killing the harness
(PR_SET_PDEATHSIG). Whether it is contained is written to FD (`contained pid+proc`, or `contained no: why`; the
row keeps it, fsm/gateway/harness.py).

It is run by path with `-S` (no site, no agentfsm import: started in milliseconds) and uses only the standard
library. Elsewhere than on Linux it only runs the command (no subreaper).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x10000000, 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
KILL_WAIT_S = 5.0  # at most this long to kill and reap what the harness left


def prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _unshare() -> str | None:
    """Enter new mount and PID namespaces (the next child is PID 1 of the new one), in a user namespace of our own
    where that needs one (not root); None, or why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS | CLONE_NEWPID) == 0:
        return None
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    try:  # the same ids inside: files keep their owners
        maps = (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1"))
        for name, text in maps:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError as exc:
        return f"user namespace maps: {exc.strerror or exc}"
    return None


def _own_proc() -> str | None:
    """In the harness (PID 1 of its namespace), before exec: /proc shows its own namespace only. None, or why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:  # our mounts stay ours
        return f"mount --make-rprivate /: {os.strerror(ctypes.get_errno())}"
    if libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) != 0:
        return f"mount proc: {os.strerror(ctypes.get_errno())}"
    return None


def children() -> dict[int, list[int]]:
    """Each process's children, read from /proc (each one's parent pid); empty without /proc."""
    found: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:  # no /proc (not Linux): only the command itself is ours to end
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(b")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        found.setdefault(ppid, []).append(int(name))
    return found


def descendants(root: int) -> list[int]:
    """Every process under `root`."""
    kids = children()
    out, todo = [], [root]
    while todo:
        for pid in kids.get(todo.pop(), ()):
            out.append(pid)
            todo.append(pid)
    return out


def kill_tree() -> None:
    """SIGKILL every descendant and reap them, again and again until none is left (a process that forked
    before it was killed leaves an orphan, re-parented here, for the next pass)."""
    me, deadline = os.getpid(), time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        for pid in descendants(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            reaped, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if reaped == 0:
            time.sleep(0.005)  # the killed ones are still dying


def main(argv: list[str]) -> int:
    fd, command = int(argv[0]), argv[1:]
    why: str | None = "not Linux"
    if sys.platform == "linux":
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        why = _unshare()
    stopped = []

    def stop(signum: int, _frame: object) -> None:
        stopped.append(signum)
        kill_tree()
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        child = os.fork()
    except OSError as exc:
        os.write(2, f"agentfsm harness: cannot start {command[0]}: {exc}\n".encode())
        return 127
    if child == 0:
        if why is None:  # the reaper's death ends the namespace, whoever killed it
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            why = _own_proc()
        try:
            os.write(fd, f"contained {'pid+proc' if why is None else 'no: ' + why}\n".encode())
        except OSError:
            pass
        os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            os.write(2, f"agentfsm harness: cannot start {command[0]}: {exc.strerror or exc}\n".encode())
        os._exit(127)
    try:
        os.write(fd, f"pid {child}\n".encode())
    except OSError:
        pass
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:  # (cannot happen: the command is ours until we reap it)
            status = 0
            break
        if pid == child:
            break
    code = os.waitstatus_to_exitcode(status)
    try:
        os.write(fd, f"exit {code}\n".encode())
        os.close(fd)
    except OSError:
        pass
    kill_tree()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
