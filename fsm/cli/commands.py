"""`agentfsm`'s commands and how a command ends: run and gateway here; replay in replay.py; validate, schema,
render and show in views.py; bench and dev-server in bundled.py; the flags in args.py.

The composition root: the one place in `fsm` that picks concrete backends, lazily, so `import fsm` never loads
transformers models or aiohttp servers. Every user error ends as one line on stderr naming the file, flag, row
or server and what to do, with no traceback. Exit codes: 0 done; 1 a user error, or error rows past
--max-error-rate; 2 a bad command line or spec diagnostics; 130 interrupted (Ctrl-C or SIGTERM). `run` is a
thin caller of what every kept run does (fsm/output/keep.py; `--resume` reads the journal first: resume.py).
A signal after a command has ended exits at once with its code; a stdout a tool closed costs only the printout.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from fsm.cli.args import (
    DEMO_PROMPTS,
    CLIError,
    Command,
    Interrupted,
    check_run_flags,
    command_line,
    env_tracing,
    quiet_transformers,
    render_flags,
    replay_flags,
    run_flags,
    schema_flags,
    show_flags,
    validate_flags,
)
from fsm.cli.bundled import bench_flags, cmd_bench, cmd_dev_server, dev_server_flags
from fsm.cli.gateway_args import gateway_flags
from fsm.cli.launch import servers_of
from fsm.cli.resume import check_journal, resume_spec
from fsm.cli.views import cmd_render, cmd_schema, cmd_show, cmd_validate
from fsm.data.files import DataError, load_rows
from fsm.output.keep import Rollout, RunDir, RunInterrupted, keep_rollout
from fsm.run.compile import CompiledAgent, compile_spec
from fsm.run.signals import Interrupts, say_now, term_is_ctrl_c, warn
from fsm.spec.loader import SpecError

# --- how a command ends --------------------------------------------------------------------------------


def to_stdout(show: Callable[[], None]) -> None:
    """Print to stdout, which a tool may have closed (or a reader gone): the outputs are on disk already, so
    a broken stdout costs the printout, never the run."""
    try:
        show()
        sys.stdout.flush()
    except (OSError, ValueError):
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (lives until exit: nothing else flushes to fd 1)


def hold_signals() -> None:
    """From here the command's outcome is decided (its outputs are written): Ctrl-C or SIGTERM no longer
    changes it. A signal is kept, and `ended` then exits at once with the command's code."""
    with contextlib.suppress(ValueError):  # not the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: _PENDING.append(signum))


def ended(rc: int, *, exiting: bool = False) -> None:
    """The command has ended with `rc` (its outputs written, its message printed). When the interpreter then
    shuts down (torch's and threads' atexit work), Ctrl-C or SIGTERM exits at once with `rc` instead of a
    traceback from whatever ran then. `exiting` (the command line: the process ends now) installs that at
    once, and exits now if a signal came while the outcome was held (`hold_signals`); otherwise (a process
    that calls `main()` and goes on, a test) only at exit, so that it keeps its own handlers."""
    if not _ENDED:
        atexit.register(_exit_at_once_on_signals)
    _ENDED[:] = [rc]
    if exiting:
        _exit_at_once_on_signals()
        if _PENDING:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            os._exit(rc)
    _PENDING.clear()


_ENDED: list[int] = []  # the last command's exit code, once one has ended in this process

_PENDING: list[int] = []  # signals that came while the outcome was held


def _exit_at_once_on_signals() -> None:
    def now(signum: int, frame: Any) -> None:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(_ENDED[0])

    with contextlib.suppress(ValueError):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, now)


def _ignore_signals_at_the_very_end() -> None:
    """Registered when this module is imported, before torch and others register theirs, so it runs after
    them: from here on the interpreter finalizes, where Python puts a handled signal back to its default
    (death by signal, no message). Ignored instead: the process ends with the command's code."""
    if _ENDED:
        with contextlib.suppress(ValueError):
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)


atexit.register(_ignore_signals_at_the_very_end)


# --- run -----------------------------------------------------------------------------------------------


