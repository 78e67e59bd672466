"""Tree runs through the CLI, interrupted mid-tree and resumed (fsm/run/treejournal.py): `agentfsm run` of
specs/fork_calculator.yaml and specs/planner_solver.yaml on the embedded tiny model, killed with -9 once the
journal holds tree nodes, its resume stopped by SIGTERM, resumed again: at temperature 0 (and the solver's seeded
0.7) the completed run equals the uninterrupted one, every batch file's tensors, the tree fields, rows in order,
none twice. Each moment is a condition on the journal (its tree nodes, its growth), never a fixed sleep."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fsm.run.fold import rebuild
from fsm.run.journal import JOURNAL, records
from tests.test_run_interrupts import ENV, REPO
from tests.test_tree_journal import _same_batches, _same_trees

ASSETS = REPO / "backends/tiny/assets"
NODE = b'"n":{"node":"0.'  # a child's or a branch's record (a root's path is "0")


def _args(spec: str, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fsm.cli.commands",
        "run",
        *(extra or (f"specs/{spec}.yaml", "--out", str(out))),
        "--tokenizer",
        str(ASSETS),
        "--num-prompts",
        "1",
        "--temperature",
        "0",
        "--batch-size",
        "1",
        "-q",
    ]


def _interrupt(args: list[str], journal: Path, sig: signal.Signals, more: int) -> tuple[int, str, int]:
    """Run `args`; once the journal holds a tree node's record and `more` records after it, send `sig`.
    (return code, stderr, the journal's records when it was sent)."""
    proc = subprocess.Popen(args, env=ENV, cwd=REPO, stderr=subprocess.PIPE, text=True)
    sent, pos, start = 0, 0, None
    try:
        while proc.poll() is None:
            data = journal.read_bytes() if journal.exists() else b""
            if start is None and NODE in data[pos:]:
                start = data.count(b"\n")
            pos = max(len(data) - 200, 0)
            if start is not None and data.count(b"\n") >= start + more:
                proc.send_signal(sig)
                sent = data.count(b"\n")
                break
            try:
                proc.wait(timeout=0.005)
            except subprocess.TimeoutExpired:
                pass
        err = proc.communicate(timeout=300)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err, sent


@pytest.mark.slow
# one spec through the CLI (four processes, each loading the model): planner_solver has child machines of
# another policy; both specs are interrupted and resumed in process in tests/test_tree_journal.py
@pytest.mark.parametrize("spec", ["planner_solver"])
def test_a_tree_killed_mid_tree_then_stopped_resumes_as_uninterrupted(tmp_path, spec):
    ref = tmp_path / "ref"  # the uninterrupted run, beside the interrupted ones (its own process and model)
    uninterrupted = subprocess.Popen(_args(spec, ref), env=ENV, cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        _interrupted_twice(tmp_path / "out", spec)
        assert uninterrupted.wait(300) == 0, uninterrupted.communicate()[1]
    finally:
        if uninterrupted.poll() is None:
            uninterrupted.kill()
            uninterrupted.wait(30)
    _same_batches(ref, tmp_path / "out")
    _same_trees(ref, tmp_path / "out")


def _interrupted_twice(out: Path, spec: str) -> None:
    """`spec` run into `out`, killed with -9 once tree nodes are journaled, its resume stopped by SIGTERM a record
    or two later, resumed again to the end."""
    rng = random.Random(38)
    journal = out / JOURNAL
    code, err, _ = _interrupt(_args(spec, out), journal, signal.SIGKILL, rng.randint(0, 3))
    assert code == -signal.SIGKILL, f"the run ended ({code}) before its kill: {err}"
    rb = rebuild(records(journal))
    assert any(":" in s for s in rb.trajs), "killed before any tree node was journaled"
    resume = _args(spec, out, "--resume", str(out))
    code, err, _ = _interrupt(resume, journal, signal.SIGTERM, rng.randint(1, 2))
    assert "resuming" in err and "tree nodes:" in err, err
    if code == 130:  # stopped: the journal flushed, the finished rows kept; resumed again
        assert "interrupted" in err, err
        final = subprocess.run(resume, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert final.returncode == 0, final.stderr
    else:  # the resume finished before its SIGTERM landed (a loaded machine): it is complete all the same
        assert code == 0, err
        print(f"{spec}: the resume finished before its SIGTERM")
    assert rebuild(records(journal)).ended == "completed"
