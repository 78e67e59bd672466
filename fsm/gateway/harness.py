"""A harness as a state's action: an agent written in another framework runs for the row and reaches the model
through its session of the gateway; each model call it makes is a GENERATING transition.

A spec uses two actions and guards: a HARNESS state (this module's `harness(fn)` or `harness(command=...)`)
that moves to GENERATING on `harness_calling` and ends on `harness_failed` or the harness's end, and a GENERATING
state whose action is `gateway_generate` (examples/gateway/base.yaml).

The harness is a Python callable (async or not) given a `HarnessCall` (the session's base URLs, key, the
row), or a command given the same in its environment. The state ends on its outcome: the return value, the
exit code, or its timeout; `traj.extra["harness"]` keeps it for the reward (which reads `trajectory` and
`messages`). A call past a spec limit (turns, response length) gets an API error the harness can handle;
one that keeps calling past limits (`GatewayLimits.max_refused_calls`) is ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from fsm.data.rows import RowError
from fsm.gateway import peer
from fsm.gateway.front import TOKEN_ENV
from fsm.gateway.record import GatewayError, LimitReached
from fsm.gateway.server import Session, gateway_for
from fsm.gateway.turn import record_call
from fsm.run.context import RunContext
from fsm.run.engine import owned
from fsm.run.trajectory import Trajectory
from fsm.spec.registry import action, guard
from fsm.tools.isolation import ThreadLane

MAX_OUTPUT_BYTES = 1 << 20  # a command's stdout kept as its result
REAP_S = 5.0  # how long a stopped harness may take to end
REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")  # runs each command harness
ENDED = "the session's harness has ended"
SECRET_ENV = (TOKEN_ENV,)  # this process's secrets no harness is given (a worker's registration token)
CONTAINED = "pid+proc"  # the reaper's word for a harness in a PID namespace with its own /proc (reaper.py)
log = logging.getLogger("agentfsm.gateway")
_warned: list[bool] = []  # the warning that harnesses run uncontained: once a process


class Harnesses:
    """The harness states of one engine (fsm/run/engine.py `owned`): their sessions, the threads of sync harnesses
    (never the loop's executor) and the harness tasks; closed with the engine, shared with no other."""

    def __init__(self) -> None:
        # trajectory session_id -> its gateway session, while its harness runs
        self.live: dict[str, Session] = {}
        self.lane: ThreadLane | None = None
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, dict[str, Any]]) -> asyncio.Task[dict[str, Any]]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def aclose(self) -> None:
        """Stop the harnesses still running (their rows have ended) and let the lane's idle threads go."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=REAP_S)
        if self.lane is not None:
            self.lane.close()


def harnesses() -> Harnesses:
    """The running engine's harness states."""
    return owned().get("gateway.harnesses", Harnesses)


@dataclass(frozen=True)
class HarnessCall:
    """What a harness gets for one row."""

    base_url: str  # OpenAI SDKs: base_url=...
    anthropic_base_url: str  # the anthropic SDK: base_url=...
    api_key: str
    model: str
    row: dict[str, Any]

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The row's prompt (raw_prompt), as chat messages."""
        return list(self.row.get("raw_prompt") or self.row.get("prompt") or [])

    def child(self, name: str) -> HarnessCall:
        """The same call for a sub-agent: its base URLs are the child session `name` of this one, recorded as a
        child node of the row's tree (fsm/gateway/tree.py); `call.child("a").child("b")` nests."""
        root = f"{self.anthropic_base_url}/child/{name}"
        return dataclasses.replace(self, base_url=f"{root}/v1", anthropic_base_url=root)

    @property
    def env(self) -> dict[str, str]:
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": self.api_key,
            "ANTHROPIC_BASE_URL": self.anthropic_base_url,
            "ANTHROPIC_API_KEY": self.api_key,
            "AGENTFSM_MODEL": self.model,
            "AGENTFSM_ROW": json.dumps(self.row, default=str),
        }


