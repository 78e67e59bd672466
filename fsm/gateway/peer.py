"""Which process a gateway connection comes from (issue 50, "Isolation between harnesses").

A session's key is a secret given to one harness, but a harness can lose it (its command line, a log, a sibling
reading /proc/PID/environ where harnesses run uncontained): the key alone does not prove that a request comes from
the session's harness. So a session bound to its harness (`Session.owner`, fsm/gateway/harness.py) also asks the
kernel which socket is at the other end of the connection, and whether a process of its harness holds it:

- the connecting socket's inode, found by its address with one sock_diag request over netlink;
- `socket:[inode]` among the open files (/proc/PID/fd) of the harness's tree: its reaper, the harness and their
  descendants (/proc/PID/task/TID/children), which in a PID namespace is everything the harness can start.

The gateway caches the inode per connection, and the harnesses found holding it (an HTTP client keeps its
connection alive), so a harness pays the lookup once per connection, not once per session (docs/gateway.md). Behind a front
(fsm/gateway/front.py) the worker's peer is the front: the front names its caller's socket in PEER_HEADER, which
a worker believes only over a connection its front process holds.

Linux only (`available`): elsewhere sessions are not bound, and the run says its harnesses are not contained.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
import sys
from collections.abc import Container, Iterable, Iterator

from fsm.gateway.reaper import children

PEER_HEADER = "x-agentfsm-peer-socket"  # the front -> its worker: the inode of the harness's connection
NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST = 4, 20, 1
NO_COOKIE = 0xFFFFFFFF  # INET_DIAG_NOCOOKIE: look the socket up by its addresses alone


@functools.cache
def available() -> bool:
    """Whether this system tells which process holds a connection (Linux: netlink and /proc); asked once a process,
    where every session and every new connection asks it."""
    return sys.platform == "linux" and hasattr(socket, "AF_NETLINK") and os.path.isdir("/proc/self/fd")


def socket_inode(peer: tuple | None, local: tuple | None) -> int | None:
    """The inode of the TCP socket that connected from `peer` to `local` (a server's accepted connection:
    `transport.get_extra_info("peername")` and `"sockname"`); None when no such socket is in this network
    namespace (another host, a container), or where there is no netlink."""
    if not peer or not local or not available():
        return None
    host, lhost = str(peer[0]), str(local[0])
    if host.startswith("::ffff:") and lhost.startswith("::ffff:"):  # an IPv4 client of a dual-stack server
        found = _diag(socket.AF_INET, host[7:], int(peer[1]), lhost[7:], int(local[1]))
        if found is not None:
            return found
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return _diag(family, host, int(peer[1]), lhost, int(local[1]))


def _diag(family: int, src: str, sport: int, dst: str, dport: int) -> int | None:
    """One sock_diag lookup (linux/inet_diag.h: inet_diag_req_v2 -> inet_diag_msg's idiag_inode)."""
    try:
        saddr, daddr = socket.inet_pton(family, src), socket.inet_pton(family, dst)
    except OSError:
        return None
    request = (
        struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
        + struct.pack(">HH", sport, dport)
        + saddr.ljust(16, b"\0")
        + daddr.ljust(16, b"\0")
        + struct.pack("=III", 0, NO_COOKIE, NO_COOKIE)
    )
    header = struct.pack("=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0)
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.sendto(header + request, (0, 0))
            answer = nl.recv(1 << 16)
    except OSError:
        return None
    if len(answer) < 16 + 72 or struct.unpack_from("=H", answer, 4)[0] != SOCK_DIAG_BY_FAMILY:
        return None  # NLMSG_ERROR: no such socket here
    return int(struct.unpack_from("=I", answer, 16 + 68)[0])  # inet_diag_msg.idiag_inode


def tree(root: int, skip: Container[int] = ()) -> Iterator[int]:
    """`root` and its descendants, nearest first, leaving out the subtrees of `skip`."""
    todo = [root]
    every: dict[int, list[int]] | None = None  # without /proc/PID/task/TID/children: each parent, read once
    while todo:
        pid = todo.pop(0)
        if pid in skip:
            continue
        yield pid
        kids = _children(pid)
        if kids is None:
            every = children() if every is None else every
            kids = every.get(pid, [])
        todo.extend(kids)


def descends(pid: int, root: int, skip: Container[int] = ()) -> bool:
    """Whether `pid` is `root` or one of its descendants, not in the subtree of one of `skip`: what `pid in
    tree(root, skip)` says, from `pid`'s parents (a file a level) instead of every thread's children below `root`."""
    for _ in range(64):
        if pid in skip:
            return False
        if pid == root:
            return True
        if pid <= 1:
            return False
        try:  # os.open and one read: half of open()'s cost, which builds a buffered file object
            fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
            try:
                stat = os.read(fd, 4096)
            finally:
                os.close(fd)
            pid = int(stat.rsplit(b")", 1)[1].split()[1])  # after the name: state, then the parent
        except (OSError, ValueError, IndexError):
            return False
    return False


def _children(pid: int) -> list[int] | None:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []  # gone
    kids: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids.extend(int(k) for k in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended
            return None  # CONFIG_PROC_CHILDREN is off
        except OSError:
            continue
    return kids


class Holders:
    """Which process holds which socket, as read from /proc/PID/fd: every socket read is kept (inode -> pid, fd),
    a kept one is checked with one readlink, and a walk reads only the files it has not read before, then (finding
    nothing: a number reused) all of them (why: docs/gateway.md, "Cost")."""

    def __init__(self) -> None:
        self.at: dict[int, tuple[int, str]] = {}  # socket inode -> the process and fd last seen holding it
        self.read: dict[int, set[str]] = {}  # pid -> the fds whose links are in `at`

    def holds(self, pid: int, fd: str, inode: int) -> bool:
        try:
            return os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]"
        except OSError:
            return False

    def find(self, pids: Iterable[int], inode: int, again: bool = False) -> int | None:
        """The first of `pids` that has socket `inode` open, or None; `again`: reading the files read before too."""
        if len(self.at) >= 1 << 15:  # connections come and go: a bound, not a history
            self.at.clear()
            self.read.clear()
        needle = f"socket:[{inode}]"
        for pid in pids:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            read = self.read.setdefault(pid, set())
            for fd in fds if again else set(fds) - read:
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                read.add(fd)
                if link.startswith("socket:["):
                    self.at[int(link[8:-1])] = (pid, fd)
                if link == needle:
                    return pid
        return None
