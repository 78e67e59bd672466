"""A kept run in the continuous mode across a weight update, killed with -9, resumed from its journal
(fsm/run/resume.py): the resumed rows keep the weight version of every token they had, and a resume onto
servers that now serve another version is refused in one line unless the caller opts in (`other_weights`).

The program updates the dev server's weights (the same checkpoint, version 1) after the first model turn, as a
trainer does between steps; the kill lands once the journal holds tokens of version 1 and a model turn in flight.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fsm import RolloutEngine, RunDir
from fsm.run.journal import JOURNAL, JournalError, Rebuilt, rebuild, records
from tests.test_journal_kill import model_server  # noqa: F401  (the module's dev server)
from tests.test_run_interrupts import ASSETS, ENV, REPO

SPEC = "specs/calculator_compact.yaml"
PROGRAM = """
import asyncio, sys, time

from fsm import RolloutEngine, RunDir
from fsm.spec.registry import resolve

url, out, model, spec = sys.argv[1:5]


async def main():
    engine = RolloutEngine(spec, tokenizer=model, servers=[url])
    rows = resolve(engine.agent.spec.demo_data, engine.agent.spec.trust.allow_modules)(2, seed=0)
    run = asyncio.ensure_future(
        engine.agenerate_sequences(rows, {"temperature": 0, "seed": 0}, n=2, keep=RunDir(out))
    )
    deadline = time.monotonic() + 120
    while not any(t.assistant_turns >= 1 for t, _ in list(engine.runner.live.values())):
        assert time.monotonic() < deadline and not run.done(), "no model turn finished"
        await asyncio.sleep(0.005)
    await engine.apause("abort")
    await engine.aupdate_weights_from_disk(model, weight_version=engine.weight_version + 1)
    await engine.aresume()
    await run


asyncio.run(main())
"""


def _set_version(url: str, version: int) -> None:
    """The dev server reloads the same checkpoint and reports `version` from now on."""
    body = json.dumps({"model_path": str(ASSETS), "weight_version": str(version)}).encode()
    request = urllib.request.Request(
        f"{url}/update_weights_from_disk", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.status == 200


def _made(rb: Rebuilt, sid: str) -> list[int]:
    """The weight versions of a trajectory's model tokens, over its segments (the spec compacts its context)."""
    return [
        v
        for seg in rb.trajs[sid].segments
        for v, m in zip(seg.response_versions, seg.response_mask)
        if m == 1
    ]


def _cut(rb: Rebuilt) -> bool:
    """An unfinished trajectory holds tokens of the updated weights, and a model turn is in flight: the moment
    to kill."""
    running = [s for s, t in rb.trajs.items() if s not in rb.done and len(t.path_times)]
    return any(1 in _made(rb, s) for s in running) and any(rb.trajs[s].state == "GENERATING" for s in running)


def _resume(url: str, out: Path, other_weights: bool = False) -> None:
    engine = RolloutEngine(SPEC, tokenizer=str(ASSETS), servers=[url])
    try:
        RunDir(out, other_weights=other_weights).resume(engine)
    finally:
        engine.close()


@pytest.mark.slow
def test_a_resume_keeps_each_tokens_weight_version_and_refuses_other_weights(tmp_path, model_server):  # noqa: F811
    url = model_server
    _set_version(url, 0)
    out = tmp_path / "cut"
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    proc = subprocess.Popen(
        [sys.executable, str(script), url, str(out), str(ASSETS), SPEC],
        env=ENV,
        cwd=REPO,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 240
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the journal never held version-1 tokens and a turn in flight"
        if (out / JOURNAL).exists() and _cut(rebuild(records(out / JOURNAL))):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    at_kill = rebuild(records(out / JOURNAL))
    going_on = [s for s, t in at_kill.trajs.items() if s not in at_kill.done and len(t.path_times)]
    kept = {s: _made(at_kill, s) for s in going_on}
    assert any(1 in v for v in kept.values())
    other = tmp_path / "other"
    shutil.copytree(out, other)

    # the servers moved on to version 2: refused, in one line naming the journal, the server and both versions
    _set_version(url, 2)
    with pytest.raises(JournalError) as refused:
        _resume(url, out)
    line = str(refused.value)
    assert "\n" not in line and str(out / JOURNAL) in line and url in line, line
    assert "weight version 1" in line and "weight version 2" in line, line

    # back at version 1: the rows go on with the weights they were generated with, every version kept
    _set_version(url, 1)
    _resume(url, out)
    done = rebuild(records(out / JOURNAL))
    assert done.ended == "completed" and len(done.done) == 4
    for sid, before in kept.items():
        assert _made(done, sid)[: len(before)] == before, sid  # the journaled tokens keep their versions
        assert set(_made(done, sid)[len(before) :]) <= {1}, sid
    assert {v for s in done.trajs for v in _made(done, s)} == {0, 1}  # the run spans the update

    # opted in, on version 2: the old tokens keep theirs, the new ones carry 2
    _set_version(url, 2)
    _resume(url, other, other_weights=True)
    done = rebuild(records(other / JOURNAL))
    assert done.ended == "completed" and len(done.done) == 4
    new = []
    for sid, before in kept.items():
        assert _made(done, sid)[: len(before)] == before, sid
        new += _made(done, sid)[len(before) :]
    assert new and set(new) == {2}  # a model turn was in flight at the kill: it ran again, on version 2
    _set_version(url, 0)
