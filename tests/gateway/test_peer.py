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
        assert gateway._held(os.getpid(), (), inode) and gateway._holders[inode] == os.getpid()
        assert gateway._held(os.getpid(), (), inode)  # the cached holder: still holds it, of this tree
        assert not gateway._held(child.pid, (), inode)  # another harness's tree: neither the cache nor a walk
