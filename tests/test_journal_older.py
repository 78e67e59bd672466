"""An older agentfsm reading a journal this version wrote: refused in one line, never misread (issue 47 section 1).

What an older reader does is recorded here, not run: agentfsm at ce5d369 (format 1), 4e76e26 (format 2) and
95780a6 (format 3) fold a journal only when its `run` record's format is one of theirs, and refuse any record
kind they do not know ("unknown record kind"); record keys they do not know they skip. So a journal of this
format is refused at its first record, and one of an older format resumed by this version must meet such a
reader with a record kind it refuses before any record this version appended: the `format` record
(fsm/run/journal.py `Recorder.resumed`). A format only in the `resume` record (as format 3 wrote it) is not
enough: 95780a6 skips a format it does not know there and folds the records after it by format 2's rules.
These tests check the records against those rules; they do not run the older versions' code.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from backends.scripted import ScriptedBackend
from fsm.cli.commands import main
from fsm.run.fold import rebuild
from fsm.run.journal import FORMAT, JOURNAL, JournalError, Read, frame, records
from fsm.run.resume import read_identity
from tests.conftest import ASSETS, REPO, model_turn, scripted, tool_turn, user_row
from tests.test_cli import _ThreadServer
from tests.test_journal import SPEC, _journaled

KINDS = frozenset({"run", "group", "traj", "step", "tool", "weights", "end", "taken", "resume"})
OLDER = {"ce5d369": (1,), "4e76e26": (1, 2), "95780a6": (1, 2, 3)}  # the run formats each reads


def _refused_at(recs: list[dict[str, Any]], formats: tuple[int, ...]) -> int | None:
    """The number of the first record an older reader of `formats` refuses (None: it reads them all)."""
    if recs[0].get("format") not in formats:
        return 1
    return next((k for k, r in enumerate(recs, start=1) if r["t"] not in KINDS), None)


def _spec_as_recorded(folder: Path) -> str:
    """specs/calculator.yaml as tests/fixtures/journal_format2.log was written with (its spec hash): without the
    `isolation: none` of its tool and reward, which came later; beside a copy of the spec it extends. Its hash
    is the journal's only while the reward's default isolation stays out of it (fsm/run/agent.py `_hashed`)."""
    shutil.copy2(REPO / "specs" / "tool_agent.yaml", folder / "tool_agent.yaml")
    text = (REPO / "specs" / "calculator.yaml").read_text()
    kept = [line for line in text.splitlines(keepends=True) if not line.strip().startswith("isolation: none")]
    assert len(kept) == len(text.splitlines()) - 2, "specs/calculator.yaml's isolation lines moved"
    (folder / "calculator.yaml").write_text("".join(kept))
    return str(folder / "calculator.yaml")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, tok) -> tuple[list[dict[str, Any]], int]:
    """tests/fixtures/journal_format2.log with its first row cut before its last model turn, resumed by this
    version (`agentfsm run --resume`): its records, and how many of them the format 2 journal held."""
    out = tmp_path_factory.mktemp("resumed")
    recs = records(REPO / "tests" / "fixtures" / "journal_format2.log").records
    first = next(r for r in recs if r["t"] == "group")["members"][0]
    kept = [
        r for r in recs if r["t"] != "taken" and not (r["t"] == "step" and r["s"] == first and r.get("done"))
    ]
    (out / JOURNAL).write_bytes(b"".join(map(frame, kept)))
    spec = _spec_as_recorded(tmp_path_factory.mktemp("spec"))
    server = _ThreadServer(ScriptedBackend(lambda s, n, p: model_turn(tok, "#### 3"), model_name="echo"))
    try:
        argv = ["run", spec, "--resume", str(out), "--server", server.url, "--tokenizer", str(ASSETS), "-q"]
        assert main([*argv, "--accept-changes"]) == 0
    finally:
        server.close()
    return records(out / JOURNAL).records, len(kept)


@pytest.mark.parametrize("older", sorted(OLDER))
def test_an_older_reader_refuses_this_versions_journal_before_any_record_it_wrote(
    tmp_path, tok, resumed, older
):
    """A journal this version wrote is refused at its `run` record; a format 2 journal it resumed, at the first
    record it appended (none of the records after it is folded by the older rules)."""
    call = tool_turn(tok, ("calculator", {"expression": "1 + 2"}))
    rows = [user_row("What is 1 + 2?", reward_model={"ground_truth": "3"})]
    asyncio.run(_journaled(SPEC, scripted([call, model_turn(tok, "#### 3")]), rows, tmp_path / JOURNAL, n=1))
    assert _refused_at(records(tmp_path / JOURNAL).records, OLDER[older]) == 1
    recs, held = resumed
    assert recs[0]["format"] == 2 and recs[held]["t"] == "format" and recs[held]["format"] == FORMAT
    assert _refused_at(recs, OLDER[older]) == (1 if older == "ce5d369" else held + 1)
    assert {r["t"] for r in recs[held:]} >= {"resume", "traj", "step"}  # what it would have misread
    rb = rebuild(Read(Path("resumed"), recs, 0))  # this version reads it whole
    assert [t.assistant_turns for t in sorted(rb.trajs.values(), key=lambda t: t.index)] == [2, 1]
    assert len(rb.done) == 2


@pytest.mark.parametrize("where", ["run", "format", "resume"])
def test_a_newer_format_is_refused_in_one_line(tmp_path, where):
    """This version, as the older reader of a newer one: a format it does not know, in the `run` record, a
    `format` record or a `resume` record (as format 3 wrote it), is refused in one line naming the record. Before,
    a `resume` record's unknown format was skipped, and the records after it folded by the older rules."""
    recs = records(REPO / "tests" / "fixtures" / "journal_format3.log").records
    newer = FORMAT + 1
    if where == "run":
        recs = [{**recs[0], "format": newer}, *recs[1:]]
    elif where == "format":
        recs = [*recs[:3], {"t": "format", "format": newer}, *recs[3:]]
    else:
        recs = [*recs[:3], {"t": "resume", "format": newer, "made_by": {}, "accepted": []}, *recs[3:]]
    with pytest.raises(JournalError) as err:
        rebuild(Read(Path("j.log"), recs, 0))
    msg = str(err.value)
    assert "\n" not in msg and f"format {newer}, written by a newer agentfsm" in msg
    assert msg.startswith("j.log: record 1" if where == "run" else "j.log: record 4")
    if where == "run":  # `agentfsm run --resume` reads the run record first, alone
        (tmp_path / JOURNAL).write_bytes(b"".join(map(frame, recs)))
        with pytest.raises(
            JournalError, match=f"record 1: records of format {newer}, written by a newer agentfsm"
        ):
            read_identity(tmp_path / JOURNAL)