def harness(
    fn: Callable[[HarnessCall], Any] | None = None,
    *,
    command: Sequence[str] | None = None,
    timeout_s: float = 600.0,
    model: str = "agentfsm",
) -> Callable[[RunContext, Trajectory], Awaitable[None]]:
    """The action of a harness state: `fn(call)` (sync or async) or `command` (argv, run without a shell)."""
    if (fn is None) == (command is None):
        raise ValueError("harness(): give a function or a command, not both")
    if command is not None and (isinstance(command, str) or not all(isinstance(a, str) for a in command)):
        raise ValueError("harness(command=...): an argv list of strings (no shell)")

    async def run_harness(ctx: RunContext, traj: Trajectory) -> None:
        mine = harnesses()
        session = mine.live.get(traj.session_id)
        if session is None:
            gateway = await gateway_for()
            try:
                session = gateway.open(traj.session_id)
            except GatewayError as exc:
                raise RowError(f"gateway: {exc}", "gateway") from None
            mine.live[traj.session_id] = session
            # its key works from this process's tree (a command's own tree, once started: _run_command)
            if peer.available():
                session.owner = os.getpid()
            call = HarnessCall(
                session.base_url, session.anthropic_base_url, session.key, model, dict(traj.row)
            )
            loop = asyncio.get_running_loop()
            if command is not None:
                work = _run_command(command, call, session)
            else:
                assert fn is not None  # exactly one of fn and command (checked above)
                work = _run_function(fn, call)
            task = mine.spawn(work)
            task.add_done_callback(lambda _t: session.wake.set())
            traj.extra["_harness_deadline"] = deadline = loop.time() + timeout_s
            session.task = task
            session.timer = loop.call_at(deadline, session.wake.set)
        # until the harness makes a model call within the limits (the state then moves to GENERATING) or ends;
        # calls past a limit are answered with an API error in _wait
        running = session.task
        assert running is not None  # set with the session (above)
        outcome = await _wait(ctx, traj, session, running, timeout_s)
        if outcome is not None:
            await _end(traj, session, running, outcome)
            # every call refused: nothing to train on, whatever the harness exited with
            if session.answered_errors and not traj.assistant_turns:
                raise RowError(
                    f"gateway: every model call of the harness was refused ({session.answered_errors}; the first: "
                    f"{session.first_error[:500]})",
                    "gateway",
                )

    run_harness.__name__ = run_harness.__qualname__ = (
        f"harness({getattr(fn, '__name__', None) or command[0]})"  # type: ignore[index]
    )
    return run_harness


async def _wait(
    ctx: RunContext, traj: Trajectory, session: Session, task: asyncio.Task[Any], timeout_s: float
) -> dict[str, Any] | None:
    loop = asyncio.get_running_loop()
    max_refused = session.gateway.limits.max_refused_calls
    try:
        while True:
            # first: a call that came after the harness ended is refused (_end closes the session)
            if task.done():
                return task.result() if not task.cancelled() else {"outcome": "cancelled"}
            if session.pending and _exited(session.pid):  # a call from what the harness left behind
                session.close(ENDED)
                continue
            if session.pending:
                refusal = _past_limit(ctx, traj, session)
                if refusal is None and session.refused <= max_refused:
                    session.take()
                    return None
                _call, future = session.pending.popleft()
                session.refused += 1
                refusal = refusal or session.last_refusal
                if not future.done():
                    future.set_exception(LimitReached(refusal))
                if session.refused > max_refused:
                    return {
                        "outcome": "spinning",
                        "error": f"{session.refused} calls past the spec's limits (the "
                        f"last: {refusal}); the gateway allows {max_refused}",
                    }
                continue
            left = traj.extra["_harness_deadline"] - loop.time()
            if left <= 0:
                return {"outcome": "timeout", "error": f"the harness ran past its {timeout_s:g} s"}
            session.wake.clear()
            await session.wake.wait()  # a call, the harness's end, or its deadline (session.timer) sets it
    except BaseException:  # the action's own timeout, a cancelled run: the harness ends with the row
        ended = {"outcome": "cancelled", "error": "the row ended while its harness ran"}
        await asyncio.shield(_end(traj, session, task, ended))
        raise


