"""`agentfsm validate`, `schema`, `render` and `show`: the commands that read a spec or a run and print or draw
it (viz draws; nothing here runs a model). Errors end as one line (CLIError), as every command's do."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fsm.cli.args import SHOW_LIMIT, CLIError
from fsm.run.compile import compile_spec
from fsm.run.signals import warn

# --- validate / schema ---------------------------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    from fsm.run.compile import validate_file

    problems = 0
    for path in args.specs:
        diags = validate_file(path, static=args.static)
        for d in diags:
            print(d)
        errors = sum(d.severity == "error" for d in diags)
        problems += errors
        if not errors and not args.quiet:
            warned = f" ({len(diags)} warning{'s' * (len(diags) > 1)})" if diags else ""
            print(f"{path}: ok{warned}{_tree_size(path)}")
    return 2 if problems else 0  # as `run` exits on the same diagnostics


def _tree_size(path: str) -> str:
    """What one tree of a valid spec can expand to (fsm/run/tree.py `tree_size`), for `validate`'s ok line."""
    from fsm.run.tree import tree_size
    from fsm.spec.loader import load_spec

    size = tree_size(load_spec(path).spec)
    return "" if size is None else f"; a tree: up to {size} nodes, the root included"


def cmd_schema(args: argparse.Namespace) -> int:
    from fsm.spec.model import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as exc:
            raise CLIError(f"-o {args.output}: cannot write it ({exc.strerror or exc})") from None
    else:
        sys.stdout.write(text)
    return 0


# --- render / show -------------------------------------------------------------------------------------


def same_spec(run: str, spec_path: str, agent: Any) -> None:
    """A run drawn over another spec's diagram would put its counts on edges it never took: refused; over its
    own spec edited since, a warning (the counts are the run's, the edges today's)."""
    path = Path(run) / "summary.json" if Path(run).is_dir() else Path(run)
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # load_run_stats says what is wrong with it
    if not isinstance(summary, dict) or summary.get("spec_hash") in (None, agent.hash):
        return
    ran, spec = str(summary["spec_hash"]), summary.get("spec")
    if spec and Path(spec).resolve() != Path(spec_path).resolve():
        raise CLIError(
            f"--run {run}: that run is of another spec ({spec}), not {spec_path}; render the run "
            "with its own spec"
        )
    warn(
        f"--run {run}: {spec_path} changed since that run (spec hash {ran[:12]}, now {agent.hash[:12]}); "
        "its counts are drawn on today's edges"
    )


def cmd_render(args: argparse.Namespace) -> int:
    from fsm.output.rundir import load_run_stats
    from viz.diagram import RenderError, render

    agent = compile_spec(args.spec)
    if args.run:
        same_spec(args.run, args.spec, agent)
    try:
        stats = load_run_stats(args.run) if args.run else None
    except json.JSONDecodeError as exc:
        raise CLIError(
            f"--run {args.run}: its summary.json is not JSON ({exc.msg}, line {exc.lineno})"
        ) from None
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    try:
        # `-o diagrams/agent.svg` on a fresh checkout
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        render(agent, args.output, run_stats=stats)
    except RenderError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"-o {args.output}: cannot write it ({exc.strerror or exc})") from None
    print(args.output)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """A run's transcripts: its trajectories.jsonl, or (a run still running or that died, `--journal`) its
    journal's trajectories, finished and in flight (fsm/cli/replay.py)."""
    from fsm.run.journal import JOURNAL, ended
    from viz.transcript import show

    limit = args.limit
    if limit is None and (args.worst or args.failed):
        limit = SHOW_LIMIT
    run_dir, tmp = Path(args.run_dir), None
    journal = run_dir / JOURNAL if run_dir.is_dir() else None
    if journal is not None and journal.is_file() and (args.journal or ended(journal) is None):
        from fsm.cli.replay import show_journal

        run_dir = tmp = show_journal(Path(args.run_dir), args.spec)
    elif args.journal:
        raise CLIError(f"{args.run_dir}: no {JOURNAL} there")
    try:
        show(run_dir, row=args.row, worst=args.worst, failed=args.failed, limit=limit)
    except (FileNotFoundError, LookupError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return 0
