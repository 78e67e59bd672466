"""The run's journal (fsm/run/journal.py): every step written as it happens and read back into the same
trajectories; a torn last record dropped with one line; a damaged or forged journal refused in one line naming
the file and the record, as strictly as a server's answer; a side-effecting tool never executed twice for a
journaled call. The random `kill -9` test is tests/test_journal_kill.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import zlib
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest

from backends.scripted import ScriptedBackend
from fsm import RolloutEngine
from fsm.cli.commands import main
from fsm.run.codec import encode_trajectory
from fsm.run.fold import rebuild
from fsm.run.journal import FORMAT, JOURNAL, JournalError, Read, Recorder, Scan, Writer, frame, records
from fsm.run.resume import identity, load
from tests.conftest import ASSETS, REPO, model_turn, scripted, tool_turn, user_row
from tests.test_cli import _ThreadServer, assert_consistent, one_line_error, run_argv

SPEC = str(REPO / "specs" / "calculator.yaml")


def _echo_turn(session_id: str, turn: int, prompt: list[int]) -> list[int]:
    seed = zlib.crc32(b",".join(str(t).encode() for t in prompt))
    return [10 + (seed + 7919 * k) % 500 for k in range(8)] + [2]  # plain ids of the tiny tokenizer


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run interrupted (a real SIGINT) after its third model request, and the same run uninterrupted."""
    calls: list[str] = []

    def turn(session_id, n, prompt):
        calls.append(session_id)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return _echo_turn(session_id, n, prompt)

    server = _ThreadServer(ScriptedBackend(turn, latency_s=0.02, model_name="echo"))
    ref = tmp_path_factory.mktemp("ref")
    try:
        for _ in range(3):  # the journal must hold a trajectory in flight with a model turn's step (the
            calls.clear()  # forgeries below edit one); on a loaded machine the SIGINT may land before it
            cut = tmp_path_factory.mktemp("cut")
            assert main(run_argv(server.url, cut, "--num-prompts", "6", "--concurrency", "1", "-q")) == 130
            if _in_flight_turn(_recs(cut)):
                break
        assert _in_flight_turn(_recs(cut)), "three interrupted runs, none with a model turn in flight"
        assert main(run_argv(server.url, ref, "--num-prompts", "6", "--concurrency", "2", "-q")) == 0
    finally:
        server.close()
    return cut, ref


def _in_flight_turn(recs: list[dict[str, Any]]) -> bool:
    """A step with a model turn's tokens, and a running trajectory's step that took an edge."""
    steps = [r for r in recs if r["t"] == "step"]
    return any("tok" in r for r in steps) and any("e" in r for r in _running_steps(recs))


@pytest.fixture
def echo_url():
    server = _ThreadServer(ScriptedBackend(_echo_turn, model_name="echo"))
    yield server.url
    server.close()


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(exist_ok=True)
    (dst / JOURNAL).write_bytes((src / JOURNAL).read_bytes())
    return dst


def _resume(out: Path, url: str) -> list[str]:
    return ["run", "--resume", str(out), "--server", url, "--tokenizer", str(ASSETS), "-q"]


def test_a_signal_flushes_the_journal_and_resume_completes_the_run_as_uninterrupted(
    capsys, interrupted, echo_url, tmp_path, monkeypatch
):
    cut, ref = interrupted
    out = _copy(cut, tmp_path / "out")
    read, scan = [], Scan.__iter__
    monkeypatch.setattr(Scan, "__iter__", lambda self: (read.append(r) or r for r in scan(self)))
    assert main(_resume(out, echo_url)) == 0
    assert len(_recs(cut)) < len(read) < 2 * len(_recs(cut))  # read once (and its first records), not twice
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert f"agentfsm: resuming {out / JOURNAL}: " in err and "go on from their last state" in err
    assert_consistent(out, 6)
    from tests.conftest import assert_same_batch_files

    assert_same_batch_files(ref, out)
    assert rebuild(records(out / JOURNAL)).ended == "completed"
    assert main(_resume(out, echo_url)) == 0  # a completed run (killed after its files were whole): done
    assert capsys.readouterr().err.strip() == (
        f"agentfsm: --resume: {out / JOURNAL}: the run there has completed: nothing to resume (its files are whole)"
    )


def test_a_new_run_into_an_unfinished_one_is_refused(capsys, interrupted, echo_url, tmp_path):
    out = _copy(interrupted[0], tmp_path / "out")
    line = one_line_error(capsys, run_argv(echo_url, out, "--num-prompts", "2", "-q"))
    assert (
        f"{out} holds an unfinished run (journal.log); resume it with `agentfsm run --resume {out}`" in line
    )


