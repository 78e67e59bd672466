"""A worker process of an `isolation: process` tool (fsm/tools/isolation.py starts it; nothing imports it).

It is run by path, `python fsm/tools/worker.py FD MODULE:FUNCTION PARENT_PID`, so that it imports the
standard library and the tool's own module, not the engine (whose imports take seconds). Over the socket
FD, in both directions, each frame is an 8-byte big-endian length and a pickle:

    worker -> parent, once:      ("ready", None) | ("failed", "ImportError: ...")
    parent -> worker, per call:  (kwargs, keep_chars, idempotency key or None)
    worker -> parent, per call:  ("ok", value) | ("raised", type name, message, is an Exception)

A long answer is cut here to its first and last `keep_chars` characters before it is sent (the engine's
truncation keeps at most that many at either end, so its result is unchanged) and a 50 MB string never
crosses the socket. The worker dies with its parent (PR_SET_PDEATHSIG on Linux) and runs in its own
session, so a terminal's Ctrl-C reaches the engine only.
"""

import asyncio
import copy
import importlib
import json
import os
import pickle
import signal
import socket
import sys
from typing import Any


def resolve(path: str):
    """`package.module:attr.sub` -> the object (fsm.spec.registry.resolve's rule, without the engine)."""
    module_name, _, attr = path.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def cut(text, keep):
    return text if keep is None or len(text) <= 2 * keep else text[:keep] + text[-keep:]


def shrink(ret, keep, outer=True):
    """The tool's return with its text cut, shaped as fsm.tools.base.normalize_return reads it (a tuple inside
    the (response, reward, metrics) tuple is text: its repr)."""
    if isinstance(ret, str):
        return cut(ret, keep)
    if isinstance(ret, dict):
        return cut(json.dumps(ret, ensure_ascii=False), keep)
    if isinstance(ret, tuple) and outer:
        return (shrink(ret[0], keep, outer=False), *ret[1:]) if 1 <= len(ret) <= 3 else ret
    if type(ret).__name__ == "ToolResponse" and isinstance(getattr(ret, "text", None), str):
        ret = copy.copy(ret)
        ret.text = cut(ret.text, keep)
        return ret
    return cut(str(ret), keep)


def send(sock, message):
    data = pickle.dumps(message)
    sock.sendall(len(data).to_bytes(8, "big") + data)


def receive(sock):
    header = _exactly(sock, 8)
    return None if header is None else pickle.loads(_exactly(sock, int.from_bytes(header, "big")))


def _exactly(sock, n):
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def die_with_parent(parent_pid):
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(0)


def call(fn, kwargs, keep, key=None):
    # the call's idempotency key, which fsm.idempotency_key() reads here (fsm.tools.isolation.KEY_ENV)
    if key is not None:
        os.environ["AGENTFSM_IDEMPOTENCY_KEY"] = key
    try:
        ret = fn(**kwargs)
        if asyncio.iscoroutine(ret):
            ret = asyncio.run(ret)
        reply: tuple[Any, ...] = ("ok", shrink(ret, keep))
    except Exception as exc:
        reply = ("raised", type(exc).__name__, str(exc), True)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt...: reported, and this worker serves on
        reply = ("raised", type(exc).__name__, str(exc), False)
    try:
        return pickle.dumps(reply)
    except Exception as exc:
        return pickle.dumps(
            ("raised", type(exc).__name__, f"the tool's result cannot be sent back: {exc}", True)
        )


def main():
    fd, path, parent_pid = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    sys.path[:] = json.loads(os.environ.pop("AGENTFSM_SYS_PATH", "[]")) or sys.path[1:]
    die_with_parent(parent_pid)
    sock = socket.socket(fileno=fd)
    try:
        fn = resolve(path)
    except BaseException as exc:
        send(sock, ("failed", f"{type(exc).__name__}: {exc}"))
        return
    send(sock, ("ready", None))
    while True:
        message = receive(sock)
        if message is None:  # the parent closed the socket
            return
        kwargs, keep, key = message
        data = call(fn, kwargs, keep, key)
        os.environ.pop("AGENTFSM_IDEMPOTENCY_KEY", None)
        sock.sendall(len(data).to_bytes(8, "big") + data)


if __name__ == "__main__":
    main()
