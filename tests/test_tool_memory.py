"""`isolation: thread` tools cut a long answer in their own thread, as the process lane cuts it in its worker
(issue 27.8): 50 MB answers were kept whole until the event loop cut them, 1.1 GB at 16 rows, 3.4 GB at 64.
Measured here with tracemalloc's peak over 16 rows of 4 MB answers (Python allocations only)."""

from __future__ import annotations

import tracemalloc

from tests.conftest import PARTS, model_turn, run_agent, scripted, tool_spec, tool_turn, user_row

ROWS, ANSWER = 16, 4_000_000


async def test_thread_lane_cuts_long_answers_before_they_reach_the_loop(tok, compile_yaml):
    tools = f"  - function: {PARTS}:long_text\n            isolation: thread\n            workers: {ROWS}"
    agent = compile_yaml(tool_spec(tools))
    backend = scripted([tool_turn(tok, ("long_text", {"n": ANSWER})), model_turn(tok, "ok")])
    tracemalloc.start()
    try:
        trajs = await run_agent(agent, backend, tok, [user_row(uid=f"r{i}") for i in range(ROWS)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert all(not t.failed for t in trajs), [t.termination_reason for t in trajs]
    assert peak < 4 * ANSWER, f"peak {peak / 2**20:.0f} MB for {ROWS} answers of {ANSWER / 2**20:.0f} MB"
