"""What the run's journal (fsm/run/journal.py) costs: CPU per transition with and without it, and bytes per model
turn, on `bench engine`'s workload (the calculator spec's shape, a scripted model, the echo tool on the run's
loop) run through the continuous mode a kept run uses. Interleaved, median of `repeats`, CPU seconds of this
process (the journal's fsync thread included), so other load on the machine does not count.

    agentfsm bench journal
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.engine import _workload, bench_agent
from fsm.run.journal import Recorder, Writer
from fsm.run.runtime import Runner
from fsm.run.stream import Stream

MODES = ("none", "off", "1s", "always")  # no journal; a journal with each durability setting


async def _run(mode: str, n: int, tool_turns: int, path: Path) -> tuple[float, int, int, int]:
    """(CPU seconds, transitions, model turns, journal bytes) of one run of `n` trajectories."""
    agent = bench_agent(tool_turns, "none")
    codec, backend = _workload(tool_turns)
    runner = Runner(agent, backend, codec, max_concurrency=n)
    rows = [{"raw_prompt": [{"role": "user", "content": "hi"}]} for _ in range(n)]
    sampling = runner.make_context().sampling
    recorder = None
    async with Stream(runner, lambda: 0).serving() as stream:
        assert isinstance(stream, Stream)
        t0 = time.process_time()
        if mode != "none":
            recorder = Recorder(Writer(path, mode))
            recorder.header({"agent": agent.name, "spec_hash": agent.hash, "rows_expected": n})
            stream.journal = recorder
        await stream.submit(rows, 1, sampling)
        groups = await stream.take(n)
        if recorder is not None:
            recorder.writer.close()
        elapsed = time.process_time() - t0
    trajs = [t for g in groups for t in g.trajectories]
    assert all(t.termination_reason == "done" for t in trajs), trajs[0].error
    transitions = sum(len(t.transitions_fired) for t in trajs)
    turns = sum(t.assistant_turns for t in trajs)
    return elapsed, transitions, turns, recorder.writer.bytes if recorder is not None else 0


def bench_journal(n: int = 1000, tool_turns: int = 4, repeats: int = 5) -> dict[str, Any]:
    """Median CPU per transition for each of MODES, the journal's overhead over none, and bytes per model turn."""
    times: dict[str, list[float]] = {m: [] for m in MODES}
    transitions = turns = 0
    size: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="agentfsm-bench-journal-") as tmp:
        for _ in range(repeats):
            for mode in MODES:
                gc.collect()
                elapsed, transitions, turns, size[mode] = asyncio.run(
                    _run(mode, n, tool_turns, Path(tmp) / f"{mode}.log")
                )
                times[mode].append(elapsed)
    out: dict[str, Any] = {
        "trajectories": n,
        "tool_turns": tool_turns,
        "transitions_per_trajectory": transitions // n,
        "model_turns_per_trajectory": turns // n,
        "repeats": repeats,
    }
    base = statistics.median(times["none"])
    for mode in MODES:
        med = statistics.median(times[mode])
        out[mode] = {
            "median_cpu_s": round(med, 4),
            "us_per_transition": round(med / transitions * 1e6, 2),
            "overhead_us_per_transition": round((med - base) / transitions * 1e6, 2),
            "overhead_pct": round((med / base - 1) * 100, 1),
        }
    out["journal_bytes_per_trajectory"] = round(size["1s"] / n)
    out["journal_bytes_per_model_turn"] = round(size["1s"] / turns)
    print(
        f"bench journal: {n} trajectories, {tool_turns} tool turns, median of {repeats}: "
        + ", ".join(f"{m} {out[m]['us_per_transition']:.1f} µs" for m in MODES)
        + f" CPU per transition; {out['journal_bytes_per_model_turn']} bytes per model turn",
        file=sys.stderr,
    )
    return out
