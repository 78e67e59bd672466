"""A kept run in the continuous mode across a weight update, killed with -9, resumed from its journal
(fsm/run/resume.py): the resumed rows keep the weight version of every token they had, and a resume onto
servers that now serve another version is refused in one line unless the caller accepts changes
(`accept_changes`; `other_weights` is its older name).

The program updates the server's weights (version v0, then v0 + 1) after the first model turn, as a trainer does
between steps; the kill lands once the journal holds tokens of version v0 + 1 and a model turn in flight. Over the
dev server here (the same checkpoint reloaded), over real vLLM in tests/vllm/test_journal_weights.py.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from fsm import RolloutEngine, RunDir
from fsm.run.fold import Rebuilt, rebuild
from fsm.run.journal import JOURNAL, JournalError, records
from tests.test_journal_kill import model_server  # noqa: F401  (the module's dev server)
from tests.test_run_interrupts import ASSETS, ENV, REPO

SPEC = "specs/calculator_compact.yaml"
PROGRAM = """
import asyncio, sys, threading, time

from backends.router import Router
from fsm import RolloutEngine, RunDir
from fsm.spec.registry import resolve

url, out, tokenizer, spec, checkpoint = sys.argv[1:6]


async def main():
    updated = hold_the_second_row()
    engine = RolloutEngine(spec, tokenizer=tokenizer, servers=[url])
    rows = resolve(engine.agent.spec.demo_data, engine.agent.spec.trust.allow_modules)(2, seed=0)
    run = asyncio.ensure_future(
        engine.agenerate_sequences(rows, {"temperature": 0, "seed": 0}, n=2, keep=RunDir(out))
    )
    deadline = time.monotonic() + 120
    while not any(t.assistant_turns >= 1 for t, _ in list(engine.runner.live.values())):
        assert time.monotonic() < deadline and not run.done(), "no model turn finished"
        await asyncio.sleep(0.005)
    await engine.apause("abort")
    await engine.aupdate_weights_from_disk(checkpoint, weight_version=engine.weight_version + 1)
    slow_calls()
    await engine.aresume()
    updated.set()
    await run


def hold_the_second_row():
    # The second row's first model calls wait until the update is done: whatever the first row's turns raced to,
    # the second row makes two model turns after the update, so a turn follows version-1 tokens (the tool runs on
    # the loop, specs/calculator.yaml: its next turn went out before this program's poll saw the first).
    call, first, updated = Router.generate, [], threading.Event()

    async def held(self, request):
        first[:] = first or [request.group_id]
        while request.turn == 0 and request.group_id != first[0] and not updated.is_set():
            await asyncio.sleep(0.01)
        return await call(self, request)

    Router.generate = held
    return updated


def slow_calls():
    # From the update on, every model call starts 0.3 s late: a turn of version-1 tokens stays in flight long
    # enough for the test's poll to see it on a loaded machine (without it CI's run once ended first).
    call = Router.generate

    async def late(self, request):
        await asyncio.sleep(0.3)
        return await call(self, request)

    Router.generate = late


