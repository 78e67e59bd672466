"""`agentfsm`: validate, schema, run, render, show, bench, dev-server.

This module is the composition root: the one place in `fsm` that picks concrete backends (lazily, so
`import fsm` never loads transformers models or aiohttp servers). Every user error ends as one line that
names the file, row or server and what to do, with a non-zero exit code and no traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from fsm.compile import CompiledAgent, compile_spec
from fsm.data import DataError, load_rows
from fsm.loader import SpecError


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit code 1."""


# --- validate / schema ---------------------------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    from fsm.compile import validate_file

    problems = 0
    for path in args.specs:
        diags = validate_file(path)
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
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


# --- run -----------------------------------------------------------------------------------------------


def _rows(args: argparse.Namespace, agent: CompiledAgent) -> list[dict[str, Any]]:
    if args.data:
        rows = load_rows(args.data)
        return rows[: args.num_prompts] if args.num_prompts else rows
    if agent.spec.demo_data is None:
        raise CLIError(f"{args.spec}: no --data given and the spec declares no demo_data; pass --data FILE.jsonl")
    from fsm.registry import resolve

    return resolve(agent.spec.demo_data)(args.num_prompts or 64, seed=args.seed)


async def _servers(args: argparse.Namespace, stack: AsyncExitStack) -> tuple[list[str], str | None]:
    """The server URLs the flags name (launching SGLang first when asked), all ready; and the tokenizer
    path that goes with them."""
    servers = list(args.server or [])
    tokenizer = args.tokenizer
    if args.launch_sglang:
        from backends.sglang import LaunchError, SGLangLauncher

        launcher = SGLangLauncher(args.launch_sglang, dp=args.dp, tp=args.tp, base_port=args.port,
                                  log_dir=Path(args.out) / "sglang_logs")  # fmt: skip
        try:
            await stack.enter_async_context(launcher)
        except LaunchError as exc:
            raise CLIError(str(exc).splitlines()[0]) from None
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


def _engine(args: argparse.Namespace, servers: list[str], tokenizer: str | None) -> Any:
    """The engine the flags ask for: RayRunner, or RolloutEngine over servers or the embedded model."""
    from fsm.api import RolloutEngine

    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise CLIError(f"{tokenizer}: no tokenizer directory there; pass --tokenizer DIR")
    try:
        if args.ray is not None:
            from fsm.ray_runner import RayRunner

            return RayRunner(args.spec, tokenizer=tokenizer, servers=servers or None, workers=args.workers,
                             address=args.ray or None)  # fmt: skip
        if servers:
            return RolloutEngine(args.spec, tokenizer, servers=servers, max_concurrency=args.concurrency,
                                 tracer=_tracer(args), check_tokens=args.check_tokens,
                                 group_affinity=args.group_affinity)  # fmt: skip
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

    return Telemetry(otlp=args.otlp, console=args.trace == "console", sample=args.trace_sample)


def _env_tracing() -> bool:
    import os

    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


async def _run_async(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    agent = compile_spec(args.spec)
    rows = _rows(args, agent)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = {k: v for k, v in (("temperature", args.temperature), ("seed", args.seed)) if v is not None}
    t_start = time.perf_counter()
    async with AsyncExitStack() as stack:
        servers, tokenizer = await _servers(args, stack)
        engine = _engine(args, servers, tokenizer)
        stack.push_async_callback(engine.aclose)
        sampling = engine.sampling(params)
        trajs = await _with_progress(engine, rows, args, sampling, console)
        backend = getattr(engine, "backend", None)
        router_stats = backend.stats() if hasattr(backend, "stats") else None
    wall = time.perf_counter() - t_start
    batch = engine.to_batch(trajs, sampling)
    tracer = getattr(engine, "tracer", None)
    summary = _write_outputs(out, engine.agent, trajs, batch, engine.codec, wall, router_stats, tracer)
    _print_summary(summary, console)
    console.print(f"wrote {out}/batch.pt, trajectories.jsonl, summary.json")
    return 0


async def _with_progress(engine: Any, rows: list[dict], args: argparse.Namespace, sampling: Any, console: Any) -> list:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = len(rows) * args.n
    counters = {"tokens": 0, "turns": 0, "done": 0}
    t0 = time.perf_counter()
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[rate]}")]  # fmt: skip
    with Progress(*columns, console=console, disable=args.quiet or not console.is_terminal) as progress:
        task = progress.add_task("trajectories", total=total, rate="")

        def done(traj: Any) -> None:
            counters["done"] += 1
            counters["tokens"] += traj.response_mask.count(1)
            counters["turns"] += traj.num_turns
            elapsed = max(time.perf_counter() - t0, 1e-9)
            rate = f"{counters['tokens'] / elapsed:,.0f} tok/s · {counters['turns'] / counters['done']:.1f} turns"
            progress.update(task, advance=1, rate=rate)

        return await engine.arun(rows, n=args.n, sampling=sampling, on_done=done)


