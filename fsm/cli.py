"""`agentfsm`: validate, schema, run, render, show, bench, dev-server.

This module is the composition root: the one place in `fsm` that picks concrete backends (lazily, so
`import fsm` never loads transformers models or aiohttp servers). Every user error ends as one line on
stderr that names the file, flag, row or server and what to do, with a non-zero exit code and no traceback.
Exit codes: 0 done; 1 a user error, or a run whose error rows exceed --max-error-rate; 2 a bad command
line or spec diagnostics; 130 interrupted. `run` replaces its three output files together (fsm/rundir.py).

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
from collections.abc import Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsm.cli_args import DEMO_PROMPTS, SHOW_LIMIT, command_line
from fsm.compile import CompiledAgent, compile_spec
from fsm.data import DataError, load_rows
from fsm.loader import SpecError


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit code `exit_code`."""

    exit_code = 1


class Interrupted(CLIError):
    exit_code = 130


def _warn(message: str) -> None:
    print(f"agentfsm: warning: {message}", file=sys.stderr)


# --- validate / schema ---------------------------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    from fsm.compile import validate_file

    problems = 0
    for path in args.specs:
        diags = validate_file(path, static=args.static)
        for d in diags:
            print(d)
        problems += len(diags)
        if not diags and not args.quiet:
            print(f"{path}: ok")
    return 1 if problems else 0


def cmd_schema(args: argparse.Namespace) -> int:
    from fsm.spec import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as exc:
            raise CLIError(f"-o {args.output}: cannot write it ({exc.strerror or exc})") from None
    else:
        sys.stdout.write(text)
    return 0


# --- run -----------------------------------------------------------------------------------------------


def _check_run_flags(args: argparse.Namespace) -> None:
    """What argparse cannot check alone: refuse flags that cannot work together, warn about ones that would
    do nothing."""
    servers = bool(args.server or args.launch_sglang)
    if args.request_timeout is not None and not servers:
        raise CLIError("--request-timeout: it times SGLang requests; give --server URL or --launch-sglang MODEL "
                       "(the embedded model makes no requests)")  # fmt: skip
    if args.ray is not None:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise CLIError("--ray: Ray is not installed in this Python; pip install 'agentfsm[ray]', "
                           "or run without --ray") from None  # fmt: skip
        if args.request_timeout is not None:
            raise CLIError("--request-timeout: not passed to Ray actors yet; drop --ray or --request-timeout")
    tracing = bool(args.otlp or args.trace or _env_tracing())
    if args.trace_sample is not None and not tracing:
        _warn("--trace-sample does nothing without --otlp URL, --trace console or OTEL_EXPORTER_OTLP_ENDPOINT")
    if args.ray is not None and tracing:
        _warn("tracing is not passed to Ray actors yet: this --ray run exports no spans")


