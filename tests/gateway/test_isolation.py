"""Harnesses of one run cannot reach each other or the run's workers (issue 50, "Isolation between harnesses").
Real processes throughout: `agentfsm gateway` runs, command harnesses under fsm/gateway/reaper.py, /proc read as
an attacker would read it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsm.gateway import harness
from tests.gateway.conftest import row
from tests.gateway.isolation_attacks import INJECTED
from tests.gateway.test_hostile import SCRIPT, run, spec
from tests.gateway.test_workers import ENV, ROOT, _finish, _pid_file, _spec

WAIT = """
import json, os, sys, time
here = os.environ["ENV_DIR"]  # named by the session's key: each is PID 1 of its own namespace; its environment in it
open(os.path.join(here, "started-" + os.environ["OPENAI_API_KEY"]), "w").write(json.dumps(dict(os.environ)))
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
    front took it (409 for a registered tag, not 401). Now it comes down a pipe, read once. Nor is it in a
    harness's environment, which holds its own session's key instead."""
    from fsm.gateway.front import TOKEN_ENV

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
    envs = [json.loads(p.read_text()) for p in dumps.glob("started-*")]
    assert len(envs) == 2 and all("OPENAI_API_KEY" in e for e in envs)  # one per row, each given its session
    assert not [e for e in envs if TOKEN_ENV in e or any(k.startswith("AGENTFSM_FRONT") for k in e)]


ATTACKS = str(Path(__file__).with_name("isolation_attacks.py"))
attack_harness = harness(command=[sys.executable, ATTACKS], timeout_s=180)
escape_kill = harness(command=[sys.executable, ATTACKS, "escape", str(int(signal.SIGKILL))], timeout_s=60)
escape_stop = harness(command=[sys.executable, ATTACKS, "escape", str(int(signal.SIGSTOP))], timeout_s=10)


def _namespaces() -> bool:
    """Whether this machine lets the reaper contain a harness (a PID namespace with its own /proc)."""
    for argv in (["unshare", "-pf", "--mount-proc", "true"], ["unshare", "-Urpf", "--mount-proc", "true"]):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if subprocess.run(argv, capture_output=True, timeout=60).returncode == 0:
                return True
    return False


contained = pytest.mark.skipif(
    not _namespaces(), reason="no PID namespace here: the run says it is not contained"
)


def _left(mark: Path) -> list[int]:
    """Live processes whose environment holds ISO_DIR=`mark`: what the test's harnesses left behind."""
    needle = f"ISO_DIR={mark}".encode() + b"\0"
    left = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and needle in (entry / "environ").read_bytes():
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    left.append(int(entry.name))
    return left


@contained
def test_a_harness_cannot_read_another_harness_session_nor_call_into_it(tmp_path, tokenizer, monkeypatch):
    """A harness read other harnesses' base URL and key from /proc/*/environ and called into their sessions
    (3 of 3 answered, the injected message in the victims' rows). In its own PID namespace with its own /proc it
    sees only its own tree: no session found. The keys the victims leak (into a shared directory, as a harness that
    logs its command line would) are refused, each with 403: the thief's connection is not the victims' harness's
    (fsm/gateway/peer.py). Without that check both leaked keys were answered (200) and injected."""
    monkeypatch.setenv("ISO_DIR", str(tmp_path))
    rows = [row(), row(), row()]
    for r, role in zip(rows, ("victim", "thief", "victim")):
        r["extra_info"] = {"role": role, "victims": 2}
    trajs, backend = run(spec(tmp_path, "tests.gateway.test_isolation:attack_harness"), tokenizer, rows)
    stolen = json.loads((tmp_path / "thief.json").read_text())
    assert stolen["sessions_found"] == 0 and stolen["statuses"] == [], stolen
    assert stolen["leaked"] == 2 and stolen["leaked_statuses"] == [403, 403], stolen
    assert 0 < stolen["processes_seen"] < 10  # its own tree only
    for traj, r in zip(trajs, rows):
        assert traj.extra["harness"]["contained"] == "pid+proc", traj.extra["harness"]
        assert traj.termination_reason == "done" and traj.assistant_turns == 1, traj.extra["harness"]
        assert INJECTED not in json.dumps(traj.messages)
        intruded = "came from another process" in json.dumps(traj.extra.get("gateway_notes"))
        assert intruded == (r["extra_info"]["role"] == "victim"), traj.extra.get("gateway_notes")
    assert len(backend.requests) == 3


