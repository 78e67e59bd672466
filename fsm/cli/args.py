"""The command line of `agentfsm`: one function per command adds its flags (`run`'s in groups by topic;
`bench`'s and `dev-server`'s in fsm/cli/bundled.py), and `command_line` puts them under their commands.

Every numeric flag takes a range-checked type (`--concurrency 0`, `--temperature nan` are refused before anything
runs), a usage error is one line, help shows defaults, and every user error ends as one line (CLIError)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from fsm.run.signals import warn


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


COUNT = int_in(1)  # how many of something: at least one

PORT = int_in(1, 65535)


def seconds_flag(p: Any, flag: str, default: float | None, text: str) -> None:
    """A flag of a duration: seconds, more than 0."""
    p.add_argument(flag, type=float_in(0.0, above=True), default=default, metavar="SECONDS", help=text)


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


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit code `exit_code`."""

    exit_code = 1


class Interrupted(CLIError):
    exit_code = 130


DEMO_PROMPTS = 64  # `run` without --data or --num-prompts
SHOW_LIMIT = 5  # transcripts `show --worst/--failed` prints without --limit
RAY_WORKERS = 2  # `run --ray`'s actors without --workers

DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]  # the embedded model's (backends/hf.py)


def check_run_flags(args: argparse.Namespace) -> None:
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
    tracing = bool(args.otlp or args.trace or env_tracing())
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


def env_tracing() -> bool:
    """Whether the OTEL_* variables ask for OTLP export (read as the SDK reads them; with none set, nothing
    does, and the SDK is not imported)."""
    if not any(name.startswith("OTEL_") for name in os.environ):
        return False
    from fsm.telemetry.config import otlp_from_env

    return otlp_from_env()


def quiet_transformers() -> None:
    """No "Loading weights" progress bar or load-report chatter from transformers in our output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


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


Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def command_line(commands: Sequence[Command], argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; `commands`: each subcommand's name, one-line help, what adds its flags and what
    runs it (fsm/cli/commands.py). Given the `argv` it will parse, only the command named there gets its
    flags: parsing a run builds no other command's."""
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
    for name, text, add_flags, run in commands:
        p = sub.add_parser(
            name, help=text, description=text[0].upper() + text[1:] + ".", formatter_class=Help
        )
        if named in (None, name):
            add_flags(p)
        p.set_defaults(fn=run)
    return ap
