"""`agentfsm run --resume DIR`: the run's journal read and checked before anything starts (the spec it names, the
flags a resume ignores, the code the spec names), and a run killed before its first row started again. A run's
own resume (the engine restored from the journal) is every kept run's: fsm/output/keep.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fsm.cli.args import CLIError
from fsm.output.keep import SNAPSHOT


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
    from fsm.run.resume import ResumeRefused, changes, code_digests, judge

    if accept:
        return
    try:
        judge(path, changes(made_by, {"code": code_digests(agent)}), False)
    except ResumeRefused as exc:
        raise CLIError(str(exc)) from None


def _sampling(ident: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sampling a journal's `run` record names and its params, each {} where absent or malformed."""
    found = ident.get("sampling")
    sampling: dict[str, Any] = found if isinstance(found, dict) else {}
    return sampling, sampling["params"] if isinstance(sampling.get("params"), dict) else {}


def _flags_a_resume_ignores(args: argparse.Namespace, ident: dict[str, Any]) -> str | None:
    """A flag that shapes a new run's rows but not a resume's, given unlike the run's (the rows, their samples
    and their sampling come from the journal): one line naming it, else None. The same command line with
    --resume added passes."""
    sampling, params = _sampling(ident)
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


def start_over(args: argparse.Namespace, journal: Path) -> None:
    """A run killed between its journal's `run` record and its first group's did nothing: `--resume` starts it
    again into its directory, with the rows and sampling its `run` record names (the same run: its id too)."""
    from fsm.run.resume import read_identity

    ident = read_identity(journal)
    sampling, params = _sampling(ident)
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


def check_journal(args: argparse.Namespace, agent: Any) -> bool:
    """`run --resume DIR` once the spec has compiled: the journal read and checked now (but the tokenizer, at
    restore), refused before anything starts; True when the run there has completed (nothing to resume). A
    run that stopped before its first row goes on as a new run (`start_over`)."""
    from fsm.run.codec import SnapshotError
    from fsm.run.journal import JOURNAL
    from fsm.run.resume import load, refuse_unbegun

    journal = Path(args.resume) / JOURNAL
    try:
        loaded = load(journal, agent)
        if not loaded.data["groups"] and loaded.ended is None:
            start_over(args, journal)
            if args.resume is None:
                return False
        refuse_unbegun(loaded, journal)
    except SnapshotError as exc:
        raise CLIError(f"--resume: {exc}") from None
    if loaded.ended == "completed":  # killed after its files were whole: resuming it is done already
        print(
            f"agentfsm: --resume: {journal}: the run there has completed: nothing to resume (its files are whole)",
            file=sys.stderr,
        )
        return True
    if loaded.ended is not None:
        raise CLIError(f"--resume: {journal}: the run there has {loaded.ended}: nothing to resume")
    refuse_changed_code(journal, agent, loaded.made_by, args.accept_changes)
    args.resumed = loaded  # checked: the run goes on from it (fsm/output/keep.py `keep_rollout`)
    return False
