"""Snapshots (a journal compacted, fsm/run/stream.py; its codec fsm/run/codec.py): a trajectory round-trips through
JSON slot for slot; a snapshot restores only
into the spec it was taken with; a continuous-mode snapshot taken at any point and restored in a new process
gives the greedy result of an uninterrupted run; and `agentfsm run`, interrupted by a real SIGINT while rows
are in flight, resumes with `--resume DIR` to the uninterrupted run's batch, token for token."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.base import BaseBackend, GenerateRequest, GenerateResult
from backends.scripted import echo_backend
from fsm import RolloutEngine
from fsm.run.codec import SnapshotError, decode_trajectory, encode_trajectory
from fsm.run.fold import rebuild
from fsm.run.journal import JOURNAL, records
from specs.calculator import make_prompts
from tests.conftest import ASSETS, assert_same_batch_files, model_turn, scripted, tool_turn, user_row
from tests.fixtures import snapshot_tools

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
GREEDY = {"temperature": 0}


def test_trajectory_round_trips_every_slot(tok):
    with RolloutEngine("calculator", tok, backend=echo_backend()) as engine:
        trajs = engine._run_sync(engine.arun(make_prompts(2), n=2))
    for t in trajs:
        back = decode_trajectory(json.loads(json.dumps(encode_trajectory(t))))
        for name in type(t).__slots__:
            # path_times: moved to this process's clock; the kept context: built again from the ids; a model
            # turn's deadline: this process's loop's clock, of a turn in flight
            if name not in ("path_times", "_context", "turn_deadline", "node"):
                assert getattr(back, name) == getattr(t, name), name
        assert back.node.alone and back.node.fields() == t.node.fields()  # transient: its root again
        assert back.context() == t.context() == t.context_ids()
        assert len(back.path_times) == len(t.path_times) - 1  # the driver's begin() adds the current state's


def test_restore_refuses_another_spec(tok, tmp_path):
    with RolloutEngine("calculator", tok, backend=echo_backend(latency_s=0.2)) as engine:
        engine.submit(make_prompts(2), n=1)
        engine.snapshot(tmp_path / "s.json")
    with RolloutEngine("tool_agent", tok, backend=echo_backend()) as other:
        with pytest.raises(SnapshotError, match="spec hash"):
            other.restore(tmp_path / "s.json")


class Counting(BaseBackend):
    """The embedded tiny model, counting its model calls: `reached` is set at the k-th."""

    def __init__(self, inner, k: int):
        self.inner, self.k, self.calls = inner, k, 0
        self.reached = asyncio.Event()
        self.model_name, self.context_length = inner.model_name, inner.context_length

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.calls += 1
        if self.calls >= self.k:
            self.reached.set()
        return await self.inner.generate(request)


RESTORE = """
import sys, json, torch
from fsm import RolloutEngine
for snapshot, out in zip(sys.argv[1::2], sys.argv[2::2]):  # each into an engine of its own
    with RolloutEngine("calculator", torch_threads=1) as engine:
        meta = engine.restore(snapshot)
        batch = engine.take(meta["groups"], timeout=120)
    torch.save({k: v for k, v in batch.batch.items()} | {"uid": list(batch.non_tensor_batch["uid"])}, out)
"""


@pytest.fixture(scope="module")
def greedy_reference():
    rows = make_prompts(3)
    with RolloutEngine("calculator", torch_threads=1) as engine:
        return rows, engine.generate_sequences(rows, n=2, sampling_params=GREEDY)


def same_groups(reference, got) -> None:
    """The same batch up to group order (completion order varies)."""
    ref_uids = list(reference.non_tensor_batch["uid"])
    for key in reference.batch.keys():
        for i, uid in enumerate(got["uid"]):
            j = ref_uids.index(uid) + (i % 2)  # samples keep their order inside a group
            assert torch.equal(reference.batch[key][j], got[key][i]), (key, uid)


def _snapshot_at(rows: list, k: int, path: Path) -> None:
    """Run `rows` greedily on the embedded model; snapshot into `path` after the k-th model call, and stop."""
    from fsm.api import make_backend

    backend = Counting(make_backend(torch_threads=1), k)
    with RolloutEngine("calculator", ASSETS, backend=backend) as engine:

        async def at_k():
            await engine.asubmit(rows, n=2, sampling_params=GREEDY)
            await engine.core.call(asyncio.wait_for(backend.reached.wait(), 120))
            return await engine.asnapshot(path, meta={"groups": len(rows)}, stop=True)

        asyncio.run(at_k())


@pytest.mark.slow
@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# 3 rows x 2 samples x 2 model turns = 12 model calls: snapshot after the k-th, with some still to come.
@given(ks=st.lists(st.integers(min_value=1, max_value=11), min_size=3, max_size=3, unique=True))
def test_snapshot_at_any_point_restores_in_a_new_process_to_the_greedy_result(greedy_reference, tmp_path, ks):
    """Three points, each restored in a fresh engine of one new process (a process start each cost ~5 s)."""
    rows, reference = greedy_reference
    argv = []
    for k in ks:
        _snapshot_at(rows, k, tmp_path / f"s{k}.json")
        argv += [str(tmp_path / f"s{k}.json"), str(tmp_path / f"b{k}.pt")]
    subprocess.run([sys.executable, "-c", RESTORE, *argv], env=ENV, cwd=REPO, check=True, timeout=240)
    for k in ks:
        same_groups(reference, torch.load(tmp_path / f"b{k}.pt", weights_only=False))


# --- agentfsm run: Ctrl-C, then --resume --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def tiny_server():
    """The tiny model behind a dev server: the run's own start-up is short, and the server says when
    requests are in flight."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "backends.devserver",
            "--model",
            str(ASSETS),
            "--device",
            "cpu",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=ENV,
        cwd=REPO,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the tiny dev server did not come up"
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(20)


