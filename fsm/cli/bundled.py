"""`agentfsm bench` and `agentfsm dev-server`: their flags and commands (the dev server's flags are
backends/devflags.py's, as `python -m backends.devserver`'s), and where `bench` finds the benchmark code (bench/).

bench/ sits beside fsm/ in a checkout. A wheel carries it inside fsm (fsm/_bundled/bench, pyproject.toml's
package-dir), never as a top-level `bench` in site-packages, where another distribution's `bench` would
collide. Its modules import each other and name their tools as `bench.*`, so the folder that holds it goes
first on sys.path for the bench command's process (and, through PYTHONPATH, the client processes it starts).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from types import ModuleType

from backends.devflags import dev_server_flags as dev_server_flags  # `agentfsm dev-server`: the same flags
from fsm.cli.args import COUNT, CLIError, int_in, quiet_transformers, server_url
from fsm.cli.launch import port_free

FSM_DIR = Path(__file__).resolve().parents[1]
PLACES = (FSM_DIR / "_bundled", FSM_DIR.parent)  # an installed wheel's copy, then a checkout's bench/


def bench_module(name: str) -> ModuleType:
    """`bench.<name>` from the installed copy or the checkout (`async` is a keyword: no plain import)."""
    for folder in PLACES:
        if (folder / "bench" / "__init__.py").is_file():
            where = str(folder)
            if where not in sys.path:
                sys.path.insert(0, where)
            paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if where not in paths:
                os.environ["PYTHONPATH"] = os.pathsep.join([where, *filter(None, paths)])
            break
    return importlib.import_module(f"bench.{name}")


BENCHMARKS = (  # `bench WHAT`
    "engine router hf prefix-cache tracing ray faults async families collate vs-verl engines gateway fleet "
    "trees journal"
).split()


def bench_flags(p: argparse.ArgumentParser) -> None:
    """`agentfsm bench WHAT`: the engine's own benchmarks' flags here, those of benchmarks against servers and
    fleets in `_fleet_flags`."""
    p.add_argument(
        "what",
        choices=BENCHMARKS,
        help="which benchmark",
    )
    p.add_argument(
        "--n",
        type=COUNT,
        default=2000,
        metavar="N",
        help="engine: trajectories; engines: prompts (default 8); trees with --server: trees per run (default 4)",
    )
    p.add_argument(
        "--concurrency",
        type=COUNT,
        metavar="N",
        help="engine: trajectories in flight (default: --n); engines: rows in flight for the client's CPU "
        "per call under load (default 1000)",
    )
    p.add_argument(
        "--processes",
        type=COUNT,
        nargs="+",
        action="extend",
        metavar="N",
        help="engines: also run the load split over N processes (--processes 1 2 4); without --server, each "
        "with a modeled vLLM server of its own (bench/fleet_sim.py), the counts alternated over --repeats rounds",
    )
    p.add_argument(
        "--tool-turns", type=int_in(0), default=4, metavar="N", help="engine: tool turns per trajectory"
    )
    p.add_argument(
        "--repeats", type=COUNT, default=3, metavar="N", help="engine, tracing: repeats (the median is kept)"
    )
    p.add_argument("--model", metavar="DIR", help="hf: model dir (default: the tiny model)")
    p.add_argument(
        "--workload",
        choices=["engine", "calculator", "contexts", "embedded"],
        default="engine",
        help="engine: calculator is specs/calculator.yaml's prompt, tool and answer with a replayed model "
        "(CPU per trajectory at --n in flight); contexts: the template context policy's CPU per "
        "model turn against append's on the same calculator conversation (--n default 500); tracing: engine, calculator, or embedded "
        "(`agentfsm run specs/calculator.yaml` without and with --otlp, alternated); gateway: contexts is its "
        "CPU per call at a 1k- and a 30k-token prompt, per API (docs/gateway.md, 'Cost')",
    )
    _fleet_flags(p)


def _fleet_flags(p: argparse.ArgumentParser) -> None:
    """`agentfsm bench engines|fleet|trees`: the servers, recorded traffic and routers they run."""
    p.add_argument(
        "--server",
        action="append",
        type=server_url,
        metavar="URL",
        help="engines: a server serving the tiny model (SGLang, vLLM or dev); several run in turn, tokens compared; "
        "fleet: a vLLM server of the fleet (default: two launched from .venv-vllm); trees: a real SGLang or "
        "vLLM server of the tiny model, whose own count of the branch prompts' cached tokens is read",
    )
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="fleet: recorded calls to replay (JSON lines: session, group, turn, prompt_tokens, new_tokens, "
        "tool_s), or a run directory whose journal holds them (bench/traffic.py); default: the generated shapes",
    )
    p.add_argument(
        "--shape",
        action="append",
        choices=["calculator", "long", "groups", "skewed", "crowded", "echo"],
        help="fleet: replay only these generated shapes (repeatable; default: all five); engines without "
        "--server: the turn shapes the instant servers answer, calculator (its real turns) and echo (one "
        "turn, no tool call; default: both)",
    )
    p.add_argument(
        "--router",
        action="append",
        metavar="NAME",
        help="fleet: run only these routers, by their name in the table ('agentfsm', 'sglang-router "
        "cache_aware', ...; repeatable; default: all)",
    )
    p.add_argument(
        "--sim",
        type=COUNT,
        metavar="N",
        help="fleet: N modeled vLLM servers (bench/fleet_sim.py: vLLM's scheduling and prefix cache, compute "
        "as sleeps fitted to a real server) instead of real ones",
    )


def cmd_bench(args: argparse.Namespace) -> int:
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
        quiet_transformers()
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
    from backends.devserver import serve

    port_free(args.host, args.port)  # before the model loads (tens of seconds), not after
    if not args.scripted:
        quiet_transformers()
    try:
        serve(args)
    except OSError as exc:  # the port is taken, or the host is not ours
        raise CLIError(
            f"--port {args.port}: cannot serve on {args.host}:{args.port} ({exc.strerror or exc})"
        ) from None
    return 0
