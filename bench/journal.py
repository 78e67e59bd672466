"""What the run's journal (fsm/run/journal.py) costs: CPU per transition with and without it, and bytes per model
turn, on `bench engine`'s workload (the calculator spec's shape, a scripted model, the echo tool on the run's
loop, each model call taking MODEL_S) run through the continuous mode a kept run uses. Interleaved, median of `repeats`, CPU seconds of this
process (the journal's fsync thread included), so other load on the machine does not count.

CPU is not the whole cost: work the journal does on the event loop (encoding a record, an fsync there) delays
every row's next step, which CPU totals do not show. So each run also measures the loop's lateness: a task that
sleeps TICK_S at a time records how much later than asked it wakes; p50, p99 and the worst, in ms, per mode.
This is wall time, so a loaded machine inflates it; compare the modes within one run.

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
TICK_S = 0.005  # the lateness probe's sleep: short against a step, long against one callback
MODEL_S = 0.001  # each model call's latency (an instant one never yields: the whole run would be one stall)


async def _late(out: list[float]) -> None:
    """Sleep TICK_S again and again on the running loop, appending how many seconds late each wake-up came."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + TICK_S
        await asyncio.sleep(TICK_S)
        out.append(loop.time() - due)


async def _run(
    mode: str, n: int, tool_turns: int, path: Path, late: list[float]
) -> tuple[float, int, int, int]:
    """(CPU seconds, transitions, model turns, journal bytes) of one run of `n` trajectories; the loop's
    lateness during it appended to `late`."""
    agent = bench_agent(tool_turns, "none")
    codec, backend = _workload(tool_turns)
    backend._latency_s = (
        MODEL_S  # rows wait on their model calls and interleave on the loop, as against a server
    )
    runner = Runner(agent, backend, codec, max_concurrency=n)
    rows = [{"raw_prompt": [{"role": "user", "content": "hi"}]} for _ in range(n)]
    sampling = runner.make_context().sampling
    recorder = None
    async with Stream(runner, lambda: 0).serving() as stream, asyncio.TaskGroup() as tg:
        assert isinstance(stream, Stream)
        probe = tg.create_task(_late(late))
        t0 = time.process_time()
        try:
            if mode != "none":
                recorder = Recorder(Writer(path, mode))
                recorder.header({"agent": agent.name, "spec_hash": agent.hash, "rows_expected": n})
                stream.journal = recorder
            await stream.submit(rows, 1, sampling)
            groups = await stream.take(n)
            if recorder is not None:
                recorder.writer.close()
            elapsed = time.process_time() - t0
        finally:
            await asyncio.sleep(2 * TICK_S)  # the probe's last wake-up, late by whatever ran before it
            probe.cancel()
    trajs = [t for g in groups for t in g.trajectories]
    assert all(t.termination_reason == "done" for t in trajs), trajs[0].error
    transitions = sum(len(t.transitions_fired) for t in trajs)
    turns = sum(t.assistant_turns for t in trajs)
    return elapsed, transitions, turns, recorder.writer.bytes if recorder is not None else 0


def bench_journal(n: int = 1000, tool_turns: int = 4, repeats: int = 5) -> dict[str, Any]:
    """Median CPU per transition for each of MODES, the journal's overhead over none, and bytes per model turn."""
    times: dict[str, list[float]] = {m: [] for m in MODES}
    late: dict[str, list[float]] = {m: [] for m in MODES}
    transitions = turns = 0
    size: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="agentfsm-bench-journal-") as tmp:
        for _ in range(repeats):
            for mode in MODES:
                gc.collect()
                elapsed, transitions, turns, size[mode] = asyncio.run(
                    _run(mode, n, tool_turns, Path(tmp) / f"{mode}.log", late[mode])
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
            "loop_late_ms": _percentiles(late[mode]),
        }
    out["journal_bytes_per_trajectory"] = round(size["1s"] / n)
    out["journal_bytes_per_model_turn"] = round(size["1s"] / turns)
    print(
        f"bench journal: {n} trajectories, {tool_turns} tool turns, median of {repeats}: "
        + ", ".join(f"{m} {out[m]['us_per_transition']:.1f} µs" for m in MODES)
        + f" CPU per transition; {out['journal_bytes_per_model_turn']} bytes per model turn",
        file=sys.stderr,
    )
    print(
        f"bench journal: the loop's lateness (a {TICK_S * 1e3:g} ms sleep's wake-up), p50 / p99 / worst: "
        + ", ".join(
            f"{m} {d['p50']:.1f} / {d['p99']:.1f} / {d['max']:.1f} ms"
            for m in MODES
            for d in [out[m]["loop_late_ms"]]
        ),
        file=sys.stderr,
    )
    return out


def _percentiles(late: list[float]) -> dict[str, float]:
    """p50, p99 and the worst of the lateness samples, in ms (all repeats' samples together)."""
    ms = sorted(x * 1e3 for x in late) or [0.0]
    return {
        "p50": round(statistics.median(ms), 2),
        "p99": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
        "max": round(ms[-1], 2),
        "samples": len(late),
    }
