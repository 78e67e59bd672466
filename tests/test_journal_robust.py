"""The journal on a hard day (fsm/run/journal.py, fsm/run/resume.py, fsm/output/rundir.py): ids the model may
sample past the tokenizer's length, a kill before the first group record, a full disk, a kill while the
outputs are written, hostile files where the journal should be, a journal shared with another run by a hard
link. Each is met the way it happens: real runs interrupted (a real SIGINT, or a `kill -9` of a real CLI
process), real journals cut or damaged on disk."""

from __future__ import annotations

import os
import signal
import zlib
from pathlib import Path

import pytest

from backends.scripted import ScriptedBackend
from fsm.cli.commands import main
from fsm.run.journal import JOURNAL, rebuild, records
from tests.conftest import ASSETS, REPO
from tests.test_cli import _ThreadServer, assert_consistent, one_line_error

PAD_ID = 550  # an embedding row of the tiny model (576) past its tokenizer (516): a token it may sample


def _padded_turn(session_id: str, turn: int, prompt: list[int]) -> list[int]:
    """A turn decided by its prompt (a resumed run asks again for the turn in flight) holding a padding id."""
    seed = zlib.crc32(b",".join(str(t).encode() for t in prompt))
    return [10 + (seed + 7919 * k) % 500 for k in range(6)] + [PAD_ID, 2]


def _argv(spec: str, url: str, out: Path, *extra: str) -> list[str]:
    spec_path = str(REPO / "specs" / f"{spec}.yaml")
    return ["run", spec_path, "--server", url, "--tokenizer", str(ASSETS), "--out", str(out), "-q", *extra]


def _resume(out: Path, url: str) -> list[str]:
    return ["run", "--resume", str(out), "--server", url, "--tokenizer", str(ASSETS), "-q"]


@pytest.mark.parametrize("spec", ["calculator", "fork_calculator"])
def test_ids_of_the_models_vocabulary_past_the_tokenizer_are_resumed(capsys, tmp_path, spec):
    """The server's answers are checked against the model's vocabulary (576 rows), so its journal holds ids the
    tokenizer (516) does not name; a resume checks them against the same bound, linear or tree."""
    import torch

    calls: list[str] = []

    def turn(session_id: str, n: int, prompt: list[int]) -> list[int]:
        calls.append(session_id)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return _padded_turn(session_id, n, prompt)

    server = _ThreadServer(ScriptedBackend(turn, latency_s=0.02, model_name="echo"))
    try:
        out = tmp_path / "out"
        assert main(_argv(spec, server.url, out, "--num-prompts", "4", "--concurrency", "1")) == 130
        journaled = rebuild(records(out / JOURNAL))
        assert any(PAD_ID in t.response_ids for t in journaled.trajs.values())
        assert journaled.ended is None
        capsys.readouterr()
        assert main(_resume(out, server.url)) == 0, capsys.readouterr().err
    finally:
        server.close()
    assert "go on from their last state" in capsys.readouterr().err
    batch = torch.load(out / sorted(p.name for p in out.glob("batch*.pt"))[0], weights_only=False)
    assert (batch["batch"]["responses"] == PAD_ID).any()
    if spec == "calculator":
        assert_consistent(out, 4)


def test_a_snapshot_holding_ids_of_the_models_vocabulary_restores(tmp_path):
    """The same bound for a continuous-mode snapshot restored through the API."""
    import time

    from fsm import RolloutEngine
    from specs.calculator import make_prompts

    with RolloutEngine("calculator", str(ASSETS), backend=ScriptedBackend(_padded_turn)) as engine:
        engine.submit(make_prompts(2), n=2)
        deadline = time.monotonic() + 120
        while engine.stream_stats["ready_groups"] < 2:
            assert time.monotonic() < deadline, "the rows did not finish"
            time.sleep(0.05)
        engine.snapshot(tmp_path / "s.json", stop=True)
    with RolloutEngine("calculator", str(ASSETS), backend=ScriptedBackend(_padded_turn)) as engine:
        engine.restore(tmp_path / "s.json")
        groups = engine._run_sync(engine.atake_groups(2, timeout=60))
    assert any(PAD_ID in t.response_ids for g in groups for t in g.trajectories)


@pytest.fixture
def echo_url():
    server = _ThreadServer(ScriptedBackend(_padded_turn, model_name="echo"))
    yield server.url
    server.close()


def test_a_journal_cut_before_its_first_group_is_nothing_to_resume_and_a_new_run_takes_the_directory(
    capsys, tmp_path, echo_url
):
    """A kill between the `run` record and the first `group` record: the journal a real run wrote, cut there."""
    out = tmp_path / "out"
    assert main(_argv("calculator", echo_url, out, "--num-prompts", "2")) == 0
    for name in ("batch.pt", "trajectories.jsonl", "summary.json"):  # the kill came before any was written
        (out / name).unlink()
    data = (out / JOURNAL).read_bytes()
    (out / JOURNAL).write_bytes(data[: data.index(b"\n") + 1])
    capsys.readouterr()
    line = one_line_error(capsys, _resume(out, echo_url))
    assert line == (
        f"agentfsm: --resume: {out / JOURNAL}: the run there stopped before its first row was recorded: nothing "
        f"to resume; start it again (a new run into {out} replaces this journal)"
    )
    assert main(_argv("calculator", echo_url, out, "--num-prompts", "2")) == 0
    assert_consistent(out, 2)
    assert rebuild(records(out / JOURNAL)).ended == "completed"
