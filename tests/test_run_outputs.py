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
            raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing "
                               "file data/0: file write failed")  # fmt: skip
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    line = one_line_error(capsys, run_argv(echo_server.url, out, "--num-prompts", "3", "-q"))
    assert "cannot write the run's outputs (batch.pt: [enforce fail" in line and "they are kept in " in line
    kept = Path(line.rsplit("they are kept in ", 1)[1])
    assert sorted(p.name for p in kept.iterdir()) == ["batch.pt", "summary.json", "trajectories.jsonl"]
    assert len((kept / "trajectories.jsonl").read_text().splitlines()) == 3 and read_summary(kept)["trajectories"] == 3
    assert not (out / "summary.json").exists()


def test_a_tool_that_moves_the_process_and_closes_stdout_costs_nothing(tmp_path):
    spec = tmp_path / "rude.yaml"
    spec.write_text(f"name: calculator_rude\nextends: {REPO}/specs/calculator.yaml\ntools:\n"
                    "  - function: tests.fixtures.parts:rude_calculator\n    schema: specs.calculator:TOOL_SCHEMA\n")
    done = subprocess.run([sys.executable, "-m", "fsm.cli.commands", "run", str(spec), "--num-prompts", "2", "--out",
                           "relative/out"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)  # fmt: skip
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
    return next(t for g in data["groups"] if g["status"] == "running" for t in g["trajectories"]
                if not t["done"] and t["prompt_ids"]["items"])  # fmt: skip


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


@pytest.mark.parametrize("tamper, reason", [
    (_unknown_dc, "unknown record type 'os.system'"), (_no_groups, "malformed snapshot (KeyError: 'groups')"),
    (_unknown_state, "state 'NOWHERE' is not one of the agent's"), (_oversized, "arrays differ in length"),
    (_out_of_vocab, "token ids outside the tokenizer's vocabulary"), (_huge_id, "malformed snapshot"),
])  # fmt: skip
def test_a_crafted_snapshot_is_refused_in_one_line(capsys, interrupted, echo_server, tmp_path, tamper, reason):
    out, data = interrupted
    data = json.loads(json.dumps(data))
    tamper(data)
    data.pop("checksum")
    (tmp_path / "snapshot.json").write_text(json.dumps({**data, "checksum": snap._digest(data)}))
    line = one_line_error(capsys, ["run", "--resume", str(tmp_path), "--server", echo_server.url,
                                   "--tokenizer", str(ASSETS), "-q"])  # fmt: skip
    assert line.startswith("agentfsm: --resume: ") and reason in line


def test_an_edited_snapshot_is_refused_by_its_checksum(capsys, interrupted, tmp_path):
    out, data = interrupted
    data = json.loads(json.dumps(data))
    ids = _first_running(data)["prompt_ids"]["items"]
    ids[-1] = (ids[-1] + 1) % 500  # still a token of the vocabulary: only the checksum can tell
    (tmp_path / "snapshot.json").write_text(json.dumps(data))
    line = one_line_error(capsys, ["run", "--resume", str(tmp_path), "--server", "http://127.0.0.1:9",
                                   "--tokenizer", str(ASSETS), "-q"])  # fmt: skip
    assert "its checksum does not match its content" in line
