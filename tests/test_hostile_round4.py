"""Hostile inputs, round 4 (issue 50): a stop that must end while a tool call outlasts it, journals forged on disk
that must not become rows, and run directories that must not run code or reach the network when read.

Every run here is a real `agentfsm run` process on the tiny model (backends/tiny), signalled for real; every
forged journal is one a real run wrote, edited on disk.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsm.run.journal import ended
from tests.conftest import assert_same_batch_files
from tests.test_run_interrupts import ENV, REPO, Lines

SLEEPY_SPEC = """
name: calculator_sleepy
extends: {specs}/calculator.yaml
tools:
  - function: tests.fixtures.parts:sleeps
    schema: specs.calculator:TOOL_SCHEMA
"""


def _run(spec: Path | None, out: Path, *extra: str, env: dict[str, str] | None = None) -> list[str]:
    where = [str(spec), "--out", str(out)] if spec is not None else ["--resume", str(out)]
    return [
        sys.executable,
        "-m",
        "fsm.cli.commands",
        "run",
        *where,
        "--num-prompts",
        "2",
        "--temperature",
        "0",
        "-q",
        *extra,
    ]


@pytest.fixture(scope="module")
def sleepy(tmp_path_factory) -> tuple[Path, Path]:
    """The sleepy spec, and its run with a quick tool: the rows a stopped and resumed run must give."""
    where = tmp_path_factory.mktemp("sleepy")
    spec, ref = where / "sleepy.yaml", where / "ref"
    spec.write_text(SLEEPY_SPEC.format(specs=REPO / "specs"))
    done = subprocess.run(_run(spec, ref), env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return spec, ref


# --- a stop while a tool call outlasts the stop's wait ---------------------------------------------------------


@pytest.mark.slow
def test_a_stop_while_a_tool_outlasts_its_wait_exits_promptly_and_resume_runs_the_step_again(
    sleepy, tmp_path
):
    """issue 50: one SIGTERM (SIGINT is handled alike, fsm/run/signals.py) while a tool call runs past the stop's wait (60 s; 3 s here through
    $AGENTFSM_STOP_TIMEOUT_S) spun for good, the snapshot's own TimeoutError swallowed. Now the run exits within
    seconds with a line saying so, and the rows in the tool call are kept as before it: the resume (a quick tool
    now) calls it again and gives the rows of a run never stopped."""
    spec, ref = sleepy
    cut = tmp_path / "cut"
    env = {**ENV, "AGENTFSM_TEST_TOOL_S": "120", "AGENTFSM_STOP_TIMEOUT_S": "3"}
    proc = subprocess.Popen(
        _run(spec, cut, "--watchdog", "1"), env=env, cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    try:
        err = Lines(proc)
        err.wait_for("in PROCESSING_TOOLS for", 240)  # a tool call is running (it sleeps 120 s)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    text = err.rest()
    assert proc.returncode == 130, text
    assert took < 30, f"the stop took {took:.1f} s"
    assert (
        "did not reach a state boundary in 3 s" in text and "they go on from their last one on resume" in text
    )
    assert "Traceback" not in text
    assert ended(cut / "journal.log") is None
    resumed = subprocess.run(_run(None, cut), env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert ended(cut / "journal.log") == "completed"
    assert_same_batch_files(ref, cut)


def test_a_stop_wait_that_is_not_a_number_is_named_and_the_default_kept(monkeypatch, capsys):
    from fsm.run.interruptible import SNAPSHOT_TIMEOUT_S, STOP_TIMEOUT_ENV, stop_timeout_s

    monkeypatch.setenv(STOP_TIMEOUT_ENV, "2.5")
    assert stop_timeout_s() == 2.5
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv(STOP_TIMEOUT_ENV, bad)
        assert stop_timeout_s() == SNAPSHOT_TIMEOUT_S
        assert f"{STOP_TIMEOUT_ENV}={bad!r} is not a positive number" in capsys.readouterr().err
    monkeypatch.delenv(STOP_TIMEOUT_ENV)
    assert stop_timeout_s() == SNAPSHOT_TIMEOUT_S and os.environ.get(STOP_TIMEOUT_ENV) is None
