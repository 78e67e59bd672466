"""Hostile inputs, round 4 (issue 50): a stop that must end while a tool call outlasts it, journals forged on disk
that must not become rows, and run directories that must not run code or reach the network when read.

Every run here is a real `agentfsm run` process on the tiny model (backends/tiny), signalled for real; every
forged journal is one a real run wrote, edited on disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from fsm.cli.commands import main
from fsm.run.journal import JOURNAL, ended
from tests.conftest import assert_same_batch_files
from tests.test_cli import one_line_error
from tests.test_run_interrupts import ENV, REPO, Lines

SLEEPY_SPEC = """
name: calculator_sleepy
extends: {specs}/calculator.yaml
tools:
  - function: tests.fixtures.parts:sleeps
    schema: specs.calculator:TOOL_SCHEMA
"""


def _run(spec: Path | None, out: Path, *extra: str, env: dict[str, str] | None = None) -> list[str]:
    where = [str(spec), "--out", str(out)] if spec is not None else ["--resume", str(out)]
    return [
        sys.executable,
        "-m",
        "fsm.cli.commands",
        "run",
        *where,
        "--num-prompts",
        "2",
        "--temperature",
        "0",
        "-q",
        *extra,
    ]


@pytest.fixture(scope="module")
def sleepy(tmp_path_factory) -> tuple[Path, Path]:
    """The sleepy spec, and its run with a quick tool: the rows a stopped and resumed run must give."""
    where = tmp_path_factory.mktemp("sleepy")
    spec, ref = where / "sleepy.yaml", where / "ref"
    spec.write_text(SLEEPY_SPEC.format(specs=REPO / "specs"))
    done = subprocess.run(_run(spec, ref), env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return spec, ref


# --- a stop while a tool call outlasts the stop's wait ---------------------------------------------------------


@pytest.mark.slow
def test_a_stop_while_a_tool_outlasts_its_wait_exits_promptly_and_resume_runs_the_step_again(
    sleepy, tmp_path
):
    """issue 50: one SIGTERM (SIGINT is handled alike, fsm/run/signals.py) while a tool call runs past the stop's wait (60 s; 3 s here through
    $AGENTFSM_STOP_TIMEOUT_S) spun for good, the snapshot's own TimeoutError swallowed. Now the run exits within
    seconds with a line saying so, and the rows in the tool call are kept as before it: the resume (a quick tool
    now) calls it again and gives the rows of a run never stopped."""
    spec, ref = sleepy
    cut = tmp_path / "cut"
    env = {**ENV, "AGENTFSM_TEST_TOOL_S": "120", "AGENTFSM_STOP_TIMEOUT_S": "3"}
    proc = subprocess.Popen(
        _run(spec, cut, "--watchdog", "1"), env=env, cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    try:
        err = Lines(proc)
        err.wait_for("in PROCESSING_TOOLS for", 240)  # a tool call is running (it sleeps 120 s)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    text = err.rest()
    assert proc.returncode == 130, text
    assert took < 30, f"the stop took {took:.1f} s"
    assert (
        "did not reach a state boundary in 3 s" in text and "they go on from their last one on resume" in text
    )
    assert "Traceback" not in text
    assert ended(cut / "journal.log") is None
    resumed = subprocess.run(_run(None, cut), env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert ended(cut / "journal.log") == "completed"
    assert_same_batch_files(ref, cut)


def test_a_stop_wait_that_is_not_a_number_is_named_and_the_default_kept(monkeypatch, capsys):
    from fsm.output.keep import SNAPSHOT_TIMEOUT_S, STOP_TIMEOUT_ENV, stop_timeout_s

    monkeypatch.setenv(STOP_TIMEOUT_ENV, "2.5")
    assert stop_timeout_s() == 2.5
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv(STOP_TIMEOUT_ENV, bad)
        assert stop_timeout_s() == SNAPSHOT_TIMEOUT_S
        assert f"{STOP_TIMEOUT_ENV}={bad!r} is not a positive number" in capsys.readouterr().err
    monkeypatch.delenv(STOP_TIMEOUT_ENV)
    assert stop_timeout_s() == SNAPSHOT_TIMEOUT_S and os.environ.get(STOP_TIMEOUT_ENV) is None


# --- forged journals: a real run's journal, edited on disk, resumed ---------------------------------------------


@pytest.fixture(scope="module")
def compact_journal(tmp_path_factory) -> list[dict[str, Any]]:
    """The records of a real `agentfsm run` of the compacting calculator (every trajectory has closed segments:
    a summary starts a new one), without its `end` record: a run killed once every row had finished, which
    `--resume` writes out as it stands."""
    out = tmp_path_factory.mktemp("compact") / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsm.cli.commands",
            "run",
            "specs/calculator_compact.yaml",
            "--num-prompts",
            "2",
        ]
        + ["--out", str(out), "-q"],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    recs = [json.loads(line[9:]) for line in (out / JOURNAL).read_bytes().splitlines()]
    assert recs[-1]["t"] == "end" and len({r["uid"] for r in recs if r["t"] == "group"}) == 2
    assert all(len(_last_whole(recs[:-1], s)["closed"]) for s in _sessions(recs))
    return recs[:-1]


def _written(out: Path, recs: list[dict[str, Any]], name: str = JOURNAL) -> None:
    """The journal's records as a forger writes them: each line's CRC recomputed (it is unkeyed), NaN allowed."""
    out.mkdir(exist_ok=True)
    lines = [json.dumps(r, separators=(",", ":"), ensure_ascii=False).encode() for r in recs]
    (out / name).write_bytes(b"".join(b"%08x %s\n" % (zlib.crc32(b), b) for b in lines))


def _sessions(recs: list[dict[str, Any]]) -> list[str]:
    return [s for r in recs if r["t"] == "group" for s in r["members"]]


def _last_whole(recs: list[dict[str, Any]], sid: str) -> dict[str, Any]:
    """The trajectory's last whole record (after its last rewrite: it holds the closed segments)."""
    return next(r["d"] for r in reversed(recs) if r["t"] == "traj" and r["s"] == sid)


