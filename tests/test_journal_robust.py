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
from fsm.run.fold import rebuild
from fsm.run.journal import JOURNAL, records
from tests.conftest import ASSETS, REPO
from tests.test_cli import _ThreadServer, assert_consistent

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


def _interrupted_at_the_third_call(calls: list[str]) -> _ThreadServer:
    """A server of padded turns (ids past the tokenizer) that SIGINTs this process at its third call."""

    def turn(session_id: str, n: int, prompt: list[int]) -> list[int]:
        calls.append(session_id)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return _padded_turn(session_id, n, prompt)

    return _ThreadServer(ScriptedBackend(turn, latency_s=0.02, model_name="echo"))


@pytest.mark.parametrize("spec", ["calculator", "fork_calculator"])
def test_ids_of_the_models_vocabulary_past_the_tokenizer_are_resumed(capsys, tmp_path, spec):
    """The server's answers are checked against the model's vocabulary (576 rows), so its journal holds ids the
    tokenizer (516) does not name; a resume checks them against the same bound, linear or tree."""
    import torch

    calls: list[str] = []
    server = _interrupted_at_the_third_call(calls)
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


def test_a_journal_cut_before_its_first_group_starts_over_on_resume_and_a_new_run_takes_the_directory(
    capsys, tmp_path, echo_url
):
    """A kill between the `run` record and the first `group` record (the journal a real run wrote, cut there):
    the run did nothing, so `--resume` starts it again, with the rows and sampling its `run` record names, to
    the uninterrupted run's batch; a new run into the directory takes it too."""
    from tests.conftest import assert_same_batch_files

    ref, out = tmp_path / "ref", tmp_path / "out"
    argv = ("--num-prompts", "2", "--n", "2", "--temperature", "0.5", "--seed", "3")
    assert main(_argv("calculator", echo_url, ref, *argv)) == 0
    assert main(_argv("calculator", echo_url, out, *argv)) == 0
    for name in ("batch.pt", "trajectories.jsonl", "summary.json"):  # the kill came before any was written
        (out / name).unlink()
    data = (out / JOURNAL).read_bytes()
    (out / JOURNAL).write_bytes(data[: data.index(b"\n") + 1])
    capsys.readouterr()
    assert main(_resume(out, echo_url)) == 0
    assert "the run stopped before its first row was recorded: starting it again" in capsys.readouterr().err
    assert_consistent(out, 4)
    assert_same_batch_files(ref, out)
    assert rebuild(records(out / JOURNAL)).ended == "completed"
    (out / JOURNAL).write_bytes(data[: data.index(b"\n") + 1])
    assert main(_argv("calculator", echo_url, out, "--num-prompts", "2")) == 0
    assert_consistent(out, 2)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (where mount works: root), else None."""
    import subprocess

    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("disk", ["tmpfs", "enospc"])
def test_a_full_disk_stops_the_run_in_one_line_and_its_journal_stays_whole(
    capsys, tmp_path, echo_url, small_disk, monkeypatch, disk
):
    """The disk fills mid-run (a real 1 MiB tmpfs filled up, or, where mount is not allowed, ENOSPC from every
    write to the journal past 48 KiB): one line says so, the run stops, the journal stays whole up to its last
    record, and once there is room `--resume` completes the run as an uninterrupted one."""
    from tests.conftest import assert_same_batch_files

    ref = tmp_path / "ref"
    assert main(_argv("calculator", echo_url, ref, "--num-prompts", "16")) == 0
    if disk == "tmpfs":
        if small_disk is None:
            pytest.skip("mount is not allowed here (the enospc case covers it)")
        out = small_disk / "out"
        out.mkdir()
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        (small_disk / "filler").write_bytes(b"x" * (free - 48 * 1024))
    else:
        out = tmp_path / "out"
        pwrite, budget = os.pwrite, {"left": 48 * 1024}

        def full(fd: int, data: bytes, at: int) -> int:
            if os.readlink(f"/proc/self/fd/{fd}").endswith(JOURNAL):
                budget["left"] -= len(data)
                if budget["left"] < 0:
                    raise OSError(28, os.strerror(28))
            return pwrite(fd, data, at)

        monkeypatch.setattr(os, "pwrite", full)
    capsys.readouterr()
    assert main(_argv("calculator", echo_url, out, "--num-prompts", "16", "--concurrency", "2")) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert err.count(f"{out / JOURNAL}: the journal cannot be written (No space left on device)") == 1, err
    read = records(out / JOURNAL)  # whole: no damage mid-way, no torn record
    assert read.torn is None
    assert 0 < len(rebuild(read).done) < 16
    if disk == "tmpfs":
        (small_disk / "filler").unlink()
    else:
        monkeypatch.setattr(os, "pwrite", pwrite)
    assert main(_resume(out, echo_url)) == 0, capsys.readouterr().err
    assert_consistent(out, 16)
    assert_same_batch_files(ref, out)


def test_always_fsyncs_each_batch_off_the_event_loop_in_order(tmp_path, monkeypatch):
    """`--journal-sync always`: every batch is fsynced, on the journal's own thread (the loop never waits on the
    disk), after its write (an fsync covers what was written before it); `sync` is the barrier."""
    import asyncio
    import threading

    from fsm.run.journal import Writer

    fsync, seen = os.fsync, []

    def watched(fd: int) -> None:
        seen.append((threading.current_thread().name, os.fstat(fd).st_size))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", watched)
    writer = Writer(tmp_path / JOURNAL, "always")
    written = []

    async def run() -> str:
        for k in range(20):
            writer.append({"t": "step", "s": "x", "k": k})
            await asyncio.sleep(0.01)  # one batch a loop turn
            written.append(os.stat(tmp_path / JOURNAL).st_size)
        return threading.current_thread().name

    loop_thread = asyncio.run(run())
    writer.close()
    assert len(records(tmp_path / JOURNAL).records) == 20
    on_loop = [size for name, size in seen if name == loop_thread]
    assert on_loop == [written[-1]]  # only close's barrier, after the loop ended
    synced = [size for name, size in seen if name == "agentfsm-journal-sync"]
    # each batch's fsync came after its write (on a loaded machine, some batches share one)
    assert len(synced) >= 5 and synced == sorted(synced)


# --- hostile files where the journal should be (issue 50) ---------------------------------------------------


def _cli(*args: str) -> tuple[int, str]:
    """A real `agentfsm` process, bounded: a hang is a failure, not a stuck suite."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "fsm.cli.commands", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return done.returncode, done.stderr


