"""`agentfsm bench collate`: what padding a batch costs next to copying its bytes once.

A trainer waits for `fsm.output.batch.collate` between rollout and update, so it should cost about what moving its
output does. The floor is a memcpy of the batch's tensors' bytes (every byte written once), measured two ways:
into a new buffer, as collate's output is (the kernel maps and zeroes its pages on first touch: most of the
cost at this size), and into a buffer already touched (the bandwidth floor). Collate also reads the
trajectories' arrays and builds the masks, so a few memcpys is the most it should take.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import numpy as np

from fsm.output.batch import collate
from fsm.run.trajectory import Trajectory


def _trajectories(n: int, prompt: int, response: int, seed: int = 0) -> list[Trajectory]:
    """`n` trajectories, prompts up to `prompt` and responses up to `response` tokens long (a few past the
    widths, to be cut), alternating model turns and observations as in a tool-calling run."""
    rng = np.random.default_rng(seed)
    trajs = []
    for i in range(n):
        t = Trajectory(i, 0, f"s{i}", f"u{i}", {"raw_prompt": []}, "DONE")
        t.prompt_ids.extend(rng.integers(1, 50_000, int(rng.integers(prompt // 4, prompt + 8))).tolist())
        left = int(rng.integers(response // 4, response + 8))
        while left > 0:
            k = min(left, int(rng.integers(50, 600)))
            ids = rng.integers(1, 50_000, k).tolist()
            if len(t.runs) % 2 == 0:
                t.append_generated(ids, [-0.5] * k, 3)
            else:
                t.append_context(ids, "tool")
            left -= k
        t.reward_score = float(i % 2)
        trajs.append(t)
    return trajs


def bench_collate(
    n: int = 1024, prompt: int = 1024, response: int = 4096, repeats: int = 5
) -> dict[str, Any]:
    """Median ms (CPU time of this process: other load on the machine does not count) of `collate` and of a
    memcpy of its output tensors' bytes into a new and into a touched buffer, interleaved `repeats` times."""
    trajs = _trajectories(n, prompt, response)

    def run() -> Any:
        return collate(trajs, prompt_length=prompt, response_length=response, pad_token_id=0)

    nbytes = sum(v.numel() * v.element_size() for v in run().batch.values())
    src, dst = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    steps = {"collate": run, "memcpy": src.copy, "memcpy_touched": lambda: np.copyto(dst, src)}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            t0 = time.process_time()
            step()
            times[name].append(time.process_time() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out = {
        "trajectories": n,
        "prompt_length": prompt,
        "response_length": response,
        "repeats": repeats,
        "batch_mib": round(nbytes / 2**20, 1),
        "collate_ms": round(med["collate"], 1),
        "memcpy_ms": round(med["memcpy"], 1),
        "memcpy_touched_ms": round(med["memcpy_touched"], 1),
        "ratio_to_memcpy": round(med["collate"] / med["memcpy"], 2),
        "ratio_to_memcpy_touched": round(med["collate"] / med["memcpy_touched"], 2),
    }
    print(
        f"collate {n} x ({prompt} + {response}) tokens: {out['collate_ms']:.1f} ms CPU; a memcpy of its "
        f"{out['batch_mib']} MiB into a new buffer {out['memcpy_ms']:.1f} ms ({out['ratio_to_memcpy']:.2f}x), "
        f"into a touched one {out['memcpy_touched_ms']:.1f} ms ({out['ratio_to_memcpy_touched']:.2f}x); "
        f"median of {repeats}",
        file=sys.stderr,
    )
    return out