def _closed(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first closed segment's fields of the first trajectory, as its last whole record holds them."""
    return _last_whole(recs, _sessions(recs)[0])["closed"][0]["fields"]


def _items(fields: dict[str, Any], name: str) -> list[Any]:
    return fields[name]["items"]


def _done_step(recs: list[dict[str, Any]], sid: str) -> dict[str, Any]:
    return next(r for r in recs if r["t"] == "step" and r["s"] == sid and r.get("done"))


def _every_whole(recs: list[dict[str, Any]], sid: str) -> list[dict[str, Any]]:
    return [r["d"] for r in recs if r["t"] == "traj" and r["s"] == sid]


def _group(recs: list[dict[str, Any]], k: int) -> dict[str, Any]:
    return [r for r in recs if r["t"] == "group"][k]


def _long(recs):
    f = _closed(recs)
    for name, value in (("response_ids", 300), ("response_mask", 1), ("response_logprobs", -0.5)):
        _items(f, name).extend([value] * (5000 - len(_items(f, name))))


def _second_group(recs):
    at = recs.index(_group(recs, 1))
    recs.insert(at + 1, dict(_group(recs, 0)))
    recs[0]["rows_expected"] += 1  # as many rows as the groups hold


def _session_twice(recs):
    _group(recs, 1)["members"].append(_sessions(recs)[0])
    recs[0]["rows_expected"] += 1


def _same_index(recs):
    first, second = _sessions(recs)[:2]
    index = _every_whole(recs, first)[0]["index"]
    for d in _every_whole(recs, second):
        d["index"] = index


def _negative_index(recs):
    for d in _every_whole(recs, _sessions(recs)[0]):
        d["index"] = -1


def _last_model_run(recs: list[dict[str, Any]]) -> list[Any]:
    """The first trajectory's last model turn as its step appends it, [role, ids, logprobs, weight version]
    (nothing after it replaces it)."""
    sid = _sessions(recs)[0]
    steps = [r for r in recs if r["t"] == "step" and r["s"] == sid and "tok" in r]
    return [run for step in steps for run in step["tok"][1] if run[0] == "assistant"][-1]


def _version(value: int):
    def forge(recs):
        _last_model_run(recs)[3] = value

    return forge


def _odd_versions(recs):
    """The weight version runs of the first trajectory's last whole record, one short of a pair."""
    _every_whole(recs, _sessions(recs)[0])[-1]["_version_runs"].append(0)


def _reward(value: float):
    def forge(recs):
        _done_step(recs, _sessions(recs)[0]).setdefault("v", {})["reward_score"] = value

    return forge


def _closed_reward(recs):
    _closed(recs)["turn_rewards"] = [["tool", 3, float("nan")]]


FORGED = [
    (
        lambda r: _items(_closed(r), "response_mask").__setitem__(0, 7),
        "closed segment 0: response_mask holds",
    ),
    (
        lambda r: _items(_closed(r), "response_mask").__setitem__(0, -3),
        "closed segment 0: response_mask holds",
    ),
    (
        lambda r: _items(_closed(r), "response_logprobs").__setitem__(0, float("nan")),
        "closed segment 0: logprobs",
    ),
    (lambda r: _items(_closed(r), "response_logprobs").__setitem__(0, 1e30), "closed segment 0: logprobs"),
    (lambda r: _items(_closed(r), "response_ids").__setitem__(0, -5), "closed segment 0: token ids outside"),
    (
        lambda r: _items(_closed(r), "prompt_ids").__setitem__(0, 99_999),
        "closed segment 0: token ids outside",
    ),
    (
        lambda r: _items(_closed(r), "response_mask").pop(),
        "closed segment 0: its response arrays differ in length",
    ),
    (_long, "closed segment 0: more tokens than limits.prompt_length/response_length"),
    (lambda r: _closed(r).__setitem__("turns", "2"), "closed segment 0: field 'turns'"),
    (_closed_reward, "closed segment 0: field 'turn_rewards': nan is not a finite number"),
    (_second_group, "a second group of that uid"),
    (_session_twice, "and again in group"),
    (_same_index, "sample 0 is trajectory"),
    (_negative_index, "index -1, sample 0 is no row of the run"),
    (_version(-7), "field 'response_versions': weight version -7 on a token of mask 1"),
    # the journal records every version the run served (`weights`): one it never served is forged, whatever it is
    (
        _version(2**31 - 1),
        "field 'response_versions': weight version 2147483647 was never served in this run",
    ),
    (
        _version(1),
        "field 'response_versions': weight version 1 was never served in this run (its weights: 0)",
    ),
    (_odd_versions, "field 'version_runs'"),
    (_reward(float("nan")), "field 'reward_score': nan is not a finite number"),
    (_reward(float("inf")), "field 'reward_score': inf is not a finite number"),
    (_reward(1e308), "field 'reward_score': 1e+308 is beyond float32's range"),
]


@pytest.mark.slow
@pytest.mark.parametrize("forge, words", FORGED, ids=[w[:40] for _, w in FORGED])
def test_a_forged_journal_is_refused_in_one_line_naming_the_row_and_field(
    compact_journal, tmp_path, capsys, forge, words
):
    """issue 50: each of these reached batch.pt (exit 0), or ended in a traceback; `--resume` now refuses the
    journal in one line naming it, the trajectory (and closed segment) and the field, and writes nothing."""
    recs = json.loads(json.dumps(compact_journal))
    forge(recs)
    out = tmp_path / "out"
    _written(out, recs)
    line = one_line_error(capsys, ["run", "--resume", str(out), "-q"])
    assert line.startswith(f"agentfsm: --resume: {out / JOURNAL}: ") and words in line, line
    assert not (out / "batch.pt").exists()


def test_the_unforged_journal_resumes(compact_journal, tmp_path, capsys):
    """The control: the same journal, written back untouched, resumes into a batch."""
    out = tmp_path / "out"
    _written(out, compact_journal)
    assert main(["run", "--resume", str(out), "-q"]) == 0, capsys.readouterr().err
    assert (out / "batch.pt").exists()


# --- a forged snapshot of the continuous mode, restored through the API ------------------------------------------


def _snapshot_forges() -> list[tuple[Any, str]]:
    """Forges of a snapshot's records (a compacted journal: `run`, `group`, its trajectories whole, ...)."""

    def closed(recs):
        return recs[2]["d"]["closed"][0]["fields"]

    def set_item(name, value):
        return lambda recs: closed(recs)[name]["items"].__setitem__(0, value)

    def newer_version(recs):
        runs = recs[2]["d"]["_version_runs"]
        runs[1::2] = [2**31 - 1 if v >= 0 else v for v in runs[1::2]]

    return [
        (set_item("response_mask", 7), "closed segment 0: response_mask holds values other than 0 and 1"),
        (set_item("response_ids", 99_999), "closed segment 0: token ids outside the tokenizer's vocabulary"),
        (set_item("response_logprobs", float("nan")), "closed segment 0: logprobs that are not finite"),
        (
            lambda r: r[2]["d"].__setitem__("reward_score", float("nan")),
            "field 'reward_score': nan is not a finite",
        ),
        (newer_version, "weight version 2147483647 on a token of mask 1"),
        (
            lambda r: r[1]["held"].__setitem__("version_max", 2**31 - 1),
            "are not a span up to the run's weight",
        ),
        (lambda r: r.extend(r[1:3]), "again after it finished (a row twice)"),
    ]


@pytest.mark.slow
def test_a_forged_continuous_mode_snapshot_with_a_finished_group_is_refused(tmp_path):
    """issue 50: through the API, a forged snapshot whose groups had finished (closed segments and all) gave its
    rows back `done` with invalid masks, ids, logprobs and a NaN reward. A snapshot is a journal, checked as one."""
    from fsm import RolloutEngine
    from fsm.run.codec import SnapshotError
    from fsm.run.journal import records
    from specs.calculator import make_prompts
    from tests.conftest import ASSETS

    spec, path = str(REPO / "specs/calculator_compact.yaml"), tmp_path / "s.json"
    with RolloutEngine(spec, str(ASSETS)) as engine:
        engine.submit(make_prompts(2), n=1)
        deadline = time.monotonic() + 240
        while engine.stream_stats.get("ready_groups", 0) < 2:
            assert time.monotonic() < deadline, engine.stream_stats
            time.sleep(0.2)
        engine.snapshot(path)
        real = records(path).records
        assert [r["t"] for r in real] == ["run", "group", "traj", "group", "traj"]
        assert all(r.get("done") and r["d"]["closed"] for r in real if r["t"] == "traj")
        for forge, words in _snapshot_forges():
            recs = json.loads(json.dumps(real))
            forge(recs)
            _written(tmp_path, recs, path.name)
            with pytest.raises(SnapshotError) as refused:
                engine.restore(path)
            line = str(refused.value)
            assert line.startswith(f"{path}: ") and words in line and "\n" not in line, line
        assert engine.stream_stats.get("ready_groups") == 2  # nothing was restored


# --- a run directory read or resumed runs none of its code and makes no request ----------------------------------

SHIPPED_SPEC = """
name: calculator_compact
extends: {specs}/calculator_compact.yaml
tools:
  - function: shipped_tools:calculator
    schema: specs.calculator:TOOL_SCHEMA
"""
SHIPPED_MODULE = """
from pathlib import Path

Path(__file__).with_name("IMPORTED").write_text("the run directory's code ran")
from specs.calculator import calculator  # noqa: E402,F401
"""


def _cli(*argv: str, env: dict[str, str] = ENV) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsm.cli.commands", *argv],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def shipped(compact_journal, tmp_path) -> Path:
    """A run directory as someone else ships it: its journal names a spec inside it, whose tool module writes
    IMPORTED beside itself when imported."""
    out = tmp_path / "shipped"
    recs = json.loads(json.dumps(compact_journal))
    recs[0]["spec"] = str(out / "spec.yaml")
    _written(out, recs)
    (out / "spec.yaml").write_text(SHIPPED_SPEC.format(specs=REPO / "specs"))
    (out / "shipped_tools.py").write_text(SHIPPED_MODULE)
    return out


@pytest.mark.slow
def test_reading_or_resuming_a_run_directory_imports_no_spec_module_shipped_in_it(shipped):
    """issue 50: `replay`, `show --journal` and `run --resume` imported the spec module shipped inside the run
    directory (resume before refusing). Each now refuses in one line, its code never imported; naming the spec
    yourself (`--spec`) is asking for it."""
    marker = shipped / "IMPORTED"
    argvs = (
        ["replay", str(shipped), "--row", "0"],
        ["show", str(shipped), "--journal"],
        ["run", "--resume", str(shipped), "-q"],
    )
    with ThreadPoolExecutor() as each:  # side by side: none may import it
        dones = list(each.map(lambda argv: _cli(*argv), argvs))
    for argv, done in zip(argvs, dones):
        assert done.returncode == 1 and not marker.exists(), (argv, done.stderr)
        (line,) = done.stderr.strip().splitlines()
        assert f"names the spec {shipped / 'spec.yaml'}, inside the run directory" in line, line
        assert "its code is not imported unless you name it yourself" in line
    asked = _cli("replay", str(shipped), "--row", "0", "--spec", str(shipped / "spec.yaml"))
    assert asked.returncode == 0, asked.stderr
    assert marker.exists()  # the same spec, named by the user: its module is imported (the test can fail)


class _Listener:
    """A TCP port that counts the connections made to it (each closed at once): the Hugging Face endpoint a
    tokenizer download would reach."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.count = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.count += 1
            conn.close()


@pytest.mark.slow
def test_replay_asks_no_server_for_the_tokenizer_its_journal_names(compact_journal, tmp_path):
    """issue 50: `replay` downloaded the tokenizer a journal names. Now it looks on this machine only (with or
    without HF_HUB_OFFLINE) and says how to ask for the download; `--tokenizer NAME` asks for it."""
    out = tmp_path / "out"
    recs = json.loads(json.dumps(compact_journal))
    recs[0]["tokenizer"]["name"] = "agentfsm-test/no-such-tokenizer"
    _written(out, recs)
    hub = _Listener()
    env = {**ENV, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    env["HF_HOME"] = str(tmp_path / "hf")  # an empty cache: nothing is found there
    done = _cli("replay", str(out), "--row", "0", env=env)
    assert done.returncode == 1 and hub.count == 0, (hub.count, done.stderr)
    (line,) = done.stderr.strip().splitlines()
    assert "names the tokenizer 'agentfsm-test/no-such-tokenizer', which is not on this machine" in line, line
    asked = _cli("replay", str(out), "--row", "0", "--tokenizer", "agentfsm-test/no-such-tokenizer", env=env)
    assert asked.returncode == 1 and hub.count > 0, asked.stderr  # asked for: the request is made
    hub.sock.close()
