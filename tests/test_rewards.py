"""Rewards must be numbers a trainer can use: a non-finite one (NaN, +-inf) from the reward function, a tool, an
interaction turn or an interaction's final score ends its row as a reward error naming the function and the
row, never a `done` row carrying NaN into rm_scores; and the run's JSON files refuse non-finite numbers, so no
NaN or Infinity (which is not JSON) reaches them (issue 27.7).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from backends.scripted import echo_backend
from fsm.api import RolloutEngine
from fsm.cli.commands import main
from fsm.output.batch import load_batch
from tests.conftest import (
    ASSETS,
    PARTS,
    REPO,
    SPECS,
    model_turn,
    run_agent,
    scripted,
    tool_spec,
    tool_turn,
    user_row,
)
from tests.test_cli import _ThreadServer

REWARD_SPEC = """
    name: rewarded
    extends: {specs}/single_turn.yaml
    reward: {function: '{parts}:%s'}
"""


def strict_json(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as every JSON parser but Python's does."""

    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    "fn, shown", [("nan_reward", "nan"), ("inf_reward", "inf"), ("nan_reward_dict", "-inf")]
)
async def test_a_non_finite_reward_is_a_reward_error_naming_the_function_and_the_row(
    tok, compile_yaml, fn, shown
):
    agent = compile_yaml(REWARD_SPEC % fn)
    trajs = await run_agent(agent, echo_backend(), tok, [user_row(uid="row-3"), user_row(uid="row-4")])
    for traj, uid in zip(trajs, ("row-3", "row-4")):
        assert traj.termination_reason == (
            f"error: reward: reward function {PARTS}:{fn} on row {uid}: returned {shown}, not a finite number"
        ), traj.termination_reason
        assert traj.reward_score is None or math.isfinite(traj.reward_score)


async def test_a_non_finite_reward_never_reaches_rm_scores(tok, compile_yaml):
    agent = compile_yaml(REWARD_SPEC % "nan_if_asked")
    rows = [user_row(uid="a"), user_row(uid="b", extra_info={"nan": True}), user_row(uid="c")]
    async with RolloutEngine(agent, tok, backend=echo_backend()) as engine:
        batch = await engine.agenerate_sequences(rows)
    reasons = list(batch.non_tensor_batch["termination_reason"])
    assert reasons[0] == reasons[2] == "done" and reasons[1].startswith("error: reward: reward function"), (
        reasons
    )
    assert batch.batch["rm_scores"].sum(-1).tolist() == [1.0, 0.0, 1.0]


async def test_a_non_finite_tool_reward_is_a_reward_error_naming_the_tool_and_the_row(tok, compile_yaml):
    agent = compile_yaml(tool_spec(f"  - function: {PARTS}:nan_tool"))
    backend = scripted([tool_turn(tok, ("nan_tool", {"text": "hi"})), model_turn(tok, "done")])
    (traj,) = await run_agent(agent, backend, tok, [user_row(uid="row-9")])
    assert traj.termination_reason == (
        "error: reward: tool nan_tool on row row-9: returned reward nan, not a finite number"
    ), traj.termination_reason
    assert traj.tool_rewards == [] and traj.reward_score in (None, 0.0)


@pytest.mark.parametrize(
    "cls, words",
    [
        (
            "NaNTurns",
            "interaction {parts}:NaNTurns on row row-5: returned turn score nan, not a finite number",
        ),
        (
            "InfFinalScore",
            "interaction {parts}:InfFinalScore on row row-5: calculate_score returned inf, "
            "not a finite number",
        ),
    ],
)
async def test_a_non_finite_interaction_score_is_a_reward_error(tok, compile_yaml, cls, words):
    agent = compile_yaml(f"""
        name: talk
        extends: {{specs}}/tool_agent.yaml
        interaction: {{class: "{PARTS}:{cls}"}}
    """)
    backend = scripted([model_turn(tok, "first"), model_turn(tok, "second")])
    (traj,) = await run_agent(agent, backend, tok, [user_row(uid="row-5", interaction_kwargs={})])
    assert traj.termination_reason == "error: reward: " + words.format(parts=PARTS), traj.termination_reason
    assert all(math.isfinite(s) for s in traj.turn_scores)
    assert traj.interaction_score is None or math.isfinite(traj.interaction_score)