def _out_dir(args: argparse.Namespace) -> Path:
    """--out, absolute, made and checked writable now: a bad path fails before the rollout, not after it."""
    from fsm.output.rundir import RunDirError, prepare

    try:
        return prepare(args.out)
    except RunDirError as exc:
        raise CLIError(f"--out {exc}") from None


def _rows(args: argparse.Namespace, agent: CompiledAgent) -> list[dict[str, Any]]:
    if args.data:
        return load_rows(args.data, limit=args.num_prompts)  # the rows past them are never read
    if agent.spec.demo_data is None:
        raise CLIError(
            f"{args.spec}: no --data given and the spec declares no demo_data; pass --data FILE.jsonl"
        )
    from fsm.spec.registry import resolve

    count = args.num_prompts if args.num_prompts is not None else DEMO_PROMPTS
    return resolve(agent.spec.demo_data, agent.spec.trust.allow_modules)(count, seed=args.seed)


def _engine(args: argparse.Namespace, servers: list[str], tokenizer: str | None) -> Any:
    """The engine the flags ask for: RayRunner, or RolloutEngine over servers or the embedded model."""
    from fsm.api import RolloutEngine

    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise CLIError(f"{tokenizer}: no tokenizer directory there; pass --tokenizer DIR")
    quiet_transformers()
    try:
        if args.ray is not None:
            from fsm.cli.ray_run import ray_runner

            return ray_runner(args, servers, tokenizer)
        common: dict[str, Any] = {  # every engine's, whatever serves the model
            "max_concurrency": args.concurrency,
            "tracer": _tracer(args),
            "check_tokens": args.check_tokens,
            "watchdog_s": args.watchdog,
        }
        if servers:
            options = {"retry_window_s": args.retry_window, "engine": args.engine}
            if args.request_timeout is not None:
                options["request_timeout_s"] = args.request_timeout
            return RolloutEngine(
                args.spec,
                tokenizer,
                servers=servers,
                group_affinity=args.group_affinity,
                **common,
                **options,
            )
        return RolloutEngine(
            args.spec,
            tokenizer,
            model=args.model,
            torch_threads=args.threads,
            max_batch_size=args.batch_size,
            device=args.device,
            dtype=args.dtype,
            exact_logprobs=args.exact_logprobs,
            **common,
        )
    except FileNotFoundError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:  # transformers: a directory without tokenizer or model files
        raise CLIError(
            f"{tokenizer or args.model}: cannot load a tokenizer there ({exc}); pass --tokenizer DIR"
        ) from None


def _tracer(args: argparse.Namespace) -> Any:
    if not (args.otlp or args.trace) and not env_tracing():
        return None
    from fsm.telemetry import Telemetry

    sample = 1.0 if args.trace_sample is None else args.trace_sample
    # console spans go to stderr (stdout is the run table); the run's close waits for the collector at most
    # FLUSH_TIMEOUT_S, then counts what is left as dropped
    return Telemetry(
        otlp=args.otlp, console=args.trace == "console", sample=sample, flush_timeout_s=FLUSH_TIMEOUT_S
    )


