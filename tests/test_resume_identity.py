"""A resume continues the same run or refuses (issue 46, fsm/run/resume.py): real `agentfsm run` processes
whose journals are cut where a `kill -9` leaves them (or killed with -9 for real), then resumed after a change in
what made the rows (the reward module the spec names, the checkpoint's weights, the servers, an engine flag, a
sampling flag). Each change is refused in one line naming it; `--accept-changes` (`RunDir(out,
accept_changes=True)`) goes on and records it in the journal, where `show` and `replay` read it."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fsm.run.fold import rebuild
from fsm.run.journal import JOURNAL, JournalError, records
from fsm.run.resume import ResumeRefused
from tests.test_journal_kill import _serve_model
from tests.test_run_interrupts import ENV, REPO

ASSETS = REPO / "backends/tiny/assets"
TIMEOUT = 600  # one CLI run on a loaded 2-core machine: loading torch and the model, 3 rows
SPEC = """\
name: ident
extends: {base}
reward:
  function: ident_reward:score
"""
REWARD = """\
def score(data_source, solution_str, ground_truth, extra_info=None):
    return {value}
"""


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsm.cli.commands", "run", *args],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def _records(out: Path) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in (out / JOURNAL).read_text().splitlines()]


def _cut(done: Path, out: Path) -> Path:
    """`out`: the run in `done` as a kill -9 leaves it: its journal up to two records past the first trajectory
    that finished (one finished, the others in flight), no `end`."""
    shutil.copytree(done, out)
    lines = (done / JOURNAL).read_bytes().splitlines(keepends=True)
    first_done = next(i for i, r in enumerate(_records(done)) if r.get("done"))
    (out / JOURNAL).write_bytes(b"".join(lines[: first_done + 3]))
    rb = rebuild(records(out / JOURNAL))
    assert len(rb.done) == 1 and len(rb.trajs) == 3 and rb.ended is None
    return out


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == 1 and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished embedded run of a spec whose reward module is its own (every row 1.0), on a copy of the tiny
    checkpoint; the spec's folder, the checkpoint and the run's directory back."""
    root = tmp_path_factory.mktemp("ident")
    spec_dir, model = root / "spec", root / "model"
    spec_dir.mkdir()
    (spec_dir / "agent.yaml").write_text(SPEC.format(base=REPO / "specs" / "calculator.yaml"))
    (spec_dir / "ident_reward.py").write_text(REWARD.format(value=1.0))
    model.mkdir()
    for f in ASSETS.iterdir():  # the checkpoint's own files (not the early and mid ones beside them)
        if f.is_file():
            shutil.copy2(f, model / f.name)
    out = root / "done"
    first = _cli(str(spec_dir / "agent.yaml"), "--model", str(model), *_FLAGS, "--out", str(out), "-q")
    assert first.returncode == 0, first.stderr
    return spec_dir, model, out


_FLAGS = ("--num-prompts", "3", "--temperature", "0", "--concurrency", "1")


def test_an_edited_reward_module_is_refused_and_accepted_changes_are_recorded(run, tmp_path):
    """Before: finished rows kept 1.0 and resumed rows got 0.5, silently."""
    spec_dir, model, done = run
    out = _cut(done, tmp_path / "out")
    module = spec_dir / "ident_reward.py"
    before = (out / JOURNAL).read_bytes()
    module.write_text(REWARD.format(value=0.5))
    try:
        t0 = time.monotonic()
        line = _one_line(_cli("--resume", str(out), "--model", str(model), "-q"))
        took = time.monotonic() - t0
        assert line.startswith(
            f"agentfsm: resume refused: {out / JOURNAL}: the reward module {module} changed "
            "since the run started (sha256 "
        ), line
        assert line.endswith(
            "rerun with --resume --accept-changes (RunDir(out, accept_changes=True)) to go on anyway"
        ), line
        assert (out / JOURNAL).read_bytes() == before  # nothing written
        print(f"refused in {took:.1f} s (before the model loads)")

        going = _cli("--resume", str(out), "--model", str(model), "--accept-changes", "-q")
        assert going.returncode == 0, going.stderr
        assert "going on with changes accepted (recorded in the journal): the reward module" in going.stderr
        resumes = rebuild(records(out / JOURNAL)).resumes
        assert len(resumes) == 1 and resumes[0]["finished_before"] == 1, resumes
        assert len(resumes[0]["accepted"]) == 1 and str(module) in resumes[0]["accepted"][0]
        rewards = sorted(
            json.loads(line)["reward_score"] for line in (out / "trajectories.jsonl").read_text().splitlines()
        )
        assert rewards == [0.5, 0.5, 1.0]  # what accepting means: rows made before and after the change
        show = [
            sys.executable,
            "-m",
            "fsm.cli.commands",
            "show",
            str(out),
            "--journal",
        ]  # beside the next run
        shown = subprocess.Popen(show, env=ENV, cwd=REPO, stdout=subprocess.PIPE, text=True)

        # a second resume of the same run compares with what the first accepted: nothing changed since
        again = _cut(done, tmp_path / "again")
        lines = (out / JOURNAL).read_bytes().splitlines(keepends=True)  # and the resume's `format`, `resume`
        (again / JOURNAL).write_bytes(b"".join(lines[: len(before.splitlines()) + 2]))
        assert _cli("--resume", str(again), "--model", str(model), "-q").returncode == 0
        said = shown.communicate(timeout=TIMEOUT)[0]
        assert "resume 1 (after 1 trajectories finished) accepted changes: the reward module" in said
    finally:
        module.write_text(REWARD.format(value=1.0))


