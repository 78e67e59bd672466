"""Tree runs in the journal (fsm/run/treejournal.py): a run of child machines or forks interrupted mid-tree (a
real SIGINT from the model server's handler) resumes node by node, finished nodes taken back as journaled and
never asked for again, and equals the uninterrupted run: tokens, masks, logprobs, rewards, the tree fields, rows
in order. A forged tree record is refused in one line. The `kill -9` and SIGTERM runs through the CLI with the
embedded model are tests/test_tree_journal_kill.py."""

from __future__ import annotations

import functools
import json
import os
import signal
import zlib
from pathlib import Path
from typing import Any

import pytest

from backends.scripted import ScriptedBackend
from fsm.cli.commands import main
from fsm.run.fold import rebuild
from fsm.run.journal import JOURNAL, records
from tests.conftest import ASSETS, REPO, hermes_text
from tests.test_cli import _ThreadServer, one_line_error

TREE_FIELDS = ("node", "parent", "node_kind", "branch_offset", "policy", "depth", "weight", "shared_prefix")


@functools.cache
def _tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSETS)


def _ids(text: str) -> list[int]:
    return _tok().encode(text, add_special_tokens=False) + [_tok().eos_token_id]


def _echo(session_id: str, turn: int, prompt: list[int]) -> list[int]:
    """fork_calculator's model: a turn decided by its prompt alone (branches share their routing key)."""
    seed = zlib.crc32(b",".join(str(t).encode() for t in prompt))
    return [10 + (seed + 7919 * k) % 500 for k in range(6)] + [2]


def _planner(session_id: str, turn: int, prompt: list[int]) -> list[int]:
    """planner_solver's: the planner delegates 1 + <row> to the solver child, which answers; then it answers.
    Decided by the prompt, not the turn number: a resumed run asks again for the turns in flight only."""
    if ":" in session_id:  # a child's routing key is its own session id, <root>:<path>
        return _ids("It is done.\n#### 3")
    if "<tool_response>" not in _tok().decode(prompt):
        row = session_id.rsplit("-", 2)[1]
        return _ids(hermes_text([("calculator", {"expression": f"1 + {row}"})]))
    return _ids("The answer is 3.\n#### 3")


SPECS = {"fork_calculator": _echo, "planner_solver": _planner}


def _argv(spec: str, url: str, out: Path, *extra: str) -> list[str]:
    return [
        "run",
        str(REPO / "specs" / f"{spec}.yaml"),
        "--server",
        url,
        "--tokenizer",
        str(ASSETS),
        "--num-prompts",
        "2",
        "--out",
        str(out),
        "-q",
        *extra,
    ]


def _resume(out: Path, url: str) -> list[str]:
    return ["run", "--resume", str(out), "--server", url, "--tokenizer", str(ASSETS), "-q"]


@pytest.fixture(scope="module", params=sorted(SPECS))
def tree_run(request, tmp_path_factory):
    """(spec, the run interrupted mid-tree, the uninterrupted run, the server's url, the requests it saw)."""
    spec, model = request.param, SPECS[request.param]
    calls: list[str] = []
    stop_at = {"n": -1}

    def turn(session_id: str, n: int, prompt: list[int]) -> list[int]:
        calls.append(session_id)
        if len(calls) == stop_at["n"]:
            os.kill(os.getpid(), signal.SIGINT)
        return model(session_id, n, prompt)

    server = _ThreadServer(ScriptedBackend(turn, latency_s=0.02, model_name="echo"))
    try:
        ref = tmp_path_factory.mktemp("ref")
        assert main(_argv(spec, server.url, ref)) == 0
        cut = tmp_path_factory.mktemp("cut")
        calls.clear()
        stop_at["n"] = 3
        assert main(_argv(spec, server.url, cut, "--concurrency", "1")) == 130
        stop_at["n"] = -1
        yield spec, cut, ref, server.url, calls
    finally:
        server.close()


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "trajectories.jsonl").open()]


def _same_batches(ref: Path, out: Path) -> None:
    """Every batch file (one per policy for planner_solver) holds the same rows: every tensor equal."""
    import torch

    names = sorted(p.name for p in ref.glob("batch*.pt"))
    assert names and names == sorted(p.name for p in out.glob("batch*.pt"))
    for name in names:
        a, b = torch.load(ref / name, weights_only=False), torch.load(out / name, weights_only=False)
        assert list(a["non_tensor_batch"]["uid"]) == list(b["non_tensor_batch"]["uid"])
        assert a["batch"].keys() == b["batch"].keys()
        for key, value in a["batch"].items():
            assert torch.equal(value, b["batch"][key]), (name, key)