def _past_limit(ctx: RunContext, traj: Trajectory, session: Session) -> str | None:
    """A call past the spec's limits, refused before it is taken. A session that is a tree (child sessions,
    branches) has them per node: the call is checked once its node is known (fsm/gateway/record.py)."""
    if session.pending[0][0].child or len(session.tree.nodes) > 1:
        return None
    limits = ctx.agent.limits
    if limits.max_assistant_turns is not None and traj.assistant_turns >= limits.max_assistant_turns:
        return (
            f"the session has made its limits.max_assistant_turns ({limits.max_assistant_turns}) model calls"
        )
    if len(traj.response_mask) >= limits.response_length:
        return f"the session has used its limits.response_length ({limits.response_length}) tokens"
    return None


async def _end(traj: Trajectory, session: Session, task: asyncio.Task[Any], outcome: dict[str, Any]) -> None:
    """Record the outcome, close the session and stop the harness (a command's process group is killed and
    reaped; a sync function's thread is written off)."""
    traj.extra.pop("_harness_deadline", None)
    if session.timer is not None:
        session.timer.cancel()
    traj.extra["harness"] = outcome
    traj.extra["harness_calls"] = session.calls
    traj.extra["harness_session"] = session.id  # behind a front, its tag names the worker that served the row
    session.tree.finalize(traj)  # every node's segments back in the trajectory, with their tree fields
    _notes(traj, session)
    harnesses().live.pop(traj.session_id, None)
    session.close()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            async with asyncio.timeout(REAP_S):
                await task


async def gateway_generate(ctx: RunContext, traj: Trajectory) -> None:
    """The GENERATING state of a harness: record the call the harness state took and answer it."""
    session = harnesses().live.get(traj.session_id)
    if session is None or session.current is None:
        raise RowError(
            "gateway_generate runs after a harness state that took a model call (harness_calling)", "gateway"
        )
    call, future = session.current
    try:
        answer = await record_call(ctx, traj, session.tree, call, f"call_{session.id[:8]}")
    # refused while recording (too_many_segments, a prefill...): counts as spinning
    except GatewayError as exc:
        session.current = None
        session.refused += 1
        session.last_refusal = str(exc)
        if exc.code in TREE_REFUSALS:
            session.note(str(exc))
        _notes(traj, session)
        if not future.done():
            future.set_exception(exc)
        return
    except BaseException as exc:  # the row fails (a dead server, a timeout): the harness ends with it
        task = session.task
        if task is not None:
            await _end(traj, session, task, {"outcome": "error", "error": f"model call failed: {exc}"})
        if not future.done():
            future.set_exception(
                GatewayError(f"the model call failed: {exc}", code="server_error", status=500)
            )
        raise
    session.current = None
    if not future.done():
        future.set_result(answer)


action("gateway_generate")(gateway_generate)

TREE_REFUSALS = ("unknown_parent", "tree_cycle", "tree_too_deep", "too_many_nodes", "invalid_child")


def _notes(traj: Trajectory, session: Session) -> None:
    """The session's refusals of its tree, on the row (`gateway_notes` in trajectories.jsonl)."""
    if session.notes:
        notes = traj.extra.setdefault("gateway_notes", [])
        notes.extend(n for n in session.notes if n not in notes)


@guard("harness_calling")
def harness_calling(traj: Trajectory) -> bool:
    """The harness made a model call the state took (the next state records it)."""
    session = harnesses().live.get(traj.session_id)
    return session is not None and session.current is not None


@guard("harness_failed")
def harness_failed(traj: Trajectory) -> bool:
    """The harness raised, exited non-zero, timed out or kept calling past the limits."""
    outcome = traj.extra.get("harness") or {}
    ok = outcome.get("outcome") in (None, "returned", "exit") and outcome.get("exit_code") in (None, 0)
    return not ok