def _out_dir(args: argparse.Namespace) -> Path:
    """--out, made now: a bad path fails before the rollout, not after it."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out}: exists and is not a directory; pass a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CLIError(f"--out {out}: cannot create it ({exc.strerror or exc})") from None
    return out


def _rows(args: argparse.Namespace, agent: CompiledAgent) -> list[dict[str, Any]]:
    if args.data:
        rows = load_rows(args.data)
        return rows[: args.num_prompts] if args.num_prompts is not None else rows
    if agent.spec.demo_data is None:
        raise CLIError(f"{args.spec}: no --data given and the spec declares no demo_data; pass --data FILE.jsonl")
    from fsm.registry import resolve

    count = args.num_prompts if args.num_prompts is not None else DEMO_PROMPTS
    return resolve(agent.spec.demo_data, agent.spec.trust.allow_modules)(count, seed=args.seed)


def _launch_failure(message: str) -> str:
    """A LaunchError's message ("... log X ends with:\\n<tail>") as one line: the head and the log's last line,
    which is where a Python process says why it died."""
    head, _, tail = message.partition(" ends with:\n")
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    cause = lines[-1] if lines else "its log is empty"
    hint = "; pip install sglang (on a GPU host), or pass --server URL" if "No module named" in cause else ""
    return f"--launch-sglang: {head.strip()}: {cause}{hint}"


async def _servers(args: argparse.Namespace, stack: AsyncExitStack) -> tuple[list[str], str | None]:
    """The server URLs the flags name (launching SGLang first when asked), all ready; and the tokenizer
    path that goes with them."""
    servers = list(args.server or [])
    tokenizer = args.tokenizer
    if args.launch_sglang:
        from backends.launcher import LaunchError, SGLangLauncher

        launcher = SGLangLauncher(args.launch_sglang, dp=args.dp, tp=args.tp, base_port=args.port,
                                  log_dir=Path(args.out) / "sglang_logs", python=args.sglang_python,
                                  device="cpu" if args.device == "cpu" else None)  # fmt: skip
        try:
            await stack.enter_async_context(launcher)
        except LaunchError as exc:
            raise CLIError(_launch_failure(str(exc))) from None
        servers += launcher.urls
        tokenizer = tokenizer or args.launch_sglang
    if not servers:
        return servers, tokenizer
    from fsm.api import ServerNotReady, probe_servers

    try:
        served = await probe_servers(servers)
    except ServerNotReady as exc:
        raise CLIError(f"{exc}: the server does not answer /ready; start it (agentfsm dev-server or sglang) "
                       "or fix --server") from None  # fmt: skip
    if tokenizer is None:
        if not served or not Path(served).exists():
            raise CLIError(f"{servers[0]}: serves {served!r}, which is not a local directory; pass --tokenizer DIR")
        tokenizer = served
    return servers, tokenizer


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
            from fsm.ray_runner import RayRunner

            return RayRunner(args.spec, tokenizer=tokenizer, servers=servers or None, workers=args.workers,
                             address=args.ray or None)  # fmt: skip
        if servers:
            options = {} if args.request_timeout is None else {"request_timeout_s": args.request_timeout}
            return RolloutEngine(args.spec, tokenizer, servers=servers, max_concurrency=args.concurrency,
                                 tracer=_tracer(args), check_tokens=args.check_tokens,
                                 group_affinity=args.group_affinity, **options)  # fmt: skip
        return RolloutEngine(args.spec, tokenizer, model=args.model, max_concurrency=args.concurrency,
                             tracer=_tracer(args), check_tokens=args.check_tokens, torch_threads=args.threads,
                             max_batch_size=args.batch_size, device=args.device, dtype=args.dtype)  # fmt: skip
    except FileNotFoundError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:  # transformers: a directory without tokenizer or model files
        raise CLIError(f"{tokenizer or args.model}: cannot load a tokenizer there ({exc}); pass --tokenizer DIR") from None


def _tracer(args: argparse.Namespace) -> Any:
    if not (args.otlp or args.trace) and not _env_tracing():
        return None
    from fsm.telemetry import Telemetry

    sample = 1.0 if args.trace_sample is None else args.trace_sample
    return Telemetry(otlp=args.otlp, console=args.trace == "console", sample=sample)


def _env_tracing() -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


@dataclass
class _Rollout:
    """What `run` rolled out: every trajectory, or (interrupted) those that finished, in input order."""

    engine: Any
    sampling: Any
    trajs: list
    expected: int  # rows x n
    wall: float
    router_stats: Any
    interrupted: bool


async def _rollout(args: argparse.Namespace, rows: list[dict[str, Any]] | None, console: Any) -> _Rollout:
    """Roll `rows` out (or, `rows` None, resume the snapshot in --resume DIR). A RolloutEngine runs them in its
    continuous mode, so that Ctrl-C can snapshot the rows in flight; Ray keeps what finished."""
    params = {k: v for k, v in (("temperature", args.temperature), ("seed", args.seed)) if v is not None}
    finished: list = []
    interrupted = False
    t_start = time.perf_counter()
    expected = len(rows) * args.n if rows is not None else 0
    async with AsyncExitStack() as stack:
        stack.enter_context(_ctrl_c_cancels(asyncio.current_task()))
        servers, tokenizer = await _servers(args, stack)
        engine = _engine(args, servers, tokenizer)
        stack.push_async_callback(engine.aclose)
        sampling = engine.sampling(params)
        if args.ray is None:
            trajs, interrupted, expected, sampling = await _resumable(engine, rows, args, sampling, console)
        else:
            try:
                trajs = await _with_progress(engine, rows, args, sampling, console, finished)
            except asyncio.CancelledError:  # Ctrl-C (_ctrl_c_cancels): keep what finished
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                interrupted = True
                trajs = sorted(finished, key=lambda t: (t.index, t.sample))
        backend = getattr(engine, "backend", None)
        router_stats = backend.stats() if hasattr(backend, "stats") else None
    wall = time.perf_counter() - t_start
    return _Rollout(engine, sampling, trajs, expected, wall, router_stats, interrupted)


SNAPSHOT = "snapshot.json"  # in --out: the rows in flight when Ctrl-C came, for `run --resume`
SNAPSHOT_TIMEOUT_S = 120.0  # waiting for every running trajectory to reach a state boundary


async def _resumable(engine: Any, rows: list[dict[str, Any]] | None, args: argparse.Namespace, sampling: Any,
                     console: Any) -> tuple[list, bool, int, Any]:  # fmt: skip
    """Every trajectory (sorted), whether Ctrl-C came, rows x n, the sampling. Ctrl-C here parks the running
    trajectories at their next state boundary and writes them, with the finished ones, to --out/snapshot.json."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    out = Path(args.out)
    if rows is None:
        meta = await engine.arestore(out / SNAPSHOT)
        groups, expected = int(meta["groups"]), int(meta["rows_expected"])
    else:
        await engine.asubmit(rows, n=args.n, sampling=sampling)
        groups, expected = len(rows), len(rows) * args.n
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # main thread only
        loop.add_signal_handler(signal.SIGINT, stop.set)
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=args.quiet or not console.is_terminal) as progress:
        task = progress.add_task("groups", total=groups)
        while not stop.is_set():
            ready = engine.stream_stats.get("ready_groups", 0)
            progress.update(task, completed=ready)
            if ready >= groups:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
    interrupted = stop.is_set()
    taken = []
    if interrupted:
        meta = {"groups": groups, "rows_expected": expected}
        try:
            info = await engine.asnapshot(out / SNAPSHOT, meta=meta, stop=True, timeout=SNAPSHOT_TIMEOUT_S)
            ready = info["ready_groups"]
        except TimeoutError:
            _warn(f"no snapshot: some trajectories did not reach a state boundary in {SNAPSHOT_TIMEOUT_S:g} s")
            ready = engine.stream_stats.get("ready_groups", 0)
        if ready:
            taken = await engine.atake_groups(ready)
    else:
        taken = await engine.atake_groups(groups)
    trajs = sorted((t for g in taken for t in g.trajectories), key=lambda t: (t.index, t.sample))
    return trajs, interrupted, expected, taken[0].sampling if taken else sampling