def test_a_torn_last_record_is_dropped_with_one_line(capsys, interrupted, echo_url, tmp_path):
    out = _copy(interrupted[0], tmp_path / "out")
    data = (out / JOURNAL).read_bytes()
    last = frame({"t": "step", "s": "x", "v": {"assistant_turns": 1}})
    (out / JOURNAL).write_bytes(data + last[: len(last) // 2])  # a write cut mid-way by a kill
    n = data.count(b"\n") + 1
    assert main(_resume(out, echo_url)) == 0
    err = capsys.readouterr().err
    assert (
        f"agentfsm: warning: {out / JOURNAL}: record {n}, the last, was cut mid-way ({len(last) // 2} bytes, "
        "a write a kill interrupted); dropped" in err
    )
    assert_consistent(out, 6)


def test_a_damaged_record_is_refused_naming_the_file_and_the_record(capsys, interrupted, tmp_path):
    out = _copy(interrupted[0], tmp_path / "out")
    lines = (out / JOURNAL).read_bytes().split(b"\n")
    lines[3] = lines[3].replace(b'"t":', b'"T":', 1)  # an edit the checksum catches
    (out / JOURNAL).write_bytes(b"\n".join(lines))
    line = one_line_error(capsys, _resume(out, "http://127.0.0.1:9"))
    assert line == (
        f"agentfsm: --resume: {out / JOURNAL}: record 4: its checksum does not match (damaged or edited); the "
        "run cannot be resumed from it"
    )


def _recs(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line[9:]) for line in (out / JOURNAL).read_bytes().splitlines()]


def _whole_running(recs):
    done = {r["s"] for r in recs if r.get("done")}
    return next(r["d"] for r in recs if r["t"] == "traj" and r["s"] not in done)


def _step(recs):
    return next(r for r in recs if r["t"] == "step" and "tok" in r)


def _model_run(recs):
    """The token run of the first model turn: [role, ids, logprobs, version]."""
    return next(run for run in _step(recs)["tok"][1] if run[0] == "assistant")


def _running_steps(recs):
    done = {r["s"] for r in recs if r.get("done")}
    return [r for r in recs if r["t"] == "step" and r["s"] not in done]


def _state(recs):
    [r for r in _running_steps(recs) if "e" in r][-1]["e"][-1][1] = "NOWHERE"


def _out_of_vocab(recs):
    step = next(
        r for r in _running_steps(recs) if "prompt_ids" in r.get("a", {}) or "prompt_ids" in r.get("r", {})
    )
    (step.get("a") or step["r"])["prompt_ids"][1][-1] = 10**6


def _delta_out_of_vocab(recs):
    _model_run(recs)[1][0] = 10**6


def _mask_7(recs):
    """A model turn's tokens written as slots replaced (as a failed row's emptied response is), its mask 7s."""
    step = _step(recs)
    ids = [i for run in step.pop("tok")[1] for i in run[1]]
    arrays = {
        "response_ids": ("i", ids),
        "response_mask": ("b", [7] * len(ids)),
        "_version_runs": ("i", [0, 0]),
    }
    step["r"] = {**arrays, "response_logprobs": ("f", [0.0] * len(ids)), "runs": ("i", [0, 0, len(ids)])}


def _nan_logprob(recs):
    _model_run(recs)[2][0] = float("nan")


def _offset(recs):
    _step(recs)["tok"][0] += 3


def _unknown_event(recs):
    _step(recs)["ev"] = "teleport"


def _row_5(recs):
    _whole_running(recs)["row"] = 5


def _turns_a_string(recs):  # stated where a model turn's runs imply it
    _step(recs).setdefault("v", {})["assistant_turns"] = "2"


def _edge_time(recs):
    _step(recs)["e"][-1][2] = "soon"


def _unknown_slot(recs):
    _step(recs).setdefault("v", {})["__class__"] = "x"


def _unknown_kind(recs):
    recs.insert(2, {"t": "exec", "code": "os.system('x')"})


def _second_run(recs):
    recs.insert(2, dict(recs[0]))


def _unknown_dc(recs):
    _whole_running(recs)["metrics"]["__dc__"] = "os.system"


def _orphan_step(recs):
    recs.insert(2, {"t": "step", "s": "nobody", "v": {}})


def _spec_hash(recs):
    recs[0]["spec_hash"] = "000000000000"


def _rows_expected(recs):
    recs[0]["rows_expected"] = "12"


def _done_unfinished(recs):
    _running_steps(recs)[-1]["done"] = True  # a row mid-run called finished: no termination reason


def _forged_node(recs):
    """A tree node (fsm/run/treejournal.py) forged into a linear run: its spec has no child machine to run it."""
    root = next(r for r in recs if r["t"] == "traj")
    sid = f"{root['s']}:0.0"
    meta = {"node": "0.0", "parent": "0", "kind": "child", "offset": 0, "policy": "default", "depth": 1}
    meta |= {"shared": 0, "route": sid, "ordinal": 1, "forks": {}, "origin": "calculator", "k": 0}
    recs.append(
        {
            "t": "traj",
            "s": sid,
            "ev": "child_started",
            "d": {**root["d"], "session_id": sid},
            "n": {**meta, "forked": False},
        }
    )


@pytest.mark.parametrize(
    "tamper, reason",
    [
        (_state, "state 'NOWHERE' is not one of the agent's"),
        (_out_of_vocab, "token ids outside the tokenizer's vocabulary"),
        (_delta_out_of_vocab, "token ids outside the tokenizer's vocabulary"),
        (_mask_7, "response_mask holds values other than 0 and 1"),
        (_nan_logprob, "logprobs that are not finite numbers <= 0"),
        (_offset, "response_ids continues at"),
        (_row_5, "field 'row': Input should be a valid dictionary"),
        (_turns_a_string, "field 'assistant_turns': Input should be a valid integer"),
        (_edge_time, "an edge that is not [index, state] or [index, state, time]"),
        (_unknown_slot, "'__class__' is not a slot a step changes"),
        (_unknown_event, "unknown event 'teleport' (known: action, begin, "),
        (_unknown_kind, "unknown record kind 'exec'"),
        (_second_run, "a second 'run' record"),
        (_unknown_dc, "unknown record type 'os.system'"),
        (_orphan_step, "a step of trajectory 'nobody', which no record started"),
        (_spec_hash, "resume with the spec it was written with"),
        (_rows_expected, "rows_expected is not a count"),
        (_done_unfinished, "finished without a termination reason"),
        (_forged_node, "'calculator' is not a child machine of its parent's spec"),
    ],
)
def test_a_forged_journal_is_refused_in_one_line(capsys, interrupted, echo_url, tmp_path, tamper, reason):
    """Forged: each record's checksum matches (it is unkeyed), so its content is checked as a snapshot's is."""
    out = tmp_path / "out"
    out.mkdir()
    recs = _recs(interrupted[0])
    tamper(recs)
    body = b"".join(
        b"%08x %s\n" % (zlib.crc32(b := json.dumps(r, separators=(",", ":")).encode()), b) for r in recs
    )
    (out / JOURNAL).write_bytes(body)
    line = one_line_error(capsys, _resume(out, echo_url))
    assert line.startswith(f"agentfsm: --resume: {out / JOURNAL}: ") and reason in line, line


# --- written, read back: the same trajectories --------------------------------------------------------------


async def _journaled(spec: Any, backend: Any, rows: list[dict], path: Path, n: int = 2) -> list:
    async with RolloutEngine(spec, tokenizer=str(ASSETS), backend=backend) as engine:
        recorder = Recorder(Writer(path, "off"))
        recorder.header(
            identity(engine.agent, engine.codec, run_id="t", groups=len(rows), rows_expected=len(rows) * n)
        )
        await engine.ajournal(recorder)
        await engine.asubmit(rows, n=n, sampling=engine.sampling({"temperature": 0.0}))
        groups = await engine.atake_groups(len(rows))
        recorder.writer.close()
    return sorted((t for g in groups for t in g.trajectories), key=lambda t: (t.index, t.sample))


def _same(a, b) -> None:
    x, y = encode_trajectory(a), encode_trajectory(b)
    for slot in ("path_times",):  # this process's clock
        x.pop(slot), y.pop(slot)
    assert x == y


def test_the_journal_reads_back_into_the_same_trajectories(tmp_path, tok):
    rows = [user_row(f"What is {i} + {2 * i}?") for i in range(3)]
    script = [tool_turn(tok, ("calculator", {"expression": "1 + 2"})), model_turn(tok, "The answer is 3.")]
    trajs = asyncio.run(_journaled(SPEC, scripted(script), rows, tmp_path / JOURNAL))
    rb = rebuild(records(tmp_path / JOURNAL))
    assert len(rb.done) == len(trajs) == 6
    for t in trajs:
        _same(t, rb.trajs[t.session_id])
    assert all(t.metrics.num_tool_calls == 1 for t in trajs)


def test_a_stale_group_run_again_resumes_as_its_rerun(tmp_path, tok):
    """`take(stale="rerun")` starts a stale group again under its uid: the journal records the rerun, and a
    resume takes the rerun's trajectories back where it was cut, never the stale ones (which would come back
    finished, the rerun's trajectories journaled under no group)."""
    rows = [user_row(f"What is {i} + {i}?") for i in range(2)]
    script = [tool_turn(tok, ("calculator", {"expression": "1 + 1"})), model_turn(tok, "#### 2")]
    path = tmp_path / JOURNAL

    async def run() -> tuple[Any, Any]:
        async with RolloutEngine(SPEC, tokenizer=str(ASSETS), backend=scripted(script)) as engine:
            recorder = Recorder(Writer(path, "off"))
            recorder.header(identity(engine.agent, engine.codec, run_id="t", groups=2, rows_expected=4))
            await engine.ajournal(recorder)
            await engine.asubmit(rows, n=2, sampling=engine.sampling({"temperature": 0.0}))
            first = await engine.atake_groups(1, timeout=30)
            async with asyncio.timeout(30):
                while engine.stream_stats["ready_groups"] < 1:  # the other group, finished at version 0
                    await asyncio.sleep(0.01)
            engine.runner.gate.version = 2  # two updates later (the scripted backend has no weights)
            again = await engine.atake_groups(1, max_staleness=1, stale="rerun", timeout=30)
            recorder.writer.close()
        return first[0], again[0]

    first, again = asyncio.run(run())
    assert again.reruns == 1 and again.uid != first.uid
    rb = rebuild(records(path))
    assert [g["uid"] for g in rb.groups] == [first.uid, again.uid]
    assert rb.groups[1]["members"] == [t.session_id for t in again.trajectories]
    assert rb.groups[1]["reruns"] == 1

    # cut right after the rerun started: its group record and its trajectories' first records
    lines = path.read_bytes().split(b"\n")
    at = next(i for i, line in enumerate(lines) if b'"reruns":1' in line)
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / JOURNAL).write_bytes(b"\n".join(lines[: at + 3]) + b"\n")

    async def resume() -> list:
        async with RolloutEngine(SPEC, tokenizer=str(ASSETS), backend=scripted(script)) as engine:
            loaded = load(cut / JOURNAL, engine.agent, engine.codec)
            recorder = Recorder(Writer(cut / JOURNAL, "off", keep=loaded.good_bytes), loaded.tool_results)
            await engine.ajournal(recorder)
            meta = await engine.arestore(loaded.data)
            groups = await engine.atake_groups(meta["groups"], timeout=30)
            recorder.writer.close()
        return groups

    resumed = {g.uid: g for g in asyncio.run(resume())}
    assert sorted(resumed) == [again.uid]  # the first group was taken before the cut: not handed out again
    back = resumed[again.uid]
    assert [t.session_id for t in back.trajectories] == [t.session_id for t in again.trajectories]
    assert back.reruns == 1
    for a, b in zip(again.trajectories, back.trajectories):
        assert a.response_ids == b.response_ids and a.messages == b.messages


