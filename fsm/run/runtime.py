"""The driver: many trajectories of one compiled agent, concurrently, on one event loop.

For each trajectory the loop is:

    while the state is not final:
        await the state's action (a model call, tool calls, the user simulator...)
        fire the first outgoing edge whose guard holds (through the shared machine)

Each trajectory is one task; a semaphore bounds how many are in flight. A failure (bad row, dead server,
timeout, a user action raising anything, even a BaseException such as a stray CancelledError) ends only that
trajectory, with `termination_reason` "error: ...", and so does ending in a state that is not final. Only a
real cancellation of the run itself (or Ctrl-C) goes through. A watchdog owned by the run logs which rows
are stuck, in which state and on which server, when no trajectory has moved for `watchdog_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any

from backends.base import Backend, BackendError, BackendTimeout, GenerationAborted
from fsm.data.rows import RowError, encodable_value, normalize_record, row_inputs, score_fault
from fsm.families import Codec, codec_for
from fsm.run import signals, tree
from fsm.run.agent import CompiledAgent
from fsm.run.context import TRACED, PauseGate, Policy, RunContext, Sampling
from fsm.run.failures import run_state
from fsm.run.interaction import call_lifecycle
from fsm.run.policy import check_segments
from fsm.run.tracer import Tracer
from fsm.run.trajectory import Trajectory
from fsm.tools.isolation import CALLER, INLINE_STEPS

log = logging.getLogger("agentfsm.runtime")

WATCHDOG_S = 90.0  # default: longer than a healthy turn of a long response, far shorter than a hang


class RewardError(Exception):
    """The spec's reward function failed, hung or returned something that is not a score; names it and the row."""


def reward_extra(traj: Trajectory, name: str) -> Any:
    """One of fsm.run.agent.REWARD_EXTRAS for `traj`, for a reward function that names it."""
    if name == "trajectory":
        return traj
    if name == "tool_results":
        return [m.get("content") for m in traj.messages if m.get("role") == "tool"]
    if name == "messages":
        return list(traj.messages)
    return traj.metrics.as_dict()


def agent_codec(agent: CompiledAgent, tokenizer: Any) -> Codec:
    """The codec a run of `agent` reads and writes tokens with (its spec's model: family, template kwargs, special
    tokens in observations); a Codec given is used as it is."""
    if isinstance(tokenizer, Codec):
        return tokenizer
    model = agent.spec.model
    return codec_for(
        tokenizer, model.family, model.chat_template_kwargs, model.special_tokens_in_observations
    )


def _why(agent: CompiledAgent, traj: Trajectory, exc: BaseException) -> tuple[str, str]:
    """Why `exc` failed `traj`, in one line, and the failure's kind ("": the exception's class name)."""
    if isinstance(exc, asyncio.CancelledError):
        why = f"CancelledError raised in {traj.state} by the action, not by a cancellation of the run"
        return why + (f": {exc}" if str(exc) else ""), ""
    if isinstance(exc, RowError):
        return str(exc), exc.kind
    if isinstance(exc, GenerationAborted):
        return f"aborted: {exc}", "aborted"
    if isinstance(exc, BackendTimeout):
        return f"timeout: {exc}", "timeout"
    if isinstance(exc, BackendError):
        return f"backend: {exc}", "backend"
    if isinstance(exc, TimeoutError):
        return f"timeout: action of {traj.state} exceeded {agent.limits.action_timeout_s}s", "timeout"
    return f"{type(exc).__name__} in {traj.state}: {exc}", ""


