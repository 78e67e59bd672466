"""`agentfsm`: run, gateway, replay, bench, dev-server here; validate, schema, render and show in
fsm/cli/views.py.

This module is the composition root: the one place in `fsm` that picks concrete backends (lazily, so
`import fsm` never loads transformers models or aiohttp servers). Every user error ends as one line on
stderr that names the file, flag, row or server and what to do, with a non-zero exit code and no traceback.
Exit codes: 0 done; 1 a user error, or a run whose error rows exceed --max-error-rate; 2 a bad command
line or spec diagnostics; 130 interrupted (Ctrl-C or SIGTERM). `run` is a thin caller of what every kept run
does (the Python API's `keep=` too): signals (fsm/run/signals.py), the stop and the snapshot (fsm/output/keep.py),
the three output files, replaced together under a lock on --out (fsm/output/keep.py, fsm/output/rundir.py);
how the command ends (errors, a signal after the outcome, a closed stdout): fsm/cli/outcome.py.

"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from fsm.cli.args import DEMO_PROMPTS, command_line
from fsm.cli.launch import port_free, servers_of
from fsm.cli.outcome import (
    CLIError,
    Interrupted,
    ended,
    refuse_changed_code,
    resume_spec,
    run_locked,
    start_over,
)
from fsm.cli.views import cmd_render, cmd_schema, cmd_show, cmd_validate
from fsm.data.files import DataError, load_rows
from fsm.output.keep import Rollout, RunDir, RunInterrupted
from fsm.run.compile import CompiledAgent, compile_spec
from fsm.run.signals import Interrupts, say_now, term_is_ctrl_c, warn
from fsm.spec.loader import SpecError

# --- run -----------------------------------------------------------------------------------------------


def _check_run_flags(args: argparse.Namespace) -> None:
    """What argparse cannot check alone: refuse flags that cannot work together, warn about ones that would
    do nothing."""
    servers = bool(args.server or args.launch_sglang or args.launch_vllm)
    if args.launch_sglang and args.launch_vllm:
        raise CLIError("--launch-sglang and --launch-vllm: a fleet is one engine kind; launch one of them")
    launched = "sglang" if args.launch_sglang else "vllm" if args.launch_vllm else None
    if args.engine and launched and args.engine != launched:
        raise CLIError(f"--engine {args.engine} with --launch-{launched}: a fleet is one engine kind")
    if getattr(args, "accept_changes", False) and getattr(args, "resume", None) is None:
        raise CLIError("--accept-changes: it goes with --resume DIR (a new run has nothing to compare with)")
    if getattr(args, "exact_logprobs", False) and servers:
        raise CLIError(
            "--exact-logprobs: it is the embedded model's mode; servers have their own deterministic modes "
            "(docs/running.md, 'Logprobs on resume'): drop --exact-logprobs or --server/--launch-*"
        )
    if args.request_timeout is not None and not servers:
        raise CLIError(
            "--request-timeout: it times server requests; give --server URL, --launch-sglang MODEL or "
            "--launch-vllm MODEL (the embedded model makes no requests)"
        )
    if args.ray is not None:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise CLIError(
                "--ray: Ray is not installed in this Python; pip install 'agentfsm[ray]', "
                "or run without --ray"
            ) from None
        if args.request_timeout is not None:
            raise CLIError("--request-timeout: not passed to Ray actors yet; drop --ray or --request-timeout")
        if getattr(args, "exact_logprobs", False):
            raise CLIError("--exact-logprobs: not passed to Ray actors; drop --ray or --exact-logprobs")
    tracing = bool(args.otlp or args.trace or _env_tracing())
    if tracing and not args.otlp:  # checked now, not when the exporter starts after the model has loaded
        from fsm.telemetry.config import OtlpSettings
        from fsm.telemetry.export import otlp_url

        try:
            otlp_url(OtlpSettings.from_env().endpoint)
        except ValueError as exc:
            raise CLIError(f"OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT: {exc}") from None
    if args.trace_sample is not None and not tracing:
        warn("--trace-sample does nothing without --otlp URL, --trace console or OTEL_EXPORTER_OTLP_ENDPOINT")
    if args.ray is not None and tracing:
        warn("tracing is not passed to Ray actors yet: this --ray run exports no spans")


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


def _quiet_transformers() -> None:
    """No "Loading weights" progress bar or load-report chatter from transformers in our output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _engine(args: argparse.Namespace, servers: list[str], tokenizer: str | None) -> Any:
    """The engine the flags ask for: RayRunner, or RolloutEngine over servers or the embedded model."""
    from fsm.api import RolloutEngine

    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise CLIError(f"{tokenizer}: no tokenizer directory there; pass --tokenizer DIR")
    _quiet_transformers()
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
    if not (args.otlp or args.trace) and not _env_tracing():
        return None
    from fsm.telemetry import Telemetry

    sample = 1.0 if args.trace_sample is None else args.trace_sample
    # console spans go to stderr (stdout is the run table); the run's close waits for the collector at most
    # FLUSH_TIMEOUT_S, then counts what is left as dropped
    return Telemetry(
        otlp=args.otlp, console=args.trace == "console", sample=sample, flush_timeout_s=FLUSH_TIMEOUT_S
    )