def _write_outputs(out: Path, agent: CompiledAgent, trajs: list, batch: Any, codec: Any, wall: float,
                   router_stats: Any, tracer: Any) -> dict[str, Any]:  # fmt: skip
    import torch

    from fsm.batch import summarize

    torch.save({"batch": {k: v for k, v in batch.batch.items()}, "non_tensor_batch": batch.non_tensor_batch,
                "meta_info": batch.meta_info}, out / "batch.pt")  # fmt: skip
    with (out / "trajectories.jsonl").open("w") as f:
        for traj in trajs:
            f.write(json.dumps(_record(traj, codec), ensure_ascii=False) + "\n")
    summary = summarize(trajs)
    summary.update(spec=str(agent.path), agent=agent.name, spec_hash=agent.hash, wall_s=round(wall, 3),
                   timing=batch.meta_info["timing"], router=router_stats)  # fmt: skip
    summary["fsm"] = _run_stats(agent, trajs)
    if tracer is not None:
        summary["tracing"] = tracer.stats()
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def _record(traj: Any, codec: Any) -> dict[str, Any]:
    from viz.transcript import trajectory_record

    return trajectory_record(traj, codec)


def _run_stats(agent: CompiledAgent, trajs: list) -> dict[str, Any]:
    from viz.stats import run_stats

    return run_stats(agent, trajs)


def _print_summary(summary: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"{summary['agent']}: {summary['trajectories']} trajectories in {summary['wall_s']:.1f}s")
    table.add_column("metric")
    table.add_column("value", justify="right")

    def add(name: str, value: Any) -> None:
        table.add_row(name, f"{value:.3f}" if isinstance(value, float) else str(value))

    if summary["reward_mean"] is not None:
        add("reward mean", summary["reward_mean"])
        add("accuracy (reward > 0)", summary["accuracy"])
    for reason, count in summary["termination_reasons"].items():
        add(f"ended: {reason}", count)
    add("turns (mean)", summary["turns_mean"])
    add("response tokens (mean)", summary["response_tokens_mean"])
    add("model tokens / s", round(summary["model_tokens"] / max(summary["wall_s"], 1e-9)))
    add("failed rows", summary["failed"])
    add("tool errors", summary["tool_errors"])
    timing = summary["timing"]
    if timing:
        add("generate s (mean / max)", f"{timing['agent_loop/generate_sequences/mean']:.3f} / "
            f"{timing['agent_loop/generate_sequences/max']:.3f}")  # fmt: skip
        add("tool calls s (mean)", timing["agent_loop/tool_calls/mean"])
    router = summary.get("router")
    if router:
        totals = router.get("totals", router)
        for key in ("sticky", "new", "group", "moved", "retries", "cache_hit_rate"):
            if key in totals:
                add(f"router {key}", totals[key])
    console.print(table)


def cmd_run(args: argparse.Namespace) -> int:
    return asyncio.run(_run_async(args))


# --- render / show -------------------------------------------------------------------------------------


def cmd_render(args: argparse.Namespace) -> int:
    from viz.diagram import render
    from viz.stats import load_run_stats

    agent = compile_spec(args.spec)
    stats = load_run_stats(args.run) if args.run else None
    render(agent, args.output, run_stats=stats)
    print(args.output)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from viz.transcript import show

    show(args.run_dir, row=args.row, worst=args.worst, failed=args.failed)
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
    else:  # argparse restricts the choices
        raise CLIError(f"unknown benchmark {what!r}")
    print(json.dumps(result, indent=2))
    return 0