def _same_trees(ref: Path, out: Path) -> None:
    """The same rows in the same order with the same place in their trees (tree ids: each run's own)."""
    a, b = _rows(ref), _rows(out)
    assert len(a) == len(b)
    trees: dict[str, str] = {}
    for x, y in zip(a, b):
        assert trees.setdefault(x["tree"], y["tree"]) == y["tree"]
        assert {k: x[k] for k in TREE_FIELDS} == {k: y[k] for k in TREE_FIELDS}
        assert (x["index"], x["sample"], x["reward_score"]) == (y["index"], y["sample"], y["reward_score"])
    keys = [(r["index"], r["sample"], r["node"]) for r in b]
    assert len(keys) == len(set(keys))  # no row twice


def test_a_tree_interrupted_mid_tree_resumes_node_by_node_as_uninterrupted(capsys, tree_run, tmp_path):
    spec, cut, ref, url, calls = tree_run
    rb = rebuild(records(cut / JOURNAL))
    nodes = [s for s in rb.trajs if ":" in s]
    assert nodes and set(rb.nodes) >= set(nodes), "the interrupted run journaled no tree node"
    finished = [s for s in nodes if s in rb.done]
    out = tmp_path / "out"
    out.mkdir()
    (out / JOURNAL).write_bytes((cut / JOURNAL).read_bytes())
    calls.clear()
    assert main(_resume(out, url)) == 0
    assert "go on from their last state" in capsys.readouterr().err
    _same_batches(ref, out)
    _same_trees(ref, out)
    asked = set(calls)
    if spec == "planner_solver":  # a finished child is taken back: never asked again
        assert not asked & set(finished), (asked, finished)
    assert rebuild(records(out / JOURNAL)).ended == "completed"


def _recs(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line[9:]) for line in (out / JOURNAL).read_bytes().splitlines()]


