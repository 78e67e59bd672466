"""How `agentfsm` meets its user: flags checked as they come in, and how a command ends.

Every numeric flag takes a range-checked type (`--concurrency 0`, `--temperature nan` are refused before anything
runs), a usage error is one line, help shows defaults (the parser, fsm/cli/args.py's building blocks). Every user
error ends as one line (CLIError), a signal after the command has ended exits at once with the command's code, a
stdout that a tool may have closed costs only the printout, and `run --resume` reads the journal first. A run's
own signals, snapshot and files are every kept run's (fsm/run/signals.py, fsm/output/keep.py). fsm/cli/commands.py
composes these."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import math
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from fsm.output.keep import SNAPSHOT


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


def to_stdout(show: Callable[[], None]) -> None:
    """Print to stdout, which a tool may have closed (or a reader gone): the outputs are on disk already, so
    a broken stdout costs the printout, never the run."""
    try:
        show()
        sys.stdout.flush()
    except (OSError, ValueError):
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (lives until exit: nothing else flushes to fd 1)


def journal_spec(journal: Path, named: Any, what_to_do: str) -> str:
    """The spec a journal names, which compiling imports the code of: one inside the run directory is refused
    (a run directory from elsewhere may ship a spec and its modules, and reading or resuming a run must not
    run them); the user's own `--spec` (or `run SPEC --resume`) is never checked here: naming it asks for it."""
    if not isinstance(named, str) or not Path(named).is_file():
        raise CLIError(f"{journal} names the spec {named!r}, which is not there; {what_to_do}")
    if Path(named).resolve().is_relative_to(journal.parent.resolve()):
        raise CLIError(
            f"{journal} names the spec {named}, inside the run directory: its code is not imported unless you "
            f"name it yourself ({what_to_do}, if you trust it)"
        )
    return named


def resume_spec(args: argparse.Namespace) -> None:
    """`run --resume DIR` needs no spec: the journal's first record names it; one given must be the one it was
    written with (checked by hash when the journal is read). An old snapshot.json is refused in one line."""
    from fsm.run.journal import JOURNAL, JournalError
    from fsm.run.resume import read_identity

    path = Path(args.resume) / JOURNAL
    if not path.is_file():
        if path.exists() or path.is_symlink():  # a FIFO, a directory, a link: never opened
            raise CLIError(f"--resume: {path}: not a regular file; remove it")
        if (Path(args.resume) / SNAPSHOT).is_file():
            raise CLIError(
                f"--resume: {Path(args.resume) / SNAPSHOT}: a snapshot of an agentfsm before the journal; "
                "this version cannot resume it: resume it with the version that wrote it, or start the run again"
            )
        raise CLIError(
            f"--resume {args.resume}: no {JOURNAL} there (every `agentfsm run --out DIR` writes one)"
        )
    try:
        ident = read_identity(path)
    except JournalError as exc:
        raise CLIError(f"--resume: {exc}") from None
    named, run_id = ident.get("spec"), ident.get("run_id")
    if not isinstance(run_id, str) or not 0 < len(run_id) <= 64:
        raise CLIError(f"--resume: {path}: record 1: run_id is not a run's id")
    if args.spec is None:  # the journal's, checked before compiling it imports any code (fsm/cli/replay.py)
        try:
            args.spec = journal_spec(
                path, named, f"pass the spec too: agentfsm run SPEC --resume {args.resume}"
            )
        except CLIError as exc:
            raise CLIError(f"--resume: {exc}") from None
    args.run_id = run_id
    if (ignored := _flags_a_resume_ignores(args, ident)) is not None:
        raise CLIError(f"resume refused: {path}: {ignored}")


def refuse_changed_code(path: Path, agent: Any, made_by: dict[str, Any] | None, accept: bool) -> None:
    """The code the spec names checked against the journal's before a model loads (the model and the engine's
    options are checked once the engine has started: fsm/output/keep.py): CLIError `resume refused: ...`."""
    from fsm.run.provenance import ResumeRefused, changes, code_digests, judge

    if accept:
        return
    try:
        judge(path, changes(made_by, {"code": code_digests(agent)}), False)
    except ResumeRefused as exc:
        raise CLIError(str(exc)) from None


