"""Every process a command harness starts ends with it: `python -S reaper.py FD ARGV...` runs ARGV as its child
and is a child subreaper (Linux `PR_SET_CHILD_SUBREAPER`), so every descendant of the harness that loses its
parent (a double fork, `setsid`, a daemon) is re-parented here rather than to PID 1 and cannot leave the tree.
The harness's pid is written to FD when it starts (`pid N`), and its exit status the moment it exits (`exit N`:
the gateway closes the session then, and refuses a call taken after the harness exited, fsm/gateway/harness.py), then every descendant left is killed (SIGKILL, whatever
it ignores) and reaped, and the reaper exits with the harness's status. SIGTERM, SIGINT or SIGHUP to the
reaper (the row ended first), or its parent's death, kill the whole tree the same way.

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
KILL_WAIT_S = 5.0  # at most this long to kill and reap what the harness left


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def descendants(root: int) -> list[int]:
    """Every process under `root`, read from /proc (each one's parent pid)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:  # no /proc (not Linux): only the command itself is ours to end
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(b")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
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
    if sys.platform == "linux":
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
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
