"""Harnesses of one run cannot reach each other or the run's workers (issue 50, "Isolation between harnesses").
Real processes throughout: `agentfsm gateway` runs, command harnesses under fsm/gateway/reaper.py, /proc read as
an attacker would read it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsm.gateway import harness
from tests.gateway.test_hostile import SCRIPT
from tests.gateway.test_workers import ENV, ROOT, _finish, _pid_file, _spec

WAIT = """
import os, sys, time
here = os.environ["ENV_DIR"]
open(os.path.join(here, "started-%d" % os.getpid()), "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(here, "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
"""
waiting_harness = harness(command=[sys.executable, "-c", WAIT + SCRIPT, "0"], timeout_s=180)


def _until(predicate, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout  # generous: the machine is shared
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_workers_environment_never_holds_the_front_token(tmp_path):
    """The token was in each worker's environment: `os.environ.pop` left it in the kernel's copy, readable in
    /proc/<worker pid>/environ by any process of the user (a harness too) for the worker's whole life, and the
    front took it (409 for a registered tag, not 401). Now it comes down a pipe, read once."""
    spec = _spec(tmp_path, "tests.gateway.test_isolation:waiting_harness")
    dumps, out = tmp_path / "env", tmp_path / "run"
    dumps.mkdir()
    argv = [sys.executable, "-m", "fsm.cli", "gateway", str(spec), "--num-prompts", "2", "--workers", "2"]
    proc = subprocess.Popen(
        [*argv, "-q", "--out", str(out)],
        cwd=ROOT,
        env={**ENV, "ENV_DIR": str(dumps)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _until(lambda: len(list(dumps.glob("started-*"))) == 2 or proc.poll() is not None)
        assert proc.poll() is None, proc.communicate()
        for tag in ("w0", "w1"):  # both workers registered and run a harness now
            environ = Path(f"/proc/{_pid_file(out, tag)}/environ").read_bytes()
            assert b"AGENTFSM_FRONT" not in environ and b"ENV_DIR" in environ
    finally:
        (dumps / "go").touch()
    rc, said = _finish(proc)
    assert rc == 0, said