async def _rollout(
    args: argparse.Namespace, rows: list[dict[str, Any]] | None, console: Any, first_index: int | None = None
) -> Rollout:
    """Roll `rows` out (or, `rows` None, resume the snapshot in --resume DIR). A RolloutEngine runs them as
    every kept run does (fsm/output/keep.py: Ctrl-C snapshots the rows in flight); Ray keeps what finished.
    `first_index`: `rows` are a slice of a batch, whose index (and seed) their first sample takes."""
    params = {k: v for k, v in (("temperature", args.temperature), ("seed", args.seed)) if v is not None}
    finished: list = []
    interrupts = Interrupts()  # a signal cancels this task until the rollout runs, then stops it
    async with AsyncExitStack() as stack:
        stack.enter_context(interrupts.listening(asyncio.current_task()))
        servers: list[str] = []  # the embedded model: nothing to launch or probe
        tokenizer = args.tokenizer
        if args.server or args.launch_sglang or args.launch_vllm:
            servers, tokenizer = await servers_of(args, stack)
        engine = _engine(args, servers, tokenizer)
        stack.push_async_callback(engine.aclose)
        if getattr(args, "gateway", None) is not None and args.ray is None:  # `agentfsm gateway`'s (serve.py)
            args.gateway.attach(engine.owned)
        try:
            sampling = engine.sampling(params)
        # one a spec's sampling holds that its model cannot take (a stop id past the vocabulary)
        except ValueError as exc:
            raise CLIError(f"{args.spec}: {exc}") from None
        t_start = time.perf_counter()  # the rollout's time: not launching servers, imports, loading the model
        c_start = time.process_time()
        if args.ray is None:
            keep = RunDir(
                Path(args.out),
                args.run_id,
                str(Path(args.spec).resolve()),
                sync=getattr(args, "journal_sync", "1s"),
                data=str(Path(args.data).resolve()) if getattr(args, "data", None) else None,
                accept_changes=getattr(args, "accept_changes", False),
            )
            run = await keep_rollout(
                engine,
                rows,
                args.n,
                sampling,
                keep,
                interrupts,
                _progress(args, console),
                first_index=first_index,
                resumed=vars(args).pop("resumed", None),  # cmd_run's: the journal is read once
            )
        else:
            from fsm.cli.ray_run import ray_rollout

            assert rows is not None  # None only with --resume, which refuses --ray (cmd_run)
            run = Rollout(engine, sampling, [], len(rows) * args.n, 0.0, None, False, 0.0)
            try:
                run.trajs = await ray_rollout(engine, rows, args, sampling, console, finished)
            except asyncio.CancelledError:  # Ctrl-C (interrupts, never armed here): keep what finished
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                run.interrupted = True
                run.trajs = sorted(finished, key=lambda t: (t.index, t.sample))
        backend = getattr(engine, "backend", None)
        run.router_stats = backend.stats() if backend is not None and hasattr(backend, "stats") else None
    run.wall, run.cpu = time.perf_counter() - t_start, time.process_time() - c_start
    return run


FLUSH_TIMEOUT_S = 10.0


