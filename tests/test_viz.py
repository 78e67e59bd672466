"""Diagrams (DOT, SVG/PNG through `dot`, Mermaid), run statistics from a scripted run, transcripts."""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console
from transformers import AutoTokenizer

import fsm
from backends.base import BackendUnavailable
from backends.scripted import ScriptedBackend
from fsm.output.rundir import load_run_stats, run_stats, trajectory_record
from specs.calculator import make_prompts
from viz.diagram import RenderError, diagram, render, to_mermaid
from viz.transcript import render_transcript, select, show

REPO = Path(__file__).resolve().parents[1]
TOOL_AGENT = REPO / "specs/tool_agent.yaml"

# A custom state (REFLECTING) between model turns, and guards with a parameter and a negation.
CUSTOM = """
name: reflective
states:
  PENDING:
    action: encode_prompt
    next:
      - to: GENERATING
  GENERATING:
    action: generate
    next:
      - to: TERMINATED
        when: {max_assistant_turns: 2}
        reason: turn_limit
      - to: REFLECTING
        when: {not: response_budget_exhausted}
      - to: TERMINATED
        reason: done
  REFLECTING:
    action: generate
    description: think again before answering
    next:
      - to: TERMINATED
  TERMINATED:
    final: true
"""


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "backends/tiny/assets")


@pytest.fixture(scope="module")
def tool_agent():
    return fsm.compile_spec(TOOL_AGENT)


