"""Trees (docs/trees.md): child machines, forks and several policies, run on the embedded tiny model and over real
HTTP (the dev server in front of it), and the rows that carry the tree: parent links, shared prefix tokens,
weights, one batch per policy, the child's answer verbatim as the parent's observation."""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path

import numpy as np
import pytest

from backends.devserver import DevServer
from fsm import RolloutEngine
from fsm.api import make_backend, model_tokenizer, tiny_model_dir
from fsm.output.batch import collate
from fsm.output.rundir import trajectory_record
from fsm.run.tree import nodes_of, row_nodes
from specs.calculator import make_prompts

SPECS = Path(__file__).resolve().parents[1] / "specs"


def _tool_texts(traj) -> list[str]:
    return [m["content"] for m in traj.messages if m.get("role") == "tool"]


def _all_batches(out) -> dict:
    return out if isinstance(out, dict) else {"default": out}


def _weights_per_tree(batches: dict) -> dict[str, float]:
    total: dict[str, float] = {}
    for b in batches.values():
        for tree, w in zip(b.non_tensor_batch["tree"], b.non_tensor_batch["weight"]):
            total[tree] = total.get(tree, 0.0) + float(w)
    return total


def _check_child_answers(trajs) -> int:
    """Every child's answer (its spec's `answer:` over its final message) is, verbatim, its parent's tool
    observation; returns how many children answered."""
    answered = 0
    for root in trajs:
        for node in nodes_of(root)[1:]:
            parent = next(n for n in nodes_of(root) if n.node is not None and n.node.node == node.node.parent)
            assert node.node.kind == "child" and node.node.policy == "solver"
            if node.failed:
                continue
            final = [m["content"] for m in node.messages if m["role"] == "assistant"][-1]
            m = re.search(r"####\s*(\S+)", final)
            answer = m.group(1) if m else final
            assert answer in _tool_texts(parent), (answer, _tool_texts(parent))
            # the parent's tokens show it: the observation after the call was rendered from that text
            assert node.node.branch_offset <= len(parent.prompt_ids) + len(parent.response_ids)
            answered += 1
    return answered


@pytest.mark.slow
def test_planner_solver_two_policies_on_the_tiny_model():
    with RolloutEngine("specs/planner_solver.yaml", check_tokens=True) as engine:
        rows = make_prompts(4, 0)
        sampling = engine.sampling()
        trajs = engine._run_sync(engine.arun(rows, sampling=sampling))
        batches = engine.to_batch(trajs, sampling)
    assert set(batches) == {"planner", "solver"}
    assert _check_child_answers(trajs) >= 2
    for root in trajs:
        assert root.node is not None and root.node.kind == "root" and root.node.policy == "planner"
        for node in nodes_of(root):
            assert node.token_check is None, node.token_check  # --check-tokens passes on every node
            assert node.node.tree == root.session_id
    planner, solver = batches["planner"], batches["solver"]
    assert len(planner) == 4 and set(planner.non_tensor_batch["node"]) == {"0"}
    assert set(solver.non_tensor_batch["node_kind"]) == {"child"}
    assert all(p == "0" for p in solver.non_tensor_batch["parent"])
    assert planner.meta_info["policy"] == "planner" and solver.meta_info["policy"] == "solver"
    for tree, total in _weights_per_tree(batches).items():
        assert total == pytest.approx(1.0), tree  # a root counts once, over both policies' batches
    # a child's row is scored with its tree's reward
    scores = dict(zip(planner.non_tensor_batch["tree"], planner.batch["rm_scores"].sum(1).tolist()))
    for tree, s in zip(solver.non_tensor_batch["tree"], solver.batch["rm_scores"].sum(1).tolist()):
        assert s == scores[tree]


