"""`kill -9` of a program that keeps its run with the API (`keep=RunDir(out)`), then `RunDir(out).resume(engine)`
in a fresh program, over a real server (tests/vllm, tests/sglang reuse their suite's one server): at
temperature 0 the resumed batch equals an uninterrupted one (token ids and masks exactly, logprobs within the
suite's noise), no row twice, and the actions run again are at most those in flight at the kill.

The kill lands when the journal has grown to a fraction of the uninterrupted run's (a condition on the file,
polled, bounded), so it cuts the run among its model turns, tool calls and rewrites (specs/calculator_compact).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fsm.run.journal import JOURNAL, rebuild, records
from tests.test_journal_kill import _count
from tests.test_run_interrupts import ASSETS, ENV, REPO

SPEC = "specs/calculator_compact.yaml"
PROGRAM = """
import json, sys

from fsm import RolloutEngine, RunDir
from fsm.spec.registry import resolve

mode, url, out, spec, tokenizer = sys.argv[1:6]
engine = RolloutEngine(spec, tokenizer=tokenizer, servers=[url])
if mode == "run":
    rows = resolve(engine.agent.spec.demo_data, engine.agent.spec.trust.allow_modules)(2, seed=0)
    engine.generate_sequences(rows, {"temperature": 0, "seed": 0}, n=2, keep=RunDir(out))
else:
    keep = RunDir(out)
    keep.resume(engine)
    found = keep.resumed
    print(json.dumps({"finished": found.finished, "in_flight": found.in_flight, "restarted": found.restarted}))
engine.close()
"""
TIMEOUT_S = 300  # one program: imports, then 4 trajectories of the tiny model on a loaded 2-core machine


def _program(tmp: Path, mode: str, url: str, out: Path) -> list[str]:
    script = tmp / "keep_api.py"
    if not script.exists():
        script.write_text(PROGRAM)
    return [sys.executable, str(script), mode, url, str(out), SPEC, str(ASSETS)]


def _in_flight(out: Path) -> tuple[int, int, int]:
    """From the journal a kill left: trajectories finished, begun and unfinished (their action in flight), and
    of those, the ones in a model turn."""
    rb = rebuild(records(out / JOURNAL))
    begun = [t for s, t in rb.trajs.items() if s not in rb.done and len(t.path_times)]
    return len(rb.done), len(begun), sum(t.state == "GENERATING" for t in begun)


def kill_and_resume(tmp: Path, url: str, fraction: float, noise: float) -> dict[str, Any]:
    """The uninterrupted run, then one killed at `fraction` of its journal's records and resumed; asserts they
    agree, returns what was in flight and what ran again."""
    import torch

    t0 = time.monotonic()
    ref = tmp / "ref"
    done = subprocess.run(
        _program(tmp, "run", url, ref), env=ENV, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    target = max(4, int(_count(ref / JOURNAL) * fraction))
    out = tmp / "cut"
    proc = subprocess.Popen(
        _program(tmp, "run", url, out), env=ENV, cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + TIMEOUT_S
    while proc.poll() is None and _count(out / JOURNAL) < target:
        assert time.monotonic() < deadline, f"the program's journal did not grow to {target} records"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == -signal.SIGKILL, f"the program ended before its kill: {err[-2000:]}"
    finished, in_flight, turns = _in_flight(out)
    resumed = subprocess.run(
        _program(tmp, "resume", url, out),
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    found = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert found["finished"] == finished and found["in_flight"] == in_flight, (found, finished, in_flight)
    assert found["in_flight"] + found["restarted"] <= 4 - finished  # at most the unfinished ones run again

    a = torch.load(ref / "batch.pt", weights_only=False)
    b = torch.load(out / "batch.pt", weights_only=False)
    assert list(a["non_tensor_batch"]["uid"]) == list(b["non_tensor_batch"]["uid"])
    for key, value in a["batch"].items():
        if key == "rollout_log_probs":
            assert (value - b["batch"][key]).abs().max().item() < noise, key
        else:
            assert torch.equal(value, b["batch"][key]), key
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").open()]
    keys = [(r["index"], r["sample"]) for r in rows]
    assert len(keys) == len(set(keys)) == 4, keys  # no row twice, none missing
    ref_rows = [json.loads(line) for line in (ref / "trajectories.jsonl").open()]
    assert [r["reward_score"] for r in rows] == [r["reward_score"] for r in ref_rows]
    assert rebuild(records(out / JOURNAL)).ended == "completed"
    return {
        "killed_at": target,
        "finished": finished,
        "in_flight": in_flight,
        "model_turns_in_flight": turns,
        "redone": found["in_flight"] + found["restarted"],
        "seconds": round(time.monotonic() - t0, 1),
    }