# --- running one -------------------------------------------------------------------------------------------


async def _run_function(fn: Callable[[HarnessCall], Any], call: HarnessCall) -> dict[str, Any]:
    try:
        if inspect.iscoroutinefunction(fn):
            result = await fn(call)
        else:
            mine = harnesses()
            mine.lane = mine.lane or ThreadLane("harness", 64)
            result = await mine.lane.call(fn, call)
            if inspect.isawaitable(result):
                result = await result
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        return {"outcome": "error", "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
    return {"outcome": "returned", "result": _plain(result)}


def _plain(value: Any) -> Any:
    """The result as JSON data where it is (kept in outputs), else its text."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


async def _run_command(command: Sequence[str], call: HarnessCall, session: Session) -> dict[str, Any]:
    """Run the command under the reaper (fsm/gateway/reaper.py: every process it starts ends with it) in its own
    process group; the session closes the moment the command itself exits; stdout is its result."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    read_fd, write_fd = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-S",
            REAPER,
            str(write_fd),
            *command,
            env={**env, **call.env},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            pass_fds=(write_fd,),
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    if session.owner is not None:  # from now on only the harness's tree (fsm/gateway/peer.py)
        session.owner = proc.pid
        session.gateway.harnesses.add(proc.pid)
    status = os.fdopen(read_fd, "rb", 0)  # closed by its reader, or when dropped
    said: dict[str, str] = {}
    try:
        exited, out, err = await asyncio.gather(
            _exit_status(status, session, said), _bounded(proc.stdout), _bounded(proc.stderr)
        )
        code = await proc.wait()
    except BaseException:
        await asyncio.shield(_stop(proc))
        raise
    code = code if exited is None else exited  # the command's own status (a signal's is negative)
    result: dict[str, Any] = {
        "outcome": "exit",
        "exit_code": code,
        "result": out.decode(errors="replace").strip(),
        "contained": said.get("contained", "no: the reaper said nothing"),
    }
    if result["contained"] != CONTAINED and not _warned:
        _warned.append(True)
        log.warning(
            "command harnesses run uncontained (%s): one can read another's session key in /proc and outlive "
            "its row; this run is not isolated (docs/gateway.md)",
            result["contained"].removeprefix("no: "),
        )
    if code != 0:
        result["error"] = err.decode(errors="replace").strip()[-2000:]
    return result


async def _exit_status(pipe: Any, session: Session, said: dict[str, str]) -> int | None:
    """The command's pid (`session.pid`) and exit status as the reaper writes them on `pipe` (None if the reaper
    died first), and whether it is contained (`said["contained"]`); the session is closed when the command
    exits."""
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        while line := await reader.readline():
            kind, _, value = line.decode(errors="replace").partition(" ")
            if kind == "pid":
                session.pid = int(value)
            elif kind == "contained":
                said["contained"] = value.strip()
            elif kind == "exit":
                return int(value)
        return None
    finally:
        transport.close()
        session.close(ENDED)


def _exited(pid: int | None) -> bool:
    """Whether a command harness's process has exited (a zombie, or reaped); False for a function harness, or
    without /proc."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return os.path.isdir("/proc/self")
    except (OSError, IndexError):
        return False


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """The row ended first: the reaper kills the harness's whole tree (SIGTERM to it); its process group is
    killed if it does not end within REAP_S."""
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(REAP_S):
            await proc.wait()
            return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        await proc.wait()


async def _bounded(stream: asyncio.StreamReader | None) -> bytes:
    """At most MAX_OUTPUT_BYTES of a stream; the rest is read and dropped so the process never blocks on it."""
    kept = bytearray()
    while stream is not None:
        chunk = await stream.read(1 << 16)
        if not chunk:
            break
        if len(kept) < MAX_OUTPUT_BYTES:
            kept += chunk[: MAX_OUTPUT_BYTES - len(kept)]
    return bytes(kept)