@pytest.mark.slow
async def test_solver_policy_over_real_http_gets_only_the_childrens_requests():
    """RolloutEngine(policies={"solver": ...}): the solver's turns go to its own server (the dev server over the
    tiny model, real HTTP), the planner's stay in process."""
    served = make_backend()
    async with DevServer(served) as dev:
        solver = make_backend(servers=[dev.url], engine="sglang")
        async with RolloutEngine(
            "specs/planner_solver.yaml", check_tokens=True, policies={"solver": solver}
        ) as engine:
            trajs = await engine.arun(make_prompts(3, 1))
        rids = [e["rid"] for e in dev.log]
    await served.close()
    children = [n for t in trajs for n in nodes_of(t)[1:]]
    assert children, "the planner delegated nothing"
    assert _check_child_answers(trajs) >= 1
    child_sessions = {n.session_id for n in children}
    assert rids and all(rid.split("_t")[0] in child_sessions for rid in rids), rids
    assert sum(n.assistant_turns for n in children) == len(rids)
    assert all(n.token_check is None for t in trajs for n in nodes_of(t))


def _fork_engine(**kw):
    return RolloutEngine("specs/fork_calculator.yaml", check_tokens=True, **kw)


def _check_fork(trajs, k: int = 4, sampling=None) -> None:
    for root in trajs:
        assert root.node.forked and root.termination_reason == "forked"
        branches = row_nodes(root)
        assert [b.node.node for b in branches] == [f"0.{i}" for i in range(k)]
        prefix = root.prompt_ids.tolist() + root.response_ids.tolist()
        for b in branches:
            assert b.node.kind == "branch" and b.node.parent == "0" and b.node.route == root.session_id
            assert b.node.shared_length == b.node.branch_offset == len(prefix)
            assert (b.prompt_ids.tolist() + b.response_ids.tolist())[: len(prefix)] == prefix
            assert b.token_check is None, b.token_check
        # each branch samples on its own: its own arrays, and with a seed its own draws (the tiny model is so
        # peaked that at temperature 1 its branches often agree token for token)
        assert len({id(b.response_ids) for b in branches}) == k
        if sampling is not None:
            assert len({sampling.for_turn(b, 8)["sampling_seed"] for b in branches}) == k


@pytest.mark.slow
def test_fork_shares_its_prefix_exactly_and_weights_sum_to_one():
    with _fork_engine() as engine:
        sampling = engine.sampling({"seed": 3})
        trajs = engine._run_sync(engine.arun(make_prompts(3, 0), sampling=sampling))
        batch = engine.to_batch(trajs, sampling)
    _check_fork(trajs, sampling=sampling)
    nt = batch.non_tensor_batch
    assert len(batch) == 12 and set(nt["node_kind"]) == {"branch"}
    for tree, total in _weights_per_tree({"default": batch}).items():
        assert total == pytest.approx(1.0), tree
    ids = batch.batch["input_ids"].numpy()
    mask = batch.batch["attention_mask"].numpy()
    for i in range(len(batch)):  # the shared prefix, as padded rows hold it: identical across siblings
        shared = nt["shared_prefix"][i]
        assert shared["node"] == "0"
        row = ids[i][mask[i] == 1][: shared["length"]]
        first = next(j for j in range(len(batch)) if nt["tree"][j] == nt["tree"][i])
        assert np.array_equal(row, ids[first][mask[first] == 1][: shared["length"]])
    per_row = collate(
        trajs, prompt_length=320, response_length=160, pad_token_id=0, weight="per_row"
    ).non_tensor_batch["weight"]
    assert per_row.tolist() == [1.0] * 12


@pytest.mark.slow
async def test_fork_branches_go_to_one_server_over_real_http():
    """Two dev servers over the tiny model behind the Router: every branch of a root is sent where the root's
    routing key is pinned, and its prompt hits that server's prefix cache."""
    served = make_backend()
    async with DevServer(served) as a, DevServer(served) as b:
        async with _fork_engine(
            tokenizer=model_tokenizer(tiny_model_dir()), servers=[a.url, b.url], engine="sglang"
        ) as engine:
            trajs = await engine.arun(make_prompts(4, 2))
        logs = {a.url: list(a.log), b.url: list(b.log)}
    _check_fork(trajs)
    for root in trajs:
        where = {url for url, log in logs.items() for e in log if e["rid"].startswith(root.session_id + ":")}
        assert len(where) == 1, (root.session_id, where)
    entries = [e for log in logs.values() for e in log]
    first_turns = [e for e in entries if e["rid"].endswith("_t00")]
    assert sum(e["cached_tokens"] > 0 for e in first_turns) >= len(first_turns) - len(trajs)


