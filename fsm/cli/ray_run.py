"""`agentfsm run --ray --out DIR` and the journal: the actors journal each chunk in flight under DIR/ray-journal
(fsm/adapters/ray_journal.py), so an actor that dies (`ray.kill`, `kill -9`, the OOM killer, a lost node with a
shared file system) has its trajectories go on from their last state boundary on another actor.

`--resume` of such a run is refused in one line: the chunks that came back are in the driver's memory only
(their journals are removed as they return), so a killed driver leaves nothing of the finished rows. A new
`--ray` run into DIR removes what a killed one left.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from fsm.cli.args import CLIError
from fsm.run.journal import JOURNAL
from fsm.run.signals import warn

RAY_JOURNAL = "ray-journal"  # under --out: one journal per chunk in flight


def refuse_resume(args: argparse.Namespace) -> None:
    """`--resume` of a Ray run, or with --ray: one line saying why not."""
    if args.ray is None and not (Path(args.resume) / RAY_JOURNAL).is_dir():
        return
    if args.ray is None and (Path(args.resume) / JOURNAL).is_file():  # a single-process run there since
        return
    raise CLIError(
        f"--resume {args.resume}: a --ray run cannot be resumed: its actors journal only the chunks in flight "
        f"({RAY_JOURNAL}/), the rows finished before lived in the driver; run it again (while a --ray run lives, "
        "a dead actor's rows go on from that journal), or resume a single-process run without --ray"
    )


def journal_dir(args: argparse.Namespace) -> Path:
    """DIR/ray-journal for `run --ray --out DIR`, emptied of what a killed --ray run left there (said once)."""
    path = Path(args.out) / RAY_JOURNAL
    left = sorted(path.glob("*.log")) if path.is_dir() else []
    if left:
        warn(
            f"{path}: removing {len(left)} chunk journal{'s' * (len(left) > 1)} a killed --ray run left "
            "(a --ray run cannot be resumed: docs/running.md)"
        )
        for p in left:
            p.unlink(missing_ok=True)
    return path


def ray_runner(args: argparse.Namespace, servers: list[str], tokenizer: str | None) -> Any:
    """The RayRunner `run --ray` asks for, its chunks journaled under --out."""
    from fsm.adapters.ray_runner import RayRunner

    return RayRunner(
        args.spec,
        tokenizer=tokenizer,
        servers=servers or None,
        workers=args.workers,
        address=args.ray or None,
        engine=args.engine,
        journal_dir=journal_dir(args),
        journal_sync=getattr(args, "journal_sync", "1s"),
    )


async def ray_rollout(
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