asyncio.run(main())
"""


def _set_version(url: str, checkpoint: Path, version: int) -> None:
    """The dev server reloads `checkpoint` and reports `version` from now on."""
    body = json.dumps({"model_path": str(checkpoint), "weight_version": str(version)}).encode()
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


def _cut(rb: Rebuilt, version: int) -> bool:
    """An unfinished trajectory holds tokens of `version`, and a model turn is in flight: the moment to kill."""
    running = [s for s, t in rb.trajs.items() if s not in rb.done and len(t.path_times)]
    return any(version in _made(rb, s) for s in running) and any(
        rb.trajs[s].state == "GENERATING" for s in running
    )


def _resume(url: str, tokenizer: Path, out: Path, other_weights: bool = False) -> None:
    engine = RolloutEngine(SPEC, tokenizer=str(tokenizer), servers=[url])
    try:
        RunDir(out, other_weights=other_weights).resume(engine)
    finally:
        engine.close()


def kill_across_an_update(
    tmp: Path,
    url: str,
    tokenizer: Path,
    shipped: Path,
    updated: Path,
    set_version: Callable[[Path, int], None],
    v0: int,
    opt_in: bool = True,
) -> dict[str, list[int]]:
    """The server at `shipped`, version v0; the program's run updates it to `updated`, v0 + 1, and is killed;
    the resume is refused at v0 + 2, goes on at v0 + 1 with every version kept, and (`opt_in`) at v0 + 2 with the
    new tokens carrying it. The server is left at `shipped`, v0 + 3. The versions journaled at the kill back."""
    v1, v2 = v0 + 1, v0 + 2
    set_version(shipped, v0)
    out = tmp / "cut"
    script = tmp / "program.py"
    script.write_text(PROGRAM)
    proc = subprocess.Popen(
        [sys.executable, str(script), url, str(out), str(tokenizer), SPEC, str(updated)],
        env=ENV,
        cwd=REPO,
        stderr=subprocess.PIPE,
    )
    try:  # whatever fails, the server is put back for the tests after this one
        deadline = time.monotonic() + 240
        while proc.poll() is None:
            assert time.monotonic() < deadline, (
                f"the journal never held version-{v1} tokens and a turn in flight"
            )
            try:
                if _cut(rebuild(records(out / JOURNAL)), v1):
                    proc.send_signal(signal.SIGKILL)
                    break
            except (FileNotFoundError, JournalError):  # not there yet, or its first record not whole yet
                pass
            time.sleep(0.02)
        err = proc.communicate(timeout=60)[1]
        assert proc.returncode == -signal.SIGKILL, err[-2000:]
        at_kill = rebuild(records(out / JOURNAL))
        going_on = [s for s, t in at_kill.trajs.items() if s not in at_kill.done and len(t.path_times)]
        kept = {s: _made(at_kill, s) for s in going_on}
        assert any(v1 in v for v in kept.values())
        other = tmp / "other"
        shutil.copytree(out, other)
        # the server moved on to v2: refused, in one line naming the journal, the server and both versions
        set_version(shipped, v2)
        with pytest.raises(JournalError) as refused:
            _resume(url, tokenizer, out)
        line = str(refused.value)
        assert "\n" not in line and str(out / JOURNAL) in line and url in line, line
        assert f"weight version {v1}," in line and f"weight version {v2};" in line, line

        # back at v1: the rows go on with the weights they were generated with, every version kept
        set_version(updated, v1)
        _resume(url, tokenizer, out)
        done = rebuild(records(out / JOURNAL))
        assert done.ended == "completed" and len(done.done) == 4
        for sid, before in kept.items():
            assert _made(done, sid)[: len(before)] == before, sid  # the journaled tokens keep their versions
            assert set(_made(done, sid)[len(before) :]) <= {v1}, sid
        assert {v for s in done.trajs for v in _made(done, s)} == {v0, v1}  # the run spans the update

        if opt_in:  # opted in, on v2: the old tokens keep theirs, the new ones carry v2
            set_version(shipped, v2)
            _resume(url, tokenizer, other, other_weights=True)
            done = rebuild(records(other / JOURNAL))
            assert done.ended == "completed" and len(done.done) == 4
            new = []
            for sid, before in kept.items():
                assert _made(done, sid)[: len(before)] == before, sid
                new += _made(done, sid)[len(before) :]
            assert new and set(new) == {v2}  # a model turn was in flight at the kill: it ran again, on v2
        return kept
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        set_version(shipped, v0 + 3)


@pytest.mark.slow
def test_a_resume_keeps_each_tokens_weight_version_and_refuses_other_weights(tmp_path, model_server):  # noqa: F811
    url = model_server
    kill_across_an_update(
        tmp_path, url, ASSETS, ASSETS, ASSETS, lambda path, v: _set_version(url, path, v), v0=0
    )


def test_the_weights_check_names_the_journal_the_servers_and_both_versions():
    """fsm/run/resume.py `weights_change`: the newest of the unfinished rows' last versions against the servers'."""
    from fsm.run.resume import Loaded, judge, weights_change

    loaded = Loaded({}, 0, None, {}, 0, 2, 0, None, last_versions={"a-0-0": 3, "a-0-1": 2})
    assert weights_change(loaded, 3, "server http://h:1") is None
    change = weights_change(loaded, 5, "server http://h:1")
    assert change is not None
    with pytest.raises(JournalError) as refused:  # one mechanism, one form: fsm/run/resume.py `judge`
        judge("out/journal.log", [change], False)
    assert str(refused.value) == (
        "resume refused: out/journal.log: 2 unfinished trajectories were generated with weight version 3, but "
        "server http://h:1 now serves weight version 5; update the servers back to version 3, or rerun with "
        "--resume --accept-changes (RunDir(out, accept_changes=True)) to go on anyway"
    )
    assert judge("out/journal.log", [change], True) == [
        "2 unfinished trajectories were generated with weight version 3, but server http://h:1 now serves weight "
        "version 5 (their next tokens carry version 5)"
    ]
    none_made = Loaded(
        {}, 0, None, {}, 0, 2, 0, None, last_versions={}
    )  # no unfinished row has a model token yet
    assert weights_change(none_made, 5, "server http://h:1") is None