def _node_rec(recs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(r for r in recs if r["t"] == "traj" and isinstance(r.get("n"), dict) and ":" in r["s"])


def _node_n(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first node's place as a resume reads it: from its last record that carries one (a branch's `n` is
    written again at its second boundary, when it is no longer at the entry it was copied at)."""
    sid = _node_rec(recs)["s"]
    return [r for r in recs if r.get("s") == sid and isinstance(r.get("n"), dict)][-1]["n"]


def _orphan(recs):
    _node_n(recs)["parent"] = "0.7"


def _wrong_origin(recs):
    _node_n(recs)["origin"] = "__import__"


def _deep(recs):
    _node_n(recs)["depth"] = 5


def _policy(recs):
    _node_n(recs)["policy"] = "someone_else"


def _extra_key(recs):
    _node_n(recs)["code"] = "os.system('x')"


def _stray(recs):
    r = dict(_node_rec(recs))
    r.pop("n")
    r["s"] = "somebody:0.0"
    r["d"] = {**r["d"], "session_id": "somebody:0.0"}
    recs.append(r)


def _trees_over(recs):
    recs.append({"t": "resume", "made_by": {}, "accepted": [], "trees_over": ["somebody"]})


@pytest.mark.parametrize(
    "tamper, reason",
    [
        (_orphan, "its path, parent or depth does not fit a tree of this run"),
        (_wrong_origin, "is not a"),
        (_deep, "its path, parent or depth does not fit"),
        (_policy, "its policy, routing key or shared prefix is not its"),
        (_extra_key, "its tree record 'n' is not a node's place"),
        (_stray, "trajectory 'somebody:0.0' is in no group and is no tree node"),
        (_trees_over, "a resume record's trees_over names trajectories no record started"),
    ],
)
def test_a_forged_tree_record_is_refused_in_one_line(capsys, tree_run, tmp_path, tamper, reason):
    """Each record's checksum matches (it is unkeyed): the node's place is checked against its tree and spec."""
    _, cut, _, url, _ = tree_run
    out = tmp_path / "out"
    out.mkdir()
    recs = _recs(cut)
    tamper(recs)
    body = b"".join(
        b"%08x %s\n" % (zlib.crc32(b := json.dumps(r, separators=(",", ":")).encode()), b) for r in recs
    )
    (out / JOURNAL).write_bytes(body)
    line = one_line_error(capsys, _resume(out, url))
    assert line.startswith(f"agentfsm: --resume: {out / JOURNAL}: ") and reason in line, line


def test_a_child_killed_between_its_failure_and_its_end_starts_over_alone(capsys, tmp_path):
    """A child machine whose failure was journaled but not its `child_ended` (a kill -9 between the two) starts
    over from its first record, as a failed row does (fsm/run/resume.py), rather than run its failed action again
    with the failure on it; its finished sibling is taken back, its parent goes on from its last boundary, and the
    run ends as the uninterrupted one, its journal read back whole."""
    from backends.base import BackendRequestError
    from fsm.run.journal import frame

    calls: list[str] = []

    def turn(session_id: str, n: int, prompt: list[int]) -> list[int]:
        calls.append(session_id)
        text = _tok().decode(prompt)
        if ":" not in session_id:  # the planner: two sums for the solver, then its answer
            k = text.count("<tool_response>")
            said = hermes_text([("calculator", {"expression": ("7 + 1", "9 + 1")[k]})]) if k < 2 else "#### 3"
            return _ids(said)
        if "What is 9 + 1" not in text:  # the first solver answers
            return _ids("It is done.\n#### 8")
        if "<tool_response>" in text:  # the second fails mid-action: its second turn refused
            raise BackendRequestError("the solver's server refuses its second turn")
        return _ids(hermes_text([("calculator", {"expression": "9 + 1"})]))

    server = _ThreadServer(ScriptedBackend(turn, model_name="echo"))
    try:
        ref, out = tmp_path / "ref", tmp_path / "out"
        assert main(_argv("planner_solver", server.url, ref, "--concurrency", "1")) == 0
        recs = records(ref / JOURNAL).records
        cut = next(k for k, r in enumerate(recs) if r.get("ev") == "failure" and ":" in r["s"])
        assert recs[cut + 1]["ev"] == "child_ended" and recs[cut]["failure"]["kind"] == "backend"
        out.mkdir()
        (out / JOURNAL).write_bytes(b"".join(map(frame, recs[: cut + 1])))
        root, failed = recs[cut]["s"].split(":")[0], recs[cut]["s"]
        calls.clear()
        assert main(_resume(out, server.url)) == 0
    finally:
        server.close()
    err = capsys.readouterr().err
    assert "1 go on from their last state (the step in flight runs again), 0 start over" in err, err
    assert (
        "; tree nodes: 1 finished (taken back as journaled), 0 go on from their last state, 1 start over"
        in err
    )
    # the root's action in flight (its call of the child; then it ends, as uninterrupted) runs again, the child
    # from its start, the sibling never
    assert (calls.count(root), calls.count(failed), calls.count(f"{root}:0.0")) == (0, 2, 0), calls
    _same_batches(ref, out)
    _same_trees(ref, out)
    failures = [r for r in records(out / JOURNAL).records if r.get("ev") == "failure"]
    assert len(failures) == 3  # the cut one, and each failing child's in the resumed run
    assert rebuild(records(out / JOURNAL)).ended == "completed"


def test_a_tree_started_over_after_a_node_finished_is_read_back(capsys, tmp_path):
    """A tree that starts over from its root (here its root's failure journaled, not its end: a kill -9 between
    the two) after one of its nodes had finished: the node runs again with its tree and is journaled again under
    its session id; the resumed journal is read back whole, the finished node's first run let go (fsm/run/fold.py),
    and a second --resume and `agentfsm replay` read it too."""
    from backends.base import BackendRequestError
    from fsm.run.journal import frame

    calls: list[str] = []

    def turn(session_id: str, n: int, prompt: list[int]) -> list[int]:
        calls.append(session_id)
        text = _tok().decode(prompt)
        if ":" in session_id:  # the solver answers
            return _ids("It is done.\n#### 8")
        if "<tool_response>" not in text:
            return _ids(hermes_text([("calculator", {"expression": "7 + 1"})]))
        if session_id.rsplit("-", 2)[1] == "0":  # row 0's second turn, after its child finished, refused
            raise BackendRequestError("the planner's server refuses its second turn")
        return _ids("The answer is 8.\n#### 8")

    server = _ThreadServer(ScriptedBackend(turn, model_name="echo"))
    try:
        ref, out = tmp_path / "ref", tmp_path / "out"
        assert main(_argv("planner_solver", server.url, ref, "--concurrency", "1")) == 0
        recs = records(ref / JOURNAL).records
        cut = next(k for k, r in enumerate(recs) if r.get("ev") == "failure")
        root = recs[cut]["s"]
        assert ":" not in root and recs[cut + 1]["ev"] == "reward"
        assert any(r.get("s") == f"{root}:0.0" and r.get("done") for r in recs[:cut])  # its child finished
        out.mkdir()
        (out / JOURNAL).write_bytes(b"".join(map(frame, recs[: cut + 1])))
        calls.clear()
        assert main(_resume(out, server.url)) == 0
        err = capsys.readouterr().err
        assert "0 go on from their last state (the step in flight runs again), 1 start over" in err, err
        assert (calls.count(root), calls.count(f"{root}:0.0")) == (2, 1), calls  # its tree from the root
        _same_batches(ref, out)
        _same_trees(ref, out)
        again = rebuild(records(out / JOURNAL))
        assert again.ended == "completed" and f"{root}:0.0" in again.done
        assert main(_resume(out, server.url)) == 0  # read again: "the run there has completed"
        assert "has completed: nothing to resume" in capsys.readouterr().err
    finally:
        server.close()
    assert main(["replay", str(out), "--row", "0", "--tokenizer", str(ASSETS)]) == 0
    text = capsys.readouterr().out
    assert text.count(f"({root}:0.0): finished, done") == 1 and text.count("token check: exact") == 1, text