def cmd_dev_server(args: argparse.Namespace) -> int:
    from backends.devserver import main as devserver_main

    argv = ["--host", args.host, "--port", str(args.port)]
    argv += ["--scripted"] if args.scripted else ["--model", args.model or _default_model()]
    argv += [f"--{k}={v}" for k, v in (("device", args.device), ("dtype", args.dtype)) if v]
    devserver_main(argv)
    return 0


def _default_model() -> str:
    from backends.tiny import ASSET_DIR

    return str(ASSET_DIR)


# --- parser --------------------------------------------------------------------------------------------


DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]  # the embedded model's (backends/hf.py)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="agentfsm", description="Declarative agent loops for RL rollouts.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check specs; prints path:line:col: code: message")
    p.add_argument("specs", nargs="+")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser("schema", help="write the JSON Schema of the spec format")
    p.add_argument("-o", "--output")
    p.set_defaults(fn=cmd_schema)

    p = sub.add_parser("run", help="run a spec over prompts and write the padded batch")
    p.add_argument("spec")
    p.add_argument("--data", help=".jsonl or .parquet rows with raw_prompt (default: the spec's demo_data)")
    p.add_argument("--num-prompts", type=int, help="use the first N rows (demo: generate N; default 64)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (GRPO group size)")
    p.add_argument("--out", default="runs/latest")
    p.add_argument("--server", action="append", help="SGLang (or dev) server URL; repeat for a fleet")
    p.add_argument("--launch-sglang", metavar="MODEL", help="launch SGLang servers for MODEL first (GPU hosts)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas to launch")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--port", type=int, default=30000, help="first port for launched servers")
    p.add_argument("--model", help="model dir for the embedded backend (default: the tiny calculator model)")
    p.add_argument("--tokenizer", help="tokenizer dir (default: the model's)")
    p.add_argument("--group-affinity", action="store_true", help="route a GRPO group's samples to one server")
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="torch threads for the embedded model")
    p.add_argument("--batch-size", type=int, default=64, help="max batch of the embedded model")
    p.add_argument("--device", help="embedded model's device: cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, help="embedded model's dtype (default auto: see backends/hf.py)")
    p.add_argument("--check-tokens", action="store_true", help="compare ids with a full re-render")
    p.add_argument("--otlp", metavar="URL", help="export spans to an OTLP/HTTP endpoint (e.g. Jaeger :4318)")
    p.add_argument("--trace", choices=["console"], help="print spans to the console")
    p.add_argument("--trace-sample", type=float, default=1.0, help="fraction of trajectories traced")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS", help="spread rows over Ray actors")
    p.add_argument("--workers", type=int, default=2, help="Ray actors")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("render", help="draw a spec (.svg .png .pdf .dot .mmd), optionally annotated by a run")
    p.add_argument("spec")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--run", metavar="DIR", help="annotate with a run's summary.json")
    p.set_defaults(fn=cmd_render)

    p = sub.add_parser("show", help="print a run's trajectories as transcripts")
    p.add_argument("run_dir")
    p.add_argument("--row", type=int)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--worst", action="store_true", help="lowest reward first")
    g.add_argument("--failed", action="store_true", help="only failed rows")
    p.set_defaults(fn=cmd_show)

    p = sub.add_parser("bench", help="benchmarks that print numbers")
    p.add_argument("what", choices=["engine", "router", "hf", "prefix-cache", "tracing", "ray"])
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--concurrency", type=int)
    p.add_argument("--tool-turns", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("dev-server", help="an SGLang-protocol server over the embedded model")
    p.add_argument("--model", help="model dir (default: the tiny calculator model)")
    p.add_argument("--scripted", action="store_true", help="a deterministic echo model, no weights")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, help="default auto: see backends/hf.py")
    p.set_defaults(fn=cmd_dev_server)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
        return 1
    except KeyboardInterrupt:
        print("agentfsm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
