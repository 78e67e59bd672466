"""`agentfsm gateway SPEC --workers N` (fsm/gateway/workers.py): the rows of one run over N real worker processes
behind one front, merged into one run directory; a worker that dies or never registers fails the run and
leaves no process behind; the flags that cannot go with --workers are usage errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fsm.cli.commands import main
from fsm.gateway import harness
from tests.conftest import extra

ROOT = Path(__file__).resolve().parents[2]
SPEC = str(ROOT / "examples/gateway/base.yaml")
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _agentfsm(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fsm.cli", "gateway", SPEC, *argv],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def _pid_file(out: Path, tag: str, timeout: float = 60) -> int:
    """The worker's pid, as soon as its parent has started it."""
    path = out / "workers" / tag / "pid"
    deadline = time.monotonic() + timeout
    while not (path.is_file() and path.read_text().endswith("\n")):
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.05)
    return int(path.read_text())


def _alive(pid: int) -> bool:
    """The process, or anything left in its process group."""
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return Path(f"/proc/{pid}").exists()


def _batch(path: Path) -> dict:
    return torch.load(path, weights_only=False)


@pytest.mark.slow
def test_two_workers_write_the_run_one_process_writes(tmp_path):
    extra("openai", "gateway")  # examples/gateway/base.yaml's harness is the openai SDK
    greedy = ("--num-prompts", "6", "--temperature", "0", "--check-tokens", "-q")
    out = tmp_path / "two"
    one = _agentfsm(*greedy, "--out", str(tmp_path / "one"))  # beside the run over workers: greedy either way
    two = _agentfsm(*greedy, "--workers", "2", "--out", str(out))
    try:
        (rc1, said1), (rc2, said2) = _finish(one), _finish(two)
    finally:
        for proc in (one, two):
            if proc.poll() is None:
                proc.kill()
    assert rc1 == 0, said1
    assert rc2 == 0, said2

    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(6))  # input order
    assert [r["gateway_session"].split("-")[0] for r in records] == ["w0"] * 3 + ["w1"] * 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["trajectories"] == 6 and summary["failed"] == 0
    assert summary["token_check_failures"] == 0 and summary["files"]["batch.pt"]["rows"] == 6
    workers = summary["gateway_workers"]
    assert workers["routed"]["w0"] > 0 and workers["routed"]["w1"] > 0
    assert [w["rows"] for w in workers["workers"].values()] == [[0, 3], [3, 6]]
    assert summary["rollout_cpu_s"] > max(w["rollout_cpu_s"] for w in workers["workers"].values())

    one, two = _batch(tmp_path / "one" / "batch.pt"), _batch(out / "batch.pt")
    assert one["batch"].keys() == two["batch"].keys()
    for key, tensor in one["batch"].items():  # greedy on the embedded model: token for token, logprobs too
        assert torch.equal(tensor, two["batch"][key]), key
    assert one["non_tensor_batch"].keys() == two["non_tensor_batch"].keys()
    for key, values in one["non_tensor_batch"].items():
        if key not in (
            "trajectory_id",
            "tree",
        ):  # each process names its own trajectories (a tree: its root's)
            assert [repr(v) for v in values] == [repr(v) for v in two["non_tensor_batch"][key]], key
    assert len(set(two["non_tensor_batch"]["trajectory_id"])) == 6
    assert one["meta_info"].keys() == two["meta_info"].keys()
    assert np.isclose(
        one["meta_info"]["sampling"]["temperature"], two["meta_info"]["sampling"]["temperature"]
    )
    for tag in ("w0", "w1"):
        assert not _alive(_pid_file(out, tag))


@pytest.mark.slow
def test_a_worker_that_dies_fails_the_run_and_no_process_is_left(tmp_path):
    out = tmp_path / "run"
    proc = _agentfsm("--num-prompts", "32", "--workers", "2", "--out", str(out))
    pids = {tag: _pid_file(out, tag) for tag in ("w0", "w1")}
    os.kill(pids["w1"], signal.SIGKILL)
    rc, said = _finish(proc, timeout=120)
    assert rc == 1, said
    last = said.strip().splitlines()[-1]
    assert last.startswith(
        f"agentfsm: gateway worker w1 (pid {pids['w1']}, rows 16..31) was killed by SIGKILL"
    ), said
    assert "the other workers were stopped" in last
    assert not (out / "summary.json").exists()
    assert not any(_alive(pid) for pid in pids.values())


@pytest.mark.slow
def test_a_worker_that_never_registers_fails_the_run_in_time(tmp_path):
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = _agentfsm(
        "--num-prompts", "4", "--workers", "2", "--worker-start-timeout", "20", "--out", str(out)
    )
    pids = {tag: _pid_file(out, tag) for tag in ("w0", "w1")}
    os.kill(pids["w1"], signal.SIGSTOP)  # hung before it could register
    rc, said = _finish(proc, timeout=120)
    assert rc == 1, said
    assert (
        f"agentfsm: gateway worker w1 (pid {pids['w1']}, rows 2..3) did not register with the front within 20 s "
        "(--worker-start-timeout)"
    ) in said
    assert time.monotonic() - t0 < 60
    assert not any(_alive(pid) for pid in pids.values())