def _flags_a_resume_ignores(args: argparse.Namespace, ident: dict[str, Any]) -> str | None:
    """A flag that shapes a new run's rows but not a resume's, given unlike the run's (the rows, their samples
    and their sampling come from the journal): one line naming it, else None. The same command line with
    --resume added passes."""
    found = ident.get("sampling")
    sampling: dict[str, Any] = found if isinstance(found, dict) else {}
    params: dict[str, Any] = sampling["params"] if isinstance(sampling.get("params"), dict) else {}
    data = args.data and str(Path(args.data).resolve())
    groups = ident.get("groups") if isinstance(ident.get("groups"), int) else 0
    # --num-prompts N of a --data file with fewer rows made fewer groups: only fewer than the run's is unlike it
    fewer = args.num_prompts is not None and (not data or args.num_prompts < groups)
    given = [
        ("--temperature", args.temperature, params.get("temperature"), args.temperature is not None),
        ("--seed", args.seed, sampling.get("seed"), args.seed != 0),  # 0: the flag's default
        ("--n", args.n, ident.get("n"), args.n != 1),
        ("--data", data, ident.get("data"), bool(data)),
        ("--num-prompts", args.num_prompts, ident.get("groups"), fewer),
    ]
    for flag, ours, theirs, set_ in given:
        if set_ and ours != theirs:
            return (
                f"{flag} {ours}, but the run's is {theirs} (a resume goes on with the run's own rows, samples and "
                f"sampling); drop {flag}, or start a new run"
            )
    return None


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


# --- what a finished run says about its failed rows ---------------------------------------------------------

# what differs between rows of one cause: ids, counts, ports
_ID = re.compile(r"[0-9A-Za-z_-]*\d[0-9A-Za-z_-]*")
GATEWAY_EXTRA = ("openai", "anthropic", "agents", "langgraph", "langchain_openai")  # pyproject's [gateway]


def failure_cause(traj: Any) -> str | None:
    """Why a row failed, one line: its error, or how its harness failed (the harness's own error line: a
    gateway row ends `harness_failed` with no engine error); None for a row that did not fail."""
    if traj.error:
        return " ".join(traj.error.split())
    from fsm.output.stats import harness_failure

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


def start_over(args: argparse.Namespace, journal: Path) -> None:
    """A run killed between its journal's `run` record and its first group's did nothing: `--resume` starts it
    again into its directory, with the rows and sampling its `run` record names (the same run: its id too)."""
    from fsm.run.resume import read_identity

    ident = read_identity(journal)
    found = ident.get("sampling")
    sampling: dict[str, Any] = found if isinstance(found, dict) else {}
    params: dict[str, Any] = sampling["params"] if isinstance(sampling.get("params"), dict) else {}
    data, groups, n = ident.get("data"), ident.get("groups"), ident.get("n")
    if not (isinstance(groups, int) and groups > 0 and isinstance(n, int) and n > 0):
        return  # not a run record this version wrote: refused as nothing to resume
    args.data = data if isinstance(data, str) else args.data
    args.num_prompts, args.n = groups, n
    if isinstance(sampling.get("seed"), int):
        args.seed = sampling["seed"]
    if isinstance(params.get("temperature"), (int, float)):
        args.temperature = float(params["temperature"])
    print(
        f"agentfsm: --resume: {journal}: the run stopped before its first row was recorded: starting it again",
        file=sys.stderr,
    )
    args.resume = None


def run_locked(
    args: argparse.Namespace,
    rows: list[dict[str, Any]] | None,
    out: Path,
    console_cls: Any,
    rollout: Callable[..., Any],
) -> int:
    """`run` under the lock on its --out: roll the rows out (`rollout`), write the outputs, print the summary,
    and end by the failure budget (`error_budget`)."""
    from fsm.output.keep import RunDir, close_journal
    from fsm.run.signals import term_is_ctrl_c, warn

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
