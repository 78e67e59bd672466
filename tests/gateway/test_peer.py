"""Which process holds a gateway connection (fsm/gateway/peer.py), as a bound session checks it once a session
on each connection: the holder found last is tried first, and only where it is of the session's harness tree."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from fsm.gateway import Gateway, peer

pytestmark = pytest.mark.skipif(not peer.available(), reason="Linux only: /proc and netlink")


@pytest.fixture
def child() -> object:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.DEVNULL)
    yield proc
    proc.kill()
    proc.wait()


def test_descends_reads_the_parents_as_tree_walks_the_children(child: subprocess.Popen) -> None:
    me = os.getpid()
    for pid, root, skip in [
        (child.pid, me, ()),
        (me, child.pid, ()),
        (child.pid, me, (child.pid,)),
        (me, me, ()),
    ]:
        assert peer.descends(pid, root, skip) == (pid in peer.tree(root, skip)), (pid, root, skip)
    assert not peer.descends(me, 1, (me,)) and not peer.descends(child.pid, me, (me,))


def test_the_holder_found_last_answers_only_for_a_tree_it_is_in(child: subprocess.Popen) -> None:
    gateway = Gateway()
    a, b = socket.socketpair()
    with a, b:
        inode = os.fstat(a.fileno()).st_ino  # held by this process
        assert gateway._held(os.getpid(), (), inode) and gateway._holders.at[inode][0] == os.getpid()
        assert gateway._held(os.getpid(), (), inode)  # the cached holder: still holds it, of this tree
        assert not gateway._held(child.pid, (), inode)  # another harness's tree: neither the cache nor a walk


def test_a_new_connection_reads_only_the_files_not_read_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """A function harness's tree is this process, a socket per session: a walk per new connection that read every
    link cost O(sessions) each (2-5 ms a connection at 1,000 sessions, docs/gateway.md)."""
    holders, me = peer.Holders(), os.getpid()
    pairs = [socket.socketpair() for _ in range(200)]
    new = None
    try:
        assert holders.find([me], os.fstat(pairs[0][0].fileno()).st_ino) == me
        holders.find([me], -1)  # reads every file once, finds nothing
        reads: list[str] = []
        readlink = os.readlink
        monkeypatch.setattr(os, "readlink", lambda p: reads.append(p) or readlink(p))
        new = socket.socketpair()
        assert holders.find([me], os.fstat(new[1].fileno()).st_ino) == me and len(reads) <= 4, reads
        fd, other = pairs[5][0].fileno(), socket.socketpair()  # a number read before, now a new socket's
        pairs[5][0].close()
        os.dup2(other[0].fileno(), fd)
        other[0].close()
        with other[1], socket.socket(fileno=fd) as moved:
            inode = os.fstat(moved.fileno()).st_ino
            assert holders.find([me], inode) is None and holders.find([me], inode, again=True) == me
    finally:
        for a, b in [*pairs, *([new] if new else [])]:
            a.close()
            b.close()


def test_a_kept_alive_connection_is_looked_up_once_per_harness(
    child: subprocess.Popen, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 1 in flight every session of a function harness comes over the client's one kept-alive connection: the
    walk of /proc that found this process holding it is not made again for each new session (issue 49), while a
    session of another harness on that connection is still looked up, and refused."""
    import asyncio

    import aiohttp

    async def main() -> list[int]:
        async with Gateway() as gateway, aiohttp.ClientSession() as http:
            held = gateway._held
            looked: list[int] = []
            monkeypatch.setattr(gateway, "_held", lambda owner, *a: looked.append(owner) or held(owner, *a))
            sessions = [gateway.open(f"t{i}") for i in range(3)]
            for session, owner in zip(sessions, (os.getpid(), os.getpid(), child.pid), strict=True):
                session.owner = owner
            statuses = []
            for session in sessions:
                headers = {"Authorization": f"Bearer {session.key}"}
                async with http.get(f"{session.base_url}/models", headers=headers) as r:
                    statuses.append(r.status)
            assert looked == [os.getpid(), child.pid]
            return statuses

    assert asyncio.run(main()) == [200, 200, 403]