def _one_line(code: int, err: str) -> str:
    assert code != 0 and "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_a_directory_as_the_journal_is_refused_in_one_line_without_blocking(tmp_path, kind):
    out = tmp_path / "out"
    out.mkdir()
    journal = out / JOURNAL
    os.mkfifo(journal) if kind == "fifo" else journal.mkdir()
    run = _one_line(*_cli(*_argv("calculator", "http://127.0.0.1:9", out, "--num-prompts", "1")))
    assert run.endswith(f"{journal}: not a regular file; remove it"), run
    replay = _one_line(*_cli("replay", str(out), "--row", "0"))
    assert replay == f"agentfsm: {journal}: not a regular file; remove it", replay
    resume = _one_line(*_cli("run", "--resume", str(out), "--server", "http://127.0.0.1:9", "-q"))
    assert resume == f"agentfsm: --resume: {journal}: not a regular file; remove it", resume


def test_a_sparse_20_gb_journal_is_refused_in_one_line_reading_a_bounded_record(capsys, tmp_path, echo_url):
    """A real journal whose middle is 20 GB of holes: refused at the first record past the bound, in one line,
    without reading the rest (was: MemoryError)."""
    import resource

    out = tmp_path / "out"
    assert main(_argv("calculator", echo_url, out, "--num-prompts", "2")) == 0
    data = (out / JOURNAL).read_bytes()
    first = data.index(b"\n") + 1
    with (out / JOURNAL).open("r+b") as f:
        f.truncate(first)
        f.truncate(20 << 30)  # a hole: the file reads 20 GB of zeros
        f.seek(20 << 30)
        f.write(data[first:])
    code, err = _cli("run", "--resume", str(out), "--server", echo_url, "--tokenizer", str(ASSETS), "-q")
    line = _one_line(code, err)
    assert line == (
        f"agentfsm: --resume: {out / JOURNAL}: record 2 is longer than 256 MiB, the bound of one record (damaged "
        "or forged); the run cannot be resumed from it"
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    from fsm.run.journal import JournalError

    with pytest.raises(JournalError, match="record 2 is longer than 256 MiB"):
        rebuild(records(out / JOURNAL))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20  # KiB: under 1 GiB more


def test_a_run_into_a_hard_linked_copy_never_writes_the_original_journal(capsys, tmp_path, echo_url):
    """`cp -al runA runB`, then a new run into runB and a resume of an interrupted runB: runA's journal keeps
    its bytes (was: the same inode, truncated and rewritten)."""
    import shutil
    import subprocess

    calls: list[str] = []
    server = _interrupted_at_the_third_call(calls)
    try:
        for interrupted in (False, True):
            a, b = tmp_path / f"runA{interrupted}", tmp_path / f"runB{interrupted}"
            calls[:] = [] if interrupted else ["x"] * 10  # the SIGINT only in the interrupted run
            code = main(_argv("calculator", server.url, a, "--num-prompts", "4", "--concurrency", "1"))
            assert code == (130 if interrupted else 0)
            subprocess.run(["cp", "-al", str(a), str(b)], check=True)
            kept = (a / JOURNAL).read_bytes()
            assert os.stat(a / JOURNAL).st_ino == os.stat(b / JOURNAL).st_ino
            calls[:] = ["x"] * 10
            if interrupted:
                assert main(_resume(b, server.url)) == 0
            else:
                assert main(_argv("calculator", server.url, b, "--num-prompts", "4")) == 0
            assert (a / JOURNAL).read_bytes() == kept
            assert rebuild(records(b / JOURNAL)).ended == "completed"
            assert_consistent(b, 4)
            shutil.rmtree(b)
    finally:
        server.close()


def test_a_kill_while_the_outputs_are_written_leaves_no_staging_folder_after_the_resume(
    capsys, tmp_path, echo_url
):
    """A real `agentfsm run` killed (-9) while its staging folder exists; `--resume` completes the run and
    removes the folder (was: 23 MB left behind for good)."""
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    args = _argv("calculator", echo_url, out, "--num-prompts", "32")
    for _ in range(5):  # the window is a fraction of a second: on a loaded machine, the kill may miss it
        proc = subprocess.Popen(
            [sys.executable, "-m", "fsm.cli.commands", *args],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if out.is_dir() and any(p.name.startswith(".agentfsm-writing-") for p in out.iterdir()):
                proc.kill()
                break
            time.sleep(0.001)
        proc.wait(60)
        if proc.returncode == -signal.SIGKILL:
            break
        for p in out.iterdir():  # it finished first: again, from nothing
            p.unlink()
    assert proc.returncode == -signal.SIGKILL, "five runs, none killed while writing"
    assert any(p.name.startswith(".agentfsm-writing-") for p in out.iterdir())
    assert main(_resume(out, echo_url)) == 0
    assert_consistent(out, 32)  # the directory holds the run's files and nothing else


# --- a trainer's taken groups --------------------------------------------------------------------------------

TRAINER = """
import asyncio, sys, zlib

from backends.scripted import ScriptedBackend
from fsm import RolloutEngine
from fsm.run.journal import Recorder, Writer
from fsm.run.resume import identity
from specs.calculator import make_prompts


def turn(session_id, n, prompt):
    seed = zlib.crc32(b",".join(str(t).encode() for t in prompt))
    return [10 + (seed + 7919 * k) % 500 for k in range(6)] + [2]


async def main(path, tokenizer):
    backend = ScriptedBackend(turn, latency_s=0.05)
    async with RolloutEngine("calculator", tokenizer=tokenizer, backend=backend) as engine:
        recorder = Recorder(Writer(path, "1s"))
        recorder.header(identity(engine.agent, engine.codec, run_id="t", groups=4, rows_expected=8))
        await engine.ajournal(recorder)
        await engine.asubmit(make_prompts(4), n=2, sampling=engine.sampling({"temperature": 0.0}))
        taken = await engine.atake_groups(2, timeout=120)
        print(" ".join(g.uid for g in taken), flush=True)  # the trainer has them: killed from here on
        await asyncio.sleep(600)


asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_groups_a_trainer_took_are_not_handed_out_again_after_a_kill(tmp_path):
    """A trainer takes 2 of 4 groups from a journaled continuous mode and is killed (-9); the resumed stream
    hands out the other 2 only (was: all 4, the 2 trained on twice)."""
    import asyncio
    import subprocess
    import sys

    from fsm import RolloutEngine
    from fsm.run.journal import Recorder, Writer
    from fsm.run.resume import load

    path = tmp_path / JOURNAL
    program = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(path), str(ASSETS)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        line = program.stdout.readline()  # bounded by the program's own take timeout
        assert line.strip(), "the trainer took nothing"
        program.kill()
        program.wait(60)
    finally:
        program.kill()
    trained = set(line.split())
    assert len(trained) == 2

    async def resume() -> tuple[set[str], set[str]]:
        async with RolloutEngine("calculator", str(ASSETS), backend=ScriptedBackend(_padded_turn)) as engine:
            loaded = load(path, engine.agent, engine.codec)
            recorder = Recorder(Writer(path, "off", keep=loaded.good_bytes), loaded.tool_results)
            await engine.ajournal(recorder)
            await engine.arestore(loaded.data)
            again = await engine.atake_groups(4, timeout=120, exhausted_ok=True)
            recorder.writer.close()
        return {g["uid"] for g in loaded.data["groups"]}, {g.uid for g in again}

    offered, again = asyncio.run(resume())
    assert len(again) == 2 and not again & trained and offered == again
    assert len(rebuild(records(path)).taken) == 4  # the trainer's 2, then the resumed stream's 2


def test_a_record_past_the_bound_is_never_written_and_the_journal_stays_readable(
    tmp_path, monkeypatch, capsys
):
    """The writer keeps the reader's bound: a record it could not read back fails the journal in one line."""
    import fsm.run.codec as codec
    import fsm.run.journal as journal

    monkeypatch.setattr(journal, "MAX_RECORD", 4096)
    writer = journal.Writer(tmp_path / JOURNAL, "off")
    writer.append({"t": "run", "format": codec.FORMAT})
    writer.append({"t": "step", "s": "x", "v": {"extra": {"text": "y" * 8192}}})
    writer.append({"t": "end", "status": "completed"})  # nothing more after a failure
    writer.close()
    assert (
        writer.failed
        == f"{tmp_path / JOURNAL}: the journal cannot be written (a record of 8,248 bytes, past "
        "the bound of one record (4,096))"
    )
    assert capsys.readouterr().err.count("the journal cannot be written") == 1
    assert [r["t"] for r in records(tmp_path / JOURNAL).records] == ["run"]