def test_linear_rows_are_their_own_root(tok):
    """A linear spec's rows carry root values; nothing else in its batch changes."""
    from backends.scripted import echo_backend
    from fsm.api import load_agent
    from tests.conftest import run_agent

    agent = load_agent("calculator")
    trajs = asyncio.run(run_agent(agent, echo_backend(), tok, make_prompts(3, 0)))
    batch = collate(trajs, prompt_length=320, response_length=160, pad_token_id=0)
    nt = batch.non_tensor_batch
    assert list(nt["tree"]) == [t.session_id for t in trajs]
    assert list(nt["node"]) == ["0"] * 3 and list(nt["parent"]) == [None] * 3
    assert list(nt["node_kind"]) == ["root"] * 3 and nt["weight"].tolist() == [1.0] * 3
    assert nt["branch_offset"].tolist() == [0] * 3 and nt["depth"].tolist() == [0] * 3
    assert list(nt["shared_prefix"]) == [{"length": 0, "node": None}] * 3
    record = trajectory_record(trajs[0])
    assert record["node"] == "0" and record["weight"] == 1.0 and record["policy"] == "default"


# --- failures, bounds and cancellation ------------------------------------------------------------------

CHILD = """
name: sub
extends: {specs}/planner_solver.yaml
children:
  calculator:
    spec: {child}
    policy: solver
    input: expression
    schema: specs.calculator:TOOL_SCHEMA
tree:
  max_depth: {depth}
"""


