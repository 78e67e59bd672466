"""The process lane (`isolation: process`, fsm/tools/isolation.py says why lanes exist): function tools by
import path run in worker processes, one call at a time each. A call past its timeout SIGKILLs its worker's
process group and a fresh worker replaces it; a worker that dies, or answers more than MAX_REPLY_BYTES, is an
error observation, never the run's end. Fault containment, not a security sandbox.

A worker (`serve`, below) imports the standard library, this module and fsm.tools.isolation (standard library
only) and the tool's own module, not the engine (whose imports take seconds). Over the socket, in both
directions, each frame is an 8-byte big-endian length and a pickle:

    worker -> parent, once:      ("ready", None) | ("failed", "ImportError: ...")
    parent -> worker, per call:  (kwargs, keep_chars, idempotency key or None)
    worker -> parent, per call:  ("ok", value) | ("raised", type name, message, is an Exception)

A long answer is cut in the worker (fsm.tools.isolation.shrink), so a 50 MB string never crosses the socket.
The worker dies with its parent (PR_SET_PDEATHSIG on Linux) and runs in its own session, so a terminal's
Ctrl-C reaches the engine only.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsm.tools.isolation import KEY, KEY_ENV, ToolCrashed, ToolUnavailable, shrink

WORKER_START_TIMEOUT_S = 120.0  # a worker process's interpreter start and the tool module's imports
MAX_REPLY_BYTES = 16 << 20  # a worker's reply beyond this (huge metrics) kills it: the answer is an error
# a worker's first lines: the parent's sys.path before anything of fsm is imported, then the folder this fsm
# came from (last: the parent may have imported it from a working directory it has left since)
WORKER_BOOT = (
    "import json, os, sys; sys.path[:] = json.loads(os.environ.pop('AGENTFSM_SYS_PATH')) + "
    f"[{str(Path(__file__).resolve().parents[2])!r}]; from fsm.tools.processes import serve; serve()"
)


class ToolRaised(Exception):
    """An exception the tool raised in its worker process, by type name and message."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


class _Worker:
    """One worker process and its socket. Frames: 8-byte big-endian length, then a pickle."""

    def __init__(
        self, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ):
        self.proc, self.reader, self.writer = proc, reader, writer

    async def send(self, message: Any) -> None:
        data = pickle.dumps(message)
        self.writer.write(len(data).to_bytes(8, "big") + data)
        await self.writer.drain()

    async def receive(self) -> Any:
        size = int.from_bytes(await self.reader.readexactly(8), "big")
        if size > MAX_REPLY_BYTES:
            raise ToolUnavailable(
                f"the worker's reply is {size >> 20} MiB, over the {MAX_REPLY_BYTES >> 20} MiB limit"
            )
        return pickle.loads(await self.reader.readexactly(size))

    def kill(self) -> None:
        """SIGKILL the worker and whatever it started (it leads its own process group); never waits."""
        if self.proc.returncode is None:  # once reaped, its pid may belong to someone else
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.writer.close()
        except RuntimeError:  # its event loop is closed already (an engine's, a test's): nothing to flush
            pass


class _Pool:
    """One event loop's workers of a ProcessLane (a worker's socket belongs to the loop that opened it)."""

    def __init__(self, size: int):
        self.slots = asyncio.Semaphore(size)  # calls in flight
        self.idle: list[_Worker] = []
        self.workers: set[_Worker] = set()


