"""The command line of `agentfsm`: one function per command adds its flags (`run`'s and `bench`'s in groups by
topic), and `command_line` puts them under their commands; the number types and the parser they use are in
fsm/cli/outcome.py."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence

from fsm.cli.outcome import (
    COUNT,
    PORT,
    Help,
    Parser,
    float_in,
    int_in,
    otlp_endpoint,
    seconds_flag,
    server_url,
)

DEMO_PROMPTS = 64  # `run` without --data or --num-prompts
SHOW_LIMIT = 5  # transcripts `show --worst/--failed` prints without --limit
RAY_WORKERS = 2  # `run --ray`'s actors without --workers
BENCHMARKS = (  # `bench WHAT`
    "engine router hf prefix-cache tracing ray faults async families collate vs-verl engines gateway fleet "
    "trees journal"
).split()

DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]  # the embedded model's (backends/hf.py)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentfsm")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def validate_flags(p: argparse.ArgumentParser) -> None:
    """`agentfsm validate SPEC...`."""
    p.add_argument("specs", nargs="+", metavar="SPEC", help="spec files (YAML)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only problems (no 'SPEC: ok')")
    p.add_argument(
        "--static",
        action="store_true",
        help="import nothing the spec names (for editors and CI on unvetted specs): schema, graph and "
        "built-in names; import paths checked for form and the deny-list only",
    )


def schema_flags(p: argparse.ArgumentParser) -> None:
    """`agentfsm schema`."""
    p.add_argument("-o", "--output", metavar="FILE", help="write it here (default: print it)")


def _rows_flags(p: argparse.ArgumentParser) -> None:
    """What a run rolls out, how many at once, and where its outputs go."""
    p.add_argument(
        "spec",
        metavar="SPEC",
        nargs="?",
        help="the spec file (YAML), e.g. specs/calculator.yaml "
        "(with --resume: optional, the snapshot names it)",
    )
    p.add_argument(
        "--data",
        metavar="FILE",
        help=".jsonl or .parquet rows with raw_prompt (default: the spec's demo_data)",
    )
    p.add_argument(
        "--num-prompts",
        type=COUNT,
        metavar="N",
        help=f"the first N rows of --data, or N demo prompts "
        f"(default: every row of --data; {DEMO_PROMPTS} demo prompts)",
    )
    p.add_argument("--n", type=COUNT, default=1, metavar="N", help="samples per prompt (GRPO group size)")
    p.add_argument(
        "--out",
        default="runs/latest",
        metavar="DIR",
        help="where batch.pt, trajectories.jsonl and summary.json go (a previous run's are replaced)",
    )
    p.add_argument(
        "--temperature",
        type=float_in(0.0),
        metavar="T",
        help="sampling temperature, 0 = greedy (default: the spec's sampling)",
    )
    p.add_argument("--seed", type=int_in(0), default=0, help="sampling seed, and the demo prompts' seed")
    p.add_argument(
        "--concurrency", type=COUNT, default=256, metavar="N", help="trajectories in flight at once"
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="print only errors, warnings and the final 'wrote ...' line",
    )


def _server_flags(g: argparse._ArgumentGroup) -> None:
    """The inference servers a run calls or launches, and how it treats them."""
    g.add_argument(
        "--server",
        action="append",
        type=server_url,
        metavar="URL",
        help="SGLang, vLLM or dev server URL; repeat for a fleet (one engine kind)",
    )
    g.add_argument(
        "--engine",
        choices=["sglang", "vllm"],
        help="what the servers run (default: ask them; the dev server speaks SGLang's protocol)",
    )
    g.add_argument(
        "--launch-sglang",
        metavar="MODEL",
        help="launch SGLang servers for MODEL first (GPU hosts, or --device cpu); logs go to DIR/sglang_logs",
    )
    g.add_argument(
        "--sglang-python",
        metavar="PATH",
        help="the interpreter that has sglang, for --launch-sglang "
        "(default: $AGENTFSM_SGLANG_PYTHON, else this one)",
    )
    g.add_argument(
        "--launch-vllm",
        metavar="MODEL",
        help="launch vLLM servers for MODEL first (GPU hosts, or --device cpu); logs go to DIR/vllm_logs",
    )
    g.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="the interpreter that has vllm, for --launch-vllm "
        "(default: $AGENTFSM_VLLM_PYTHON, else this one)",
    )
    g.add_argument("--dp", type=COUNT, default=1, metavar="N", help="data-parallel replicas to launch")
    g.add_argument(
        "--tp", type=COUNT, default=1, metavar="N", help="tensor-parallel GPUs per launched replica"
    )
    g.add_argument("--port", type=PORT, default=30000, help="first port for launched servers")
    g.add_argument(
        "--group-affinity",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="route a GRPO group's samples to one server, sharing their prompt's cache (default: on, as the "
        "Python API)",
    )
    seconds_flag(
        g, "--request-timeout", None, "seconds per request attempt to a server (default: the backend's)"
    )
    g.add_argument(
        "--strict-servers",
        action="store_true",
        help="refuse to start when any --server is down or malformed (default: leave it out, warn)",
    )
    g.add_argument(
        "--retry-window",
        type=float_in(0.0),
        default=60.0,
        metavar="SECONDS",
        help="while every server fails, keep failing over for this long before a row errs (default 60)",
    )


def _model_flags(g: argparse._ArgumentGroup) -> None:
    """The embedded model (no servers) and the tokenizer."""
    g.add_argument(
        "--model",
        metavar="DIR",
        help="model dir for the embedded backend (default: the tiny calculator model)",
    )
    g.add_argument(
        "--tokenizer", metavar="DIR", help="tokenizer dir (default: the model's, or the one a server reports)"
    )
    g.add_argument(
        "--threads",
        type=COUNT,
        metavar="N",
        help="torch threads for the embedded model (default: OMP_NUM_THREADS if set, else all cores but one, "
        "so the engine's loop keeps a core)",
    )
    g.add_argument(
        "--batch-size", type=COUNT, default=64, metavar="N", help="max batch of the embedded model"
    )
    g.add_argument(
        "--device",
        help="the embedded model's device: cpu, cuda, cuda:1 (default: cuda if available); "
        "with --launch-sglang or --launch-vllm, cpu starts the engine's CPU backend",
    )
    g.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        help="the embedded model's dtype (default: auto, see backends/hf.py)",
    )
    g.add_argument(
        "--exact-logprobs",
        action="store_true",
        help="the embedded model recomputes each turn's logprobs alone, so they do not depend on what the row "
        "was batched with or on a resume: bit-identical on resume (costs one forward pass per turn)",
    )


def _watch_flags(g: argparse._ArgumentGroup) -> None:
    """What a run checks and traces while it runs."""
    g.add_argument("--check-tokens", action="store_true", help="compare ids with a full re-render")
    text = "when no row has changed state for this long, log the stuck rows (state, server, rid)"
    seconds_flag(g, "--watchdog", 90.0, text)
    g.add_argument(
        "--max-error-rate",
        type=float_in(0.0, 1.0),
        default=None,
        metavar="RATE",
        help="exit 1 when more than this share of rows end in error (the outputs are written anyway); "
        "overrides the spec's failures.max_error_rate (default 0.5)",
    )
    g.add_argument(
        "--otlp",
        type=otlp_endpoint,
        metavar="URL",
        help="export spans to an OTLP/HTTP endpoint (Jaeger :4318, Phoenix :6006; no scheme: http://)",
    )
    g.add_argument("--trace", choices=["console"], help="print spans to the console")
    g.add_argument(
        "--trace-sample",
        type=float_in(0.0, 1.0),
        metavar="P",
        help="share of trajectories traced, "
        "with --otlp, --trace or OTEL_EXPORTER_OTLP_ENDPOINT (default: 1.0)",
    )


def _durable_flags(p: argparse.ArgumentParser, workers: bool) -> None:
    """Resuming a run from its journal, and spreading rows over Ray (`workers`: Ray's `--workers`, which
    `gateway` leaves out: its own means processes)."""
    g = p.add_argument_group("resume and Ray")
    g.add_argument(
        "--resume",
        metavar="DIR",
        help="complete the run in DIR that a signal, kill -9 or a crash interrupted, from its journal.log "
        "(which names the spec; another one is refused); the outputs go to DIR",
    )
    g.add_argument(
        "--accept-changes",
        "--resume-other-weights",
        dest="accept_changes",
        action="store_true",
        help="with --resume: go on although what makes the rows changed since the run started (the model's "
        "weights, the servers' model or weight version, the code the spec names, --dtype, --device, "
        "--exact-logprobs, --check-tokens; refused otherwise), recording the changes in the journal",
    )
    g.add_argument(
        "--journal-sync",
        choices=("1s", "always", "off"),
        default="1s",
        help="when the run's journal reaches the disk: at most a second after each step (default: a power "
        "cut loses at most the last second), after every batch of steps, or when the OS decides (kill -9 "
        "loses nothing either way)",
    )
    g.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="spread rows over Ray actors (ADDRESS: a cluster to join; default: a local one)",
    )
    if workers:
        g.add_argument("--workers", type=COUNT, default=RAY_WORKERS, metavar="N", help="Ray actors")
    else:
        p.set_defaults(workers=RAY_WORKERS)  # Ray's actors, for --ray


def run_flags(p: argparse.ArgumentParser, workers: bool = True) -> None:
    """`agentfsm run SPEC`, its flags in groups by topic; `gateway` takes the same but Ray's `--workers`."""
    _rows_flags(p)
    _server_flags(p.add_argument_group("servers"))
    _model_flags(p.add_argument_group("embedded model"))
    _watch_flags(p.add_argument_group("checks and tracing"))
    _durable_flags(p, workers)


