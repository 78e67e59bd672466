"""`kill -9` of a program that keeps its run with the API (`keep=RunDir(out)`), then `RunDir(out).resume(engine)`
in a fresh program, over a real server (tests/vllm, tests/sglang reuse their suite's one server): at
temperature 0 the resumed batch equals an uninterrupted one (token ids and masks exactly, logprobs within the
suite's noise), no row twice, and the actions run again are at most those in flight at the kill. The
uninterrupted run and the resume run in the test's process, the killed program in its own.

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

from fsm.run.fold import rebuild
from fsm.run.journal import JOURNAL, records
from tests.test_journal_kill import _count
from tests.test_run_interrupts import ASSETS, ENV, REPO

SPEC = "specs/calculator_compact.yaml"
PROGRAM = """
import sys

from fsm import RolloutEngine, RunDir
from fsm.spec.registry import resolve

url, out, spec, tokenizer, count = sys.argv[1:6]
engine = RolloutEngine(spec, tokenizer=tokenizer, servers=[url])
rows = resolve(engine.agent.spec.demo_data, engine.agent.spec.trust.allow_modules)(int(count), seed=0)
engine.generate_sequences(rows, {"temperature": 0, "seed": 0}, n=2, keep=RunDir(out))
engine.close()
"""
TIMEOUT_S = 300  # one program: imports, then 4 trajectories of the tiny model on a loaded 2-core machine


def _program(tmp: Path, url: str, out: Path, rows: int) -> list[str]:
    """The program that is killed: a process of its own, as a trainer's is."""
    script = tmp / "keep_api.py"
    script.write_text(PROGRAM)
    return [sys.executable, str(script), url, str(out), SPEC, str(ASSETS), str(rows)]


def _in_flight(out: Path) -> tuple[int, int, int]:
    """From the journal a kill left: trajectories finished, begun and unfinished (their action in flight), and
    of those, the ones in a model turn."""
    rb = rebuild(records(out / JOURNAL))
    begun = [t for s, t in rb.trajs.items() if s not in rb.done and len(t.path_times)]
    return len(rb.done), len(begun), sum(t.state == "GENERATING" for t in begun)


def _in_process(url: str, out: Path, rows: int, resume: bool) -> Any:
    """The uninterrupted run, or the resume, here: a process of its own all the same (not the killed one)."""
    from fsm import RolloutEngine, RunDir
    from fsm.spec.registry import resolve

    engine = RolloutEngine(SPEC, tokenizer=str(ASSETS), servers=[url])
    try:
        keep = RunDir(out)
        if resume:
            keep.resume(engine)
            return keep.resumed
        demo = engine.agent.spec.demo_data
        assert demo is not None  # the spec's demo rows
        made = resolve(demo, engine.agent.spec.trust.allow_modules)(rows, seed=0)
        return engine.generate_sequences(made, {"temperature": 0, "seed": 0}, n=2, keep=keep)
    finally:
        engine.close()


def kill_and_resume(tmp: Path, url: str, fraction: float, noise: float, rows: int = 2) -> dict[str, Any]:
    """The uninterrupted run of `rows` rows x 2 samples, then one killed at `fraction` of its journal's records
    and resumed; asserts they agree, returns what was in flight and what ran again."""
    import torch

    t0 = time.monotonic()
    ref = tmp / "ref"
    _in_process(url, ref, rows, resume=False)
    target = max(4, int(_count(ref / JOURNAL) * fraction))
    out = tmp / "cut"
    proc = subprocess.Popen(
        _program(tmp, url, out, rows), env=ENV, cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + TIMEOUT_S
    while proc.poll() is None and _count(out / JOURNAL) < target:
        assert time.monotonic() < deadline, f"the program's journal did not grow to {target} records"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == -signal.SIGKILL, f"the program ended before its kill: {err[-2000:]}"
    finished, in_flight, turns = _in_flight(out)
    found = _in_process(url, out, rows, resume=True)
    assert found.finished == finished and found.in_flight == in_flight, (found, finished, in_flight)
    assert found.in_flight + found.restarted <= 2 * rows - finished  # at most the unfinished ones run again

    a = torch.load(ref / "batch.pt", weights_only=False)
    b = torch.load(out / "batch.pt", weights_only=False)
    assert list(a["non_tensor_batch"]["uid"]) == list(b["non_tensor_batch"]["uid"])
    for key, value in a["batch"].items():
        if key == "rollout_log_probs":
            assert (value - b["batch"][key]).abs().max().item() < noise, key
        else:
            assert torch.equal(value, b["batch"][key]), key
    records_out = [json.loads(line) for line in (out / "trajectories.jsonl").open()]
    keys = [(r["index"], r["sample"]) for r in records_out]
    assert len(keys) == len(set(keys)) == 2 * rows, keys  # no row twice, none missing
    ref_rows = [json.loads(line) for line in (ref / "trajectories.jsonl").open()]
    assert [r["reward_score"] for r in records_out] == [r["reward_score"] for r in ref_rows]
    assert rebuild(records(out / JOURNAL)).ended == "completed"
    return {
        "killed_at": target,
        "finished": finished,
        "in_flight": in_flight,
        "model_turns_in_flight": turns,
        "redone": found.in_flight + found.restarted,
        "seconds": round(time.monotonic() - t0, 1),
    }