def _env_tracing() -> bool:
    """Whether the OTEL_* variables ask for OTLP export (read as the SDK reads them; with none set, nothing
    does, and the SDK is not imported)."""
    if not any(name.startswith("OTEL_") for name in os.environ):
        return False
    from fsm.telemetry.config import otlp_from_env

    return otlp_from_env()


async def _rollout(
    args: argparse.Namespace, rows: list[dict[str, Any]] | None, console: Any, first_index: int | None = None
) -> Rollout:
    """Roll `rows` out (or, `rows` None, resume the snapshot in --resume DIR). A RolloutEngine runs them as
    every kept run does (fsm/output/keep.py: Ctrl-C snapshots the rows in flight); Ray keeps what finished.
    `first_index`: `rows` are a slice of a batch, whose index (and seed) their first sample takes."""
    from fsm.output.keep import keep_rollout

    params = {k: v for k, v in (("temperature", args.temperature), ("seed", args.seed)) if v is not None}
    finished: list = []
    interrupted = False
    journal = None
    expected = len(rows) * args.n if rows is not None else 0
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
            kept = await keep_rollout(
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
            trajs, interrupted, expected, sampling = (
                kept.trajs,
                kept.interrupted,
                kept.expected,
                kept.sampling,
            )
            journal = kept.journal
        else:
            assert rows is not None  # None only with --resume, which refuses --ray (cmd_run)
            try:
                trajs = await _with_progress(engine, rows, args, sampling, console, finished)
            except asyncio.CancelledError:  # Ctrl-C (interrupts, never armed here): keep what finished
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                interrupted = True
                trajs = sorted(finished, key=lambda t: (t.index, t.sample))
        backend = getattr(engine, "backend", None)
        router_stats = backend.stats() if backend is not None and hasattr(backend, "stats") else None
    wall, cpu = time.perf_counter() - t_start, time.process_time() - c_start
    return Rollout(engine, sampling, trajs, expected, wall, router_stats, interrupted, cpu, journal=journal)


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


async def _with_progress(
    engine: Any, rows: list[dict], args: argparse.Namespace, sampling: Any, console: Any, finished: list
) -> list:
    """Ray's rollout, its trajectories as a bar with the tokens per second and turns per row so far."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = len(rows) * args.n
    counters = {"tokens": 0, "turns": 0, "done": 0}
    t0 = time.perf_counter()
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    columns.append(TextColumn("{task.fields[rate]}"))
    with Progress(*columns, console=console, disable=args.quiet or not console.is_terminal) as progress:
        task = progress.add_task("trajectories", total=total, rate="")

        def done(traj: Any) -> None:  # on the engine's thread; rich's Progress takes its own lock
            finished.append(traj)
            counters["done"] += 1
            counters["tokens"] += traj.response_mask.count(1)
            counters["turns"] += traj.num_turns
            elapsed = max(time.perf_counter() - t0, 1e-9)
            rate = f"{counters['tokens'] / elapsed:,.0f} tok/s · {counters['turns'] / counters['done']:.1f} turns"
            progress.update(task, advance=1, rate=rate)

        return await engine.arun(rows, n=args.n, sampling=sampling, on_done=done)


def cmd_run(args: argparse.Namespace, rollout: Callable[..., Any] | None = None) -> int:
    """`agentfsm run`; `rollout` replaces `_rollout` (`agentfsm gateway --workers N` rolls the rows out in worker
    processes and merges them, fsm/gateway/workers.py)."""
    from rich.console import Console

    from fsm.cli.ray_run import refuse_resume
    from fsm.output.rundir import RunDirError, locked
    from fsm.run import codec as snap
    from fsm.run.journal import JOURNAL
    from fsm.run.provenance import ResumeRefused
    from fsm.run.resume import load, refuse_unbegun

    term_is_ctrl_c()
    if args.resume is not None:
        refuse_resume(args)  # a --ray run (fsm/cli/ray_run.py says why)
        resume_spec(args)
        args.out = args.resume
    elif args.spec is None:
        raise CLIError("run: give a SPEC (or --resume DIR)")
    else:
        args.run_id = uuid.uuid4().hex[:12]
    _check_run_flags(args)
    agent = compile_spec(args.spec)
    if args.resume is not None:  # checked now (but the tokenizer, at restore): refused before anything starts
        try:
            loaded = load(Path(args.resume) / JOURNAL, agent)
        except snap.SnapshotError as exc:
            raise CLIError(f"--resume: {exc}") from None
        if not loaded.data["groups"] and loaded.ended is None:
            start_over(args, Path(args.resume) / JOURNAL)
    if args.resume is not None:
        try:
            refuse_unbegun(loaded, Path(args.resume) / JOURNAL)
        except snap.SnapshotError as exc:
            raise CLIError(f"--resume: {exc}") from None
        if loaded.ended == "completed":  # killed after its files were whole: resuming it is done already
            print(
                f"agentfsm: --resume: {Path(args.resume) / JOURNAL}: the run there has completed: nothing to "
                "resume (its files are whole)",
                file=sys.stderr,
            )
            return 0
        if loaded.ended is not None:
            raise CLIError(
                f"--resume: {Path(args.resume) / JOURNAL}: the run there has {loaded.ended}: nothing to resume"
            )
        refuse_changed_code(Path(args.resume) / JOURNAL, agent, loaded.made_by, args.accept_changes)
        args.resumed = loaded  # checked: the run goes on from it (fsm/output/keep.py `keep_rollout`)
    rows = _rows(args, agent) if args.resume is None else None
    out = args.out = _out_dir(args)
    try:
        with locked(out):
            return run_locked(args, rows, out, Console, rollout or _rollout)
    except RunInterrupted as exc:
        raise Interrupted(str(exc)) from None
    except RunDirError as exc:
        raise CLIError(f"--out {exc}") from None
    except ResumeRefused as exc:  # what made the rows changed: its own line (fsm/run/provenance.py)
        raise CLIError(str(exc)) from None
    except snap.SnapshotError as exc:
        raise CLIError(f"--resume: {exc}") from None


def cmd_replay(args: argparse.Namespace) -> int:
    from fsm.cli.replay import cmd_replay as replay

    return replay(args)


# --- bench / dev-server --------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    from fsm.cli.bundled import bench_module

    what = args.what
    if args.workload != "engine" and (what, args.workload) not in (
        ("engine", "calculator"),
        ("engine", "contexts"),
        ("tracing", "calculator"),
        ("tracing", "embedded"),
        ("gateway", "contexts"),
    ):
        raise CLIError(
            f"bench {what}: no --workload {args.workload} (engine: engine | calculator | contexts; tracing: engine | "
            "calculator | embedded; gateway: engine | contexts)"
        )
    bench = bench_module(what.replace("-", "_"))
    if what == "engine" and args.workload == "contexts":
        result = bench.bench_contexts(
            n=500 if args.n == 2000 else args.n, tool_turns=args.tool_turns, repeats=args.repeats
        )
    elif what == "engine" and args.workload == "calculator":
        result = bench.bench_calculator(n=args.n, concurrency=args.concurrency, repeats=args.repeats)
    elif what == "engine":
        result = bench.bench_engine(
            n=args.n, concurrency=args.concurrency or args.n, tool_turns=args.tool_turns, repeats=args.repeats
        )
    elif what == "hf":
        from backends.tiny import ASSET_DIR

        result = bench.bench_hf(args.model or str(ASSET_DIR))
    elif what == "prefix-cache":
        result = {f"affinity={a}": bench.bench_prefix_cache(n=8, affinity=a) for a in (False, True)}
    elif what == "tracing":
        result = bench.bench_tracing(workload=args.workload, repeats=args.repeats)
    elif what == "gateway" and args.workload == "contexts":
        result = bench.bench_context(repeats=args.repeats)
    elif what == "engines":
        if not args.server and (odd := [s for s in args.shape or () if s not in bench.SHAPES]):
            raise CLIError(f"bench engines: no --shape {odd[0]} (engines: {' | '.join(bench.SHAPES)})")
        _quiet_transformers()
        load = {
            "repeats": args.repeats,
            "in_flight": args.concurrency or 1000,
            "processes": args.processes or (),
        }
        try:
            if args.server:
                result = bench.bench_engines(args.server, n=8 if args.n == 2000 else args.n, **load)
            else:
                result = bench.bench_instant(shapes=args.shape or tuple(bench.SHAPES), **load)
        except RuntimeError as exc:  # a server or client process that did not start, or died
            raise CLIError(str(exc)) from None
    elif what == "fleet":
        if problem := bench.refusal(args.trace, args.shape or (), args.router or ()):
            raise CLIError(problem)
        result = bench.bench_fleet(
            args.server or (),
            trace=args.trace,
            repeats=args.repeats,
            shapes=args.shape or (),
            routers=args.router or (),
            sim=args.sim or 0,
        )
    elif what == "trees":
        result = bench.bench_trees(args.server or (), prompts=4 if args.n == 2000 else args.n)
    else:  # argparse restricts the choices to the modules of bench/
        result = getattr(bench, f"bench_{what.replace('-', '_')}")()
    print(json.dumps(result, indent=2))
    return 0


def cmd_dev_server(args: argparse.Namespace) -> int:
    from backends.devserver import main as devserver_main

    port_free(args.host, args.port)  # before the model loads (tens of seconds), not after
    argv = ["--host", args.host, "--port", str(args.port)]
    if args.scripted_tools:
        argv += ["--scripted-tools"]
        argv += [f"--{k}={v}" for k, v in (("tokenizer", args.tokenizer), ("script", args.script)) if v]
    else:
        argv += ["--scripted"] if args.scripted else ["--model", args.model or _default_model()]
    if args.context_length is not None:  # at least 16: the parser's int_in(16)
        argv += [f"--context-length={args.context_length}"]
    if not args.scripted:
        _quiet_transformers()
    argv += [f"--{k}={v}" for k, v in (("device", args.device), ("dtype", args.dtype)) if v]
    try:
        devserver_main(argv)
    except OSError as exc:  # the port is taken, or the host is not ours
        raise CLIError(
            f"--port {args.port}: cannot serve on {args.host}:{args.port} ({exc.strerror or exc})"
        ) from None
    return 0


def _default_model() -> str:
    from backends.tiny import ASSET_DIR

    return str(ASSET_DIR)


def cmd_gateway(args: argparse.Namespace) -> int:
    from fsm.gateway.serve import cmd_gateway as gateway
    from fsm.gateway.workers import WorkerError

    try:
        return gateway(args, cmd_run, _rollout)
    except WorkerError as exc:
        raise CLIError(str(exc)) from None


COMMANDS = {
    "validate": cmd_validate,
    "schema": cmd_schema,
    "run": cmd_run,
    "render": cmd_render,
    "show": cmd_show,
    "bench": cmd_bench,
    "dev-server": cmd_dev_server,
    "gateway": cmd_gateway,
    "replay": cmd_replay,
}


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
