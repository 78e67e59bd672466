"""What `agentfsm run` leaves behind, whatever happens around it: --out checked before the rollout, a lock
against a second run, outputs kept when --out refuses them, a tool that moves the process or closes its
stdout, and snapshots refused in one line when damaged or crafted (fsm/output/rundir.py, fsm/run/snapshot.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from backends.scripted import ScriptedBackend, echo_backend
from fsm.cli.commands import main
from fsm.output.rundir import locked
from fsm.run import snapshot as snap
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


# --- snapshots: damaged or crafted, refused in one line -------------------------------------------------------


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run interrupted (a real SIGINT) after its third model request: its directory, with snapshot.json."""
    calls = []

    def turn(session_id, turn, prompt):
        calls.append(session_id)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        seed = zlib.crc32(b",".join(str(t).encode() for t in prompt))
        return [10 + (seed + 7919 * k) % 500 for k in range(8)] + [2]

    server = _ThreadServer(ScriptedBackend(turn, latency_s=0.05, model_name="echo"))
    out = tmp_path_factory.mktemp("cut")
    try:
        assert main(run_argv(server.url, out, "--num-prompts", "6", "--concurrency", "2", "-q")) == 130
    finally:
        server.close()
    data = json.loads((out / "snapshot.json").read_text())
    assert any(g["status"] == "running" for g in data["groups"])
    return out, data


def _first_running(data):
    """A running trajectory past its prompt (one still queued has no tokens yet)."""
    return next(
        t
        for g in data["groups"]
        if g["status"] == "running"
        for t in g["trajectories"]
        if not t["done"] and t["prompt_ids"]["items"]
    )


def _unknown_dc(d):
    _first_running(d)["metrics"]["__dc__"] = "os.system"


def _no_groups(d):
    del d["groups"]


def _unknown_state(d):
    _first_running(d)["state"] = "NOWHERE"


def _oversized(d):
    _first_running(d)["response_ids"]["items"] = [11] * 100_000


def _out_of_vocab(d):
    t = _first_running(d)
    t["prompt_ids"]["items"][-1] = 10**6


def _huge_id(d):
    _first_running(d)["prompt_ids"]["items"][0] = 2**40


def _with_response(d, done=None):
    return next(
        t
        for g in d["groups"]
        for t in g["trajectories"]
        if t["response_mask"]["items"] and (done is None or t["done"] == done)
    )


def _meta_without_groups(d):
    del d["meta"]["groups"]


def _meta_groups_99(d):
    d["meta"]["groups"] = 99  # resume waited for 99 groups, forever


def _meta_not_a_dict(d):
    d["meta"] = [1, 2]


def _mask_7(d):
    _with_response(d)["response_mask"]["items"][0] = 7


def _mask_minus_3(d):
    _with_response(d)["response_mask"]["items"][-1] = -3


def _nan_logprob(d):
    _with_response(d)["response_logprobs"]["items"][0] = float("nan")


def _done_without_reason(d):
    _with_response(d, done=True)["termination_reason"] = None


def _sampling_not_a_dict(d):
    d["groups"][0]["sampling"] = "greedy"


def _group_not_a_dict(d):
    d["groups"][0] = 5


def _row_5(d):
    _first_running(d)["row"] = 5  # issue 36 item 11: ran the whole rollout, then AttributeError at output


def _running_group_ready(d):
    # issue 36 item 11: rc 0 with rows whose termination reason was null
    next(g for g in d["groups"] if g["status"] == "running")["status"] = "ready"


def _turns_a_string(d):
    _first_running(d)["assistant_turns"] = "2"


def _messages_not_messages(d):
    _first_running(d)["messages"] = [1, 2]


@pytest.mark.parametrize(
    "tamper, reason",
    [
        (_unknown_dc, "unknown record type 'os.system'"),
        (_no_groups, "malformed snapshot (KeyError: 'groups')"),
        (_unknown_state, "state 'NOWHERE' is not one of the agent's"),
        (_oversized, "arrays differ in length"),
        (_out_of_vocab, "token ids outside the tokenizer's vocabulary"),
        (_huge_id, "malformed snapshot"),
        (_meta_without_groups, "meta.groups: Field required"),
        (_meta_groups_99, "meta.groups is 99, but it holds"),
        (_meta_not_a_dict, "not a snapshot"),
        (_mask_7, "response_mask holds values other than 0 and 1"),
        (_mask_minus_3, "response_mask holds values other than 0 and 1"),
        (_nan_logprob, "logprobs that are not finite numbers <= 0"),
        (_done_without_reason, "finished without a termination reason"),
        (_sampling_not_a_dict, "malformed snapshot"),
        (_group_not_a_dict, "bad status or uid"),
        (_row_5, "field 'row': Input should be a valid dictionary"),
        (_running_group_ready, "is 'ready' but its trajectory"),
        (_turns_a_string, "field 'assistant_turns': Input should be a valid integer"),
        (_messages_not_messages, "field 'messages.0': Input should be a valid dictionary"),
    ],
)
def test_a_crafted_snapshot_is_refused_in_one_line(
    capsys, interrupted, echo_server, tmp_path, tamper, reason
):
    out, data = interrupted
    data = json.loads(json.dumps(data))
    tamper(data)
    data.pop("checksum")
    (tmp_path / "snapshot.json").write_text(json.dumps({**data, "checksum": snap._digest(data)}))
    line = one_line_error(
        capsys,
        ["run", "--resume", str(tmp_path), "--server", echo_server.url, "--tokenizer", str(ASSETS), "-q"],
    )
    assert line.startswith("agentfsm: --resume: ") and reason in line


def test_an_edited_snapshot_is_refused_by_its_checksum(capsys, interrupted, tmp_path):
    out, data = interrupted
    data = json.loads(json.dumps(data))
    ids = _first_running(data)["prompt_ids"]["items"]
    ids[-1] = (ids[-1] + 1) % 500  # still a token of the vocabulary: only the checksum can tell
    (tmp_path / "snapshot.json").write_text(json.dumps(data))
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
    assert "its checksum does not match its content" in line


def test_a_deeply_nested_snapshot_is_refused_in_one_line(capsys, tmp_path):
    (tmp_path / "snapshot.json").write_text("[" * 200_000 + "]" * 200_000)
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
    assert line.startswith("agentfsm: --resume: ") and "nested too deeply" in line


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
