"""The command line of `agentfsm`: every subcommand and flag (`command_line`), range-checked number types,
usage errors as one line, and help that shows defaults. Every numeric flag takes one of these types, so a value out of range (`--concurrency 0`,
`--num-prompts -1`, `--trace-sample 2`, `--temperature nan`) is refused before anything runs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from typing import Any, NoReturn


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be an integer {_bounds(lo, hi)}, got {value}")
        return value

    return parse


def float_in(lo: float, hi: float | None = None, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= lo (> lo with `above`), <= hi."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if (
            not math.isfinite(value)
            or value < lo
            or (above and value == lo)
            or (hi is not None and value > hi)
        ):
            bound = f"> {lo:g}" if above else _bounds(lo, hi)
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text}")
        return value

    return parse


def server_url(text: str) -> str:
    """An argparse type: an http(s) URL; `localhost:30000` gets the line that fixes it."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL; did you mean http://{text}?")
    if scheme not in ("http", "https") or not rest.strip("/"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected an http:// or https:// URL such as http://localhost:30000"
        )
    return text


def otlp_endpoint(text: str) -> str:
    """An argparse type: --otlp's endpoint, checked when the flags are read (not after the model loads);
    `localhost:4318` is http://localhost:4318, as the SDK reads OTEL_EXPORTER_OTLP_ENDPOINT."""
    from fsm.telemetry.export import otlp_url

    try:
        return otlp_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bounds(lo: float, hi: float | None) -> str:
    return f">= {lo:g}" if hi is None else f"from {lo:g} to {hi:g}"


DEMO_PROMPTS = 64  # `run` without --data or --num-prompts
SHOW_LIMIT = 5  # transcripts `show --worst/--failed` prints without --limit
COUNT = int_in(1)  # how many of something: at least one
PORT = int_in(1, 65535)


