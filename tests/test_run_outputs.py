"""What `agentfsm run` leaves behind, whatever happens around it: --out checked before the rollout, a lock
against a second run, outputs kept when --out refuses them, a tool that moves the process or closes its
stdout, and an old snapshot refused in one line (fsm/output/rundir.py, fsm/cli/commands.py, fsm/cli/resume.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.scripted import echo_backend
from fsm.cli.commands import main
from fsm.output.rundir import locked
from tests.conftest import ASSETS, REPO
from tests.test_cli import _ThreadServer, assert_consistent, one_line_error, read_summary, run_argv

ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "PYTHONPATH": str(REPO)}


@pytest.fixture
def echo_server():
    backend = echo_backend()
    server = _ThreadServer(backend)
    server.backend = backend
    yield server
    server.close()


def test_an_unwritable_out_is_refused_before_the_rollout(capsys, echo_server):
    line = one_line_error(capsys, run_argv(echo_server.url, "/sys/kernel", "--num-prompts", "2", "-q"))
    assert line.startswith("agentfsm: --out /sys/kernel: cannot write there")
    assert list(echo_server.server.log) == []  # not one request: refused before the rollout


def test_a_second_run_into_a_locked_directory_refuses_in_one_line(capsys, echo_server, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with locked(out):
        line = one_line_error(capsys, run_argv(echo_server.url, out, "--num-prompts", "2", "-q"))
    assert f"another agentfsm run (pid {os.getpid()}) is writing there" in line
    assert main(run_argv(echo_server.url, out, "--num-prompts", "2", "-q")) == 0  # free again
    assert_consistent(out, 2)


def test_outputs_go_to_a_named_fallback_when_out_refuses_them(capsys, echo_server, tmp_path, monkeypatch):
    import torch

    out = tmp_path / "out"
    real_save = torch.save

    def full_disk(obj, path, *args, **kwargs):  # what torch's writer raises on a full disk
        if str(path).startswith(str(out)):
            raise RuntimeError(
                "[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing "
                "file data/0: file write failed"
            )
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    line = one_line_error(capsys, run_argv(echo_server.url, out, "--num-prompts", "3", "-q"))
    assert "cannot write the run's outputs (batch.pt: [enforce fail" in line and "they are kept in " in line
    kept = Path(line.rsplit("they are kept in ", 1)[1])
    assert sorted(p.name for p in kept.iterdir()) == ["batch.pt", "summary.json", "trajectories.jsonl"]
    assert (
        len((kept / "trajectories.jsonl").read_text().splitlines()) == 3
        and read_summary(kept)["trajectories"] == 3
    )
    assert not (out / "summary.json").exists()


@pytest.mark.slow
def test_a_tool_that_moves_the_process_and_closes_stdout_costs_nothing(tmp_path):
    spec = tmp_path / "rude.yaml"
    spec.write_text(
        f"name: calculator_rude\nextends: {REPO}/specs/calculator.yaml\ntools:\n"
        "  - function: tests.fixtures.parts:rude_calculator\n    schema: specs.calculator:TOOL_SCHEMA\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsm.cli.commands",
            "run",
            str(spec),
            "--num-prompts",
            "2",
            "--out",
            "relative/out",
        ],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    summary = read_summary(tmp_path / "relative/out")
    assert summary["status"] == "completed" and summary["tool_errors"] == 0 and summary["trajectories"] == 2


# --- an old snapshot: refused in one line (the journal replaced it; crafted journals: tests/test_journal.py) ---


def test_an_old_snapshot_is_refused_in_one_line(capsys, tmp_path):
    (tmp_path / "snapshot.json").write_text(json.dumps({"format": 2, "groups": []}))
    line = one_line_error(
        capsys,
        [
            "run",
            "--resume",
            str(tmp_path),
            "--server",
            "http://127.0.0.1:9",
            "--tokenizer",
            str(ASSETS),
            "-q",
        ],
    )
    assert line == (
        f"agentfsm: --resume: {tmp_path / 'snapshot.json'}: a snapshot of an agentfsm before the journal; this "
        "version cannot resume it: resume it with the version that wrote it, or start the run again"
    )


# --- the lock: links, directories, forked children ------------------------------------------------------------


def test_a_planted_lock_link_is_refused_and_its_target_untouched(capsys, echo_server, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".agentfsm.lock").symlink_to(victim)
    line = one_line_error(capsys, run_argv(echo_server.url, out, "--num-prompts", "2", "-q"))
    assert "its lock file .agentfsm.lock cannot be used (a symbolic link); remove it" in line
    assert victim.read_text() == "precious"


def test_a_lock_path_that_is_a_directory_is_refused_in_one_line(capsys, echo_server, tmp_path):
    out = tmp_path / "out"
    (out / ".agentfsm.lock").mkdir(parents=True)
    line = one_line_error(capsys, run_argv(echo_server.url, out, "--num-prompts", "2", "-q"))
    assert "its lock file .agentfsm.lock cannot be used" in line and "remove it" in line


HOLDER = """
import os, sys, time
from pathlib import Path
from fsm.output.rundir import locked
with locked(Path(sys.argv[1])):
    child = os.fork()
    if child == 0:  # a tool's process, forked while the run holds the lock
        time.sleep(120)
        os._exit(0)
    print(child, flush=True)
    time.sleep(120)
"""


def test_a_killed_runs_forked_children_do_not_hold_its_lock(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], env=ENV, stdout=subprocess.PIPE, text=True
    )
    child = int(holder.stdout.readline())
    try:
        holder.kill()  # kill -9: the run is gone, its forked child lives on
        holder.wait(10)
        os.kill(child, 0)  # still alive
        with locked(out):  # before the fix: "another agentfsm run (pid <the dead one>) is writing there"
            pass
    finally:
        os.kill(child, signal.SIGKILL)


# --- a signal once the outputs are written ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, signal.SIGTERM, signal.SIGINT, signal.SIGTERM],
    ids=["SIGINT-1", "SIGTERM-1", "SIGINT-2", "SIGTERM-2"],
)
def test_a_signal_right_after_wrote_keeps_the_runs_exit_code(echo_server, tmp_path, sig):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fsm.cli",
            *run_argv(echo_server.url, tmp_path / "out", "-q", "--num-prompts", "2"),
        ],
        env=ENV,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("wrote "):
                break
        deadline = time.monotonic() + 60
        while (
            proc.poll() is None and time.monotonic() < deadline
        ):  # signals until it exits: every moment is hit
            proc.send_signal(sig)  # before the fix: a KeyboardInterrupt traceback, or rc -2 / -15
            time.sleep(0.005)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, (proc.returncode, err)
    assert_consistent(tmp_path / "out", 2)
