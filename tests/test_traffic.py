"""Agent traffic recorded from a run (bench/traffic.py): a real CLI run on the embedded tiny model, its journal
read back as `bench fleet`'s calls, checked against the run's own trajectories.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.fleet import load_trace
from bench.traffic import calls_of_run
from bench.traffic import main as traffic_main
from fsm.cli.commands import main
from tests.conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    argv = [
        "run",
        str(REPO / "specs" / "calculator.yaml"),
        "--num-prompts",
        "4",
        "--n",
        "2",
        "--out",
        str(out),
    ]
    assert main([*argv, "--temperature", "0", "-q"]) == 0
    return out


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]


def test_every_model_request_of_the_run_is_a_call_with_its_tokens(run_dir):
    calls = calls_of_run(run_dir)
    records = _records(run_dir)
    assert len(calls) == sum(1 for r in records for t in r["turns"] if t["role"] == "assistant")
    for r in records:
        mine = [c for c in calls if c.session == r["session_id"]]
        assert {c.group for c in mine} == {r["uid"]}  # a GRPO group's samples share their group
        assert [c.turn for c in mine] == list(range(len(mine)))
        sent = r["prompt_tokens"]  # the context each request carried: the prompt and every token before it
        expected = []
        for t in r["turns"]:
            if t["role"] == "assistant":
                expected.append((sent, t["n_tokens"]))
            sent += t["n_tokens"]
        assert [(c.prompt_tokens, c.new_tokens) for c in mine] == expected


def test_the_wait_after_a_turn_is_the_time_its_tools_took(run_dir):
    calls = calls_of_run(run_dir)
    by_session: dict[str, list] = {}
    for c in calls:
        by_session.setdefault(c.session, []).append(c)
    for mine in by_session.values():
        assert mine[-1].tool_s == 0.0  # the trajectory ended after its last answer
        assert all(c.tool_s > 0 for c in mine[:-1])  # a tool ran before each next request


def test_fleet_replays_a_run_directory_and_its_trace_file_alike(run_dir, tmp_path, capsys):
    assert traffic_main([str(run_dir)]) == 0
    trace = tmp_path / "trace.jsonl"
    trace.write_text(capsys.readouterr().out)
    assert load_trace(trace) == load_trace(run_dir) == calls_of_run(run_dir)


def test_a_directory_without_a_journal_is_one_line(tmp_path, capsys):
    assert traffic_main([str(tmp_path)]) == 1
    assert (
        capsys.readouterr().err
        == f"bench traffic: {tmp_path}: no journal.log (a run directory of `agentfsm run` holds one)\n"
    )
