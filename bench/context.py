"""CPU per model call as the context grows (issue 49): is a call at turn 1,000 as cheap as one at turn 1?

A trajectory of the calculator spec over the tiny tokenizer's ids: a 438-token prompt, then per turn 20 generated
tokens and a 200-token tool answer. At each measured turn a fresh trajectory is grown to that size, one call is
made untimed (the previous turn's: whatever the engine keeps from call to call is as a run leaves it), one turn is
appended and the next call is timed with `time.process_time`: the engine's own request path
(`fsm.run.actions._resumed_turn`: the context, the request, the client, the answer's checks). Two servers:

- `http`: an SGLang client against the scripted dev server in a subprocess (its CPU is not counted);
- `inproc`: an in-process backend that answers at once (no HTTP): the engine's side alone.

The file reads only what the base commit e42daaf has too, so the same file measures the old build:
`PYTHONPATH=/tmp/base python bench/context.py` (a `git worktree add /tmp/base e42daaf`), alternated with this
tree's in one session. Run as a script: `python bench/context.py [--turns 1,100,1000] [--calls 15]`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PROMPT_TOKENS, GENERATED, ANSWER_TOKENS = 438, 20, 200


def _ids(n: int, start: int) -> list[int]:
    """`n` plain ids of the tiny tokenizer's vocabulary (10-500), varied so no run of them repeats."""
    return [10 + (start + 7 * k) % 490 for k in range(n)]


@contextmanager
def _server() -> Iterator[str]:
    """The scripted dev server (`python -m backends.devserver --scripted`) in a subprocess, with room for the
    longest context measured; its URL once it answers /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "backends.devserver", "--scripted", "--port", str(port)]
    cmd += ["--context-length", "1000000", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


async def _measure(backend: Any, turns: list[int], calls: int) -> dict[str, float]:
    from transformers import AutoTokenizer

    from backends.tiny import ASSET_DIR
    from fsm.run.actions import _resumed_turn
    from fsm.run.compile import compile_spec
    from fsm.run.runtime import Runner
    from fsm.run.trajectory import Trajectory

    repo = Path(__file__).resolve().parent.parent
    agent = compile_spec(repo / "specs/calculator.yaml")
    tok = AutoTokenizer.from_pretrained(str(ASSET_DIR))
    ctx = Runner(agent, backend, tok).make_context()
    params = {**ctx.sampling.params, "max_new_tokens": 16}
    out: dict[str, float] = {}
    for k in turns:
        samples = []
        for c in range(calls):
            traj = Trajectory(0, 0, f"b{k}_{c}", f"u{k}_{c}", {}, "generating")
            traj.prompt_ids.extend(_ids(PROMPT_TOKENS, c))
            for t in range(k):
                traj.append_generated(_ids(GENERATED, t), [-0.5] * GENERATED, 0)
                traj.append_context(_ids(ANSWER_TOKENS, t + 1), "tool")
                if t == k - 2:  # the previous call, untimed, with the context as it had then
                    await _resumed_turn(ctx, traj, params, f"b{k}_{c}_t{t:02d}")
            gc.collect()
            t0 = time.process_time()
            await _resumed_turn(ctx, traj, params, f"b{k}_{c}_t{k:02d}")
            samples.append(time.process_time() - t0)
            del traj
        out[f"turn {k} ({PROMPT_TOKENS + k * (GENERATED + ANSWER_TOKENS)} tokens) ms"] = round(
            statistics.median(samples) * 1e3, 3
        )
    return out


def bench_context(turns: list[int], calls: int = 15) -> dict[str, Any]:
    """Median CPU ms per call at each turn, over HTTP and in process (module docstring)."""
    from backends.base import BaseBackend, GenerateResult
    from backends.sglang import SGLangBackend

    class Instant(BaseBackend):
        provider, model_name = "scripted", "instant"

        async def generate(self, request: Any) -> GenerateResult:
            ids = _ids(8, 3) + [2]
            return GenerateResult(
                ids, [-0.5] * len(ids), "stop", len(request.prompt_ids), 0, server="instant"
            )

    async def http(url: str) -> dict[str, float]:
        client = SGLangBackend(url)
        await client.start()
        try:
            return await _measure(client, turns, calls)
        finally:
            await client.close()

    with _server() as url:
        result = {"http": asyncio.run(http(url))}
    result["inproc"] = asyncio.run(_measure(Instant(), turns, calls))
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", default="1,100,1000", help="comma-separated turns to measure")
    ap.add_argument("--calls", type=int, default=15, help="timed calls per turn (the median is reported)")
    args = ap.parse_args()
    print(json.dumps(bench_context([int(t) for t in args.turns.split(",")], args.calls)))
