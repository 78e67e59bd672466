"""A gateway session as a tree (issue 38, "Through the gateway"): a harness's sub-agents reach the model through
child sessions and are recorded as child nodes; a request that continues an earlier turn attaches there as a
branch, and one that goes back to a node's own latest turn extends that node in place; every node's rows are
exactly what the backend was given and gave, and carry their place in the tree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backends.scripted import ScriptedBackend
from fsm.api import RolloutEngine
from fsm.gateway import Gateway, GatewayLimits, HarnessCall, harness
from fsm.output.batch import collate
from fsm.output.rundir import trajectory_record
from fsm.run.policy import check_segments
from tests.conftest import extra
from tests.gateway.conftest import ANSWER, CALL, row
from tests.gateway.test_hostile import USER, _attach, chat, post, spec
from tests.gateway.test_segments import tool, turn

LIMITS = "limits: {max_assistant_turns: 8, response_length: 1024, prompt_length: 1024}"


class ByPrompt(ScriptedBackend):
    """The scripted model, answering by what its prompt holds, whichever node asks: a calculator call until the
    prompt has a tool response, then the answer (as a calculator agent does). Keeps each request and answer."""

    def __init__(self, tokenizer: Any):
        ids = {
            k: tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id]
            for k, t in (("call", CALL), ("answer", ANSWER))
        }
        self.seen: list[tuple[str, list[int], list[int]]] = []

        def turn(session: str, k: int, prompt: list[int]) -> list[int]:
            out = ids["answer" if "<tool_response>" in tokenizer.decode(prompt) else "call"]
            self.seen.append((session, list(prompt), out))
            return out

        super().__init__(turn)


def run(path: Path, tokenizer: Any, backend: ScriptedBackend, gateway: Gateway | None = None, rows: int = 1):
    with RolloutEngine(str(path), tokenizer, backend=backend) as engine:
        if gateway is not None:
            _attach(gateway, engine)
        trajs = engine._run_sync(engine.arun([row() for _ in range(rows)]))
        for (
            traj
        ) in trajs:  # --check-tokens: each row is the template's render of its own conversation and tools
            assert check_segments(engine.codec, traj) is None, check_segments(engine.codec, traj)
        limits = engine.agent.limits
        batch = collate(
            trajs,
            prompt_length=limits.prompt_length,
            response_length=limits.response_length,
            pad_token_id=tokenizer.pad_token_id or 0,
            logprobs=False,
        )
        records = [trajectory_record(t, engine.codec) for t in trajs]
    return trajs, batch, records


def assert_nodes_exact(traj: Any, backend: Any) -> None:
    """Every model turn of every row is one request the backend answered, and every request is one turn: its
    prompt is the row's context up to that turn, its answer the turn's ids (mask 1; observations mask 0)."""
    seen = [(prompt, out) for session, prompt, out in backend.seen if session == traj.session_id]
    turns = [(seg, run) for seg in traj.segments for run in seg.runs if run.role == "assistant"]
    assert len(turns) == len(seen) and seen
    unmatched = list(seen)
    for seg, run in turns:
        context = seg.prompt_ids.tolist() + seg.response_ids.tolist()
        asked = (
            context[: len(seg.prompt_ids) + run.start],
            context[len(seg.prompt_ids) + run.start :][: run.end - run.start],
        )
        assert asked in unmatched, f"segment {seg.index}'s turn at {run.start} is no request the backend saw"
        unmatched.remove(asked)
        mask = seg.response_mask.tolist()
        for r in seg.runs:
            assert set(mask[r.start : r.end]) == ({1} if r.role == "assistant" else {0})


# --- a retry from an earlier turn, in plain HTTP -------------------------------------------------------------


async def retrying(call: HarnessCall) -> None:
    """Two turns; a retry from the first turn with another tool result (a branch); back to the main line's
    latest turn (it goes on in place); then the branch goes on."""
    a1 = await turn(call, USER)
    a2 = await turn(call, USER, a1, tool(a1))
    b2 = await turn(call, USER, a1, tool(a1, "Error: timeout"))  # from a1's context, not the latest turn
    await turn(call, USER, a1, tool(a1), a2, {"role": "user", "content": "And 2 + 2?"})  # the main line
    await turn(
        call, USER, a1, tool(a1, "Error: timeout"), b2, {"role": "user", "content": "Retry."}
    )  # the branch


retry_harness = harness(retrying, timeout_s=60)


def test_a_retry_from_an_earlier_turn_is_a_branch_and_the_main_line_goes_on_in_place(tmp_path, tokenizer):
    backend = ByPrompt(tokenizer)
    trajs, batch, records = run(
        spec(tmp_path, "tests.gateway.test_tree:retry_harness", LIMITS), tokenizer, backend
    )
    traj = trajs[0]
    assert traj.termination_reason == "done", traj.extra.get("harness")
    # two rows: the main line's (three turns, the third appended in place, nothing copied) and the branch's
    assert [s.reason for s in traj.segments] == ["prompt", "branch"]
    assert [s.turns for s in traj.segments] == [3, 2]
    main, branch = traj.segments
    a1 = main.runs[0]
    offset = len(main.prompt_ids) + a1.end
    assert branch.prompt_ids.tolist() == main.context_ids()[:offset]  # a1's context, token for token
    assert "Error: timeout" in tokenizer.decode(branch.response_ids.tolist())
    assert "And 2 + 2?" in tokenizer.decode(
        main.response_ids.tolist()
    )  # the main line went on in its own row
    assert_nodes_exact(traj, backend)
    rows = traj.extra["tree"]
    assert [(r["node"], r["parent"], r["node_kind"], r["depth"]) for r in rows] == [
        ("0", None, "root", 0),
        ("0.0", "0", "branch", 1),
    ]
    assert rows[1]["branch_offset"] == offset and rows[0]["branch_offset"] == 0
    assert rows[1]["shared_prefix"]["node"] == "0" and rows[1]["shared_prefix"]["length"] >= offset
    assert rows[0]["shared_prefix"] == {"length": 0, "node": None}
    assert [r["weight"] for r in rows] == [0.5, 0.5] and {r["tree"] for r in rows} == {traj.session_id}
    nt = batch.non_tensor_batch  # the batch's rows carry the same fields
    assert nt["node"].tolist() == ["0", "0.0"] and nt["node_kind"].tolist() == ["root", "branch"]
    assert nt["parent"].tolist() == [None, "0"] and nt["branch_offset"].tolist() == [0, offset]
    assert nt["weight"].tolist() == [0.5, 0.5] and set(nt["policy"].tolist()) == {"default"}
    record = records[0]
    assert [s["node"] for s in record["segments"]] == ["0", "0.0"]
    assert record["node"] == "0.0" and record["shared_prefix"] == rows[1]["shared_prefix"]


# --- refusals: an unknown parent, a cycle, a depth past the bound ---------------------------------------------


async def refusing(call: HarnessCall) -> dict:
    await turn(call, USER)
    out = {}
    for name, names in {
        "unknown_parent": ["a", "b"],  # "a" has made no call
        "ok": ["a"],
        "cycle": ["a", "b", "a"],
        "too_deep": ["a", "b", "c"],
        "bad_name": ["-x"],
    }.items():
        child = call
        for n in names:
            child = child.child(n)
        out[name] = await post(call, "chat/completions", chat(USER), base=child.base_url)
    return out


refuse_harness = harness(refusing, timeout_s=60)


def test_tree_refusals_are_one_line_answers_and_on_the_record(tmp_path, tokenizer):
    gateway = Gateway(limits=GatewayLimits(max_depth=2))
    trajs, _, records = run(
        spec(tmp_path, "tests.gateway.test_tree:refuse_harness", LIMITS),
        tokenizer,
        ByPrompt(tokenizer),
        gateway,
    )
    out = trajs[0].extra["harness"]["result"]
    codes = {
        k: (status, body["error"]["code"] if status != 200 else None) for k, (status, body) in out.items()
    }
    assert codes == {
        "unknown_parent": (404, "unknown_parent"),
        "ok": (200, None),
        "cycle": (400, "tree_too_deep"),  # three deep: the depth is checked first
        "too_deep": (400, "tree_too_deep"),
        "bad_name": (400, "invalid_child"),
    }
    message = out["unknown_parent"][1]["error"]["message"]
    assert message == (
        "/child/a/child/b: unknown parent session /child/a (a child session exists once it has made a call)"
    )
    assert trajs[0].termination_reason == "done", trajs[0].extra["harness"]
    assert message in records[0]["gateway_notes"]
    assert any("max_depth (2)" in n for n in records[0]["gateway_notes"])
    assert [r["node"] for r in trajs[0].extra["tree"]] == ["0", "0.0"]


async def cycling(call: HarnessCall) -> dict:
    await turn(call, USER)
    a, b = call.child("a"), call.child("a").child("b")
    await turn(a, USER)
    await turn(b, USER)
    status, body = await post(call, "chat/completions", chat(USER), base=b.child("a").base_url)
    return {"status": status, "code": body["error"]["code"], "message": body["error"]["message"]}


cycle_harness = harness(cycling, timeout_s=60)


def test_a_cycle_is_refused(tmp_path, tokenizer):
    trajs, _, records = run(
        spec(tmp_path, "tests.gateway.test_tree:cycle_harness", LIMITS), tokenizer, ByPrompt(tokenizer)
    )
    out = trajs[0].extra["harness"]["result"]
    assert out == {
        "status": 400,
        "code": "tree_cycle",
        "message": "/child/a/child/b/child/a: a cycle, a child session named again under itself",
    }
    assert out["message"] in records[0]["gateway_notes"]
    rows = trajs[0].extra["tree"]
    assert [(r["node"], r["parent"], r["node_kind"]) for r in rows] == [
        ("0", None, "root"),
        ("0.0", "0", "child"),
        ("0.0.0", "0.0", "child"),
    ]


# --- a real harness's sub-agents: the OpenAI Agents SDK's agents-as-tools --------------------------------------


@pytest.mark.slow
def test_agents_sdk_sub_agents_are_child_nodes(tokenizer):
    extra("agents", "gateway")  # the harness itself, from PyPI
    backend = ByPrompt(tokenizer)
    trajs, batch, records = run(Path("examples/gateway/agents_tree.yaml"), tokenizer, backend, rows=2)
    assert len(batch) == 4  # two rows of two nodes each
    for traj in trajs:
        assert traj.error is None and traj.extra["harness"]["outcome"] == "returned", traj.extra["harness"]
        rows = traj.extra["tree"]
        assert [(r["node"], r["parent"], r["node_kind"], r["depth"]) for r in rows] == [
            ("0.0", "0", "child", 1),  # the solver began second and ended first
            ("0", None, "root", 0),  # the planner's row, where the session ended, last
        ]
        solver, planner = traj.segments
        assert [s.reason for s in traj.segments] == ["child", "prompt"]
        assert [s.turns for s in traj.segments] == [2, 2]
        assert rows[0]["branch_offset"] == len(planner.prompt_ids) + planner.runs[0].end  # after its call
        # the solver's final answer is exactly the tool result the planner's model then saw
        answer = solver.messages[-1]
        assert answer["role"] == "assistant" and ANSWER in answer["content"]
        seen = [m["content"] for m in planner.messages if m["role"] == "tool"]
        assert seen == [answer["content"]]
        assert [m["content"] for m in solver.messages if m["role"] == "tool"] == ["3"]  # the real calculator
        assert traj.extra["harness"]["result"] == ANSWER
        assert_nodes_exact(traj, backend)
        assert traj.reward_score == 1.0
    assert [r["node_kind"] for r in records[0]["segments"]] == ["child", "root"]


async def crowding(call: HarnessCall) -> dict:
    await turn(call, USER)
    await turn(call.child("a"), USER)
    status, body = await post(call, "chat/completions", chat(USER), base=call.child("b").base_url)
    return {"status": status, "code": body["error"]["code"], "message": body["error"]["message"]}


crowd_harness = harness(crowding, timeout_s=60)


def test_nodes_per_tree_are_bounded(tmp_path, tokenizer):
    gateway = Gateway(limits=GatewayLimits(max_nodes=2))
    trajs, _, records = run(
        spec(tmp_path, "tests.gateway.test_tree:crowd_harness", LIMITS),
        tokenizer,
        ByPrompt(tokenizer),
        gateway,
    )
    out = trajs[0].extra["harness"]["result"]
    message = "the session's tree holds 2 nodes, its max_nodes (2)"
    assert out == {"status": 400, "code": "too_many_nodes", "message": message}
    assert message in records[0]["gateway_notes"] and trajs[0].termination_reason == "done"
    assert [r["node"] for r in trajs[0].extra["tree"]] == ["0", "0.0"]  # it ended on the child's call


# --- the Agents SDK's handoffs: the agent handed off to runs on a child session ---------------------------------

TRANSFER = '<tool_call>\n{"name": "transfer_to_solver", "arguments": {}}\n</tool_call>'


class Handing(ScriptedBackend):
    """A planner that hands off at once, then a solver that calls the calculator and answers: the turn is chosen by
    how many tool responses the prompt holds (0, 1, 2)."""

    def __init__(self, tokenizer: Any):
        ids = [
            tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id]
            for t in (TRANSFER, CALL, ANSWER)
        ]
        self.seen: list[tuple[str, list[int], list[int]]] = []

        def turn(session: str, k: int, prompt: list[int]) -> list[int]:
            out = ids[min(tokenizer.decode(prompt).count("<tool_response>"), 2)]
            self.seen.append((session, list(prompt), out))
            return out

        super().__init__(turn)


async def handing_off(call: HarnessCall) -> str:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner

    from examples.gateway.harnesses import agents_sdk_solver

    solver, clients = agents_sdk_solver(call)
    planner = Agent(
        name="planner",
        instructions="Hand arithmetic to the solver.",
        handoffs=[solver],
        model=OpenAIResponsesModel(model=call.model, openai_client=clients[0]),
        model_settings=ModelSettings(store=False),
    )
    try:
        result = await Runner.run(
            planner, USER["content"], max_turns=6, run_config=RunConfig(tracing_disabled=True)
        )
        return str(result.final_output)
    finally:
        for client in clients:
            await client.close()


handoff_harness = harness(handing_off, timeout_s=120)


@pytest.mark.slow
def test_agents_sdk_handoff_is_a_child_node(tmp_path, tokenizer):
    extra("agents", "gateway")
    backend = Handing(tokenizer)
    trajs, _, records = run(
        spec(tmp_path, "tests.gateway.test_tree:handoff_harness", LIMITS), tokenizer, backend
    )
    traj = trajs[0]
    assert traj.extra["harness"]["outcome"] == "returned", traj.extra["harness"]
    assert traj.extra["harness"]["result"] == ANSWER  # the solver's answer ends the run
    rows = traj.extra["tree"]
    assert [(r["node"], r["parent"], r["node_kind"]) for r in rows] == [
        ("0", None, "root"),
        ("0.0", "0", "child"),
    ]
    planner, solver = traj.segments
    assert [s.turns for s in traj.segments] == [1, 2]
    assert "transfer_to_solver" in tokenizer.decode(planner.response_ids.tolist())
    # the solver was given the conversation the planner had: the question, under its own instructions and tools
    assert "What is 1 + 2?" in tokenizer.decode(solver.prompt_ids.tolist())
    assert [m["content"] for m in solver.messages if m["role"] == "tool"][-1] == "3"
    assert_nodes_exact(traj, backend)