def test_other_weights_in_the_checkpoint_are_refused(run, tmp_path):
    """Another checkpoint and the same one changed in place are refused; the same weights moved go on. The three
    resumes run side by side, each on its own cut of the run (a run directory has one writer at a time)."""
    spec_dir, model, done = run
    out, changed, again = (_cut(done, tmp_path / name) for name in ("out", "changed", "again"))
    other, moved = tmp_path / "model", tmp_path / "moved"
    shutil.copytree(model, other)
    shutil.copy2(
        ASSETS / "early" / "model.safetensors", other / "model.safetensors"
    )  # a real other checkpoint
    shutil.copytree(model, moved)  # the same weights elsewhere: the same run
    before = (changed / JOURNAL).read_bytes()
    shutil.copy2(ASSETS / "early" / "model.safetensors", model / "model.safetensors")
    try:  # the same checkpoint, its weights changed in place
        with ThreadPoolExecutor() as three:
            elsewhere, in_place, going = three.map(
                lambda at: _cli("--resume", str(at[0]), "--model", str(at[1]), "-q"),
                [(out, other), (changed, model), (again, moved)],
            )
    finally:
        shutil.copy2(ASSETS / "model.safetensors", model / "model.safetensors")
    line = _one_line(elsewhere)
    assert line.startswith(
        f"agentfsm: resume refused: {out / JOURNAL}: the run's rows were made by the embedded "
        f"model 'model' from {model}, but this resume runs the embedded model 'model' from {other}"
    ), line
    line = _one_line(in_place)
    assert f"the model's checkpoint {model} changed since the run started (sha256 " in line, line
    assert (changed / JOURNAL).read_bytes() == before  # nothing written
    assert going.returncode == 0, going.stderr


def test_an_engine_flag_and_a_sampling_flag_unlike_the_runs_are_refused(run, tmp_path):
    spec_dir, model, done = run
    out = _cut(done, tmp_path / "out")
    with ThreadPoolExecutor() as both:  # two refusals side by side: neither writes
        tokens, temperature = both.map(
            lambda flags: _cli("--resume", str(out), "--model", str(model), *flags, "-q"),
            [("--check-tokens",), ("--temperature", "0.7")],
        )
    line = _one_line(tokens)
    assert line == (
        f"agentfsm: resume refused: {out / JOURNAL}: --check-tokens is True, the run's was False; resume without "
        "--check-tokens, or rerun with --resume --accept-changes (RunDir(out, accept_changes=True)) to go on anyway"
    )
    line = _one_line(temperature)
    assert line == (
        f"agentfsm: resume refused: {out / JOURNAL}: --temperature 0.7, but the run's is 0.0 (a resume goes on with "
        "the run's own rows, samples and sampling); drop --temperature, or start a new run"
    )
    # the run's own command line with --resume added goes on
    going = _cli("--resume", str(out), "--model", str(model), *_FLAGS, "-q")
    assert going.returncode == 0, going.stderr


def test_the_api_resume_checks_the_same(run, tmp_path):
    """RunDir(out).resume(engine): refused as the CLI refuses (ResumeRefused, a JournalError), accepted with
    RunDir(out, accept_changes=True)."""
    from fsm import RolloutEngine
    from fsm.output.keep import RunDir

    spec_dir, model, done = run
    out = _cut(done, tmp_path / "out")
    module = spec_dir / "ident_reward.py"
    module.write_text(REWARD.format(value=0.5))
    engine = RolloutEngine(str(spec_dir / "agent.yaml"), model=str(model))
    try:
        with pytest.raises(ResumeRefused) as refused:
            RunDir(out).resume(engine)
        assert str(refused.value).startswith(f"resume refused: {out / JOURNAL}: the reward module {module} ")
        batch = RunDir(out, accept_changes=True).resume(engine)
        assert len(batch) == 3
        assert [r["t"] for r in _records(out)].count("resume") == 1
    finally:
        engine.close()
        module.write_text(REWARD.format(value=1.0))