class Runner:
    """Runs rows through a compiled agent. Reusable across batches; one per (agent, backend, tokenizer)."""

    def __init__(
        self,
        agent: CompiledAgent,
        backend: Backend,
        tokenizer: Any,
        *,
        max_concurrency: int = 512,
        tracer: Tracer | None = None,
        check_tokens: bool = False,
        watchdog_s: float | None = WATCHDOG_S,
    ):
        self.agent = agent
        self.backend = backend
        self.codec = agent_codec(agent, tokenizer)
        self.max_concurrency = max_concurrency
        self.tracer = tracer
        self.check_tokens = check_tokens
        self.watchdog_s = watchdog_s  # None or 0: no watchdog
        self.stalls = 0  # watchdog reports so far
        self.gate = PauseGate()  # closed while the engine is paused: model requests wait there
        # session_id -> (trajectory, its root span or None) while it is driven: pause events reach them
        self.live: dict[str, tuple[Trajectory, Any]] = {}
        self._watchers = 0  # runs inside `watching()`: the watchdog runs while there is one
        self.driving: dict[
            asyncio.Task[Any], Trajectory
        ] = {}  # the task driving each trajectory (loop watch)
        self._watchdog_task: asyncio.Task[None] | None = None
        self._moved_at = time.perf_counter()  # the last time a trajectory finished
        # the spec's policies (fsm/run/tree.py): name -> backend and codec; a policy not here, or with None, uses
        # the run's backend and codec (RolloutEngine(policies=...) and the CLI fill it)
        self.policies: dict[str, Policy] = {}

    def make_context(
        self,
        sampling_params: Mapping[str, Any] | None = None,
        validate: bool = False,
        *,
        sampling: Sampling | None = None,
    ) -> RunContext:
        policy = self.policies.get(self.agent.spec.policy)
        if sampling is None:
            base = policy.sampling if policy is not None else None
            sampling = Sampling.resolve(
                self.agent, self.codec, sampling_params, validate=validate, base_spec=base
            )
        backend = (policy.backend if policy is not None else None) or self.backend
        ctx = RunContext(self.agent, backend, self.codec, sampling, tracer=self.tracer, gate=self.gate)
        ctx.policies, ctx.drive = self.policies, self.drive
        # where a policy with no backend of its own runs (the root's may have one: `backend` above)
        ctx.run_parts = (self.backend, self.codec, self.gate)
        return ctx

    def trajectories(self, rows: Iterable[Mapping[str, Any]], n: int = 1) -> list[Trajectory]:
        """Rows -> one trajectory per (row, sample); samples of a row share its uid (a GRPO group)."""
        run_id = uuid.uuid4().hex[:8]
        out: list[Trajectory] = []
        for i, row in enumerate(rows):
            source = getattr(row, "source", None)  # a data file's path:line (fsm/data/files.py SourcedRow)
            row = (
                encodable_value(normalize_record(dict(row)))
                if isinstance(row, Mapping)
                else {"__bad_row__": row}
            )
            uid = str(row.get("uid") or f"{run_id}-{i}")
            name = f"{row.get('uid') or i}" + (f" ({source})" if source else "")
            for k in range(n):
                traj = Trajectory(len(out), k, f"{run_id}-{i}-{k}", uid, row, self.agent.initial)
                traj.extra["row_name"] = name
                try:
                    self._bind_row(traj)
                except RowError as exc:  # runs as an error row: the batch keeps one row per input
                    traj.extra["row_error"] = f"bad row {name}: {exc}"
                out.append(traj)
        return out

    def _bind_row(self, traj: Trajectory) -> None:
        inputs = row_inputs(traj.row)
        traj.tools_kwargs = inputs.tools_kwargs
        if self.agent.interaction_cls is not None:
            traj.interaction_kwargs = inputs.interaction_kwargs
        traj.tool_schemas = self.agent.tools.schemas_for(inputs.tool_selection)
        active = self.agent.tools.active_names(inputs.tool_selection)
        if active is not None:
            traj.extra["active_tools"] = active

    def prepare(
        self, rows: Iterable[Mapping[str, Any]], n: int, ctx: RunContext
    ) -> tuple[RunContext, list[Trajectory]]:
        """`ctx` (`make_context`'s) made a batch's, and the trajectories (one per row and sample, in input order)
        of the batch, not started."""
        ctx.group_size = n
        return ctx, self.trajectories(rows, n)

    async def run(
        self,
        rows: Iterable[Mapping[str, Any]],
        *,
        n: int = 1,
        sampling_params: Mapping[str, Any] | None = None,
        validate: bool = False,
        sampling: Sampling | None = None,
        on_done: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        """Run every row (n samples each); returns one finished trajectory per sample, in input order.

        `sampling`, when the caller has resolved it already, replaces `sampling_params` and `validate`.
        The rows go through an `Owner` of their own, for this call."""
        ctx, trajs = self.prepare(rows, n, self.make_context(sampling_params, validate, sampling=sampling))
        async with Owner(self).serving() as owner:
            await owner.run(trajs, ctx, on_done)
        return trajs

    async def drive(
        self,
        ctx: RunContext,
        traj: Trajectory,
        boundary: Callable[[Trajectory], Awaitable[None]] | None = None,
    ) -> None:
        """Run one trajectory to a final state. Never raises for the trajectory's own failures.

        `boundary`, when given, is awaited before each action: the trajectory is then between states, whole
        (fsm/run/stream.py `Boundary` parks trajectories there to take a consistent snapshot)."""
        agent, tracer = ctx.agent, self.tracer  # a child machine's node runs its own agent
        timeout = agent.limits.action_timeout_s
        root = traced = None
        if tracer is not None:
            root = tracer.trajectory(traj, ctx)  # None: sampled out
            if root is not None or TRACED.get() is not None:  # a sampled-out one costs no ContextVar copy
                traced = TRACED.set(root)
        traj.begin()
        self.live[traj.session_id] = (traj, root)
        task, caller = asyncio.current_task(), CALLER.set(traj.session_id)
        if task is not None:
            self.driving[task] = traj
        steps, max_steps = 0, agent.limits.max_transitions
        try:
            if "row_error" in traj.extra:
                raise RowError(traj.extra.pop("row_error"), "bad_row")
            while traj.state not in agent.final_states:
                if boundary is not None:
                    await boundary(traj)
                steps += 1
                if steps > max_steps:
                    raise RowError(
                        f"max_transitions: {max_steps} transitions without reaching a final state "
                        f"(a cycle through {traj.state}; limits.max_transitions)",
                        "max_transitions",
                    )
                if steps % 64 == 0:  # a cycle of actions that never await still lets Ctrl-C and others in
                    await asyncio.sleep(0)
                source = traj.state
                if await tree.enter(ctx, traj, self.drive):
                    break  # it forked: its branches went on from here
                try:
                    if source in agent.ruled:  # retry, catch, timeout_s, heartbeat_s: fsm/run/failures.py
                        edge = await run_state(agent, source, ctx, traj, timeout) or agent.advance(traj)
                    elif timeout is None:
                        await agent.actions[source](ctx, traj)
                        edge = agent.advance(traj)
                    else:
                        async with asyncio.timeout(timeout):
                            await agent.actions[source](ctx, traj)
                        edge = agent.advance(traj)
                except BaseException as exc:
                    if root is not None:
                        root.state_failed(exc)
                    raise
                traj.enter(edge)
                if root is not None:
                    root.transition(edge)  # ends this state's span, starts the next state's
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the run itself is being cancelled: not this trajectory's failure
            self._fail(agent, traj, exc, *_why(agent, traj, exc))
        except KeyboardInterrupt:
            raise  # a real Ctrl-C cannot be told from a raised one; swallowing it would keep the run going
        except BaseException as exc:  # a user action's or guard's bug (SystemExit too): this row only
            self._fail(agent, traj, exc, *_why(agent, traj, exc))
        finally:
            self.live.pop(traj.session_id, None)
            self.driving.pop(task, None)  # type: ignore[arg-type]
            CALLER.reset(caller)
            self._moved_at = time.perf_counter()
            try:
                await self._finish(ctx, traj)
            finally:  # the root span ends even when finishing is cancelled
                tree.end(ctx, traj)
                if root is not None:
                    root.finish()
                if traced is not None:
                    TRACED.reset(traced)

    @staticmethod
    def _fail(agent: CompiledAgent, traj: Trajectory, exc: BaseException, why: str, kind: str = "") -> None:
        """End `traj` as failed in its state by `exc`, of `kind` (its class's name by default), as the spec's
        `on_error` says (fsm/spec/failures.py): mask (an empty response), zero_reward (its tokens kept; scored 0
        as any failed row), drop (masked, and left out of the batch by fsm/output/batch.py)."""
        st = agent.spec.states.get(traj.state)
        mode = (st.on_error if st is not None else None) or agent.spec.failures.on_error
        traj.fail(why, kind or type(exc).__name__, getattr(exc, "attempt", 1), mode)  # attempt: run_state's

    async def _finish(self, ctx: RunContext, traj: Trajectory) -> None:
        """Release the session, close the interaction, score, and (optionally) check the tokens."""
        agent = ctx.agent
        if ctx.journal is not None and (traj.state in agent.final_states or traj.failed):
            ctx.journal.step(traj, agent)  # its last edge's event, or its failure, before the reward
        if await tree.finish(ctx, traj):
            return
        if traj.state not in agent.final_states and not traj.failed:  # never a row that looks finished
            traj.fail(f"ended in {traj.state}, which is not a final state", "not_final")
        if traj.termination_reason is None:
            traj.termination_reason = traj.state.lower()
        if traj.extra.get("context_cut") and traj.last_finish_reason == "length" and not traj.failed:
            # its last turn stopped because the server's context (extra.context_cut tokens) was full, whatever the
            # spec's edge calls the end; that name stays in extra.spec_reason (the first: a resumed row ends again)
            traj.extra.setdefault("spec_reason", traj.termination_reason)
            traj.termination_reason = "context_length"
        try:
            await ctx.backend.release(traj.session_id)
            if traj.interaction_started:
                inter = ctx.interaction
                assert inter is not None  # started only with one
                score = float(await call_lifecycle(inter.calculate_score, traj.session_id))
                await call_lifecycle(inter.finalize_interaction, traj.session_id)
                if fault := score_fault(score):
                    raise RewardError(
                        f"interaction {self.agent.spec.interaction.class_} on row {traj.row_name}: "  # type: ignore[union-attr]
                        f"calculate_score returned {score!r}, {fault}"
                    )
                traj.interaction_score = score
            await self._score(ctx, traj)
        except RewardError as exc:
            if traj.error is None:
                traj.fail(f"reward: {exc}", "reward")
            if agent.reward is not None:  # scored as any failed row is, so the batch keeps its rm_scores
                traj.reward_score = 0.0
        except Exception as exc:  # scoring/cleanup failures are recorded, never raised into the batch
            if traj.error is None:
                traj.fail(f"{type(exc).__name__} while finishing: {exc}", type(exc).__name__)
        if self.check_tokens and not traj.failed and traj.prompt_ids:
            traj.token_check = check_segments(ctx.codec, traj, agent.spec.context.policy == "template")

    async def _score(self, ctx: RunContext, traj: Trajectory) -> None:
        reward = tree.reward_of(ctx, traj)
        if reward is None:
            return
        if traj.failed:
            traj.reward_score = 0.0
            return
        row = traj.row
        kwargs = dict(
            data_source=row.get("data_source"),
            solution_str=ctx.codec.decode(traj.response_ids.tolist()),
            ground_truth=(row.get("reward_model") or {}).get("ground_truth"),
            extra_info=row.get("extra_info"),
            **reward.kwargs,
        )
        for name in reward.extras:  # only what the function names: verl-style signatures see no change
            kwargs[name] = reward_extra(traj, name)
        t0 = time.perf_counter()
        name, limit = ctx.agent.spec.reward.function, ctx.agent.limits.reward_timeout_s  # type: ignore[union-attr]
        try:
            async with asyncio.timeout(limit):
                if reward.lane is None:  # a coroutine function
                    score = await reward.fn(**kwargs)
                else:  # its own threads (never the loop's executor: the embedded model decodes there), or inline
                    score = await reward.lane.call(reward.fn, **kwargs)
            if isinstance(score, Mapping):
                traj.extra["reward_extra_info"] = dict(score)
                score = score["score"]
            score = float(score)
        except TimeoutError:
            raise RewardError(
                f"reward function {name} on row {traj.row_name}: no result within {limit:g} s "
                "(limits.reward_timeout_s)"
            ) from None
        except Exception as exc:
            raise RewardError(
                f"reward function {name} on row {traj.row_name}: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            traj.metrics.compute_score += time.perf_counter() - t0
        if fault := score_fault(score):
            raise RewardError(f"reward function {name} on row {traj.row_name}: returned {score!r}, {fault}")
        traj.reward_score = score

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """The watchdog runs while any run is inside this block: every run path (`run`, the continuous mode of
        fsm/run/stream.py, a Ray actor) enters it, so each gets the same stuck-row reports. So does the loop
        watch (fsm/run/signals.py), a thread that sees what the watchdog, a task on this loop, cannot: code
        that blocks the loop itself."""
        self._watchers += 1
        if self._watchers == 1 and self.watchdog_s:
            self._watchdog_task = asyncio.create_task(self._watchdog(), name="agentfsm watchdog")
        if self.watchdog_s:
            signals.watch(self.blocking, min(signals.STALL_S, self.watchdog_s))
        try:
            yield
        finally:
            if self.watchdog_s:
                signals.unwatch(self.blocking)
            self._watchers -= 1
            task = self._watchdog_task
            if self._watchers == 0 and task is not None:
                self._watchdog_task = None
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(task)  # our own cancellation must not leave it running

    def blocking(self, thread: int, seconds: float) -> str | None:
        """What holds this run's loop (on `thread`) now, for the loop watch's report: the `isolation: none` tool
        and the row it runs for, or the row whose task runs, and the line of code the loop's thread is in."""
        step = INLINE_STEPS.get(thread)
        traj = None
        if step is not None:
            traj = next((t for t, _ in list(self.live.values()) if t.session_id == step[1]), None)
        else:
            loop = signals.loop_of(thread)
            traj = self.driving.get(asyncio.current_task(loop)) if loop is not None else None  # type: ignore[arg-type]
        if traj is None and self.live:
            return None  # another run's row on this loop, or none (the loop watch asks each run)
        row = (
            f"row {traj.index} sample {traj.sample} ({traj.session_id}) in {traj.state}"
            if traj is not None
            else "no row's task"
        )
        where = signals.where(thread)
        if step is not None:
            return (
                f"{step[0]} (isolation: none) on {row}{where}; declare it isolation: thread, or make it await "
                "instead of block"
            )
        return f"{row}{where}"

    async def _watchdog(self) -> None:
        """Log the stuck rows when no trajectory has changed state for `watchdog_s` (then every `watchdog_s`
        while it lasts). Owned by `watching()`, which cancels it when the last run inside it ends."""
        assert self.watchdog_s
        limit = self.watchdog_s
        reported = 0.0  # the progress time already reported on
        while True:
            await asyncio.sleep(max(0.01, limit / 4))
            now = time.perf_counter()
            running = [t for t, _ in self.live.values() if t.path_times]
            if not running or self.gate.paused:  # a paused engine is expected to stand still
                continue
            last = max(self._moved_at, max(t.path_times[-1] for t in running))
            if now - last < limit or now - max(last, reported) < limit:
                continue
            reported = now
            self.stalls += 1
            where = getattr(self.backend, "where", None)
            lines = []
            for t in sorted(running, key=lambda t: t.path_times[-1])[:10]:
                server = where(t.session_id) if where is not None else None
                lines.append(
                    f"row {t.index} sample {t.sample} ({t.session_id}) in {t.state} for "
                    f"{now - t.path_times[-1]:.1f} s" + (f" on {server}" if server else "")
                )
            more = f" (the 10 longest of {len(running)})" if len(running) > 10 else ""
            log.warning(
                "watchdog: no trajectory has changed state for %.1f s; %d in flight%s:\n  %s",
                now - last,
                len(running),
                more,
                "\n  ".join(lines),
            )


class Owner:
    """The one owner of a run's trajectory tasks: every way in (`Runner.run`, `RolloutEngine.generate_sequences`,
    the continuous mode of fsm/run/stream.py, whose `Stream` is an Owner, a Ray actor, the gateway) hands its
    trajectories to one, so the watchdog, the concurrency gate, cancellation and the tracer's flush are the
    same for all of them. The entry point:

        async with Owner(runner).serving() as owner:     # or `await owner.serve()` as a long-lived task
            await owner.run(trajs, ctx, on_done)          # trajs, ctx from `runner.prepare(rows, n, ...)`

    `serve()` is the one long task under which every trajectory task runs (a TaskGroup, inside
    `runner.watching()`); cancelled (its engine's close, a stopping snapshot), it cancels every trajectory,
    and a `run` waiting on them raises CancelledError. A trajectory's own failure never reaches the owner
    (`Runner.drive` records it in the row); an `on_done` that raises fails its own `run` only.
    """

    def __init__(self, runner: Runner):
        self.runner = runner
        self._gate = asyncio.Semaphore(runner.max_concurrency)  # trajectories past it: in flight
        self._tg: asyncio.TaskGroup | None = None
        self._serving = asyncio.Event()
        self._runs: set[asyncio.Future[None]] = set()  # `run` calls waiting for their trajectories

    async def serve(self) -> None:
        """Own every trajectory task until cancelled (see the class docstring)."""
        try:
            async with self.runner.watching(), signals.signals_wake_the_loop(), asyncio.TaskGroup() as tg:
                self._tg = tg
                self._serving.set()
                await asyncio.Event().wait()
        finally:
            self._serving.clear()
            self._tg = None
            for waiting in self._runs:
                if not waiting.done():
                    waiting.cancel()
            self._stopped()

    def _stopped(self) -> None:
        """Called when `serve` ends (a subclass wakes its own waiters)."""

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[Owner]:
        """`serve()` for the block (a call's own owner, as `Runner.run` has)."""
        task = asyncio.create_task(self.serve(), name="agentfsm run owner")
        try:
            await self._serving.wait()
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task)  # our own cancellation must not leave it running

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        if self._tg is None:
            coro.close()
            raise RuntimeError("this run's owner is not serving (its engine is closed or stopping)")
        return self._tg.create_task(coro)

    async def run(
        self,
        trajs: list[Trajectory],
        ctx: RunContext,
        on_done: Callable[[Trajectory], None] | None = None,
        boundary: Callable[[Trajectory], Awaitable[None]] | None = None,
    ) -> None:
        """Drive `trajs` to their final states under this owner (at most `max_concurrency` at once, with every
        other run of the owner); `on_done` hears each as it finishes; `boundary` is `Runner.drive`'s. Then the
        tracer's spans are flushed (off the loop: a slow collector costs at most the tracer's flush timeout).
        Cancelled, the call cancels its own trajectories."""
        await self._serving.wait()
        finished = asyncio.get_running_loop().create_future()
        left = len(trajs)

        def one_done(traj: Trajectory) -> None:
            nonlocal left
            left -= 1
            try:
                if on_done is not None:
                    on_done(traj)
            except BaseException as exc:
                if not finished.done():
                    finished.set_exception(exc)
                raise
            if left == 0 and not finished.done():
                finished.set_result(None)

        async def one(traj: Trajectory) -> None:
            async with self._gate:
                await self.runner.drive(ctx, traj, boundary)
            with contextlib.suppress(Exception):  # raised into `run` by one_done, not into the owner
                one_done(traj)

        tasks = [self._spawn(one(t)) for t in trajs]
        if not tasks:
            return
        self._runs.add(finished)
        try:
            await finished
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        finally:
            self._runs.discard(finished)
        tracer = self.runner.tracer
        if tracer is not None:
            await asyncio.to_thread(tracer.flush)