def test_the_run_files_hold_strict_json_when_the_reward_is_nan(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"name: nan_calc\nextends: {SPECS / 'calculator.yaml'}\nreward: {{function: '{PARTS}:nan_reward'}}\n"
    )
    server = _ThreadServer(echo_backend())
    try:
        out = tmp_path / "out"
        assert (
            main(
                [
                    "run",
                    str(spec),
                    "--server",
                    server.url,
                    "--tokenizer",
                    str(ASSETS),
                    "--out",
                    str(out),
                    "--num-prompts",
                    "3",
                    "-q",
                    "--max-error-rate",
                    "1",
                ]
            )
            == 0
        )
    finally:
        server.close()
    records = [strict_json(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(records) == 3
    assert all(r["termination_reason"].startswith("error: reward: reward function") for r in records)
    summary = strict_json((out / "summary.json").read_text())
    assert summary["status"] == "completed"


def test_the_json_writers_refuse_non_finite_numbers():
    from fsm.output.rundir import json_text

    assert strict_json(json_text({"a": 1.5, "b": [None, "nan"]})) == {"a": 1.5, "b": [None, "nan"]}
    for bad in (float("nan"), float("inf"), -math.inf):
        with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
            json_text({"reward": bad})


def test_a_reward_past_float32s_range_fails_its_row_and_the_run_keeps_its_batch(tmp_path):
    """A live reward of 1e308 overflowed the run's mean into inf, so the summary write raised and batch.pt and
    trajectories.jsonl were never written; 3.5e38 became inf in rm_scores (float32). Such a reward now fails
    its row with the reason, as NaN does, and the run writes everything (a real `agentfsm run`, issue 50)."""
    (tmp_path / "row_rewards.py").write_text(
        "def from_row(extra_info=None, **kwargs):\n    return extra_info['score']\n"
    )
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"name: big\nextends: {SPECS / 'single_turn.yaml'}\nreward: {{function: 'row_rewards:from_row'}}\n"
    )
    scores = [1e308, 3.5e38, 1e308, -1e308, 3.4e38, 1.0]
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(
            json.dumps({"raw_prompt": f"Say {k}.", "uid": f"r{k}", "extra_info": {"score": s}}) + "\n"
            for k, s in enumerate(scores)
        )
    )
    out = tmp_path / "out"
    server = _ThreadServer(echo_backend())
    try:
        argv = ["run", str(spec), "--data", str(data), "--server", server.url, "--tokenizer", str(ASSETS)]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "fsm.cli.commands",
                *argv,
                "--out",
                str(out),
                "-q",
                "--max-error-rate",
                "1",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])},
            timeout=600,
        )
    finally:
        server.close()
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    records = [strict_json(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    reasons = {r["uid"]: r["termination_reason"] for r in records}
    for k in (0, 1, 2, 3):
        assert reasons[f"r{k}"] == (
            f"error: reward: reward function row_rewards:from_row on row r{k} ({data}:{k + 1}): returned {scores[k]!r}, "
            "beyond float32's range (at most 3.4028235e+38 in size), which rm_scores holds"
        ), reasons
    assert reasons["r4"] == reasons["r5"] == "done", reasons
    rm = load_batch(out / "batch.pt").batch["rm_scores"].sum(-1)
    assert torch.isfinite(rm).all() and rm.tolist() == [0.0] * 4 + [pytest.approx(3.4e38, rel=1e-6), 1.0]
    summary = strict_json((out / "summary.json").read_text())
    assert summary["status"] == "completed" and math.isfinite(summary["reward_mean"])
