"""`python -m bench.sync_calls [ROUNDS]`: the CPU of a sync form (`flush_cache()`, `generate_sequences` of one row)
on its thread's kept loop (fsm/output/engine.py `SyncLoop`) against `asyncio.run` per call (3d80e5e to e66ced3),
alternated in one process over an instant echo backend; CPU µs per call (`time.process_time`: every thread).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from backends.scripted import echo_backend
from backends.tiny import ASSET_DIR
from fsm import RolloutEngine
from fsm.output.engine import BaseEngine
from specs.calculator import make_prompts


def _per_call(fn: Callable[[], Any], n: int) -> float:
    t = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t) / n * 1e6


def main(rounds: int = 3) -> dict[str, dict[str, float]]:
    kept = BaseEngine._run_sync
    ways: dict[str, Any] = {"asyncio.run": lambda self, coro: asyncio.run(coro), "kept loop": kept}
    got: dict[str, dict[str, list[float]]] = {w: {"flush_cache": [], "generate_sequences": []} for w in ways}
    try:
        with RolloutEngine("calculator", str(ASSET_DIR), backend=echo_backend()) as engine:
            rows = make_prompts(1)
            for r in range(rounds):  # the order swapped each round
                for way in list(ways)[:: 1 if r % 2 else -1]:
                    BaseEngine._run_sync = ways[way]  # type: ignore[method-assign]
                    got[way]["flush_cache"].append(_per_call(engine.flush_cache, 1000))
                    got[way]["generate_sequences"].append(
                        _per_call(lambda: engine.generate_sequences(rows), 100)
                    )
    finally:
        BaseEngine._run_sync = kept  # type: ignore[method-assign]
    return {w: {k: round(statistics.median(v), 1) for k, v in d.items()} for w, d in got.items()}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3), indent=1))