@pytest.fixture(scope="module")
def reflective(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "reflective.yaml"
    path.write_text(CUSTOM)
    return fsm.compile_spec(path)


@pytest.fixture(scope="module")
def calculator_run(tokenizer):
    """40 trajectories of specs/calculator.yaml: 0, 1 or 3 tool calls, and some dead rows."""
    agent = fsm.compile_spec(REPO / "specs/calculator.yaml")

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>'

    def turn(session: str, k: int, prompt: list[int]) -> list[int]:
        row = int(session.rsplit("-", 2)[1])
        if row % 7 == 6:
            raise BackendUnavailable("no server")
        if (row % 3 == 0 and k < 3) or (row % 3 == 1 and k == 0):
            return ids(call)
        return ids("The answer is 3.\n#### 3")

    runner = fsm.Runner(agent, ScriptedBackend(turn, latency_s=0.002), tokenizer)
    trajs = asyncio.run(runner.run(make_prompts(20), n=2))
    return agent, trajs, runner.codec


def _node(source: str, name: str) -> str:
    """The attribute text of a node statement in DOT text."""
    return re.search(rf"^\s*{name} \[(.*?)\]$", source, flags=re.M | re.S).group(1)


def _dot_edges(source: str) -> list[tuple[str, str, str]]:
    """(source, dest, attribute text) of every edge statement in DOT text."""
    return re.findall(r"^\s*(\w+) -> (\w+) \[(.*?)\]$", source, flags=re.M | re.S)


# --- diagrams ----------------------------------------------------------------------------------------------


def test_dot_has_every_state_and_edge_with_guard_and_reason(tool_agent):
    g = diagram(TOOL_AGENT)  # a path works as well as a compiled agent
    src = g.source
    assert "rankdir=LR" in src
    for name in tool_agent.spec.states:
        assert re.search(rf"^\s*{name} \[", src, flags=re.M), name
    edges = _dot_edges(src)
    assert ("__start__", "PENDING") == edges[0][:2]  # the entry point marks the initial state
    assert "shape=point" in _node(src, "__start__")
    body = edges[1:]
    assert [(s, d) for s, d, _ in body] == [(e.source, e.dest) for e in tool_agent.edges]
    for (_, _, attrs), edge in zip(body, tool_agent.edges):
        assert edge.label in attrs
        if edge.reason:
            assert f"reason: {edge.reason}" in attrs
        # default edges are dashed and labelled "default"
        assert ("style=dashed" in attrs) == (edge.guard is None)
        if edge.guard is None:
            assert "default" in attrs
    assert "shape=doublecircle" in _node(src, "TERMINATED")
    assert "shape=box" in _node(src, "GENERATING") and "#dbeafe" in _node(src, "GENERATING")
    # states in the order trajectories flow
    order = [m for m in re.findall(r"^\s*(\w+) \[label", src, flags=re.M) if m != "__start__"]
    assert order[:3] == ["PENDING", "GENERATING", "TERMINATED"]


def test_custom_states_and_parametrised_guards(reflective):
    src = diagram(reflective).source
    assert 'fillcolor="#fde68a"' in _node(src, "REFLECTING")  # custom: amber
    assert 'fillcolor="#dbeafe"' in _node(src, "GENERATING")  # standard: blue
    assert "max_assistant_turns=2" in src and "not response_budget_exhausted" in src
    assert "custom state: think again before answering" in src  # the description is the tooltip
    mmd = to_mermaid(reflective)
    assert "class REFLECTING custom" in mmd


def test_mermaid(tool_agent):
    mmd = to_mermaid(tool_agent)
    lines = mmd.splitlines()
    assert "stateDiagram-v2" in lines and "    direction LR" in lines
    assert "    [*] --> PENDING" in lines and "    TERMINATED --> [*]" in lines
    assert "    GENERATING --> PROCESSING_TOOLS: 4. has_tool_calls" in lines
    assert "    GENERATING --> TERMINATED: 1. response_budget_exhausted / reason#58; response_length" in lines
    assert "    PROCESSING_TOOLS --> GENERATING: 2. default" in lines
    assert sum(" --> " in line and "[*]" not in line for line in lines) == len(tool_agent.edges)
    assert "    GENERATING: generate()" in lines


def test_render_files(tool_agent, tmp_path):
    svg = render(tool_agent, tmp_path / "a.svg")
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    for name in tool_agent.spec.states:
        assert f">{name}<" in text
    png = render(tool_agent, tmp_path / "a.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert render(tool_agent, tmp_path / "a.dot").read_text().startswith("digraph tool_agent")
    assert render(tool_agent, tmp_path / "a.mmd").read_text().startswith("---\ntitle: tool_agent")
    with pytest.raises(RenderError, match="unknown diagram format"):
        render(tool_agent, tmp_path / "a.jpeg")


def test_missing_dot_binary(tool_agent, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no `dot` anywhere
    with pytest.raises(RenderError, match=r"apt-get install graphviz"):
        render(tool_agent, tmp_path / "a.png")
    with pytest.raises(RenderError, match="`dot`"):
        render(tool_agent, tmp_path / "a.svg")
    assert not (tmp_path / "a.png").exists()
    assert "digraph" in render(tool_agent, tmp_path / "a.dot").read_text()  # these need nothing
    assert "stateDiagram-v2" in render(tool_agent, tmp_path / "a.mmd").read_text()


# --- run statistics ---------------------------------------------------------------------------------------


def test_run_stats_from_a_scripted_run(calculator_run, tmp_path):
    agent, trajs, _ = calculator_run
    stats = run_stats(agent, trajs)
    assert json.loads(json.dumps(stats)) == stats  # plain JSON
    assert stats["trajectories"] == 40 and stats["agent_hash"] == agent.hash
    fired = {}
    for t in trajs:
        for i in t.transitions_fired:
            fired[i] = fired.get(i, 0) + 1
    assert {int(k): e["count"] for k, e in stats["edges"].items() if e["count"]} == fired
    assert set(stats["edges"]) == {str(e.index) for e in agent.edges}  # unused edges too, at 0
    tools = stats["edges"][str(next(e.index for e in agent.edges if e.label == "has_tool_calls"))]
    assert tools["trajectories"] == sum(1 for t in trajs if 4 in t.transitions_fired)
    assert tools["share"] == tools["trajectories"] / 40 and tools["count"] > tools["trajectories"]
    # 1 tool call on rows 1 mod 3, 3 (then the turn limit) on rows 0 mod 3, none otherwise; rows 6, 13 dead
    assert stats["termination_reasons"] == {"done": 24, "max_assistant_turns": 12, "error: backend": 4}
    assert stats["final_states"] == {"TERMINATED": {"done": 24, "max_assistant_turns": 12}}
    gen, term = stats["states"]["GENERATING"], stats["states"]["TERMINATED"]
    assert gen["failed"] == 4 and gen["mean_s"] >= 0.002  # the scripted latency
    assert gen["visits"] == sum(t.path.count("GENERATING") for t in trajs)
    assert term["mean_s"] is None
    assert run_stats(trajs)["edges"]["4"]["count"] == tools["count"]  # without the agent, from the paths

    (tmp_path / "summary.json").write_text(json.dumps({"trajectories": 40, "fsm": stats}))
    assert load_run_stats(tmp_path) == stats
    with pytest.raises(FileNotFoundError, match="agentfsm run"):
        load_run_stats(tmp_path / "nowhere")


def test_annotated_diagram(calculator_run, tmp_path):
    agent, trajs, _ = calculator_run
    stats = json.loads(json.dumps(run_stats(agent, trajs)))  # as read back from summary.json
    src = diagram(agent, stats).source
    edges = _dot_edges(src)[1:]
    widths = {}
    for (_, _, attrs), edge in zip(edges, agent.edges):
        e = stats["edges"][str(edge.index)]
        assert f"{e['count']}× · " in attrs
        widths[edge.index] = float(re.search(r'penwidth="?([\d.]+)', attrs).group(1))
        assert ('color="#9ca3af"' in attrs) == (e["count"] == 0)  # never taken: grey
    top = max(stats["edges"].values(), key=lambda e: e["count"])
    assert widths[int(next(k for k, e in stats["edges"].items() if e is top))] == 5.0
    assert "40× · 100%" in src and "36× · 60%" in src
    assert "done: 24" in src and "max_assistant_turns: 12" in src  # how trajectories ended
    assert "failed: 4" in src and 'color="#b91c1c"' in _node(src, "GENERATING")
    assert re.search(r"GENERATING\n\S+\(\)\n\d+ visits, mean [\d.]+ ms", src)
    assert "40 trajectories" in src
    mmd = to_mermaid(agent, stats)
    assert "    GENERATING --> PROCESSING_TOOLS: 4. has_tool_calls / 36× · 60%" in mmd
    assert "    TERMINATED: done#58; 24" in mmd
    assert render(agent, tmp_path / "run.svg", run_stats=stats).read_text().count("36× · 60%") == 2


# --- transcripts ------------------------------------------------------------------------------------------


def test_transcripts(calculator_run, tmp_path, capsys):
    agent, trajs, codec = calculator_run
    records = [json.loads(json.dumps(trajectory_record(t, codec))) for t in trajs]
    tool_row = next(r for r in records if r["state_path"].count("PROCESSING_TOOLS") == 1)
    assert [t["role"] for t in tool_row["turns"]] == ["assistant", "template", "tool", "assistant"]
    assert [t["mask"] for t in tool_row["turns"]] == [1, 0, 0, 1]
    traj = trajs[tool_row["index"]]
    assert sum(t["n_tokens"] for t in tool_row["turns"]) == len(traj.response_ids)
    assert "".join(t["text"] for t in tool_row["turns"]) == codec.decode(
        traj.response_ids.tolist(), skip_special_tokens=False
    )

    plain = render_transcript(tool_row, color=False)
    ones = traj.response_mask.count(1)
    assert isinstance(plain, str) and "\x1b[" not in plain
    assert (
        f"{ones}/{len(traj.response_ids)} tokens mask=1 ({100 * ones / len(traj.response_ids):.1f}%)" in plain
    )
    for needle in (
        "--- assistant [mask 1]",
        "--- tool [mask 0]",
        "<tool_response>",
        "end: done",
        "path: PENDING -> GENERATING -> PROCESSING_TOOLS -> GENERATING -> TERMINATED",
    ):
        assert needle in plain

    console = Console(
        force_terminal=True, color_system="standard", width=120, file=io.StringIO(), record=True
    )
    console.print(render_transcript(tool_row, color=True))
    colored = console.export_text(styles=True)
    assert "\x1b[" in colored
    green = re.search(r"\x1b\[[\d;]*32m[^\x1b]*tool_call", colored)  # the model's tokens in green
    cyan = re.search(r"\x1b\[[\d;]*36m[^\x1b]*tool_response", colored)  # the observation in cyan
    assert green and cyan

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with (run_dir / "trajectories.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    assert [r["index"] for r in select(records, failed=True)] == [t.index for t in trajs if t.failed]
    worst = select(records, worst=True)
    rewards = [r["reward_score"] for r in worst]
    assert rewards == sorted(rewards)
    assert show(run_dir, failed=True, color=False) == 4
    out = capsys.readouterr().out
    assert out.count("=== trajectory") == 4 and "error: backend: no server" in out
    assert show(run_dir, row=tool_row["index"], color=False) == 1
    assert "--- tool [mask 0]" in capsys.readouterr().out
    with pytest.raises(LookupError, match="no row 999"):
        show(run_dir, row=999, color=False)
    assert show(run_dir, worst=True, limit=2, color=False) == 2
    out = capsys.readouterr().out
    assert out.count("=== trajectory") == 2 and "(showed 2 of " in out
    assert "ground truth: " in out and "answer: " in out


def test_records_without_a_codec(calculator_run):
    _, trajs, _ = calculator_run
    record = trajectory_record(trajs[1])
    assert record["prompt"] is None and all(t["text"] is None for t in record["turns"])
    assert "(22 tokens)" in render_transcript(record, color=False)


# --- a run that rewrites its context ----------------------------------------------------------------------


@pytest.mark.skipif(not (REPO / "backends/tiny/assets/model.safetensors").exists(), reason="no tiny model")
def test_render_run_shows_where_segments_start(tmp_path):
    """`agentfsm run specs/calculator_compact.yaml` on the embedded model, then `render --run`: COMPACTING
    starts two segments per visit (the summary turn, then the task plus the summary), so the edge into it is
    a rewrite and both outputs say how many segments it started, and the state why."""
    from fsm.cli.commands import main

    out = tmp_path / "run"
    spec = str(REPO / "specs/calculator_compact.yaml")
    assert main(["run", spec, "--num-prompts", "3", "--temperature", "0", "--out", str(out), "--quiet"]) == 0
    stats = load_run_stats(out)
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    starts = [(s["state"], s["reason"]) for r in records for s in r.get("segments", [])[1:]]
    assert starts and set(starts) == {("COMPACTING", "summary"), ("COMPACTING", "rewrite")}
    rows = sum(len(r.get("segments", [None])) for r in records)
    batch = torch.load(out / "batch.pt", weights_only=False)["batch"]
    assert stats["segments"]["rows"] == rows == len(batch["prompts"])
    assert stats["segments"]["rewritten"] == sum("segments" in r for r in records) == 3
    compacting = stats["states"]["COMPACTING"]
    assert compacting["segments"] == len(starts) == 2 * compacting["visits"]
    assert compacting["segment_reasons"] == {"summary": compacting["visits"], "rewrite": compacting["visits"]}
    entered = [e for e in stats["edges"].values() if e["dest"] == "COMPACTING"]
    assert [(e["count"], e.get("rewrites"), e.get("segments")) for e in entered if e["count"]] == [
        (compacting["visits"], compacting["visits"], len(starts))
    ]
    assert not any(e.get("segments") for e in stats["edges"].values() if e["dest"] != "COMPACTING")
    assert "segments" not in stats["states"]["GENERATING"]

    n, v = len(starts), compacting["visits"]
    dot, mmd = tmp_path / "run.dot", tmp_path / "run.mmd"
    for path in (dot, mmd):
        assert main(["render", spec, "--run", str(out), "-o", str(path)]) == 0
    src = dot.read_text()
    (edge,) = [attrs for a, b, attrs in _dot_edges(src) if (a, b) == ("PROCESSING_TOOLS", "COMPACTING")]
    assert f"new segments: {n} on {v}×" in edge and 'color="#7c3aed"' in edge
    assert f"segments started: {n} (summary {v}, rewrite {v})" in _node(src, "COMPACTING")
    assert f"3 trajectories (3 rewritten), {rows} segments" in src
    assert sum("new segments" in attrs for _, _, attrs in _dot_edges(src)) == 1
    text = mmd.read_text()
    edge = f"PROCESSING_TOOLS --> COMPACTING: 2. context_tokens_over=220 / {v}× · 100% / new segments#58; {n} on {v}×"
    assert edge in text
    assert f"    COMPACTING: segments started#58; {n} (summary {v}, rewrite {v})" in text
