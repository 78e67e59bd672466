"""A row's wait on servers that never answer is what its flags say (issue 46 §4): `agentfsm run` against a real
server on loopback whose /generate (and /abort_request) never answer ends each row within --retry-window plus
one --request-timeout and small slack (the abort's grace, a tenth of the timeout or at least 5 s, and one
backoff)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "PYTHONPATH": str(REPO)}
# the abort's grace (5 s here), the last backoff (up to 2 s), a loaded machine's lag
SLACK_S = 5.0 + 2.0 + 2.0


@pytest.mark.slow
def test_rows_on_a_server_that_never_answers_end_when_the_flags_say(tmp_path):
    """Two settings of the flags, each its own silent server and run, side by side (the runs mostly wait)."""
    with ThreadPoolExecutor(2) as both:
        list(both.map(_rows_end_when_the_flags_say, [tmp_path / "a", tmp_path / "b"], [10, 4], [3, 2]))


def _rows_end_when_the_flags_say(tmp_path: Path, window_s: int, timeout_s: int) -> None:
    tmp_path.mkdir()
    silent = subprocess.Popen(
        [sys.executable, "-m", "tests.fixtures.silent_server"],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{int(silent.stdout.readline())}"
        t0 = time.monotonic()
        done = subprocess.run(
            [
                sys.executable, "-m", "fsm.cli.commands", "run", "specs/calculator.yaml", "--server", url,
                "--engine", "sglang", "--tokenizer", str(REPO / "backends/tiny/assets"), "--num-prompts", "2",
                "--request-timeout", str(timeout_s), "--retry-window", str(window_s), "--out", str(tmp_path), "-q",
            ],
            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        took = time.monotonic() - t0
    finally:
        silent.kill()
        silent.wait(10)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "2 of 2 rows ended in error" in done.stderr and f"no answer within {timeout_s:g} s" in done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    row_s = summary["timing"]["agent_loop/generate_sequences/max"]  # a row's time in its (only) model call
    assert window_s <= row_s <= window_s + timeout_s + SLACK_S, (row_s, took)
    assert summary["wall_s"] <= window_s + timeout_s + SLACK_S, summary["wall_s"]
    assert summary["server_faults"]["faults"]["timeouts"] >= 2  # each row re-routed within its window