def test_a_rerun_of_a_group_no_record_started_is_refused(tmp_path):
    path = tmp_path / JOURNAL
    recorder = Recorder(Writer(path, "off"))
    recorder.writer.append({"t": "run", "format": FORMAT})
    recorder.writer.append({"t": "group", "uid": "u", "sampling": {}, "members": [], "reruns": 1})
    recorder.writer.close()
    with pytest.raises(JournalError, match=r"record 2: a rerun \(1\) of group 'u', which no record started"):
        rebuild(records(path))


COUNTED_SPEC = """
name: calculator_counted
extends: {specs}/calculator.yaml
tools:
  - function: tests.fixtures.parts:counted
    schema: specs.calculator:TOOL_SCHEMA
"""


def test_a_side_effecting_tool_is_never_executed_again_for_a_journaled_call(tmp_path, tok, monkeypatch):
    """Killed right after the tool's result reached the journal (the step after the tool state never did): on
    resume the call's state runs again, and the tool answers from the journal, by its idempotency key."""
    count = tmp_path / "count.txt"
    monkeypatch.setenv("AGENTFSM_TEST_COUNT", str(count))
    spec = tmp_path / "counted.yaml"
    spec.write_text(COUNTED_SPEC.format(specs=REPO / "specs"))
    rows = [user_row(f"What is {i} + {i}?") for i in range(2)]

    def script(row, sample, turn, prompt):
        if "tool_response" not in tok.decode(prompt):  # by the prompt: a resumed session's turn counts anew
            return tool_turn(tok, ("calculator", {"expression": f"{row} + {row} + {sample}"}))
        return model_turn(tok, "Done.")

    ref = asyncio.run(_journaled(str(spec), scripted(script), rows, tmp_path / "ref.log"))
    assert sorted(count.read_text().split("\n")[:-1]) == sorted(
        f"{r} + {r} + {s}" for r in range(2) for s in range(2)
    )
    journal = tmp_path / JOURNAL
    data = (tmp_path / "ref.log").read_bytes()
    lines = data.split(b"\n")
    first_tool = next(i for i, line in enumerate(lines) if b'"t":"tool"' in line)
    journal.write_bytes(b"\n".join(lines[: first_tool + 1]) + b"\n")  # killed just after it
    key = json.loads(lines[first_tool][9:])["k"]
    count.write_text("")

    async def resume() -> list:
        async with RolloutEngine(str(spec), tokenizer=str(ASSETS), backend=scripted(script)) as engine:
            loaded = load(journal, engine.agent, engine.codec)
            recorder = Recorder(Writer(journal, "off", keep=loaded.good_bytes), loaded.tool_results)
            await engine.ajournal(recorder)
            meta = await engine.arestore(loaded.data)
            groups = await engine.atake_groups(meta["groups"])
            recorder.writer.close()
        return sorted((t for g in groups for t in g.trajectories), key=lambda t: (t.index, t.sample))

    again = asyncio.run(resume())
    executed = count.read_text().split("\n")[:-1]
    assert len(executed) == 3  # the journaled call is not among them
    for a, b in zip(ref, again):
        assert a.response_ids == b.response_ids and a.messages == b.messages
    assert key.endswith("_c0_0")  # (session: row and sample, turn, call): the same after the resume


