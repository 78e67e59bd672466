"""Histories that differ from the session's recorded conversation (issue 30 through issue 29's segments): a
harness that compacts, edits or branches its history gets a new segment, never a merge; a branch from an
earlier turn reattaches to that turn's context token for token; every segment is exactly what the backend was
given and gave, and the batch has one row per segment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backends.scripted import ScriptedBackend
from fsm.api import RolloutEngine
from fsm.gateway import Gateway, GatewayLimits, HarnessCall, harness
from fsm.output.batch import collate
from fsm.run.policy import check_segments
from tests.gateway.conftest import ANSWER, CALL, row
from tests.gateway.test_hostile import USER, _attach, chat, post, spec


class Recording(ScriptedBackend):
    """The scripted model (a calculator call, then the answer, and again), keeping each request's prompt and the ids
    it answered with, per session."""

    def __init__(self, tokenizer: Any):
        ids = [
            tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in (CALL, ANSWER)
        ]
        self.seen: list[tuple[str, list[int], list[int]]] = []

        def turn(session: str, k: int, prompt: list[int]) -> list[int]:
            out = ids[k % 2]
            self.seen.append((session, list(prompt), out))
            return out

        super().__init__(turn)


def run(path: Path, tokenizer: Any, gateway: Gateway | None = None) -> tuple[list[Any], Recording, Any]:
    backend = Recording(tokenizer)
    with RolloutEngine(str(path), tokenizer, backend=backend) as engine:
        if gateway is not None:
            _attach(gateway, engine)
        trajs = engine._run_sync(engine.arun([row()]))
        limits = engine.agent.limits
        for traj in trajs:  # --check-tokens: each segment is the template's render of its own conversation
            assert check_segments(engine.codec, traj) is None, check_segments(engine.codec, traj)
    batch = collate(
        trajs,
        prompt_length=limits.prompt_length,
        response_length=limits.response_length,
        pad_token_id=tokenizer.pad_token_id or 0,
        logprobs=False,
    )
    return trajs, backend, batch


def assert_segments_exact(traj: Any, backend: Recording) -> None:
    """Each segment's model turns, in order over the segments, are the backend's answers: each request's prompt
    is the segment's prompt and response up to that turn, the turn's ids are what it answered, mask 1 on them
    and 0 elsewhere."""
    seen = [(prompt, out) for session, prompt, out in backend.seen if session == traj.session_id]
    turns = [(seg, run) for seg in traj.segments for run in seg.runs if run.role == "assistant"]
    assert len(turns) == len(seen) and seen
    for (seg, run), (prompt, out) in zip(turns, seen):
        context = seg.prompt_ids.tolist() + seg.response_ids.tolist()
        assert prompt == context[: len(seg.prompt_ids) + run.start]
        assert seg.response_ids[run.start : run.end].tolist() == out
    for seg in traj.segments:
        mask = seg.response_mask.tolist()
        for run in seg.runs:
            assert set(mask[run.start : run.end]) == ({1} if run.role == "assistant" else {0})


def assert_batch_rows(traj: Any, batch: Any) -> None:
    n = traj.num_segments
    assert batch.batch["input_ids"].shape[0] == n
    assert batch.non_tensor_batch["segment_index"].tolist() == list(range(n))
    assert set(batch.non_tensor_batch["num_segments"].tolist()) == {n}
    for k, seg in enumerate(traj.segments):  # each row's response is its segment's, right-padded
        got = batch.batch["responses"][k][: len(seg.response_ids)].tolist()
        assert got == seg.response_ids.tolist()


def tool(message: dict, content: str = "3") -> dict:
    return {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": content}


async def turn(call: HarnessCall, *messages: dict) -> dict:
    status, body = await post(call, "chat/completions", chat(*messages))
    assert status == 200, body
    return body["choices"][0]["message"]


async def compacting(call: HarnessCall) -> list[str]:
    """Two turns, then the history compacted to one summary message (the old ones dropped), and on."""
    a1 = await turn(call, USER)
    a2 = await turn(call, USER, a1, tool(a1))
    summary = {
        "role": "user",
        "content": "Earlier you computed 1 + 2 = 3 with the calculator. What is 1 + 2?",
    }
    a3 = await turn(call, summary)
    a4 = await turn(call, summary, a3, tool(a3))
    return [a2["content"], a4["content"]]


async def editing(call: HarnessCall) -> None:
    """A tool result edited after later turns were built on it; a role changed."""
    a1 = await turn(call, USER)
    a2 = await turn(call, USER, a1, tool(a1))
    await turn(call, USER, a1, tool(a1, "4 (edited)"), a2, {"role": "user", "content": "Sure?"})
    await turn(call, USER, dict(a1, role="user"), tool(a1))  # the model's turn sent back as a user turn


async def branching(call: HarnessCall) -> None:
    """The harness goes back to its first turn and tries another tool result, then continues the branch."""
    a1 = await turn(call, USER)
    a2 = await turn(call, USER, a1, tool(a1))
    await turn(call, USER, a1, tool(a1), a2, {"role": "user", "content": "And 2 + 2?"})  # extends: no segment
    b2 = await turn(call, USER, a1, tool(a1, "Error: timeout"))  # from a1's context
    await turn(
        call, USER, a1, tool(a1, "Error: timeout"), b2, {"role": "user", "content": "Retry."}
    )  # extends


compact_harness = harness(compacting, timeout_s=60)
edit_harness = harness(editing, timeout_s=60)
branch_harness = harness(branching, timeout_s=60)
LIMITS = "limits: {max_assistant_turns: 8, response_length: 1024, prompt_length: 1024}"


def test_a_compacting_harness_gets_a_new_segment(tmp_path, tokenizer):
    trajs, backend, batch = run(
        spec(tmp_path, "tests.gateway.test_segments:compact_harness", LIMITS), tokenizer
    )
    traj = trajs[0]
    assert traj.termination_reason == "done", traj.extra.get("harness")
    assert [s.reason for s in traj.segments] == ["prompt", "history"]
    assert [s.turns for s in traj.segments] == [2, 2]
    second = traj.segments[1]
    assert "Earlier you computed" in tokenizer.decode(second.prompt_ids.tolist())
    assert "What is 1 + 2?" not in tokenizer.decode(second.prompt_ids.tolist()).split("Earlier")[0]  # dropped
    assert_segments_exact(traj, backend)
    assert_batch_rows(traj, batch)


def test_an_editing_harness_is_never_merged(tmp_path, tokenizer):
    trajs, backend, batch = run(spec(tmp_path, "tests.gateway.test_segments:edit_harness", LIMITS), tokenizer)
    traj = trajs[0]
    assert traj.termination_reason == "done", traj.extra.get("harness")
    assert [s.reason for s in traj.segments] == ["prompt", "history", "history"]
    first, edited, roles = traj.segments
    assert "4 (edited)" not in tokenizer.decode(first.context_ids())  # the recorded turn's row is untouched
    assert "4 (edited)" in tokenizer.decode(
        edited.prompt_ids.tolist()
    )  # the edit is the new segment's prompt
    assert roles.prompt_ids.tolist() != first.context_ids()[: len(roles.prompt_ids)]  # rendered as sent
    assert_segments_exact(traj, backend)
    assert_batch_rows(traj, batch)


def test_a_branch_reattaches_to_the_earlier_turn(tmp_path, tokenizer):
    trajs, backend, batch = run(
        spec(tmp_path, "tests.gateway.test_segments:branch_harness", LIMITS), tokenizer
    )
    traj = trajs[0]
    assert traj.termination_reason == "done", traj.extra.get("harness")
    assert [s.reason for s in traj.segments] == ["prompt", "branch"]
    assert [s.turns for s in traj.segments] == [3, 2]
    first, branch = traj.segments
    a1 = first.runs[0]
    assert a1.role == "assistant"
    # the branch's prompt is exactly a1's context, token for token: the first prompt and a1 as sampled
    assert branch.prompt_ids.tolist() == first.context_ids()[: len(first.prompt_ids) + a1.end]
    assert "Error: timeout" in tokenizer.decode(branch.response_ids.tolist())
    assert_segments_exact(traj, backend)
    assert_batch_rows(traj, batch)


async def many_edits(call: HarnessCall) -> dict:
    a1 = await turn(call, USER)
    out = {}
    for k in range(4):  # each an edited first question: a new segment each
        out[str(k)] = await post(
            call, "chat/completions", chat({"role": "user", "content": f"What is {k} + 2?"})
        )
    out["ends_on_assistant"] = await post(call, "chat/completions", chat(USER, a1))
    return out


many_harness = harness(many_edits, timeout_s=60)


def test_segments_per_session_are_bounded(tmp_path, tokenizer):
    gateway = Gateway(limits=GatewayLimits(max_segments=3))
    trajs, backend, _ = run(
        spec(tmp_path, "tests.gateway.test_segments:many_harness", LIMITS), tokenizer, gateway
    )
    out = trajs[0].extra["harness"]["result"]
    assert [out[str(k)][0] for k in range(4)] == [200, 200, 400, 400]
    assert (
        out["2"][1]["error"]["code"] == "too_many_segments"
        and "max_segments (3)" in out["2"][1]["error"]["message"]
    )
    assert (
        out["ends_on_assistant"][0] == 400
        and "ends with an assistant message" in out["ends_on_assistant"][1]["error"]["message"]
    )
    assert trajs[0].num_segments == 3
    assert_segments_exact(trajs[0], backend)


def test_the_cli_sets_max_segments(tmp_path, tokenizer):
    from fsm.cli.commands import build_parser
    from fsm.gateway.serve import cmd_gateway

    assert build_parser().parse_args(["gateway", "examples/gateway/base.yaml"]).max_segments == 32
    args = build_parser().parse_args(["gateway", "examples/gateway/base.yaml", "--max-segments", "3"])
    seen = []

    def rows(cli: Any) -> int:  # the run: its engine owns the gateway the CLI configured
        path = spec(tmp_path, "tests.gateway.test_segments:many_harness", LIMITS)
        trajs, backend, _ = run(path, tokenizer, cli.gateway)
        seen.append(trajs[0])
        assert_segments_exact(trajs[0], backend)
        return 0

    assert cmd_gateway(args, rows) == 0
    out = seen[0].extra["harness"]["result"]
    assert [out[str(k)][0] for k in range(4)] == [200, 200, 400, 400] and seen[0].num_segments == 3
    assert "max_segments (3)" in out["2"][1]["error"]["message"]


def test_a_call_keys_only_its_new_messages(monkeypatch):
    """The history the harness sends back unchanged is compared as data, once; keys are made for the new
    messages only, so a call costs O(new messages); an edited old message still starts a new segment."""
    from types import SimpleNamespace

    from fsm.gateway import record
    from fsm.gateway.record import Call, Recorder

    keyed = []
    key = record.message_key
    monkeypatch.setattr(record, "message_key", lambda m: keyed.append(m) or key(m))
    history = [{"role": "system", "content": "S"}] + [{"role": "user", "content": f"q{k}"} for k in range(50)]
    recorder = Recorder()
    recorder.begin([key(m) for m in history], None, history)
    answer = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c0", "name": "f", "arguments": '{"x": 1}'}],
    }
    recorder.turn(SimpleNamespace(messages=[], prompt_ids=[], response_ids=[]), answer)
    keyed.clear()
    echoed = [dict(m) for m in history] + [
        dict(answer),
        {"role": "tool", "content": "1", "tool_call_id": "c0"},
    ]
    plan, _keys = recorder.extends(Call(echoed, None))
    assert plan is not None and plan.kind == "extend" and keyed == [echoed[-1]]
    echoed[3] = {"role": "user", "content": "edited"}
    assert recorder.extends(Call(echoed, None))[0] is None  # not this segment's: the tree starts another


async def edit_forever(call: HarnessCall) -> dict:
    await turn(call, USER)
    k = 0
    while True:  # every request an edited first question: past max_segments, each is refused
        k += 1
        status, _ = await post(
            call, "chat/completions", chat({"role": "user", "content": f"What is {k} + 2?"})
        )
        if status == 401:  # the session ended: the row is over
            return {"calls": k}


edit_forever_harness = harness(edit_forever, timeout_s=60)


def test_a_harness_looping_on_too_many_segments_is_spinning(tmp_path, tokenizer):
    """Issue 36, risks: refusals while recording (too_many_segments) did not count toward `spinning`, so a harness
    looping 10,000 calls ran to max_transitions. They count as calls past a limit do: past max_refused_calls the
    harness is ended and its row says why."""
    gateway = Gateway(limits=GatewayLimits(max_segments=2))
    trajs, backend, _ = run(
        spec(tmp_path, "tests.gateway.test_segments:edit_forever_harness", LIMITS), tokenizer, gateway
    )
    harness_out = trajs[0].extra["harness"]
    assert harness_out["outcome"] == "spinning" and "max_segments (2)" in harness_out["error"], harness_out
    assert trajs[0].termination_reason == "harness_failed" and trajs[0].num_segments == 2
    assert len(trajs[0].path) < 100, len(trajs[0].path)
