"""The process lane (`isolation: process`, fsm/tools/isolation.py says why lanes exist): function tools by
import path run in worker processes, one call at a time each. A call past its timeout SIGKILLs its worker's
process group and a fresh worker replaces it; a worker that dies, or answers more than MAX_REPLY_BYTES, is an
error observation, never the run's end. Fault containment, not a security sandbox."""

from __future__ import annotations

import asyncio
import atexit
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

from fsm.tools.isolation import KEY, ToolCrashed, ToolRaised, ToolUnavailable

WORKER_START_TIMEOUT_S = 120.0  # a worker process's interpreter start and the tool module's imports
MAX_REPLY_BYTES = 16 << 20  # a worker's reply beyond this (huge metrics) kills it: the answer is an error
WORKER_SCRIPT = Path(__file__).with_name("worker.py")


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
                str(WORKER_SCRIPT),
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