@contextlib.contextmanager
def _ctrl_c_cancels(task: Any) -> Iterator[None]:
    """Ctrl-C cancels `task`, through the loop's wakeup fd: the loop wakes whichever thread the signal hit
    (asyncio.run's own handler waits for the main thread to run Python, which it does not while it sleeps
    on a rollout in the engine's thread)."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, task.cancel)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or no signals here
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)


async def _with_progress(engine: Any, rows: list[dict], args: argparse.Namespace, sampling: Any, console: Any,
                         finished: list) -> list:  # fmt: skip
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = len(rows) * args.n
    counters = {"tokens": 0, "turns": 0, "done": 0}
    t0 = time.perf_counter()
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[rate]}")]  # fmt: skip
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


def _write_run(out: Path, run: _Rollout, batch: Any) -> dict[str, Any]:
    """The run's three files into `out` (fsm/rundir.py), its summary saying how the run ended and how many
    rows each file holds."""
    from fsm.rundir import WriteInterrupted, write_outputs, write_run

    engine = run.engine

    def write(staging: Path) -> dict[str, Any]:
        summary = write_outputs(staging, engine.agent, run.trajs, batch, engine.codec, run.wall, run.router_stats,
                                 getattr(engine, "tracer", None))  # fmt: skip
        failed = sum(t.failed for t in run.trajs)
        summary = {"status": "interrupted" if run.interrupted else "completed", "rows_expected": run.expected,
                   "files": {"batch.pt": {"rows": len(batch)}, "trajectories.jsonl": {"rows": len(run.trajs)}},
                   "error_rate": round(failed / len(run.trajs), 4), **summary}  # fmt: skip
        (staging / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        return summary

    try:
        return write_run(out, write)
    except WriteInterrupted as exc:
        if exc.committed:
            raise Interrupted(f"interrupted; the run had finished and is written to {out}") from None
        raise Interrupted(f"interrupted while writing; {out} holds what it held before this run") from None
    except OSError as exc:
        raise CLIError(f"--out {out}: cannot write the run's outputs ({exc.strerror or exc})") from None


def cmd_run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fsm.snapshot import SnapshotError

    _check_run_flags(args)
    agent = compile_spec(args.spec)
    if args.resume is not None:
        args.out = args.resume
        if args.ray is not None:
            raise CLIError("--resume: resumes a single-process run; drop --ray")
        if not (Path(args.resume) / SNAPSHOT).is_file():
            raise CLIError(f"--resume {args.resume}: no {SNAPSHOT} there (a run interrupted with Ctrl-C leaves one)")
    rows = _rows(args, agent) if args.resume is None else None
    out = _out_dir(args)
    try:
        run = asyncio.run(_rollout(args, rows, Console(stderr=True)))
    except asyncio.CancelledError:  # Ctrl-C before the rollout began (launching, probing, loading)
        raise Interrupted(f"interrupted before the rollout; {out} holds what it held before") from None
    except SnapshotError as exc:
        raise CLIError(f"--resume: {exc}") from None
    resume_hint = (f"; resume with: agentfsm run {args.spec} --resume {out}"
                   if (out / SNAPSHOT).exists() and run.interrupted else "")  # fmt: skip
    if not run.trajs:
        raise Interrupted(f"interrupted before any trajectory finished; {out} holds what it held before{resume_hint}")
    batch = run.engine.to_batch(run.trajs, run.sampling)
    replacing = (out / "summary.json").exists()
    summary = _write_run(out, run, batch)
    if not args.quiet:
        from fsm.rundir import print_summary

        print_summary(summary, Console())
    print(f"wrote {out}/batch.pt, trajectories.jsonl, summary.json" + (" (replacing the run there)" if replacing else ""))
    if run.interrupted:
        raise Interrupted(f"interrupted: {len(run.trajs)} of {run.expected} trajectories finished and are written "
                          f"to {out} (summary.json: \"status\": \"interrupted\"){resume_hint}")  # fmt: skip
    (out / SNAPSHOT).unlink(missing_ok=True)  # the run is complete: nothing left to resume
    failed = [t.error or t.termination_reason for t in run.trajs if t.failed]
    if len(failed) / len(run.trajs) > args.max_error_rate:
        common = " ".join(max(set(failed), key=failed.count).split())  # names the server, row or tool
        common = common if len(common) <= 200 else common[:199] + "…"
        raise CLIError(f"{len(failed)} of {len(run.trajs)} rows ended in error ({len(failed) / len(run.trajs):.0%}), "
                       f"more than --max-error-rate {args.max_error_rate:g}; the most common: {common}; "
                       f"see {out}/summary.json")  # fmt: skip
    return 0


# --- render / show -------------------------------------------------------------------------------------


def cmd_render(args: argparse.Namespace) -> int:
    from viz.diagram import RenderError, render
    from viz.stats import load_run_stats

    agent = compile_spec(args.spec)
    try:
        stats = load_run_stats(args.run) if args.run else None
    except json.JSONDecodeError as exc:
        raise CLIError(f"--run {args.run}: its summary.json is not JSON ({exc.msg}, line {exc.lineno})") from None
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    try:
        render(agent, args.output, run_stats=stats)
    except RenderError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"-o {args.output}: cannot write it ({exc.strerror or exc})") from None
    print(args.output)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from viz.transcript import show

    limit = args.limit
    if limit is None and (args.worst or args.failed):
        limit = SHOW_LIMIT
    try:
        show(args.run_dir, row=args.row, worst=args.worst, failed=args.failed, limit=limit)
    except (FileNotFoundError, LookupError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    return 0


# --- bench / dev-server --------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    what = args.what
    if what == "engine":
        from bench.engine import bench_engine

        result = bench_engine(n=args.n, concurrency=args.concurrency or args.n, tool_turns=args.tool_turns,
                              repeats=args.repeats)  # fmt: skip
    elif what == "router":
        from bench.router import bench_router

        result = bench_router()
    elif what == "hf":
        from backends.tiny import ASSET_DIR
        from bench.hf import bench_hf

        result = bench_hf(args.model or str(ASSET_DIR))
    elif what == "prefix-cache":
        from bench.prefix_cache import bench_prefix_cache

        result = {f"affinity={a}": bench_prefix_cache(n=8, affinity=a) for a in (False, True)}
    elif what == "tracing":
        from bench.tracing import bench_tracing

        result = bench_tracing()
    elif what == "ray":
        from bench.ray import bench_ray

        result = bench_ray()
    elif what == "faults":
        from bench.faults import bench_faults

        result = bench_faults()
    elif what == "async":
        import importlib

        result = importlib.import_module("bench.async").bench_async()  # `async` is a keyword
    else:  # argparse restricts the choices
        raise CLIError(f"unknown benchmark {what!r}")
    print(json.dumps(result, indent=2))
    return 0


def cmd_dev_server(args: argparse.Namespace) -> int:
    from backends.devserver import main as devserver_main

    argv = ["--host", args.host, "--port", str(args.port)]
    argv += ["--scripted"] if args.scripted else ["--model", args.model or _default_model()]
    if not args.scripted:
        _quiet_transformers()
    argv += [f"--{k}={v}" for k, v in (("device", args.device), ("dtype", args.dtype)) if v]
    try:
        devserver_main(argv)
    except OSError as exc:  # the port is taken, or the host is not ours
        raise CLIError(f"--port {args.port}: cannot serve on {args.host}:{args.port} ({exc.strerror or exc})") from None
    return 0


def _default_model() -> str:
    from backends.tiny import ASSET_DIR

    return str(ASSET_DIR)


COMMANDS = {"validate": cmd_validate, "schema": cmd_schema, "run": cmd_run, "render": cmd_render, "show": cmd_show,
            "bench": cmd_bench, "dev-server": cmd_dev_server}


def build_parser() -> argparse.ArgumentParser:
    return command_line(COMMANDS)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (printed as one line)
        return exc.code if isinstance(exc.code, int) else 1
    try:
        return args.fn(args)
    except SpecError as err:
        for d in err.diagnostics:
            print(d, file=sys.stderr)
        return 2
    except DataError as exc:
        for problem in exc.problems:
            print(f"agentfsm: {problem}", file=sys.stderr)
        return 1
    except CLIError as exc:
        print(f"agentfsm: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("agentfsm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