def _spec(tmp_path: Path, child: str, depth: int = 1, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(CHILD.format(specs=SPECS, child=child, depth=depth))
    return path


@pytest.mark.slow
def test_a_failing_child_is_an_error_observation(tmp_path):
    (tmp_path / "small.yaml").write_text(
        f"name: small\nextends: {SPECS}/calculator.yaml\nlimits: {{prompt_length: 8}}\n"
    )
    with RolloutEngine(_spec(tmp_path, "small.yaml")) as engine:
        trajs = engine._run_sync(engine.arun(make_prompts(2, 0)))
    children = [n for t in trajs for n in nodes_of(t)[1:]]
    assert children and all(c.failed for c in children)
    for root in trajs:
        assert not root.failed
        for child in nodes_of(root)[1:]:
            want = f"Error: sub-agent calculator failed: {child.termination_reason}"
            assert any(text.startswith(want[:60]) for text in _tool_texts(root)), _tool_texts(root)


@pytest.mark.slow
def test_recursion_stops_at_max_depth(tmp_path):
    """A spec that starts itself: the child (depth 1) calling the tool again is refused by tree.max_depth."""
    (tmp_path / "self.yaml").write_text(CHILD.format(specs=SPECS, child="self", depth=1))
    with RolloutEngine(tmp_path / "self.yaml") as engine:
        trajs = engine._run_sync(engine.arun(make_prompts(3, 0)))
    children = [n for t in trajs for n in nodes_of(t)[1:]]
    assert children and max(c.node.depth for c in children) == 1
    refused = [c for c in children if any("tree.max_depth 1 reached" in x for x in _tool_texts(c))]
    assert refused, [_tool_texts(c) for c in children]


async def hang(expression: str) -> str:
    """A tool that never answers (the child's), to cancel a tree in flight."""
    await asyncio.Event().wait()
    return expression


@pytest.mark.slow
async def test_cancelling_the_parent_cancels_its_subtree(tmp_path):
    (tmp_path / "hang.yaml").write_text(
        f"name: hang\nextends: {SPECS}/calculator.yaml\ntools:\n"
        "  - {function: tests.test_trees:hang, name: calculator, schema: specs.calculator:TOOL_SCHEMA, "
        "isolation: none}\n"
    )
    async with RolloutEngine(_spec(tmp_path, "hang.yaml")) as engine:
        runner = engine.runner
        run = asyncio.ensure_future(engine.arun(make_prompts(2, 0)))
        for _ in range(600):  # bounded: until a child is in its tool
            if any(":" in sid for sid in runner.live):
                break
            await asyncio.sleep(0.1)
        assert any(":" in sid for sid in runner.live), "no child started"
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
        for _ in range(100):
            if not runner.live:
                break
            await asyncio.sleep(0.05)
        assert not runner.live, list(runner.live)


@pytest.mark.slow
def test_one_trace_per_tree():
    """A child's spans are in its tree's trace, its root span under the span that started it."""
    from fsm.telemetry import Telemetry

    with Telemetry(otlp=False, memory=True) as tel:
        with RolloutEngine("specs/planner_solver.yaml", tracer=tel) as engine:
            trajs = engine._run_sync(engine.arun(make_prompts(2, 0)))
        spans = tel.finished_spans()
    roots = [s for s in spans if s.name.startswith("invoke_agent")]
    by_id = {s.context.span_id: s for s in spans}
    trees = {s.context.trace_id for s in roots}
    assert len(trees) == len(trajs)  # one trace per tree, however many nodes
    children = [s for s in roots if s.parent is not None]
    assert len(children) == sum(len(nodes_of(t)) - 1 for t in trajs) > 0
    for child in children:
        parent = by_id[child.parent.span_id]
        assert (
            parent.name == "invoke_agent planner_solver" and parent.context.trace_id == child.context.trace_id
        )
    child_ids = {c.context.span_id for c in children}

    def under_a_child(span) -> bool:
        while span.parent is not None and span.parent.span_id in by_id:
            if span.parent.span_id in child_ids:
                return True
            span = by_id[span.parent.span_id]
        return False

    models = [s for s in spans if s.name.startswith("text_completion")]
    assert sum(under_a_child(s) for s in models) == sum(
        n.assistant_turns for t in trajs for n in nodes_of(t)[1:]
    )


def test_render_draws_child_machines_and_forks():
    from viz.diagram import diagram, to_mermaid

    dot = diagram("specs/planner_solver.yaml").source
    assert "cluster_calculator" in dot and "child_calculator__PENDING" in dot and "policy: planner" in dot
    mmd = to_mermaid("specs/planner_solver.yaml")
    assert "as child_calculator {" in mmd and "PROCESSING_TOOLS --> child_calculator" in mmd
    stats = {"trees": {"nodes": 9, "children": {}, "branches": {"GENERATING": 8}}, "edges": {}, "states": {}}
    assert "fork: 4 branches (1x per path), 8 made" in diagram("specs/fork_calculator.yaml", stats).source


def test_show_prints_a_tree_outline():
    from viz.transcript import tree_outline

    records = [
        {
            "tree": "t",
            "node": "0",
            "node_kind": "root",
            "policy": "planner",
            "termination_reason": "done",
            "reward_score": 1.0,
            "weight": 0.5,
        },
        {
            "tree": "t",
            "node": "0.0",
            "node_kind": "child",
            "policy": "solver",
            "termination_reason": "done",
            "reward_score": 1.0,
            "weight": 0.5,
        },
        {"tree": "u", "node": "0", "node_kind": "root"},
    ]
    text = tree_outline(records, "t")
    assert text.splitlines() == [
        "tree t: 2 nodes",
        "  0 root [planner] done  reward 1  weight 0.5",
        "    0.0 child [solver] done  reward 1  weight 0.5",
    ]
    assert tree_outline(records, "u") is None  # a linear trajectory has no outline