def gateway_flags(p: argparse.ArgumentParser) -> None:
    """`agentfsm gateway SPEC`: `run`'s flags, then where the gateway listens (fsm/gateway/serve.py)."""
    from fsm.cli.gateway_args import gateway_only_flags

    run_flags(p, workers=False)
    gateway_only_flags(p)


def render_flags(p: argparse.ArgumentParser) -> None:
    """`agentfsm render SPEC -o FILE`."""
    p.add_argument("spec", metavar="SPEC", help="the spec file (YAML)")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help="the diagram; its extension picks the format (.svg .png .pdf need Graphviz's dot)",
    )
    p.add_argument("--run", metavar="DIR", help="annotate with the run in DIR (its summary.json)")


def show_flags(p: argparse.ArgumentParser) -> None:
    """`agentfsm show RUN_DIR`."""
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="a directory `agentfsm run --out DIR` wrote (or its trajectories.jsonl)",
    )
    p.add_argument(
        "--row", type=int_in(0), metavar="INDEX", help="only the row with this index (all its samples)"
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--worst", action="store_true", help="lowest reward first")
    g.add_argument("--failed", action="store_true", help="only rows that ended in error")
    p.add_argument(
        "--limit",
        type=COUNT,
        metavar="N",
        help=f"print at most N transcripts (default: {SHOW_LIMIT} with --worst or --failed, else all)",
    )
    p.add_argument(
        "--journal",
        action="store_true",
        help="read the run's journal.log (the default for a run still running or that died)",
    )
    p.add_argument(
        "--spec",
        help="with a journal: the spec (default: the one the journal names, unless it lies in the run directory)",
    )


def replay_flags(p: argparse.ArgumentParser) -> None:
    """`agentfsm replay RUN_DIR --row INDEX`."""
    p.add_argument("run_dir", metavar="RUN_DIR", help="a directory `agentfsm run --out DIR` wrote")
    p.add_argument("--row", type=int_in(0), required=True, metavar="INDEX", help="the row (all its samples)")
    p.add_argument("--sample", type=int_in(0), metavar="K", help="only this sample of the row")
    p.add_argument("--spec", help="the spec (default: the one the journal names)")
    p.add_argument("--tokenizer", help="the tokenizer (default: the one the journal names)")


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


def dev_server_flags(p: argparse.ArgumentParser) -> None:
    """`agentfsm dev-server`."""
    p.add_argument("--model", metavar="DIR", help="model dir (default: the tiny calculator model)")
    p.add_argument("--scripted", action="store_true", help="a deterministic echo model, no weights")
    p.add_argument(
        "--scripted-tools",
        action="store_true",
        help="a scripted tool-calling model over --tokenizer, no weights: it writes a file with the harness's "
        "own write tool, then finishes (docs/gateway.md, 'Real size')",
    )
    p.add_argument(
        "--tokenizer", metavar="DIR", help="--scripted-tools: its tokenizer (default: the tiny model's)"
    )
    p.add_argument(
        "--script", metavar="FILE", help="--scripted-tools: a JSON list of steps (backends/scripted.py)"
    )
    p.add_argument(
        "--context-length",
        type=int_in(16),
        metavar="N",
        help="the longest context served (default: the model's, or 4096)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=PORT, default=30000, help="port to listen on")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, help="default: auto, see backends/hf.py")


COMMANDS: tuple[tuple[str, str, Callable[[argparse.ArgumentParser], None]], ...] = (
    ("validate", "check specs; prints path:line:col: code: message for each problem", validate_flags),
    ("schema", "write the JSON Schema of the spec format (editors use it for completion)", schema_flags),
    ("run", "run a spec over prompts and write the padded batch", run_flags),
    (
        "gateway",
        "run a harness spec (an agent in another framework) through the gateway: `run`'s flags, "
        "and where the gateway listens (docs/gateway.md)",
        gateway_flags,
    ),
    ("render", "draw a spec (.svg .png .pdf .dot .mmd), optionally annotated by a run", render_flags),
    ("show", "print a run's trajectories as transcripts", show_flags),
    (
        "replay",
        "rebuild a trajectory from a run's journal, without server or model: transcript, path, token check, "
        "reward recomputed",
        replay_flags,
    ),
    ("bench", "benchmarks that print numbers (JSON)", bench_flags),
    ("dev-server", "an SGLang-protocol server over the embedded model", dev_server_flags),
)  # each command: its name, its one-line help, what adds its flags


def command_line(
    commands: Mapping[str, Callable[[argparse.Namespace], int]], argv: Sequence[str] | None = None
) -> argparse.ArgumentParser:
    """The whole command line; `commands` maps each subcommand to the function that runs it (fsm/cli/commands.py).
    Given the `argv` it will parse, only the command named there gets its flags: parsing a run builds no
    other command's."""
    named = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    ap = Parser(
        prog="agentfsm",
        description="Declarative agent loops for RL rollouts.",
        formatter_class=Help,
        epilog="exit codes: 0 done; 1 a user error, or more error rows than --max-error-rate; 2 a bad "
        "command line or spec diagnostics; 130 interrupted",
    )
    ap.add_argument("--version", action="version", version=f"agentfsm {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text, add_flags in COMMANDS:
        p = sub.add_parser(
            name, help=text, description=text[0].upper() + text[1:] + ".", formatter_class=Help
        )
        if named in (None, name):
            add_flags(p)
        p.set_defaults(fn=commands[name])
    return ap