class Parser(argparse.ArgumentParser):
    """Usage errors as one line (argparse prints the whole usage first). `checks`: what no single flag can
    check alone (flags that cannot go together), each a function of the parsed flags that returns the problem
    or None, reported as any usage error."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.checks: list[Callable[[argparse.Namespace], str | None]] = []

    def parse_known_args(  # type: ignore[override]  # one signature for argparse's overloads
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        for check in self.checks:
            if problem := check(parsed):
                self.error(problem)
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" where there is a default worth showing (not None, not a False switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# --- parser --------------------------------------------------------------------------------------------


DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]  # the embedded model's (backends/hf.py)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentfsm")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def command_line(commands: Mapping[str, Callable[[argparse.Namespace], int]]) -> argparse.ArgumentParser:
    """The whole command line; `commands` maps each subcommand to the function that runs it (fsm/cli/commands.py)."""
    ap = Parser(
        prog="agentfsm",
        description="Declarative agent loops for RL rollouts.",
        formatter_class=Help,
        epilog="exit codes: 0 done; 1 a user error, or more error rows than --max-error-rate; 2 a bad "
        "command line or spec diagnostics; 130 interrupted",
    )
    ap.add_argument("--version", action="version", version=f"agentfsm {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=text, description=text[0].upper() + text[1:] + ".", formatter_class=Help
        )

    p = command("validate", "check specs; prints path:line:col: code: message for each problem")
    p.add_argument("specs", nargs="+", metavar="SPEC", help="spec files (YAML)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only problems (no 'SPEC: ok')")
    p.add_argument(
        "--static",
        action="store_true",
        help="import nothing the spec names (for editors and CI on unvetted specs): schema, graph and "
        "built-in names; import paths checked for form and the deny-list only",
    )
    p.set_defaults(fn=commands["validate"])

    p = command("schema", "write the JSON Schema of the spec format (editors use it for completion)")
    p.add_argument("-o", "--output", metavar="FILE", help="write it here (default: print it)")
    p.set_defaults(fn=commands["schema"])

    p = command("run", "run a spec over prompts and write the padded batch")
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
        "--server",
        action="append",
        type=server_url,
        metavar="URL",
        help="SGLang, vLLM or dev server URL; repeat for a fleet (one engine kind)",
    )
    p.add_argument(
        "--engine",
        choices=["sglang", "vllm"],
        help="what the servers run (default: ask them; the dev server speaks SGLang's protocol)",
    )
    p.add_argument(
        "--launch-sglang",
        metavar="MODEL",
        help="launch SGLang servers for MODEL first (GPU hosts, or --device cpu); logs go to DIR/sglang_logs",
    )
    p.add_argument(
        "--sglang-python",
        metavar="PATH",
        help="the interpreter that has sglang, for --launch-sglang "
        "(default: $AGENTFSM_SGLANG_PYTHON, else this one)",
    )
    p.add_argument(
        "--launch-vllm",
        metavar="MODEL",
        help="launch vLLM servers for MODEL first (GPU hosts, or --device cpu); logs go to DIR/vllm_logs",
    )
    p.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="the interpreter that has vllm, for --launch-vllm "
        "(default: $AGENTFSM_VLLM_PYTHON, else this one)",
    )
    p.add_argument("--dp", type=COUNT, default=1, metavar="N", help="data-parallel replicas to launch")
    p.add_argument(
        "--tp", type=COUNT, default=1, metavar="N", help="tensor-parallel GPUs per launched replica"
    )
    p.add_argument("--port", type=PORT, default=30000, help="first port for launched servers")
    p.add_argument(
        "--model",
        metavar="DIR",
        help="model dir for the embedded backend (default: the tiny calculator model)",
    )
    p.add_argument(
        "--tokenizer", metavar="DIR", help="tokenizer dir (default: the model's, or the one a server reports)"
    )
    p.add_argument(
        "--group-affinity",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="route a GRPO group's samples to one server, sharing their prompt's cache (default: on, as the "
        "Python API)",
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
        "--threads",
        type=COUNT,
        metavar="N",
        help="torch threads for the embedded model (default: OMP_NUM_THREADS if set, else all cores but one, "
        "so the engine's loop keeps a core)",
    )
    p.add_argument(
        "--batch-size", type=COUNT, default=64, metavar="N", help="max batch of the embedded model"
    )
    p.add_argument(
        "--device",
        help="the embedded model's device: cpu, cuda, cuda:1 (default: cuda if available); "
        "with --launch-sglang or --launch-vllm, cpu starts the engine's CPU backend",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        help="the embedded model's dtype (default: auto, see backends/hf.py)",
    )
    p.add_argument("--check-tokens", action="store_true", help="compare ids with a full re-render")
    p.add_argument(
        "--request-timeout",
        type=float_in(0.0, above=True),
        metavar="SECONDS",
        help="seconds per request attempt to a server (default: the backend's)",
    )
    p.add_argument(
        "--watchdog",
        type=float_in(0.0, above=True),
        default=90.0,
        metavar="SECONDS",
        help="when no row has changed state for this long, log the stuck rows (state, server, rid)",
    )
    p.add_argument(
        "--strict-servers",
        action="store_true",
        help="refuse to start when any --server is down or malformed (default: leave it out, warn)",
    )
    p.add_argument(
        "--retry-window",
        type=float_in(0.0),
        default=60.0,
        metavar="SECONDS",
        help="while every server fails, keep failing over for this long before a row errs (default 60)",
    )
    p.add_argument(
        "--max-error-rate",
        type=float_in(0.0, 1.0),
        default=None,
        metavar="RATE",
        help="exit 1 when more than this share of rows end in error (the outputs are written anyway); "
        "overrides the spec's failures.max_error_rate (default 0.5)",
    )
    p.add_argument(
        "--otlp",
        type=otlp_endpoint,
        metavar="URL",
        help="export spans to an OTLP/HTTP endpoint (Jaeger :4318, Phoenix :6006; no scheme: http://)",
    )
    p.add_argument("--trace", choices=["console"], help="print spans to the console")
    p.add_argument(
        "--trace-sample",
        type=float_in(0.0, 1.0),
        metavar="P",
        help="share of trajectories traced, "
        "with --otlp, --trace or OTEL_EXPORTER_OTLP_ENDPOINT (default: 1.0)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="spread rows over Ray actors (ADDRESS: a cluster to join; default: a local one)",
    )
    p.add_argument("--workers", type=COUNT, default=2, metavar="N", help="Ray actors")
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="complete the run in DIR that a signal, kill -9 or a crash interrupted, from its journal.log "
        "(which names the spec; another one is refused); the outputs go to DIR",
    )
    p.add_argument(
        "--accept-changes",
        "--resume-other-weights",
        dest="accept_changes",
        action="store_true",
        help="with --resume: go on although what makes the rows changed since the run started (the model's "
        "weights, the servers' model or weight version, the code the spec names, --dtype, --device, "
        "--check-tokens; refused otherwise), recording the changes in the journal",
    )
    p.add_argument(
        "--journal-sync",
        choices=("1s", "always", "off"),
        default="1s",
        help="when the run's journal reaches the disk: at most a second after each step (default: a power "
        "cut loses at most the last second), after every batch of steps, or when the OS decides (kill -9 "
        "loses nothing either way)",
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="print only errors, warnings and the final 'wrote ...' line",
    )
    p.set_defaults(fn=commands["run"])
    run_parser = p

    p = command(
        "gateway",
        "run a harness spec (an agent in another framework) through the gateway: `run`'s flags, "
        "and where the gateway listens (docs/gateway.md)",
    )
    for act in run_parser._actions[1:]:  # every flag of `run` (but Ray's --workers), then the gateway's own
        if act.dest != "workers":
            p._add_action(act)
    p.set_defaults(workers=run_parser.get_default("workers"))  # Ray's actors, for --ray
    from fsm.gateway.serve import add_arguments

    add_arguments(p)
    p.set_defaults(fn=commands["gateway"])

    p = command("render", "draw a spec (.svg .png .pdf .dot .mmd), optionally annotated by a run")
    p.add_argument("spec", metavar="SPEC", help="the spec file (YAML)")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help="the diagram; its extension picks the format (.svg .png .pdf need Graphviz's dot)",
    )
    p.add_argument("--run", metavar="DIR", help="annotate with the run in DIR (its summary.json)")
    p.set_defaults(fn=commands["render"])

    p = command("show", "print a run's trajectories as transcripts")
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
    p.set_defaults(fn=commands["show"])

    p = command(
        "replay",
        "rebuild a trajectory from a run's journal, without server or model: transcript, path, token check, "
        "reward recomputed",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a directory `agentfsm run --out DIR` wrote")
    p.add_argument("--row", type=int_in(0), required=True, metavar="INDEX", help="the row (all its samples)")
    p.add_argument("--sample", type=int_in(0), metavar="K", help="only this sample of the row")
    p.add_argument("--spec", help="the spec (default: the one the journal names)")
    p.add_argument("--tokenizer", help="the tokenizer (default: the one the journal names)")
    p.set_defaults(fn=commands["replay"])

    p = command("bench", "benchmarks that print numbers (JSON)")
    p.add_argument(
        "what",
        choices=[
            "engine",
            "router",
            "hf",
            "prefix-cache",
            "tracing",
            "ray",
            "faults",
            "async",
            "families",
            "collate",
            "vs-verl",
            "engines",
            "gateway",
            "fleet",
            "trees",
            "journal",
        ],
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
        action="append",
        metavar="N",
        help="engines: also run the load split over N processes (repeatable: --processes 1 --processes 2)",
    )
    p.add_argument(
        "--tool-turns", type=int_in(0), default=4, metavar="N", help="engine: tool turns per trajectory"
    )
    p.add_argument(
        "--repeats", type=COUNT, default=3, metavar="N", help="engine, tracing: repeats (the median is kept)"
    )
    p.add_argument("--model", metavar="DIR", help="hf: model dir (default: the tiny model)")
    p.add_argument(
        "--server",
        action="append",
        type=server_url,
        metavar="URL",
        help="engines: a server serving the tiny model (SGLang, vLLM or dev); two or more, run in turn; "
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
        choices=["calculator", "long", "groups", "skewed", "crowded"],
        help="fleet: replay only these generated shapes (repeatable; default: all five)",
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
    p.add_argument(
        "--workload",
        choices=["engine", "calculator", "contexts", "embedded"],
        default="engine",
        help="engine: calculator is specs/calculator.yaml's prompt, tool and answer with a replayed model "
        "(CPU per trajectory at --n in flight); contexts: the template context policy's CPU per "
        "model turn against append's on the same calculator conversation (--n default 500); tracing: engine, calculator, or embedded "
        "(`agentfsm run specs/calculator.yaml` without and with --otlp, alternated)",
    )
    p.set_defaults(fn=commands["bench"])

    p = command("dev-server", "an SGLang-protocol server over the embedded model")
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
    p.set_defaults(fn=commands["dev-server"])
    return ap
