"""A tree run's totals count every node (issue 46 §4): `agentfsm run` of the fork and planner_solver specs on the
embedded tiny model, then the run table, summary.json and `render --run` against what the batch files hold; and a
fork after a model turn, whose branches repeat their parent's generated tokens, counting each token once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsm import RolloutEngine
from fsm.output.batch import generated_tokens, load_batch, rollout_metrics, summarize
from fsm.output.rundir import run_stats
from fsm.run.tree import nodes_of, row_nodes
from specs.calculator import make_prompts

REPO = Path(__file__).resolve().parents[1]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "PYTHONPATH": str(REPO)}


def _agentfsm(*argv: str, cwd: Path) -> str:
    """A real `agentfsm` process; its stdout (the run table, the diagram)."""
    done = subprocess.run(
        [sys.executable, "-m", "fsm.cli.commands", *argv],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,  # the tiny model on a loaded 2-core machine
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    return done.stdout


def _run(spec: str, tmp_path: Path) -> tuple[dict, dict, str]:
    """Run `spec` on 2 demo prompts: its summary.json, its batch files' model tokens and rows, the table."""
    table = _agentfsm("run", str(REPO / "specs" / spec), "--num-prompts", "2", "--out", "out", cwd=tmp_path)
    out = tmp_path / "out"
    batches = {p.name: load_batch(p) for p in sorted(out.glob("batch*.pt"))}
    held = {
        "model_tokens": sum(int(b.batch["response_mask"].sum()) for b in batches.values()),
        "rows": sum(len(b) for b in batches.values()),
    }
    return json.loads((out / "summary.json").read_text()), held, table


def _edge(stats: dict, source: str, dest: str, guard: str) -> dict:
    return next(
        e for e in stats["edges"].values() if (e["source"], e["dest"], e["guard"]) == (source, dest, guard)
    )


@pytest.mark.slow
def test_a_fork_runs_totals_count_its_branches(tmp_path):
    summary, held, table = _run("fork_calculator.yaml", tmp_path)
    # the fork is at the first model turn: the branches' rows hold every token the model generated
    assert held["rows"] == 8 and summary["rows"] == 8 and summary["trajectories"] == 2
    assert summary["model_tokens"] == held["model_tokens"] > 0
    assert summary["response_tokens_mean"] >= held["model_tokens"] / 8  # and the tool answers (mask 0)
    assert "forked" not in summary["termination_reasons"]  # a forking root has no row
    assert sum(summary["termination_reasons"].values()) == 8
    assert "2 trajectories (8 rows)" in table
    tokens_per_s = int(re.search(r"model tokens / s\D*(\d+)", table).group(1))
    assert tokens_per_s == round(summary["model_tokens"] / summary["wall_s"]) > 0

    stats = summary["fsm"]
    tool_turns = stats["states"]["PROCESSING_TOOLS"]["visits"]
    assert tool_turns >= 8  # each branch called the calculator at least once
    called = _edge(stats, "GENERATING", "PROCESSING_TOOLS", "has_tool_calls")
    assert called["count"] == tool_turns and called["trajectories"] == 2 and called["share"] == 1.0
    assert (
        _edge(stats, "PENDING", "GENERATING", "default")["count"] == 2
    )  # the roots' alone, not again per branch
    assert stats["final_states"]["GENERATING"] == {"forked": 2}
    assert stats["states"]["GENERATING"]["mean_s"] is not None  # the branches' time in it
    assert all(0 <= s["mean_s"] < 300 for s in stats["states"].values() if s["mean_s"] is not None)
    assert stats["states"]["TERMINATED"]["mean_s"] is None  # a final state is never left

    _agentfsm(
        "render", str(REPO / "specs/fork_calculator.yaml"), "--run", "out", "-o", "fsm.mmd", cwd=tmp_path
    )
    mmd = (tmp_path / "fsm.mmd").read_text()
    assert f"has_tool_calls / {tool_turns}×" in mmd, mmd


@pytest.mark.slow
def test_planner_solver_totals_count_the_solvers_tokens(tmp_path):
    summary, held, table = _run("planner_solver.yaml", tmp_path)
    # batch.planner.pt and batch.solver.pt: the solver's rows and tokens are the run's too
    assert summary["rows"] == held["rows"] > 2 and summary["model_tokens"] == held["model_tokens"]
    stats = summary["fsm"]
    # the solver runs specs/calculator.yaml, another machine: the planner's diagram counts its own nodes only
    assert _edge(stats, "PENDING", "GENERATING", "default")["count"] == 2
    assert stats["trees"]["children"] == {"calculator": held["rows"] - 2}


@pytest.mark.slow
def test_a_fork_after_a_model_turn_counts_each_generated_token_once(tmp_path):
    """A fork on entering PROCESSING_TOOLS: every branch's row repeats the root's tool call, generated once."""
    spec = tmp_path / "fork_tools.yaml"
    spec.write_text(
        f"name: fork_tools\nextends: {REPO}/specs/calculator.yaml\n"
        "states:\n  PROCESSING_TOOLS:\n    fork: {branches: 2, times: 1}\n"
    )
    with RolloutEngine(str(spec)) as engine:
        trajs = engine._run_sync(engine.arun(make_prompts(2, 0)))
    forked = [t for t in trajs if t.node is not None and t.node.forked]
    assert forked, "the tiny model called no tool"
    in_rows = sum(n.response_mask.count(1) for t in trajs for n in row_nodes(t))
    once = sum(n.response_mask.count(1) for t in trajs for n in nodes_of(t)) - sum(
        t.response_mask.count(1) * len(t.node.nodes) for t in forked
    )
    assert once < in_rows  # the rows repeat the shared tool call
    assert summarize(trajs)["model_tokens"] == once == rollout_metrics(trajs)["rollout/model_tokens"]
    assert sum(generated_tokens(n) for n in nodes_of(forked[0])) == sum(
        generated_tokens(n) for n in row_nodes(forked[0])
    ) + forked[0].response_mask.count(1)
    stats = run_stats(engine.agent, trajs)
    edge = next(e.index for e in engine.agent.edges if e.label == "has_tool_calls")
    called = sum(t.transitions_fired.count(edge) for t in trajs)  # the roots' tool calls: before the fork
    called += sum(n.transitions_fired[len(t.path) - 1 :].count(edge) for t in forked for n in t.node.nodes)
    assert stats["edges"][str(edge)]["count"] == called