class ProcessLane:
    """A function tool in worker processes (one call per worker at a time, at most `workers` workers).

    Workers start on demand (`ready`, outside the call's timeout: an interpreter and the tool's imports may
    take seconds) and serve call after call; a call that times out or is cancelled kills its worker, and
    the next call starts a fresh one."""

    def __init__(self, name: str, path: str, workers: int):
        self.name, self.path, self.workers = name, path, workers
        self.keep_chars: int | None = None  # the worker cuts a longer answer to its first and last this many
        self._pools: dict[asyncio.AbstractEventLoop, _Pool] = {}
        self.started = 0  # workers started over the lane's life
        self.killed = 0  # workers killed at a timeout, a cancellation, a crash or a reply we refuse
        _LANES.add(self)

    def _pool(self) -> _Pool:
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is None:
            for old in [old for old in self._pools if old.is_closed()]:  # an engine or test loop gone
                self._close(self._pools.pop(old))
            pool = self._pools[loop] = _Pool(self.workers)
        return pool

    async def ready(self) -> None:
        pool = self._pool()
        if not pool.idle and not pool.slots.locked() and len(pool.workers) < self.workers:
            pool.idle.append(await self._start(pool))

    async def call(self, fn: Callable[..., Any], /, **kwargs: Any) -> Any:
        """Run the function at `self.path` (the parent's `fn` is its copy) with `kwargs` in a worker."""
        pool = self._pool()
        async with pool.slots:
            worker = self._idle_worker(pool) or await self._start(pool)
            try:
                await worker.send((kwargs, self.keep_chars, KEY.get()))
                reply = await worker.receive()
            except asyncio.IncompleteReadError:
                self._discard(pool, worker)
                code = await _exit_code(worker)
                raise ToolCrashed(f"tool {self.name!r}: its worker process died (exit code {code})") from None
            # the timeout, a cancellation, a reply we refuse: the worker never serves again
            except BaseException:
                self._discard(pool, worker)
                raise
            pool.idle.append(worker)
        if reply[0] == "ok":
            return reply[1]
        _, type_name, message, is_exception = reply
        if is_exception:
            raise ToolRaised(type_name, message)
        raise ToolCrashed(f"tool {self.name!r} raised {type_name}" + (f": {message}" if message else ""))

    def _idle_worker(self, pool: _Pool) -> _Worker | None:
        while pool.idle:
            worker = pool.idle.pop()
            if worker.proc.returncode is None:
                return worker
            # died while idle (the OOM killer, a stray signal): not this call's fault
            self._discard(pool, worker)
        return None

    async def _start(self, pool: _Pool) -> _Worker:
        parent, child = socket.socketpair()
        env = {**os.environ, "AGENTFSM_SYS_PATH": json.dumps(sys.path)}
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                WORKER_BOOT,
                str(child.fileno()),
                self.path,
                str(os.getpid()),
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent, limit=1 << 16)
        worker = _Worker(proc, reader, writer)
        pool.workers.add(worker)
        self.started += 1
        try:
            async with asyncio.timeout(WORKER_START_TIMEOUT_S):
                kind, detail = await worker.receive()
        except (TimeoutError, asyncio.IncompleteReadError, ToolUnavailable) as exc:
            self._discard(pool, worker)
            raise ToolUnavailable(f"tool {self.name!r}: its worker process did not start ({exc!r})") from None
        except BaseException:
            self._discard(pool, worker)
            raise
        if kind != "ready":
            self._discard(pool, worker)
            raise ToolUnavailable(
                f"tool {self.name!r}: its worker process cannot load {self.path!r}: {detail}"
            )
        return worker

    def _discard(self, pool: _Pool, worker: _Worker) -> None:
        if worker in pool.workers:
            pool.workers.discard(worker)
            self.killed += 1
        worker.kill()

    @staticmethod
    def _close(pool: _Pool) -> None:
        for worker in list(pool.workers):
            worker.kill()
        pool.workers.clear()
        pool.idle.clear()

    def close(self) -> None:
        """Kill every worker now, idle or busy (their calls fail). The lane starts fresh ones when called."""
        for pool in list(self._pools.values()):
            self._close(pool)
        self._pools.clear()


async def _exit_code(worker: _Worker) -> int | str:
    try:
        async with asyncio.timeout(1.0):
            return await worker.proc.wait()
    except TimeoutError:
        return "unknown"


_LANES: weakref.WeakSet[ProcessLane] = weakref.WeakSet()


@atexit.register
def _kill_workers() -> None:  # a busy worker would outlive us, burning a core: kill them all on the way out
    for lane in list(_LANES):
        lane.close()


# --- the worker process's side (sync: one call at a time) ---------------------------------------------------


def resolve(path: str) -> Any:
    """`package.module:attr.sub` -> the object (fsm.spec.registry.resolve's rule, without the engine)."""
    module_name, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message)
    sock.sendall(len(data).to_bytes(8, "big") + data)


def receive(sock: socket.socket) -> Any:
    header = _exactly(sock, 8)
    body = None if header is None else _exactly(sock, int.from_bytes(header, "big"))
    return None if body is None else pickle.loads(body)


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(0)


def call(fn: Callable[..., Any], kwargs: dict, keep: int | None, key: str | None = None) -> bytes:
    if key is not None:  # the call's idempotency key, which fsm.idempotency_key() reads here
        os.environ[KEY_ENV] = key
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


def serve() -> None:
    """A worker process's life (WORKER_BOOT): `python -c WORKER_BOOT FD MODULE:FUNCTION PARENT_PID`."""
    fd, path, parent_pid = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
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
        os.environ.pop(KEY_ENV, None)
        sock.sendall(len(data).to_bytes(8, "big") + data)