def _run(url: str, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fsm.cli.commands",
        "run",
        "specs/calculator.yaml",
        "--server",
        url,
        "--num-prompts",
        "6",
        "--n",
        "2",
        "--temperature",
        "0",
        "--concurrency",
        "3",
        "--out",
        str(out),
        "-q",
        *extra,
    ]


@pytest.mark.slow
def test_ctrl_c_flushes_the_journal_and_resume_completes_the_run_token_for_token(tiny_server, tmp_path):
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    subprocess.run(_run(tiny_server, ref), env=ENV, cwd=REPO, check=True, timeout=240)
    proc = subprocess.Popen(_run(tiny_server, cut), env=ENV, cwd=REPO, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while (
        True
    ):  # interrupt once the rollout is under way: requests at the server (12 trajectories, 3 at once:
        load = _get(f"{tiny_server}/v1/loads")["loads"][0]  # most are still to run then)
        if load["num_running_reqs"] + load["num_waiting_reqs"] > 0:
            break
        assert proc.poll() is None and time.monotonic() < deadline, "the run never reached the server"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "--resume" in err, err
    if (cut / "summary.json").exists():  # some rows had finished: written, with the status saying so
        assert json.loads((cut / "summary.json").read_text())["status"] == "interrupted"
    assert (cut / JOURNAL).is_file() and not (cut / "snapshot.json").exists()  # the journal is the one record
    resumed = subprocess.run(
        _run(tiny_server, tmp_path / "ignored", "--resume", str(cut)),
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr
    going_on = re.search(r"(\d+) go on from their last state", resumed.stderr)
    assert going_on and int(going_on.group(1)) > 0, (
        f"nothing was in flight at the interrupt: {resumed.stderr}"
    )
    assert rebuild(records(cut / JOURNAL)).ended == "completed"
    assert_same_batch_files(ref, cut)
    assert json.loads((cut / "summary.json").read_text())["status"] == "completed"


# --- issue 27: interactions, servers that cannot pause, full disks, other tokenizers, planted links ----------


def _guess_rows(k: int) -> list[dict]:
    return [
        {
            "raw_prompt": [{"role": "user", "content": "Guess my number between 1 and 10."}],
            "interaction_kwargs": {"secret": 7},
            "uid": f"g{i}",
        }
        for i in range(k)
    ]


def test_a_snapshot_during_an_interaction_restarts_that_trajectory_on_restore(tok, tmp_path):
    with RolloutEngine("interaction_agent", tok, backend=echo_backend(latency_s=0.05)) as engine:
        engine.submit(_guess_rows(3), n=1)
        deadline = time.monotonic() + 60
        while not any(t.interaction_started for t, _ in list(engine.runner.live.values())):
            assert time.monotonic() < deadline, "no trajectory reached its interaction"
            time.sleep(0.01)
        info = engine._run_sync(engine.asnapshot(tmp_path / "s.json", stop=True))  # refused before the fix
    assert info["restarted"] >= 1 and info["ready_groups"] + info["running_groups"] == 3
    with RolloutEngine("interaction_agent", tok, backend=echo_backend()) as engine:
        engine.restore(tmp_path / "s.json")
        groups = engine._run_sync(engine.atake_groups(3, timeout=60))
    assert sorted(g.uid for g in groups) == ["g0", "g1", "g2"]
    assert all(t.termination_reason and not t.failed for g in groups for t in g.trajectories)


class NoPauseUntilAborted(BaseBackend):
    """A server without /pause_generation whose turns last until their request is aborted (then they end
    with three tokens of partial output, as SGLang answers /abort_request); resumed turns answer at once."""

    def __init__(self):
        self.inner = echo_backend()
        self.model_name, self.context_length = "echo", None
        self.aborted: dict[str, asyncio.Event] = {}
        self.started = 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.resumed:
            return await self.inner.generate(request)
        self.started += 1
        event = self.aborted.setdefault(request.session_id, asyncio.Event())
        await event.wait()
        return GenerateResult(
            [11, 12, 13],
            [-0.5] * 3 if request.return_logprob else None,
            "abort",
            prompt_tokens=len(request.prompt_ids),
        )

    async def abort(self, session_id: str) -> None:
        self.aborted.setdefault(session_id, asyncio.Event()).set()


def test_a_server_that_cannot_pause_has_its_turns_aborted_for_the_snapshot(tok, tmp_path):
    backend = NoPauseUntilAborted()
    with RolloutEngine("calculator", tok, backend=backend) as engine:
        engine.submit(make_prompts(2), n=1)
        deadline = time.monotonic() + 60
        while backend.started < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        info = engine._run_sync(
            engine.asnapshot(tmp_path / "s.json", stop=True, timeout=20, abort_turns=True)
        )
        assert time.monotonic() - t0 < 15  # before the fix: a TimeoutError after the 20 s
    assert info["running_groups"] == 2
    partial = [t.partial_turn for t in rebuild(records(tmp_path / "s.json")).trajs.values()]
    assert len(partial) == 2 and all(p and p[0] == [11, 12, 13] for p in partial), partial  # kept


def test_a_snapshot_that_out_refuses_goes_to_the_fallback_and_leaves_no_temporary(tok, tmp_path, monkeypatch):
    from fsm.run import journal

    refused = tmp_path / "full"
    refused.mkdir()
    real_replace = os.replace

    def full_disk(src, dst, *a, **k):
        if str(dst).startswith(str(refused)):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(journal.os, "replace", full_disk)
    with RolloutEngine("calculator", tok, backend=echo_backend(latency_s=0.2)) as engine:
        engine.submit(make_prompts(2), n=1)
        kept = tmp_path / "kept"
        kept.mkdir()
        info = engine._run_sync(engine.asnapshot(refused / "snapshot.json", stop=True, fallback=lambda: kept))
    assert info["path"] == str(kept / "snapshot.json") and (kept / "snapshot.json").is_file()
    assert sorted(p.name for p in refused.iterdir()) == []  # no stray .snapshot.json.writing
    with RolloutEngine("calculator", tok, backend=echo_backend()) as engine:
        engine.restore(kept / "snapshot.json")
        assert len(engine._run_sync(engine.atake_groups(2, timeout=60))) == 2


def test_a_json_snapshot_of_an_older_agentfsm_is_refused_in_one_line(tok, tmp_path):
    """Snapshots were JSON files before they were journals: refused in one line saying what to do."""
    old = tmp_path / "s.json"
    old.write_text(json.dumps({"format": 2, "groups": [], "checksum": "0" * 64}))
    with RolloutEngine("calculator", tok, backend=echo_backend()) as engine:
        with pytest.raises(SnapshotError) as refused:
            engine.restore(old)
    line = str(refused.value)
    assert line.startswith(f"{old}: a JSON snapshot of an agentfsm before") and "take it again" in line, line
    assert "\n" not in line


def test_restore_refuses_another_tokenizer(tok, tmp_path):
    import copy

    with RolloutEngine("calculator", tok, backend=echo_backend(latency_s=0.2)) as engine:
        engine.submit(make_prompts(2), n=1)
        engine.snapshot(tmp_path / "s.json", stop=True)
    other = copy.deepcopy(tok)
    other.add_tokens(["<another_vocabulary>"])  # the same template, another vocabulary
    with RolloutEngine("calculator", other, backend=echo_backend()) as engine:
        with pytest.raises(SnapshotError, match="taken with the tokenizer"):
            engine.restore(tmp_path / "s.json")


def test_a_planted_link_in_place_of_the_temporary_is_replaced_not_followed(tmp_path):
    from fsm.run.journal import write

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".snapshot.json.writing").symlink_to(victim)
    write(out / "snapshot.json", [{"t": "run", "format": 1}])
    assert victim.read_text() == "precious"
    assert (
        not (out / "snapshot.json").is_symlink() and records(out / "snapshot.json").records[0]["t"] == "run"
    )
    assert not (out / ".snapshot.json.writing").exists()


@pytest.mark.slow
def test_a_snapshot_of_a_tree_with_nodes_keeps_them_and_restores_to_both_policies_batches(tmp_path):
    """A tree whose children exist is written node by node (before, the snapshot was refused) and restored on the
    embedded model to a batch per policy; tests/test_snapshot_trees.py compares such rows with an uninterrupted
    run's, token for token."""
    from fsm.api import make_backend

    backend = Counting(
        make_backend(torch_threads=1), 6
    )  # the planner's turn, its children's, then the planner's
    with RolloutEngine("specs/planner_solver.yaml", ASSETS, backend=backend) as engine:

        async def after_children():
            await engine.asubmit(make_prompts(2), n=1, sampling_params=GREEDY)
            await engine.core.call(asyncio.wait_for(backend.reached.wait(), 120))
            return await engine.asnapshot(tmp_path / "s.json", stop=True)

        info = asyncio.run(after_children())
    assert info["ready_groups"] + info["running_groups"] == 2, info
    assert any(r["t"] == "traj" and ":" in r["s"] for r in records(tmp_path / "s.json").records)  # its nodes
    with RolloutEngine("specs/planner_solver.yaml", ASSETS, backend=make_backend(torch_threads=1)) as engine:
        engine.restore(tmp_path / "s.json")
        batches = engine.take(2, timeout=300)  # a batch per policy, each with its staleness
    assert set(batches) == {"planner", "solver"}
    assert all(b.meta_info["staleness"] == [0, 0] for b in batches.values())


def test_the_sync_snapshot_of_a_blocked_loop_is_taken_from_outside_it_and_close_returns(tok, tmp_path):
    """A sync `snapshot` while an `isolation: none` tool blocks the engine's loop is taken from outside that loop,
    as `asnapshot`'s is (fsm/run/local.py `take_snapshot`), and `close()` on the engine it leaves wedged returns at
    once, as `aclose()` does. Before, each was handed to the blocked loop itself, and waited forever. At its end
    the tool is released and the loop's thread joined: no stuck engine thread reaches the tests after it."""
    spec = tmp_path / "blocking.yaml"
    spec.write_text(
        f"name: calculator_blocking\nextends: {REPO / 'specs'}/calculator.yaml\ntools:\n"
        "  - function: tests.fixtures.snapshot_tools:blocks_until_released\n"
        "    schema: specs.calculator:TOOL_SCHEMA\n    isolation: none\n"
    )
    turns = [tool_turn(tok, ("calculator", {"expression": "1"}))]
    engine = RolloutEngine(str(spec), tok, backend=scripted(turns, latency_s=0.05))
    engine.submit([user_row()], n=1)
    home = engine.core.home()
    answer: dict = {}

    def snapshot_then_close() -> None:
        answer.update(engine.snapshot(tmp_path / "s.json"))
        engine.close()
        answer["closed"] = True

    taking = threading.Thread(target=snapshot_then_close, daemon=True)  # the loop stays blocked: a daemon
    try:
        taking.start()
        taking.join(60)
        assert answer.get("blocked") is True and answer["running_groups"] == 1, answer
        assert engine.wedged and answer.get("closed") and (tmp_path / "s.json").exists()
    finally:
        snapshot_tools.RELEASED.set()
        home.close(30)
        snapshot_tools.RELEASED.clear()
    assert not home.thread.is_alive()


def test_a_blocked_loops_snapshot_keeps_the_side_effecting_calls_its_step_finished(tok, tmp_path):
    """One model turn calls a side-effecting tool, which answers, then a tool that blocks the loop: the snapshot
    taken from outside the loop writes the row as it was before that step, and carries the finished call's result
    (a `tool` record, as the journal keeps it), so that the restored row answers that call from it rather than run
    its effect again; the blocking call runs again. Before, the effect ran twice. No coroutine is left unawaited
    when the loop's thread ends: before, the snapshot sent to the blocked loop was (`Local._snapshot_here`)."""
    spec = tmp_path / "blocking.yaml"
    spec.write_text(
        f"name: calculator_blocking\nextends: {REPO / 'specs'}/calculator.yaml\ntools:\n"
        "  - function: tests.fixtures.snapshot_tools:counted\n    isolation: none\n"
        "  - function: tests.fixtures.snapshot_tools:blocks_until_released\n"
        "    schema: specs.calculator:TOOL_SCHEMA\n    isolation: none\nlimits:\n  max_parallel_calls: 2\n"
    )
    calls = tool_turn(tok, ("counted", {"expression": "1"}), ("calculator", {"expression": "2"}))

    def turns(row, sample, turn, prompt_ids):  # by the prompt: a restored row's backend counts turns anew
        return model_turn(tok, "#### 3") if "released 2" in tok.decode(prompt_ids) else calls

    snapshot_tools.RUNS.clear()
    snapshot_tools.BLOCKING.clear()
    engine = RolloutEngine(str(spec), tok, backend=scripted(turns, latency_s=0.05))
    engine.submit([user_row(reward_model={"ground_truth": "3"})], n=1)
    home = engine.core.home()
    try:
        answer = snapshot_tools.snapshot_while_blocked(engine, tmp_path / "s.json")
        assert answer.get("blocked") is True and answer["running_groups"] == 1, answer
        ran = list(snapshot_tools.RUNS)
        assert len(ran) == 1, ran  # the effect, before the loop blocked
        engine.close()
    finally:
        snapshot_tools.RELEASED.set()
        with warnings.catch_warnings(record=True) as caught:  # the loop's thread ends inside: it warns here
            warnings.simplefilter("always")
            home.close(30)
            gc.collect()
    unawaited = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not unawaited, (
        unawaited
    )  # the snapshot sent to the blocked loop is never made there, or ends there
    try:
        with RolloutEngine(str(spec), tok, backend=scripted(turns)) as restored:
            restored.restore(tmp_path / "s.json")
            (group,) = restored._run_sync(restored.atake_groups(1, timeout=60))
    finally:
        snapshot_tools.RELEASED.clear()
    (traj,) = group.trajectories
    assert not traj.failed, traj.termination_reason
    tools = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert tools == ["ran 1", "released 2"], tools
    assert snapshot_tools.RUNS == ran  # not run again
    kept = [r for r in records(tmp_path / "s.json").records if r["t"] == "tool"]
    assert [(r["k"], r["o"]["text"]) for r in kept] == [(ran[0], "ran 1")], kept


def test_a_row_the_snapshot_restarts_answers_its_side_effecting_calls_from_the_snapshot(tok, tmp_path):
    """A row calls a side-effecting tool, which answers, then talks with its user simulator: a snapshot taken
    during that interaction starts the row over on restore (its simulator's state is not ours), and writes that
    call's result (a `tool` record), as a journal's resume answers the calls of a row that starts over by their
    key. Restored, the row's first turn calls the tool again under the same key and is answered from it. Before,
    a restarted row's calls were left out of the snapshot and the effect ran twice."""
    spec = tmp_path / "talking.yaml"
    spec.write_text(
        f"name: calculator_talking\nextends: {REPO / 'specs'}/calculator.yaml\ntools:\n"
        "  - function: tests.fixtures.snapshot_tools:counted\n    isolation: none\n"
        "interaction:\n  class: specs.interactions:GuessNumber\n"
        "limits:\n  max_assistant_turns: 12\n  response_length: 600\n"
    )
    calls = tool_turn(tok, ("counted", {"expression": "1"}))

    def turns(row, sample, turn, prompt_ids):  # by the prompt: a restored row's backend counts turns anew
        return model_turn(tok, "5") if "ran 1" in tok.decode(prompt_ids) else calls

    row = user_row(interaction_kwargs={"secret": 7}, reward_model={"ground_truth": "7"})
    snapshot_tools.RUNS.clear()
    with RolloutEngine(str(spec), tok, backend=scripted(turns, latency_s=0.05)) as engine:
        engine.submit([row], n=1)
        deadline = time.monotonic() + 60
        while not any(t.interaction_started for t, _ in list(engine.runner.live.values())):
            assert time.monotonic() < deadline, "the row never reached its interaction"
            time.sleep(0.01)
        info = engine._run_sync(engine.asnapshot(tmp_path / "s.json", stop=True))
    assert info["restarted"] == 1 and info["running_groups"] == 1, info
    ran = list(snapshot_tools.RUNS)
    assert len(ran) == 1, ran
    kept = [r for r in records(tmp_path / "s.json").records if r["t"] == "tool"]
    assert [(r["k"], r["o"]["text"]) for r in kept] == [(ran[0], "ran 1")], kept
    with RolloutEngine(str(spec), tok, backend=scripted(turns)) as restored:
        restored.restore(tmp_path / "s.json")
        (group,) = restored._run_sync(restored.atake_groups(1, timeout=60))
    (traj,) = group.trajectories
    assert not traj.failed, traj.termination_reason
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["ran 1"]
    assert snapshot_tools.RUNS == ran  # answered from the snapshot, not run again