def test_an_http_run_killed_then_resumed_without_its_servers_is_refused(run, tmp_path):
    """Before: `--resume` of an HTTP run without `--server` went on, silently, on the embedded model."""
    spec_dir, _, _ = run
    proc, url = _serve_model()
    try:
        out = tmp_path / "out"
        cmd = [
            sys.executable,
            "-m",
            "fsm.cli.commands",
            "run",
            str(spec_dir / "agent.yaml"),
            "--server",
            url,
            "--tokenizer",
            str(ASSETS),
            "--num-prompts",
            "6",
            "--temperature",
            "0",
            "--concurrency",
            "1",
            "--out",
            str(out),
            "-q",
        ]
        killed = subprocess.Popen(cmd, env=ENV, cwd=REPO, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + TIMEOUT
            while killed.poll() is None and time.monotonic() < deadline:
                try:
                    if len(rebuild(records(out / JOURNAL)).done) >= 1:
                        killed.send_signal(signal.SIGKILL)
                        break
                except (OSError, JournalError):  # not there yet, or its first record not whole yet
                    pass
                time.sleep(0.02)
        finally:
            if killed.poll() is None:  # the wait failed (or the kill not reaped yet): nothing left running
                killed.kill()
            err = killed.communicate(timeout=TIMEOUT)[1]
        assert killed.returncode == -signal.SIGKILL, err[-2000:]
        assert rebuild(records(out / JOURNAL)).ended is None

        line = _one_line(_cli("--resume", str(out), "-q"))
        assert line.startswith(
            f"agentfsm: resume refused: {out / JOURNAL}: the run's rows were made by servers "
            "serving 'agentfsm-tiny-calculator' (SGLangBackend), but this resume runs the embedded "
            "model 'agentfsm-tiny-calculator' from "
        ), line
        assert (
            "; give the servers again with --server URL, or rerun with --resume --accept-changes" in line
        ), line
        going = _cli("--resume", str(out), "--server", url, "--tokenizer", str(ASSETS), "-q")
        assert going.returncode == 0, going.stderr
        assert rebuild(records(out / JOURNAL)).ended == "completed"
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_checkpoints_digest_reads_each_file_once_until_it_changes(tmp_path, monkeypatch):
    """The sha256 of each weight file is cached by path, size and mtime (a 1 GiB file: 7.5 s on the loaded
    2-core machine, then nothing); a file rewritten is read again, and files that are no weights are left out."""
    from fsm.run import resume as provenance

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"a" * 1000)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "README.md").write_text("not weights")
    first = provenance.checkpoint_digest(ckpt)
    read: list[str] = []
    real = provenance.file_sha256
    monkeypatch.setattr(provenance, "file_sha256", lambda p: read.append(p.name) or real(p))
    (ckpt / "README.md").write_text("edited")
    assert provenance.checkpoint_digest(ckpt) == first and read == []
    (ckpt / "model.safetensors").write_bytes(b"b" * 1000)
    assert provenance.checkpoint_digest(ckpt) != first and read == ["model.safetensors"]


def test_a_resume_under_another_exact_logprobs_setting_is_refused():
    """`--exact-logprobs` is in `made_by`'s engine options (the embedded model's): a resume without it would
    score the rows it runs again another way than the finished ones; refused in one line (the real kill and
    resume with the flag: tests/test_journal_kill.py)."""
    from types import SimpleNamespace

    from fsm.run.resume import changes, judge, options_of

    def engine(exact: bool) -> SimpleNamespace:
        backend = SimpleNamespace(checkpoint="m", dtype="torch.float32", device="cpu", exact_logprobs=exact)
        return SimpleNamespace(runner=SimpleNamespace(check_tokens=False), backend=backend)

    run, now = options_of(engine(True)), options_of(engine(False))
    assert run["exact_logprobs"] is True and now["exact_logprobs"] is False
    with pytest.raises(ResumeRefused) as refused:
        judge("out/journal.log", changes({"engine": run}, {"engine": now}), False)
    assert str(refused.value) == (
        "resume refused: out/journal.log: --exact-logprobs is False, the run's was True; resume with "
        "--exact-logprobs, or rerun with --resume --accept-changes (RunDir(out, accept_changes=True)) to go on anyway"
    )
    assert changes({"engine": run}, {"engine": options_of(engine(True))}) == []
