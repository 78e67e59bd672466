"""`agentfsm gateway SPEC --workers N`: one run's rows split over N worker processes, each its own engine with its
own tagged gateway, behind one front (fsm/gateway/front.py) at the run's one public address; their trajectories
merged into the one run directory, as a single process would have written it (docs/gateway.md, "Several gateway
processes").

The parent (`over_workers`, the rollout of `agentfsm run` it replaces) starts the front, then each worker
(fsm/gateway/worker.py) in its own process group with its contiguous slice of the rows. A worker reads the run's
token once from a pipe, never from its environment (which any process of the user can read in
/proc/PID/environ for the process's whole life), and registers with the front before anything else. The parent
decodes the workers' OUT/workers/wK/result.json and `agentfsm run`'s own code pads and writes them
(fsm/output/keep.py). A worker that fails or goes silent fails the run in one line; a signal reaches each as
Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsm.api import batch_of, load_tokenizer
from fsm.gateway.front import TOKEN_ENV, Front
from fsm.gateway.server import GatewayLimits
from fsm.output.batch import COUNTERS, FaultDelta
from fsm.output.keep import SNAPSHOT_TIMEOUT_S, Rollout, RunDir
from fsm.run.codec import decode_sampling, decode_trajectory
from fsm.run.compile import CompiledAgent, compile_spec
from fsm.run.context import Sampling
from fsm.run.runtime import agent_codec
from fsm.run.signals import handling, say_now
from fsm.run.trajectory import Trajectory

CONFIG, RESULT = "config.json", "result.json"  # in OUT/workers/wK: what the parent gave, what it rolled out
REGISTER_TIMEOUT_S = 10.0  # one worker's registration request
# a registered worker's heartbeat (a thread's write on a pipe): a stopped process sends none
HEARTBEAT_S = 1.0
STOP_TIMEOUT_S = SNAPSHOT_TIMEOUT_S + 60.0  # after a signal: the workers' snapshot and write; then killed
TAIL_LINES = 20


class WorkerError(Exception):
    """A run over workers that cannot go on: one line naming the worker, its pid and why."""


# --- the parent ------------------------------------------------------------------------------------------------


def over_workers(limits: GatewayLimits) -> Callable[..., Any]:
    """The rollout `agentfsm run` calls (fsm/cli/commands.py `cmd_run`), over `--workers N` processes."""

    async def rollout(args: argparse.Namespace, rows: list[dict[str, Any]] | None, console: Any) -> Rollout:
        assert rows is not None  # --resume with --workers is refused by the command line
        return await _Workers(args, rows, limits).run()

    return rollout


@dataclass
class _Worker:
    tag: str
    start: int  # its rows: [start, end) of the run's
    end: int
    dir: Path
    proc: asyncio.subprocess.Process | None = None
    joined: asyncio.Event = field(default_factory=asyncio.Event)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    relay: asyncio.Future[None] | None = None
    beats: int | None = None  # the read end of its heartbeat pipe

    def result(self) -> dict[str, Any] | None:
        path = self.dir / RESULT
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise WorkerError(f"gateway worker {self.tag}: its {path} cannot be read ({exc})") from None


class _Workers:
    """One run over worker processes: start, watch, stop and merge them (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, rows: list[dict[str, Any]], limits: GatewayLimits):
        self.args, self.limits, self.rows = args, limits, len(rows)
        count = min(args.gateway_workers, len(rows))
        bounds = [len(rows) * k // count for k in range(count + 1)]
        base = Path(args.out) / "workers"
        self.workers = [_Worker(f"w{k}", bounds[k], bounds[k + 1], base / f"w{k}") for k in range(count)]
        self.token = secrets.token_urlsafe(32)
        self.stopping = self.killed = False
        self._deadline: asyncio.TimerHandle | None = None

    async def run(self) -> Rollout:
        agent = compile_spec(self.args.spec)
        for w in self.workers:
            if RunDir(w.dir).unfinished():
                raise WorkerError(
                    f"{w.dir} holds the journal of an interrupted worker, which --workers cannot "
                    f"resume; remove {w.dir.parent} to start a new run in {self.args.out}"
                )
            w.dir.mkdir(parents=True, exist_ok=True)
            (w.dir / RESULT).unlink(missing_ok=True)
        by_tag = {w.tag: w for w in self.workers}
        front = Front(
            self.args.host,
            self.args.gateway_port,
            self.limits,
            token=self.token,
            expects=by_tag,
            on_register=lambda tag: by_tag[tag].joined.set(),
        )
        try:
            await front.start()
        except OSError as exc:
            raise WorkerError(
                f"--gateway-port: the front cannot listen on {self.args.host}:{self.args.gateway_port} "
                f"({exc.strerror or exc})"
            ) from None
        if not self.args.quiet:
            say_now(
                f"agentfsm: the front listens on {front.url}; {len(self.workers)} gateway workers behind it "
                f"(their logs in {self.workers[0].dir.parent})"
            )
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            with self._signals():
                for w in self.workers:
                    if not self.stopping:
                        await self._spawn(w, front)
                try:
                    async with asyncio.TaskGroup() as group:
                        for w in self.workers:
                            if w.proc is not None:
                                group.create_task(self._watch(w))
                except* WorkerError as failed:
                    raise failed.exceptions[0] from None
        finally:
            await self._kill_all()
            await front.close()
        return self._merge(agent, front, time.perf_counter() - t0, time.process_time() - c0)

    async def _spawn(self, w: _Worker, front: Front) -> None:
        given = {k: v for k, v in vars(self.args).items() if k not in ("fn", "worker_config")}
        if given["threads"] is None and not given["server"]:  # the embedded model: its share of the cores
            given["threads"] = max(1, len(os.sched_getaffinity(0)) // len(self.workers))
        w.beats, beat = os.pipe()
        token_fd = _token_pipe(self.token)
        config = {
            "tag": w.tag,
            "front": front.url,
            "rows": [w.start, w.end],
            "of": self.rows,
            "args": given,
            "parent": os.getpid(),
            "heartbeat_fd": beat,
            "token_fd": token_fd,
        }
        (w.dir / CONFIG).write_text(json.dumps(config, default=str))
        try:
            with (w.dir / "stdout.log").open("wb") as stdout:
                w.proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "fsm.cli",
                    "gateway",
                    "--worker-config",
                    str(w.dir / CONFIG),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=asyncio.subprocess.PIPE,
                    limit=1 << 20,
                    start_new_session=True,
                    env={k: v for k, v in os.environ.items() if k != TOKEN_ENV},
                    pass_fds=(beat, token_fd),
                )
        except OSError as exc:
            raise WorkerError(
                f"gateway worker {w.tag}: cannot start {sys.executable} ({exc.strerror or exc})"
            ) from None
        finally:
            os.close(beat)
            os.close(token_fd)
        (w.dir / "pid").write_text(f"{w.proc.pid}\n")
        w.relay = asyncio.ensure_future(self._relay(w))

    async def _relay(self, w: _Worker) -> None:
        """The worker's stderr: into its stderr.log, onto ours line by line (prefixed with its tag), its tail kept."""
        assert w.proc is not None and w.proc.stderr is not None
        with (w.dir / "stderr.log").open("wb") as log:
            while line := await w.proc.stderr.readline():
                log.write(line)
                log.flush()
                text = line.decode(errors="replace").rstrip()
                w.tail.append(text)
                say_now(f"[{w.tag}] {text}")

    async def _watch(self, w: _Worker) -> None:
        """Until `w` exits: it must register in time, and exit 0 (unless the parent stopped it)."""
        assert w.proc is not None
        exited = asyncio.ensure_future(w.proc.wait())
        joined = asyncio.ensure_future(w.joined.wait())
        try:
            done, _ = await asyncio.wait(
                {exited, joined}, timeout=self.args.worker_start_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            joined.cancel()
        if not done:
            exited.cancel()
            wait = self.args.worker_start_timeout
            how = f"did not register with the front within {wait:g} s (--worker-start-timeout)"
            raise WorkerError(self._failed(w, how))
        registered = w.joined.is_set()
        if registered and not exited.done():
            silent = asyncio.ensure_future(self._silent(w))
            try:
                await asyncio.wait({exited, silent}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                silent.cancel()
            if not exited.done() and not silent.cancelled() and silent.result():
                how = (
                    f"has sent no heartbeat for {self.args.worker_silent_timeout:g} s (--worker-silent-timeout): "
                    "it is stopped (SIGSTOP) or frozen"
                )
                if not (self.stopping or self.killed):
                    raise WorkerError(self._failed(w, how))
                say_now(
                    f"agentfsm: gateway worker {w.tag} (pid {w.proc.pid}) {how}; killed without its snapshot"
                )
                _kill_group(w.proc.pid)
        rc = await exited
        if rc == 0 or self.stopping or self.killed:  # stopped: however it ended, it was asked to
            return
        how = f"exited with code {rc}" if rc > 0 else f"was killed by {signal.Signals(-rc).name}"
        raise WorkerError(self._failed(w, how + ("" if registered else " before registering with the front")))

    async def _silent(self, w: _Worker) -> bool:
        """Whether the registered worker `w` goes --worker-silent-timeout without a heartbeat (False: it exited).
        Its heartbeat is a thread of its own, so a worker busy on a long model call still sends it."""
        assert w.beats is not None
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(w.beats, "rb", 0)
        )
        w.beats = None  # the transport owns it now
        try:
            while True:
                try:
                    async with asyncio.timeout(self.args.worker_silent_timeout):
                        if not await reader.read(4096):
                            return False  # the pipe closed: the worker exited
                except TimeoutError:
                    return True
        finally:
            transport.close()

    def _failed(self, w: _Worker, how: str) -> str:
        last = next((line.strip() for line in reversed(w.tail) if line.strip()), None)
        said = f"; its stderr ends: {last}" if last else "; its stderr is empty"
        pid = w.proc.pid if w.proc is not None else "?"
        return (
            f"gateway worker {w.tag} (pid {pid}, rows {w.start}..{w.end - 1}) {how}{said} "
            f"(see {w.dir / 'stderr.log'}); the other workers were stopped"
        )

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM: the first stops the workers as Ctrl-C stops a run, the second kills them."""
        try:
            with handling(self._signal):
                yield
        finally:
            if self._deadline is not None:
                self._deadline.cancel()

    def _signal(self, name: str) -> None:
        live = [w for w in self.workers if w.proc is not None and w.proc.returncode is None]
        if self.stopping:
            say_now(
                f"agentfsm: {name} again: killing the {len(live)} gateway workers left, without their snapshots"
            )
            self._kill_now()
            return
        self.stopping = True
        say_now(
            f"agentfsm: {name}: stopping {len(live)} gateway workers: each snapshots its running rows into "
            f"its own directory ({self.workers[0].dir.parent}) and writes its finished ones; {name} again to "
            "kill them without snapshots"
        )
        for w in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.proc.pid, signal.SIGINT)  # type: ignore[union-attr]
        self._deadline = asyncio.get_running_loop().call_later(STOP_TIMEOUT_S, self._kill_now)

    def _kill_now(self) -> None:
        self.killed = True
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None:
                _kill_group(w.proc.pid)

    async def _kill_all(self) -> None:
        """No worker outlives the run, nor anything left in its process group."""
        for w in self.workers:
            if w.proc is None:
                continue
            if w.proc.returncode is None:
                _kill_group(w.proc.pid)
                await w.proc.wait()
            _kill_group(w.proc.pid)  # what the worker left in its group
            if w.beats is not None:
                os.close(w.beats)
                w.beats = None
        for w in self.workers:
            if w.relay is not None:
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(w.relay, 5.0)

    def _merge(self, agent: CompiledAgent, front: Front, wall: float, cpu: float) -> Rollout:
        """The workers' trajectories as one run's, in input order, with each worker's numbers."""
        results = {w.tag: w.result() for w in self.workers}
        for w in self.workers:
            if results[w.tag] is None and w.proc is not None and w.proc.returncode == 0:
                raise WorkerError(
                    f"gateway worker {w.tag} (pid {w.proc.pid}) exited without writing {w.dir / RESULT}"
                )
        got = [r for r in results.values() if r is not None]
        trajs = sorted(
            (decode_trajectory(t) for r in got for t in r["trajectories"]), key=lambda t: (t.index, t.sample)
        )
        stats = _summed([r["router"] for r in got], list(results))
        engine = Merged(agent, got[0]["tokenizer"], stats) if got else None
        sampling = decode_sampling(got[0]["sampling"]) if got else None
        span = max((r["ended"] for r in got), default=0.0) - min(
            (r["ended"] - r["wall_s"] for r in got), default=0.0
        )
        interrupted = self.stopping or any(r["interrupted"] for r in got)
        kept = [str(RunDir(w.dir).journal) for w in self.workers if RunDir(w.dir).unfinished()]
        if interrupted and kept:
            say_now(
                f"agentfsm: the workers' journals of their running rows: {', '.join(kept)} (a run over "
                "--workers is not resumed as a whole)"
            )
        more = {
            "gateway_workers": {
                "front": front.url,
                "routed": {w.tag: front.routed.get(w.tag, 0) for w in self.workers},
                "front_cpu_s": round(cpu, 3),
                "wall_s_with_starts": round(wall, 3),
                "workers": {
                    w.tag: {
                        "rows": [w.start, w.end],
                        "pid": w.proc.pid if w.proc else None,
                        "exit_code": w.proc.returncode if w.proc else None,
                        "dir": str(w.dir.relative_to(Path(self.args.out))),
                        **(
                            {
                                "trajectories": len(r["trajectories"]),
                                "wall_s": round(r["wall_s"], 3),
                                "rollout_cpu_s": round(r["cpu_s"], 3),
                                "interrupted": r["interrupted"],
                            }
                            if (r := results[w.tag]) is not None
                            else {"trajectories": 0}
                        ),
                    }
                    for w in self.workers
                },
            }
        }
        total_cpu = cpu + sum(r["cpu_s"] for r in got)
        # engine and sampling are None only when no worker answered (no rows)
        made = (engine, sampling, trajs, self.rows * self.args.n, span, stats, interrupted, total_cpu, more)
        return Rollout(*made)  # type: ignore[arg-type]


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _summed(stats: list[Any], tags: list[str]) -> dict[str, Any] | None:
    """The workers' backend counters (fsm/output/batch.py `fault_summary` reads them) summed, each one's kept."""
    if not any(stats):
        return None
    out: dict[str, Any] = {"faults": {}, "workers": dict(zip(tags, stats))}
    for one in filter(None, stats):
        for key in COUNTERS:
            out[key] = out.get(key, 0) + one.get(key, 0)
        for kind, count in (one.get("faults") or {}).items():
            out["faults"][kind] = out["faults"].get(kind, 0) + count
    return out


class Merged:
    """The workers' run as the run directory's writer reads an engine (fsm/output/keep.py): the spec, the codec
    of the workers' tokenizer (as their runs made it, `agent_codec`), their backends' counters summed, and the
    engines' own batch code (fsm/api.py `batch_of`). Not an engine: it runs nothing; its spans were each
    worker's to export."""

    tracer = None

    def __init__(self, agent: CompiledAgent, tokenizer: str, stats: dict[str, Any] | None):
        self.agent = agent
        self.codec = agent_codec(agent, load_tokenizer(tokenizer))
        self._stats: dict[str, Any] = {}
        # counted from nothing: the batch's metrics get the workers' whole counts
        self._faults = FaultDelta(self)
        self._stats = stats or {}

    def stats(self) -> dict[str, Any]:
        return self._stats

    def to_batch(self, trajs: Sequence[Trajectory], sampling: Sampling, **options: Any) -> Any:
        """`options`: like, meta, wall_s, as the engines' `to_batch` takes them."""
        return batch_of(self.agent, self.codec, trajs, sampling, self._faults, **options)


def _token_pipe(token: str) -> int:
    """The read end of a pipe holding `token` (its write end closed): a worker reads it once and closes it."""
    read, write = os.pipe()
    os.write(write, token.encode())  # ~43 bytes: far below a pipe's buffer
    os.close(write)
    return read