@pytest.mark.slow
def test_sigterm_to_the_parent_stops_every_worker(tmp_path):
    out = tmp_path / "run"
    proc = _agentfsm("--num-prompts", "4", "--workers", "2", "--out", str(out))
    pids = {tag: _pid_file(out, tag) for tag in ("w0", "w1")}
    proc.send_signal(signal.SIGTERM)
    rc, said = _finish(proc, timeout=120)
    assert rc == 130, said
    assert "SIGTERM: stopping 2 gateway workers" in said and said.strip().splitlines()[-1].startswith(
        "agentfsm: interrupted"
    )
    assert not any(_alive(pid) for pid in pids.values())


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--workers", "0"], "argument --workers: must be an integer >= 1, got 0"),
        (["--workers", "2", "--resume", "runs/x"], "--resume cannot resume a run over --workers 2"),
        (["--workers", "2", "--ray"], "--ray with --workers 2"),
        (["--workers", "2", "--launch-sglang", "m"], "--launch-sglang with --workers 2"),
        (["--worker-start-timeout", "0"], "argument --worker-start-timeout: must be a number > 0, got 0"),
    ],
)
def test_flags_that_cannot_go_with_workers_are_usage_errors(argv, problem, capsys):
    assert main(["gateway", SPEC, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("agentfsm gateway: error: ") and problem in err, err


def _spec(tmp_path: Path, action: str) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"""name: {action.rsplit(":", 1)[1]}
extends: {SPEC}
states:
  HARNESS:
    action: {action}
    next:
      - {{to: GENERATING, when: harness_calling}}
      - {{to: TERMINATED, when: harness_failed, reason: harness_failed}}
      - {{to: TERMINATED, reason: done}}
""")
    return spec


async def _pid_then_chat(call):
    """Say which worker process runs a row (a function harness runs in its worker), then the calculator chat."""
    from examples.gateway.harnesses import openai_chat

    (Path(os.environ["ENV_DIR"]) / str(os.getpid())).touch()
    return await openai_chat(call)


pid_harness = harness(_pid_then_chat, timeout_s=120)


def _stopped_worker(tmp_path: Path, *more: str) -> tuple[subprocess.Popen, dict[str, int], Path]:
    """A run over 2 workers whose w1 is stopped (SIGSTOP) once it has registered and started a row."""
    seen, out = tmp_path / "pids", tmp_path / "run"
    seen.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fsm.cli",
            "gateway",
            str(_spec(tmp_path, "tests.gateway.test_workers:pid_harness")),
            "--num-prompts",
            "32",
            "--workers",
            "2",
            "--worker-silent-timeout",
            "5",
            "--out",
            str(out),
            *more,
        ],
        cwd=ROOT,
        env={**ENV, "ENV_DIR": str(seen)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = {tag: _pid_file(out, tag) for tag in ("w0", "w1")}
    deadline = time.monotonic() + 120
    while not (seen / str(pids["w1"])).exists():  # registered: its rows have started
        assert time.monotonic() < deadline and proc.poll() is None, "worker w1 started no row"
        time.sleep(0.05)
    os.kill(pids["w1"], signal.SIGSTOP)
    return proc, pids, out


@pytest.mark.slow
def test_a_stopped_worker_is_named_and_fails_the_run(tmp_path):
    proc, pids, out = _stopped_worker(tmp_path, "-q")
    t0 = time.monotonic()
    rc, said = _finish(proc, timeout=120)
    assert rc == 1, said
    last = said.strip().splitlines()[-1]
    assert last.startswith(
        f"agentfsm: gateway worker w1 (pid {pids['w1']}, rows 16..31) has sent no heartbeat for 5 s "
        "(--worker-silent-timeout): it is stopped (SIGSTOP) or frozen"
    ), said
    assert time.monotonic() - t0 < 60
    assert not (out / "summary.json").exists()
    assert not any(_alive(pid) for pid in pids.values())


@pytest.mark.slow
def test_ctrl_c_with_a_stopped_worker_ends_the_run(tmp_path):
    proc, pids, out = _stopped_worker(tmp_path)
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    rc, said = _finish(proc, timeout=120)
    assert rc == 130, said
    assert f"agentfsm: gateway worker w1 (pid {pids['w1']}) has sent no heartbeat for 5 s" in said, said
    assert time.monotonic() - t0 < 60
    assert said.strip().splitlines()[-1].startswith("agentfsm: interrupted"), said
    assert not any(_alive(pid) for pid in pids.values())
