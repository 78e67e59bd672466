"""bench/journal.py: CPU per transition per durability mode, and the loop's lateness (loop stalls), which CPU
totals do not show."""

from __future__ import annotations

import asyncio
import time

from bench.journal import MODES, TICK_S, _late, bench_journal


def test_the_lateness_probe_sees_a_stalled_loop():
    """A callback that holds the loop 60 ms shows as one wake-up at least ~60 ms late; the others are not."""

    async def main() -> list[float]:
        late: list[float] = []
        async with asyncio.TaskGroup() as tg:
            probe = tg.create_task(_late(late))
            await asyncio.sleep(4 * TICK_S)
            time.sleep(0.06)  # the stall: nothing else on this loop runs meanwhile
            await asyncio.sleep(4 * TICK_S)
            probe.cancel()
        return late

    late = asyncio.run(main())
    assert max(late) >= 0.05 and sorted(late)[len(late) // 2] < 0.05


def test_bench_journal_reports_loop_stalls_per_mode(capsys):
    out = bench_journal(n=20, tool_turns=1, repeats=1)
    for mode in MODES:
        late = out[mode]["loop_late_ms"]
        assert late["samples"] > 0 and 0 <= late["p50"] <= late["p99"] <= late["max"], mode
    assert "the loop's lateness" in capsys.readouterr().err
