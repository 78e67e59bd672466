"""`agentfsm run` interrupted as schedulers and people interrupt it: SIGTERM and Ctrl-C in the middle of a model
turn that would last ten minutes, a second Ctrl-C while a tool hangs, a run resumed from its journal without
repeating the spec; and the watchdog's report of a hung sync tool, in the path users run.

The servers are dev servers (backends/devserver.py) serving HashLM, the deterministic toy model: one with a
600 s latency per request (a turn no wait outlasts), one without, which the resumed run uses and whose greedy
answer the uninterrupted reference run gives.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fsm.run.fold import rebuild
from fsm.run.journal import ended, records
from tests.conftest import assert_same_batch_files
from tests.test_snapshot import _get

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "backends/tiny/assets"
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "PYTHONPATH": str(REPO)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "backends.devserver",
            "--hashlm",
            "--vocab",
            "500",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *args,
        ],
        env=ENV,
        cwd=REPO,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            _get(f"{url}/v1/loads")
            return proc, url
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the dev server did not come up"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def servers():
    slow, slow_url = _serve("--latency", "600")
    fast, fast_url = _serve()
    yield slow_url, fast_url
    for proc in (slow, fast):
        proc.terminate()
        proc.wait(20)


@pytest.fixture(scope="module")
def reference(servers, tmp_path_factory) -> Path:
    """The uninterrupted greedy run every interrupted run here must resume to, made once: HashLM is deterministic,
    so each test's reference run was this same run again."""
    ref = tmp_path_factory.mktemp("reference") / "ref"
    done = subprocess.run(
        run_args(ref, "specs/calculator.yaml", "--server", servers[1]),
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return ref


def run_args(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fsm.cli.commands",
        "run",
        "--tokenizer",
        str(ASSETS),
        "--num-prompts",
        "3",
        "--n",
        "2",
        "--temperature",
        "0",
        "--out",
        str(out),
        "-q",
        *extra,
    ]


class Lines:
    """A process's stderr, line by line, read in a thread: tests wait for a line, never for a fixed time."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no {text!r} in {timeout:g} s; stderr so far:\n{''.join(self.lines)}"
                ) from None
            if line is None:
                raise AssertionError(f"the process ended without {text!r}; stderr:\n{''.join(self.lines)}")
            self.lines.append(line)
            if text in line:
                return line

    def rest(self, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
        return "".join(self.lines)


def _in_flight(url: str) -> int:
    load = _get(f"{url}/v1/loads")["loads"][0]
    return load["num_running_reqs"] + load["num_waiting_reqs"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_interrupt_mid_turn_snapshots_within_seconds_and_resume_gives_the_same_tokens(
    servers, reference, tmp_path, sig
):
    slow, fast = servers
    cut = tmp_path / "cut"
    proc = subprocess.Popen(
        run_args(cut, "specs/calculator.yaml", "--server", slow),
        env=ENV,
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while _in_flight(slow) < 6:  # every trajectory is in its first turn, which lasts 600 s
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached the server"
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(sig)
        err = Lines(proc)
        assert "stopping 6 running trajectories" in err.wait_for("stopping", 10)
        proc.wait(30)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    err = err.rest()
    assert proc.returncode == 130, err
    assert took < 30, f"the snapshot took {took:.1f} s"
    assert f"resume with: agentfsm run --resume {cut}" in err and "Traceback" not in err
    assert ended(cut / "journal.log") is None and not (cut / "summary.json").exists()
    assert _in_flight(slow) == 0  # the aborted turns are gone from the server, which serves again

    with ThreadPoolExecutor() as both:  # two refusals side by side: neither writes
        again, other = both.map(
            lambda extra: subprocess.run(
                run_args(cut, *extra, "--server", fast),
                env=ENV,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=240,
            ),
            [("specs/calculator.yaml",), ("specs/tool_agent.yaml", "--resume", str(cut))],
        )
    assert again.returncode == 1 and "holds an unfinished run (journal.log)" in again.stderr
    assert other.returncode == 1 and "resume with the spec it was written with" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1
    resumed = subprocess.run(
        run_args(cut, "--resume", str(cut), "--server", fast),
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert ended(cut / "journal.log") == "completed"
    assert_same_batch_files(reference, cut)


STUCK_SPEC = """
name: calculator_stuck
extends: {specs}/calculator.yaml
tools:
  - function: tests.fixtures.parts:stuck
    schema: specs.calculator:TOOL_SCHEMA
"""


@pytest.mark.slow
def test_a_hung_sync_tool_gets_a_watchdog_line_and_a_second_ctrl_c_exits_at_once(tmp_path):
    spec = tmp_path / "stuck.yaml"
    spec.write_text(STUCK_SPEC.format(specs=REPO / "specs"))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fsm.cli.commands",
            "run",
            str(spec),
            "--num-prompts",
            "2",
            "--watchdog",
            "1",
            "--out",
            str(tmp_path / "out"),
            "-q",
        ],
        env=ENV,
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        err = Lines(proc)
        line = err.wait_for("watchdog:", 240)
        assert "no trajectory has changed state for" in line
        # a slow model turn (a loaded machine) may be reported first: the hung tool's row comes next
        assert "in PROCESSING_TOOLS for" in err.wait_for("in PROCESSING_TOOLS for", 240)
        proc.send_signal(signal.SIGINT)
        err.wait_for("Ctrl-C again to exit at once", 10)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(10)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    text = err.rest()
    assert proc.returncode == 130 and "exiting at once" in text, text
    assert took < 10 and "Traceback" not in text


BLOCKING_SPEC = """
name: calculator_blocking
extends: {specs}/calculator.yaml
tools:
  - function: tests.fixtures.parts:blocks_the_loop
    schema: specs.calculator:TOOL_SCHEMA
    isolation: none
"""


@pytest.mark.slow
def test_a_tool_that_blocks_the_event_loop_is_named_and_ctrl_c_still_snapshots(tmp_path):
    """issue 27 item 9: an `isolation: none` tool that blocks the loop for good (a sync sleep in a coroutine).
    The loop watch, a thread, names the tool and the row within seconds; Ctrl-C writes the snapshot from
    outside the blocked loop, from each row's last state boundary, and exits 130; `--resume` with the tool
    fixed runs every row to the end."""
    spec, out = tmp_path / "blocking.yaml", tmp_path / "out"
    spec.write_text(BLOCKING_SPEC.format(specs=REPO / "specs"))
    cmd = [
        sys.executable,
        "-m",
        "fsm.cli.commands",
        "run",
        str(spec),
        "--num-prompts",
        "4",
        "--out",
        str(out),
        "-q",
    ]
    proc = subprocess.Popen(cmd, env=ENV, cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        err = Lines(proc)
        line = err.wait_for("event loop blocked for", 240)
        # the tool by its schema's name, the row, its state, and the line the loop's thread is stuck in
        assert "tool 'calculator' (isolation: none) on row " in line and "in PROCESSING_TOOLS" in line, line
        assert "parts.py:" in line and "in blocks_the_loop" in line, line
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    text = err.rest()
    assert proc.returncode == 130, text
    assert took < 30 and "Traceback" not in text and "exiting at once" not in text, text
    assert "flushed the journal" in text and "last state boundary" in text, text
    assert ended(out / "journal.log") is None
    if (out / "summary.json").exists():  # rows that finished before the tool blocked are written
        assert '"status": "interrupted"' in (out / "summary.json").read_text()

    resumed = subprocess.run(
        [sys.executable, "-m", "fsm.cli.commands", "run", "--resume", str(out), "-q"],
        env={**ENV, "AGENTFSM_TEST_UNBLOCKED": "1"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert ended(out / "journal.log") == "completed"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["files"]["trajectories.jsonl"]["rows"] == 4
    reasons = [json.loads(line)["termination_reason"] for line in (out / "trajectories.jsonl").open()]
    assert not any(r.startswith("error") for r in reasons), reasons


EMBEDDED = """
import sys

from fsm import RolloutEngine, RunDir, RunInterrupted
from fsm.spec.registry import resolve

url, out = sys.argv[1], sys.argv[2]
engine = RolloutEngine("specs/calculator.yaml", tokenizer="backends/tiny/assets", servers=[url])
rows = resolve(engine.agent.spec.demo_data, engine.agent.spec.trust.allow_modules)(3, seed=0)
try:
    engine.generate_sequences(rows, {"temperature": 0, "seed": 0}, n=2, keep=RunDir(out))
except RunInterrupted as exc:
    print(f"kept: {exc}", file=sys.stderr, flush=True)
    engine.close()
    sys.exit(130)
engine.close()
"""


@pytest.mark.slow
def test_sigterm_keeps_a_run_of_the_python_api_and_the_cli_resumes_it(servers, reference, tmp_path):
    """issue 28: a program embedding RolloutEngine gets what `agentfsm run` gives, by passing `keep=RunDir(out)`:
    SIGTERM mid-turn stops the rows through the same code (fsm/output/keep.py), writes the
    snapshot, and `agentfsm run --resume` finishes it with the tokens of an uninterrupted CLI run."""
    slow, fast = servers
    cut = tmp_path / "cut"
    script = tmp_path / "embed.py"
    script.write_text(EMBEDDED)
    proc = subprocess.Popen(
        [sys.executable, str(script), slow, str(cut)], env=ENV, cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while _in_flight(slow) < 6:  # every trajectory is in its first turn, which lasts 600 s
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached the server"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        err = Lines(proc)
        assert "SIGTERM: stopping 6 running trajectories" in err.wait_for("stopping", 10)
        proc.wait(60)
    finally:
        proc.kill()
    err = err.rest()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "flushed the journal (3 groups running, 0 finished)" in err, err
    assert (
        f"kept: interrupted before any trajectory finished; {cut} holds what it held before; resume with: "
        f"agentfsm run --resume {cut}" in err
    ), err
    assert ended(cut / "journal.log") is None and not (cut / "summary.json").exists()
    assert _in_flight(slow) == 0  # the aborted turns are gone from the server, which serves again
    resumed = subprocess.run(
        run_args(cut, "--resume", str(cut), "--server", fast),
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert ended(cut / "journal.log") == "completed"
    assert json.loads((cut / "summary.json").read_text())["status"] == "completed"
    assert_same_batch_files(reference, cut)


@pytest.mark.slow
def test_ctrl_c_with_a_server_that_can_neither_pause_nor_abort_snapshots_within_seconds(
    tmp_path, servers, reference
):
    """Issue 36 item 6: with a server that has no /pause_generation and ignores /abort_request, the run was alive
    150 s after SIGINT and a second one exited without a snapshot. The wait for turns in flight is bounded
    (fsm/run/context.py TURN_GRACE_S): past it each is taken as it was before its turn, which runs again on
    resume, and the resumed run gives the uninterrupted run's rows."""
    _, fast = servers
    port = _free_port()
    deaf = subprocess.Popen(
        [sys.executable, "-m", "tests.fixtures.deaf_server", str(port)], env=ENV, cwd=REPO
    )
    url = f"http://127.0.0.1:{port}"
    cut = tmp_path / "cut"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                _get(f"{url}/_deaf")
                break
            except OSError:
                assert deaf.poll() is None and time.monotonic() < deadline, "the deaf server did not come up"
                time.sleep(0.1)
        proc = subprocess.Popen(
            run_args(cut, "specs/calculator.yaml", "--server", url),
            env=ENV,
            cwd=REPO,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 120
            while _get(f"{url}/_deaf")["generate"] < 6:  # every trajectory is in its first turn, for ever
                assert proc.poll() is None and time.monotonic() < deadline, "the run never reached the server"
                time.sleep(0.05)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            err = Lines(proc)
            err.wait_for("stopping 6 running trajectories", 10)
            proc.wait(45)
            took = time.monotonic() - t0
        finally:
            proc.kill()
        text = err.rest()
        assert proc.returncode == 130 and "Traceback" not in text, text
        assert took < 45, f"the snapshot took {took:.1f} s"
        assert _get(f"{url}/_deaf")["abort_request"] >= 6  # it was asked, and ignored it
        assert ended(cut / "journal.log") is None and f"resume with: agentfsm run --resume {cut}" in text, (
            text
        )
    finally:
        deaf.terminate()
        deaf.wait(20)
    resumed = subprocess.run(
        run_args(cut, "--resume", str(cut), "--server", fast),
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert_same_batch_files(reference, cut)


HANGING_REWRITE_SPEC = """
name: calculator_rewrite_{kind}
extends: {specs}/calculator.yaml
limits: {{rewrite_timeout_s: 3600}}
context:
  rewrites:
    squash: {{function: tests.fixtures.rewrites:hang_{kind}}}
states:
  GENERATING:  # the rewrite after the first model turn: the run is well under way when it hangs
    action: generate
    next: [{{to: SQUASH}}]
  SQUASH:
    action: squash
    next: [{{to: PROCESSING_TOOLS, when: has_tool_calls}}, {{to: INTERACTING, when: has_interaction}},
           {{to: TERMINATED, reason: done}}]
"""


@pytest.mark.slow
def test_ctrl_c_while_a_rewrite_hangs_snapshots_at_once(tmp_path):
    """Issue 36 item 5: an async rewrite that hung held the first Ctrl-C for 130 s and the second exited without a
    snapshot; a sync one held the loop. A row waiting for its rewrite is whole (the rewrite changes it only once
    it returns): Ctrl-C writes it as it was before the rewrite, at once, and `--resume` runs the rewrite again.
    The async and the sync rewrite hang side by side, each in its own run's process."""
    with ThreadPoolExecutor(2) as both:
        list(both.map(_ctrl_c_while_a_rewrite_hangs, [tmp_path, tmp_path], ["async", "sync"]))


def _ctrl_c_while_a_rewrite_hangs(tmp_path: Path, kind: str) -> None:
    spec, out = tmp_path / f"{kind}.yaml", tmp_path / f"out-{kind}"
    spec.write_text(HANGING_REWRITE_SPEC.format(specs=REPO / "specs", kind=kind))
    cmd = [
        sys.executable,
        "-m",
        "fsm.cli.commands",
        "run",
        str(spec),
        "--num-prompts",
        "2",
        "--out",
        str(out),
        "-q",
    ]
    proc = subprocess.Popen(cmd, env=ENV, cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        err = Lines(proc)
        err.wait_for("agentfsm-test: rewrite hanging", 240)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    text = err.rest()
    assert proc.returncode == 130 and took < 30, (kind, took, text)
    assert "flushed the journal" in text and "Traceback" not in text and "start over" not in text, text
    rb = rebuild(records(out / "journal.log"))
    states = [t.state for s, t in rb.trajs.items() if s not in rb.done]
    assert "SQUASH" in states and set(states) <= {"SQUASH", "PENDING", "GENERATING"}, (kind, states)

    resumed = subprocess.run(
        [sys.executable, "-m", "fsm.cli.commands", "run", "--resume", str(out), "-q"],
        env={**ENV, "AGENTFSM_TEST_UNBLOCKED": "1"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["files"]["trajectories.jsonl"]["rows"] == 2