@contextlib.contextmanager
def _progress(args: argparse.Namespace, console: Any) -> Iterator[Callable[[int, int], None]]:
    """The groups finished, as a bar on a terminal (fsm/output/keep.py updates it)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=args.quiet or not console.is_terminal) as progress:
        task = None

        def update(ready: int, total: int) -> None:
            nonlocal task
            if task is None:
                task = progress.add_task("groups", total=total)
            progress.update(task, completed=ready)

        yield update


def cmd_run(args: argparse.Namespace, rollout: Callable[..., Any] | None = None) -> int:
    """`agentfsm run`; `rollout` replaces `_rollout` (`agentfsm gateway --workers N` rolls the rows out in worker
    processes and merges them, fsm/gateway/workers.py)."""
    from rich.console import Console

    from fsm.cli.ray_run import refuse_resume
    from fsm.output.rundir import RunDirError, locked
    from fsm.run import codec as snap
    from fsm.run.resume import ResumeRefused

    term_is_ctrl_c()
    if args.resume is not None:
        refuse_resume(args)  # a --ray run (fsm/cli/ray_run.py says why)
        resume_spec(args)
        args.out = args.resume
    elif args.spec is None:
        raise CLIError("run: give a SPEC (or --resume DIR)")
    else:
        args.run_id = uuid.uuid4().hex[:12]
    check_run_flags(args)
    agent = compile_spec(args.spec)
    if args.resume is not None and check_journal(args, agent):  # the run there has completed
        return 0
    rows = _rows(args, agent) if args.resume is None else None
    out = args.out = _out_dir(args)
    try:
        with locked(out):
            return run_locked(args, rows, out, Console, rollout or _rollout)
    except RunInterrupted as exc:
        raise Interrupted(str(exc)) from None
    except RunDirError as exc:
        raise CLIError(f"--out {exc}") from None
    except ResumeRefused as exc:  # what made the rows changed: its own line (fsm/run/resume.py)
        raise CLIError(str(exc)) from None
    except snap.SnapshotError as exc:
        raise CLIError(f"--resume: {exc}") from None


# --- what a finished run says about its failed rows ---------------------------------------------------------

# what differs between rows of one cause: ids, counts, ports
_ID = re.compile(r"[0-9A-Za-z_-]*\d[0-9A-Za-z_-]*")

GATEWAY_EXTRA = ("openai", "anthropic", "agents", "langgraph", "langchain_openai")  # pyproject's [gateway]


def failure_cause(traj: Any) -> str | None:
    """Why a row failed, one line: its error, or how its harness failed (the harness's own error line: a
    gateway row ends `harness_failed` with no engine error); None for a row that did not fail."""
    if traj.error:
        return " ".join(traj.error.split())
    from fsm.output.rundir import harness_failure

    why = harness_failure({"harness": traj.extra.get("harness")})
    if why is None:
        return None
    missing = next((m for m in GATEWAY_EXTRA if f"No module named '{m}" in why), None)
    hint = " (the harness needs the gateway extra: pip install 'agentfsm[gateway]')" if missing else ""
    return f"{traj.termination_reason}: {why}{hint}"


def most_common_cause(causes: list[str]) -> tuple[str, int]:
    """The most common of several failure lines, counted as one cause whatever row, line or request each names
    (an example of it, and how many rows had it)."""
    kinds = [_ID.sub("#", c) for c in causes]
    kind = max(set(kinds), key=kinds.count)
    return causes[kinds.index(kind)], kinds.count(kind)


def every_row_failed(trajs: list[Any], out: Path) -> str | None:
    """One line when no row succeeded: the cause, or the most common of several; None otherwise."""
    causes = [failure_cause(t) for t in trajs]
    if not causes or None in causes:
        return None
    common, n = most_common_cause(causes)  # type: ignore[arg-type]
    common = common if len(common) <= 300 else common[:299] + "…"
    how = "all for one cause" if n == len(causes) else f"the most common cause ({n} row{'s' * (n > 1)})"
    return f"all {len(trajs)} rows failed, {how}: {common}; see agentfsm show {out} --failed"


def token_check_failures(trajs: list[Any], out: Path) -> str | None:
    """--check-tokens: one line naming the first row whose tokens differ from a re-render, and where."""
    found = [t for t in trajs if t.token_check]
    if not found:
        return None
    first = found[0]
    rows = f"{len(found)} row{'s' * (len(found) > 1)}"
    return (
        f"--check-tokens: {rows} differ{'s' * (len(found) == 1)} from a re-render of their messages; row {first.index} (sample "
        f"{first.sample}): {first.token_check}; see agentfsm show {out} --failed"
    )


def run_locked(
    args: argparse.Namespace,
    rows: list[dict[str, Any]] | None,
    out: Path,
    console_cls: Any,
    rollout: Callable[..., Any],
) -> int:
    """`run` under the lock on its --out: roll the rows out (`rollout`), write the outputs, print the summary,
    and end by the failure budget (`error_budget`)."""
    from fsm.output.keep import close_journal

    keep = RunDir(out, args.run_id)  # the files and their order of writing: the API's `keep=` path's too
    if rows is not None:
        keep.refuse_a_snapshot()
    try:
        run = asyncio.run(rollout(args, rows, console_cls(stderr=True)))
    except asyncio.CancelledError:  # Ctrl-C before the rollout began (launching, probing, loading)
        raise Interrupted(f"interrupted before the rollout; {out} holds what it held before") from None
    finally:
        term_is_ctrl_c()
    try:
        if not run.trajs:
            raise keep.nothing_finished(run)
        batch = run.engine.to_batch(run.trajs, run.sampling)
        replacing = (out / "summary.json").exists()
        summary = keep.write(run, batch)
        hold_signals()  # written: a signal from here on keeps this outcome (main's `ended` exits with it)
        stopped = keep.finish(run)  # the run is complete: its journal ends, nothing left to resume
    finally:
        close_journal(run, None)
    if not args.quiet:
        from fsm.output.rundir import print_summary

        to_stdout(lambda: print_summary(summary, console_cls()))
    to_stdout(
        lambda: print(
            f"wrote {out}/"
            + (", ".join(f"batch.{p}.pt" for p in batch) if isinstance(batch, dict) else "batch.pt")
            + ", trajectories.jsonl, summary.json"
            + (" (replacing the run there)" if replacing else "")
        )
    )
    if stopped is not None:
        raise stopped
    failed = [t.error or t.termination_reason for t in run.trajs if t.failed]
    rate, budget = error_budget(args.max_error_rate, run.engine.agent.spec.failures.max_error_rate)
    if len(failed) / len(run.trajs) > rate:
        common = " ".join(most_common_cause(failed)[0].split())  # names the server, row or tool
        common = common if len(common) <= 200 else common[:199] + "…"
        raise CLIError(
            f"{len(failed)} of {len(run.trajs)} rows ended in error ({len(failed) / len(run.trajs):.0%}), "
            f"more than {budget} {rate:g}; the most common: {common}; "
            f"see {out}/summary.json"
        )
    if (differ := token_check_failures(run.trajs, out)) is not None:
        warn(differ)
    if (every := every_row_failed(run.trajs, out)) is not None:
        if rate < 1.0:
            raise CLIError(every)
        warn(every)
    return 0


def error_budget(flag: float | None, spec: float | None) -> tuple[float, str]:
    """The run's failure budget and where it came from: --max-error-rate overrides the spec's
    failures.max_error_rate; neither: 0.5."""
    if flag is not None:
        return flag, "--max-error-rate"
    if spec is not None:
        return spec, "the spec's failures.max_error_rate"
    return 0.5, "--max-error-rate"


def cmd_replay(args: argparse.Namespace) -> int:
    from fsm.cli.replay import cmd_replay as replay

    return replay(args)


def cmd_gateway(args: argparse.Namespace) -> int:
    from fsm.gateway.serve import cmd_gateway as gateway
    from fsm.gateway.workers import WorkerError

    try:
        return gateway(args, cmd_run, _rollout)
    except WorkerError as exc:
        raise CLIError(str(exc)) from None


COMMANDS: tuple[
    Command, ...
] = (  # each command: its name, its one-line help, what adds its flags, what runs it
    (
        "validate",
        "check specs; prints path:line:col: code: message for each problem",
        validate_flags,
        cmd_validate,
    ),
    (
        "schema",
        "write the JSON Schema of the spec format (editors use it for completion)",
        schema_flags,
        cmd_schema,
    ),
    ("run", "run a spec over prompts and write the padded batch", run_flags, cmd_run),
    (
        "gateway",
        "run a harness spec (an agent in another framework) through the gateway: `run`'s flags, "
        "and where the gateway listens (docs/gateway.md)",
        gateway_flags,
        cmd_gateway,
    ),
    (
        "render",
        "draw a spec (.svg .png .pdf .dot .mmd), optionally annotated by a run",
        render_flags,
        cmd_render,
    ),
    ("show", "print a run's trajectories as transcripts", show_flags, cmd_show),
    (
        "replay",
        "rebuild a trajectory from a run's journal, without server or model: transcript, path, token check, "
        "reward recomputed",
        replay_flags,
        cmd_replay,
    ),
    ("bench", "benchmarks that print numbers (JSON)", bench_flags, cmd_bench),
    ("dev-server", "an SGLang-protocol server over the embedded model", dev_server_flags, cmd_dev_server),
)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    return command_line(COMMANDS, argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser(sys.argv[1:] if argv is None else argv).parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (printed as one line)
        return exc.code if isinstance(exc.code, int) else 1
    rc = 1
    # SIGTERM as Ctrl-C: ours
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = args.fn(args)
    except SpecError as err:
        for d in err.diagnostics:
            print(d, file=sys.stderr)
        rc = 2
    except DataError as exc:
        for problem in exc.problems:
            print(f"agentfsm: {problem}", file=sys.stderr)
    except CLIError as exc:
        say_now(f"agentfsm: {exc}")
        rc = exc.exit_code
    except KeyboardInterrupt:
        say_now("agentfsm: interrupted")
        rc = 130
    finally:
        if argv is None:  # the command line: the process ends with rc now, whatever signal comes
            ended(rc, exiting=True)
        else:
            # not the main thread; a handler set outside Python
            with contextlib.suppress(ValueError, TypeError):
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)
            ended(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