@contained
@pytest.mark.parametrize("fn", ["escape_kill", "escape_stop"])
def test_a_harness_cannot_signal_its_reaper_nor_leave_a_process_behind(tmp_path, tokenizer, monkeypatch, fn):
    """A harness that SIGKILLed or SIGSTOPped its reaper left a detached grandchild alive after the run (PPID 1,
    68 s later). The reaper is outside the harness's PID namespace, where no signal of the harness reaches it, and
    the namespace ends with the harness: the grandchild is gone when the row is."""
    monkeypatch.setenv("ISO_DIR", str(tmp_path))
    try:
        trajs, _ = run(spec(tmp_path, f"tests.gateway.test_isolation:{fn}"), tokenizer, [row()])
        assert json.loads((tmp_path / "escape.json").read_text()) == {"signalled": []}
        assert (tmp_path / "grandchild.pid").exists()  # it started, in the harness's namespace
        got = trajs[0].extra["harness"]
        assert got["outcome"] == "exit" and got["exit_code"] == 0 and got["contained"] == "pid+proc", got
        _until(lambda: not _left(tmp_path), timeout=30)
    finally:  # a failure here leaves no process either
        for pid in _left(tmp_path):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# a command run where no PID namespace can be made (its user namespace's max_pid_namespaces is 0), as on a machine
# without them: its harnesses run uncontained
UNCONTAINED = ["unshare", "-Ur", "sh", "-c", 'echo 0 > /proc/sys/user/max_pid_namespaces && exec "$@"', "sh"]


def _uncontainable() -> bool:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        works = subprocess.run([*UNCONTAINED, "true"], capture_output=True, timeout=60).returncode == 0
        namespaces = subprocess.run([*UNCONTAINED, "unshare", "-pf", "true"], capture_output=True, timeout=60)
        return works and namespaces.returncode != 0
    return False


@pytest.mark.slow
@pytest.mark.skipif(not _uncontainable(), reason="no user namespace here to run a run without PID namespaces")
def test_an_uncontained_run_says_so_and_a_stolen_key_is_still_refused(tmp_path):
    """Where no PID namespace can be made, harnesses run uncontained: the thief reads both victims' base URL and
    key in /proc/*/environ, and each call is refused (403: its connection is not the victims' harness's), as are
    the leaked ones. summary.json and the run table say the run is not contained (before, a log line only, and the
    summary read as a clean run). A real `agentfsm gateway` run of 3 rows on the embedded model, the one end-to-end test of both:
    20-30 s on a loaded 2-core machine."""
    data = tmp_path / "rows.jsonl"
    rows = [{**row(), "extra_info": {"role": role, "victims": 2}} for role in ("victim", "thief", "victim")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "fsm.cli", "gateway", str(_spec(tmp_path, f"{__name__}:attack_harness"))]
    done = subprocess.run(
        [*UNCONTAINED, *argv, "--data", str(data), "--out", str(out)],
        cwd=ROOT,
        env={**ENV, "ISO_DIR": str(tmp_path), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    stolen = json.loads((tmp_path / "thief.json").read_text())
    assert stolen["sessions_found"] == 2 and stolen["statuses"] == [403, 403], stolen
    assert stolen["leaked"] == 2 and stolen["leaked_statuses"] == [403, 403], stolen
    summary = json.loads((out / "summary.json").read_text())
    assert summary["containment"] == {
        "rows": 3,
        "contained": 0,
        "uncontained": 3,
        "why": ["unshare: No space left on device"],
    }, summary.get("containment")
    assert "harnesses NOT contained" in done.stdout and "3 of 3: not isolated" in done.stdout, done.stdout
    assert INJECTED not in (out / "trajectories.jsonl").read_text()