# --- replay and show, from the journal alone ------------------------------------------------------------------


def test_replay_rebuilds_a_row_without_server_or_model(capsys, interrupted):
    cut, _ = interrupted
    assert main(["replay", str(cut), "--row", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== row 0 sample 0 (") and "finished" in out
    assert "[user] " in out and "path: PENDING -> GENERATING -> " in out
    assert re.search(r"token check: (exact|token \d+: trajectory has )", out), out  # random echo ids
    recorded = re.search(r"reward: recorded (\S+), recomputed (\S+) \(difference \+0\)", out)
    assert recorded and recorded.group(1) == recorded.group(2), out
    line = one_line_error(capsys, ["replay", str(cut), "--row", "99"])
    assert line == f"agentfsm: {cut / JOURNAL}: no row 99 in this run (its rows are 0..5)"


def test_show_reads_the_journal_of_a_run_that_did_not_finish(capsys, interrupted):
    cut, _ = interrupted
    assert main(["show", str(cut)]) == 0
    out = capsys.readouterr().out
    assert f"{cut / JOURNAL}: 3 trajectories finished, 3 in flight; the run: not ended" in out
    assert "in flight: " in out


def test_failures_read_back_as_recorded_and_an_older_journals_error_as_a_failure(tmp_path, tok):
    """A row's fsm.Failure is journaled as recorded (kind, state, cause). A journal written before Failure holds
    a failed row's `error` text only: it reads back as a failure (kind "error"), never as a row that looks
    finished."""
    rows = [user_row("What is 1 + 2?"), user_row("x", tools_kwargs="abc")]
    trajs = asyncio.run(_journaled(SPEC, scripted([]), rows, tmp_path / JOURNAL, n=1))
    rb = rebuild(records(tmp_path / JOURNAL))
    for t in trajs:
        _same(t, rb.trajs[t.session_id])
    assert [(t.failure.kind, t.failure.state) for t in rb.trajs.values()] == [
        ("backend", "GENERATING"),
        ("bad_row", "PENDING"),
    ]
    lines = []
    for rec in records(tmp_path / JOURNAL).records:
        if "failure" in rec:  # a `failure` event's
            rec.setdefault("v", {})["failure"] = {"fields": rec.pop("failure")}
        for part in (rec.get("v"), rec.get("d")):  # as an older engine wrote them
            if isinstance(part, dict) and "failure" in part:
                failure, _ = part.pop("failure"), part.pop("failures", None)
                part["error"] = failure and failure["fields"]["cause"]
        lines.append(frame(rec))
    (tmp_path / JOURNAL).write_bytes(b"".join(lines))
    old = rebuild(records(tmp_path / JOURNAL))
    for t in trajs:
        assert old.trajs[t.session_id].failure.kind == "error" and old.trajs[t.session_id].error == t.error


@pytest.mark.parametrize("old", ["journal_format1.log", "journal_format2.log", "journal_format3.log"])
def test_an_older_journal_reads_back_as_the_events_of_this_format_do(tmp_path, tok, old):
    """A journal written before its steps were named events (format 1: slot diffs alone;
    tests/fixtures/journal_format1.log, this run written by agentfsm at ce5d369), before their counters,
    messages, times and reward were the events' payloads (format 2: journal_format2.log, written at 4e76e26,
    its last model turn on the reward record), or before a model turn's finish reason and calls and a tool's
    rewards were (format 3: journal_format3.log, written at 95780a6) is folded by the same reader into the
    trajectories the events of this version give: a tool call, its result and reward, a final answer, and a
    row whose second turn failed (its response emptied)."""
    call = tool_turn(tok, ("calculator", {"expression": "1 + 2"}))
    script = scripted({0: [call, model_turn(tok, "#### 3")], 1: [call]})
    rows = [user_row("What is 1 + 2?", reward_model={"ground_truth": "3"}), user_row("And 2 + 2?")]
    asyncio.run(_journaled(SPEC, script, rows, tmp_path / JOURNAL, n=1))
    recs = records(tmp_path / JOURNAL).records
    assert recs[0]["format"] == FORMAT == 4 and {r["ev"] for r in recs if r["t"] == "step"} == {
        "begin",
        "prompt",
        "model_turn",
        "tool_result",
        "failure",
        "reward",
    }
    read = rebuild(records(REPO / "tests" / "fixtures" / old))
    assert read.identity["format"] == int(old[-5])
    old = read.trajs.values()
    new = rebuild(records(tmp_path / JOURNAL)).trajs.values()
    slots = ("prompt_ids", "response_ids", "response_mask", "response_logprobs", "response_versions", "runs")
    slots += ("messages", "path", "transitions_fired", "reward_score", "termination_reason", "error")
    slots += ("assistant_turns", "user_turns", "needs_tail", "last_finish_reason", "pending_calls")
    slots += ("tool_rewards", "tool_scores", "turn_scores", "turn_rewards")
    for a, b in zip(sorted(old, key=lambda t: t.index), sorted(new, key=lambda t: t.index), strict=True):
        assert [getattr(a, s) for s in slots] == [getattr(b, s) for s in slots]
    assert [len(t.response_ids) for t in old] == [40, 0]
    assert [len(t.path_times) for t in old] == [len(t.path) for t in old]
    assert [t.metrics.as_dict() for t in old][0].keys() == [t.metrics.as_dict() for t in new][0].keys()


def test_a_rows_last_action_is_its_own_event_before_its_reward(tmp_path, tok):
    """The model turn that ends a row (its edge into a final state) is recorded as a `model_turn` with its tokens
    and edge, then the reward as `reward`, which carries neither (before, the reward record held that turn's tokens
    and edge). A row that failed mid-action records its failure as its own event (`failure`: kind, state, attempt,
    cause, with what the action left), then its `reward`, which carries neither (before, the reward record held
    the failure and the emptied response)."""
    call = tool_turn(tok, ("calculator", {"expression": "1 + 2"}))
    script = scripted({0: [call, model_turn(tok, "#### 3")], 1: [call]})
    rows = [user_row("What is 1 + 2?", reward_model={"ground_truth": "3"}), user_row("And 2 + 2?")]
    trajs = asyncio.run(_journaled(SPEC, script, rows, tmp_path / JOURNAL, n=1))
    recs = records(tmp_path / JOURNAL).records
    for t in trajs:
        steps = [r for r in recs if r["t"] == "step" and r["s"] == t.session_id]
        last = steps[-1]
        assert last["ev"] == "reward" and last.get("done") and "tok" not in last and "e" not in last
    ok = [r for r in recs if r["t"] == "step" and r["s"] == trajs[0].session_id]
    assert [r["ev"] for r in ok][-2:] == ["model_turn", "reward"]
    assert ok[-2]["e"][-1][1] == trajs[0].state == "TERMINATED" and ok[-2]["tok"][1][0][0] == "assistant"
    failed = [r for r in recs if r["t"] == "step" and r["s"] == trajs[1].session_id]
    assert [r["ev"] for r in failed][-2:] == ["failure", "reward"]
    assert {k: failed[-2]["failure"][k] for k in ("kind", "state", "attempt")} == {
        "kind": "backend",
        "state": "GENERATING",
        "attempt": 1,
    }
    assert failed[-2]["failure"]["cause"] == trajs[1].failure.cause and not trajs[1].response_ids
    assert not {"failure", "r", "tok", "e"} & (failed[-1].keys() | failed[-1].get("v", {}).keys())
    rb = rebuild(records(tmp_path / JOURNAL))
    for t in trajs:
        _same(t, rb.trajs[t.session_id])
    # a kill after the failure was journaled, before the reward (and the take): the row starts over, rather than
    # run its failed action again with the failure on it
    kept = [r for r in recs if r is not failed[-1] and r["t"] != "taken"]
    (tmp_path / JOURNAL).write_bytes(b"".join(map(frame, kept)))
    with RolloutEngine(SPEC, tokenizer=str(ASSETS), backend=script) as engine:
        loaded = load(tmp_path / JOURNAL, engine.agent, engine.codec)
    assert (loaded.finished, loaded.in_flight, loaded.restarted) == (1, 0, 1)
    (again,) = [m for g in loaded.data["groups"] for m in g["trajectories"] if not m["done"]]
    assert again["__traj__"].failure is None and again["__traj__"].state == "PENDING"


def test_a_step_carries_its_events_payload_not_the_slots_it_implies(tmp_path, tok):
    """Format 3: a model turn's counters follow from its token runs (each model run an assistant turn, the turn
    closer owed after it), a tool's answer is a user turn; the messages appended are the event's `msg`, each edge
    carries the time its state was entered, a reward its value. None of these is a slot diff any more, and the
    journal folds back into the same trajectories. A journal of format 2 resumed by this version says so in its
    `resume` record: the records after it fold by these rules, the ones before by format 2's."""
    call = tool_turn(tok, ("calculator", {"expression": "1 + 2"}))
    script = scripted({0: [call, model_turn(tok, "#### 3")], 1: [call, model_turn(tok, "#### 4")]})
    rows = [user_row("What is 1 + 2?", reward_model={"ground_truth": "3"}), user_row("And 2 + 2?")]
    trajs = asyncio.run(_journaled(SPEC, script, rows, tmp_path / JOURNAL, n=1))
    recs = records(tmp_path / JOURNAL).records
    steps = [r for r in recs if r["t"] == "step"]
    implied = {"assistant_turns", "user_turns", "needs_tail", "reward_score", "messages", "path_times"}
    for r in steps:
        assert not implied & (r.get("v", {}).keys() | r.get("a", {}).keys()), r
        assert all(len(edge) == 3 for edge in r.get("e", ()))
    turns = [r for r in steps if r["ev"] == "model_turn"]
    assert len(turns) == 4 and all(r["msg"][0]["role"] == "assistant" for r in turns)
    assert {r["reward"] for r in steps if r["ev"] == "reward"} == {1.0, 0.0}
    assert [(t.assistant_turns, t.user_turns, t.needs_tail) for t in trajs] == [(2, 1, True)] * 2
    rb = rebuild(records(tmp_path / JOURNAL))
    for t in trajs:
        _same(t, rb.trajs[t.session_id])
    # the same records under a format 2 header: the counters go uncounted, unless a `format` record (a resume's)
    # says they are of this format
    as2 = [{**recs[0], "format": 2}, *recs[1:]]
    assert [rebuild(Read(tmp_path, as2, 0)).trajs[t.session_id].assistant_turns for t in trajs] == [0, 0]
    resumed = [
        as2[0],
        {"t": "format", "format": FORMAT},
        {"t": "resume", "made_by": {}, "accepted": []},
        *recs[1:],
    ]
    rb = rebuild(Read(tmp_path, resumed, 0))
    for t in trajs:
        _same(t, rb.trajs[t.session_id])


def test_a_snapshot_is_the_journal_compacted(tmp_path, tok):
    """A snapshot taken while rows run holds each trajectory as the journal folds to at that moment (every one
    parked at a boundary the journal recorded): the same slots, its `traj` record the compaction of the steps."""
    turns = [tool_turn(tok, ("calculator", {"expression": "1 + 2"}))] * 2 + [model_turn(tok, "#### 3")]
    asked: list[int] = []  # the turn index of each model call, as it is asked
    gate: list[Any] = []  # the engine's pause gate

    def turn(row: int, sample: int, index: int, prompt_ids: list[int]) -> list[int]:
        asked.append(index)
        # on the engine's loop, at a row's second turn: no row asks its last one, so none ends before the
        # snapshot parks it (was: on a loaded machine every row had ended, its tokens masked by its failed reward)
        if index:
            gate[0].close()
        return turns[index]

    script = scripted(turn, latency_s=0.05)
    rows = [user_row(f"What is {i} + 2?") for i in range(3)]

    async def go() -> None:
        async with RolloutEngine(SPEC, tokenizer=str(ASSETS), backend=script) as engine:
            recorder = Recorder(Writer(tmp_path / JOURNAL, "off"))
            recorder.header(identity(engine.agent, engine.codec, run_id="t", groups=3, rows_expected=6))
            await engine.ajournal(recorder)
            gate.append(engine.runner.gate)
            await engine.asubmit(rows, n=2, sampling=engine.sampling({"temperature": 0.0}))
            async with asyncio.timeout(60):  # mid-run: a row's second turn asked, so its first is answered
                while not any(asked):
                    await asyncio.sleep(0.005)
            await engine.asnapshot(tmp_path / "snap.log", stop=True)
            recorder.writer.close()

    asyncio.run(go())
    journal, snap = rebuild(records(tmp_path / JOURNAL)), rebuild(records(tmp_path / "snap.log"))
    assert set(journal.trajs) == set(snap.trajs) and len(snap.trajs) == 6
    seen = [(t.state, len(t.response_ids), t.termination_reason) for t in snap.trajs.values()]
    assert not snap.done and any(len(t.response_ids) for t in snap.trajs.values()), (sorted(set(asked)), seen)
    for sid, t in snap.trajs.items():
        # parked at a boundary, or waiting at the closed gate before its turn, which the snapshot keeps as a turn
        # with no tokens yet (fsm/run/actions.py `_resumed_turn`) where the journal holds the boundary before it
        assert t.partial_turn is None or not any(t.partial_turn), t.partial_turn
        t.partial_turn = None
        _same(journal.trajs[sid], t)


def test_a_model_turns_finish_and_calls_a_tools_rewards_and_an_interactions_score_are_its_payload(
    tmp_path, tok
):
    """Format 4: a model turn states its finish reason (`finish`) and the calls it asked for (`calls`, their
    fields; none when it asked for none), a tool round its tool rewards and scores (`rewards`, `scores`: each
    reward also a turn reward at the model's last token), an interaction its turn score (`score`); a tool round
    answers the pending calls. None of these is a slot diff any more, and the journal folds back into the same
    trajectories."""
    slots = {
        "last_finish_reason",
        "pending_calls",
        "tool_rewards",
        "tool_scores",
        "turn_scores",
        "turn_rewards",
    }
    call = tool_turn(tok, ("calculator", {"expression": "1 + 2"}))
    script = scripted([call, model_turn(tok, "#### 3")])
    rows = [user_row("What is 1 + 2?", reward_model={"ground_truth": "3"})]
    trajs = asyncio.run(_journaled(SPEC, script, rows, tmp_path / JOURNAL, n=1))
    guess = [
        {"raw_prompt": [{"role": "user", "content": "Guess my number."}], "interaction_kwargs": {"secret": 7}}
    ]
    script = scripted([model_turn(tok, "5"), model_turn(tok, "7")])
    trajs += asyncio.run(_journaled("interaction_agent", script, guess, tmp_path / "guess.log", n=1))
    steps = [r for p in (JOURNAL, "guess.log") for r in records(tmp_path / p).records if r["t"] == "step"]
    for r in steps:
        assert not slots & (r.get("v", {}).keys() | r.get("a", {}).keys() | r.get("r", {}).keys()), r
    turns = [r for r in steps if r["ev"] == "model_turn"]
    assert [r["finish"] for r in turns] == ["stop"] * 4 and [len(r.get("calls", ())) for r in turns] == [
        1,
        0,
        0,
        0,
    ]
    assert turns[0]["calls"] == [{"name": "calculator", "arguments": {"expression": "1 + 2"}, "raw": ANY}]
    (tools,) = [r for r in steps if r["ev"] == "tool_result"]
    assert (tools["rewards"], tools["scores"]) == ([0.0], [0.0])
    assert [r["score"] for r in steps if r["ev"] == "interaction"] == [0.0, 1.0]
    assert trajs[0].turn_rewards == [["tool", len(call) - 1, 0.0]] and trajs[1].turn_scores == [0.0, 1.0]
    for t, p in zip(trajs, (JOURNAL, "guess.log")):
        _same(t, rebuild(records(tmp_path / p)).trajs[t.session_id])
