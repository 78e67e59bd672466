"""Contexts that are rewritten: a trajectory as segments, each row exactly what the model saw.

The data model (fsm/run/trajectory.py `Segment`, `start_segment`), the explicit rewrites (summary, window,
function: fsm/run/rewrites.py), their validation, and what comes out (one batch row and one Sample per
segment, the reward placed as the spec says, transcripts, snapshots). The `template` policy against real chat
templates is in tests/test_contexts_template.py.
"""

from __future__ import annotations

import json

import pytest

import fsm
from fsm.output.batch import collate
from fsm.output.sample import to_samples
from fsm.run.codec import decode_trajectory, encode_trajectory
from fsm.run.trajectory import Trajectory
from fsm.spec.loader import SpecError
from tests.conftest import run_agent, scripted, user_row

COMPACT = """
    name: compact
    extends: {specs}/calculator_compact.yaml
    context:
      reward_placement: {placement}
    states:                                  # the test rows have no system prompt: a lower threshold
      PROCESSING_TOOLS:
        action: call_tools
        next: [{to: COMPACTING, when: {context_tokens_over: 60}}, {to: GENERATING}]
"""


def _traj() -> Trajectory:
    t = Trajectory(0, 0, "s-0-0", "u", {"raw_prompt": []}, "PENDING")
    t.prompt_ids.extend([1, 2, 3])
    t.messages = [{"role": "user", "content": "q"}]
    t.segment_start = ("prompt", 1, 0, 0)
    return t


def test_one_segment_costs_nothing_and_reads_as_one():
    t = _traj()
    t.append_generated([7, 8], [-0.5, -0.25], 3)
    assert t.closed == () and t.closed is Trajectory(0, 0, "x", "u", {}, "P").closed  # one shared empty tuple
    (seg,) = t.segments
    assert seg.index == 0 and seg.reason == "prompt" and seg.prompt_ids is t.prompt_ids  # a view, no copy
    assert seg.response_ids is t.response_ids and seg.turns == 0 and seg.prompt_messages == 1


def test_start_segment_closes_at_the_last_model_turn():
    """The closed row ends with its last model turn: the observation after it belongs to the next context."""
    t = _traj()
    t.append_generated([7, 8], [-0.5, -0.25], 3)
    t.assistant_turns += 1
    t.messages.append({"role": "assistant", "content": "call"})
    t.add_turn_reward("tool", 1.0)
    t.append_context([9], "template")
    t.append_context([10, 11], "tool")
    t.messages.append({"role": "tool", "content": "42"})
    t.start_segment([1, 2, 3, 4], "template")
    first, second = t.segments
    assert first.response_ids.tolist() == [7, 8] and first.response_mask.tolist() == [1, 1]
    assert first.response_logprobs.tolist() == [-0.5, -0.25] and first.response_versions.tolist() == [3, 3]
    assert [r.role for r in first.runs] == ["assistant"] and first.turns == 1
    assert first.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "call"}]
    assert first.turn_rewards == [["tool", 1, 1.0]]
    assert second.index == 1 and second.reason == "template" and second.prompt_ids.tolist() == [1, 2, 3, 4]
    assert second.prompt_messages == 3 and second.turns == 0 and t.turn_rewards == []
    assert t.response_ids.tolist() == [] and t.num_segments == 2
    t.append_generated([5], None, 4)
    assert t.weight_versions() == (3, 4)  # over every segment
    back = decode_trajectory(json.loads(json.dumps(encode_trajectory(t))))  # snapshots keep the segments
    assert [
        (
            s.index,
            s.reason,
            s.prompt_ids.tolist(),
            s.response_ids.tolist(),
            s.response_versions.tolist(),
            list(s.runs),
            s.messages,
        )
        for s in back.segments
    ] == [
        (
            s.index,
            s.reason,
            s.prompt_ids.tolist(),
            s.response_ids.tolist(),
            s.response_versions.tolist(),
            list(s.runs),
            s.messages,
        )
        for s in t.segments
    ]
    t.fail("boom")
    assert t.num_segments == 1 and t.response_ids.tolist() == []  # a failed row is one empty row


def _segmented(reward: float) -> Trajectory:
    t = _traj()
    t.append_generated([7, 8], [-0.5, -0.25], 0)
    t.messages.append({"role": "assistant", "content": "a"})
    t.start_segment([1, 2, 3, 4, 5], "summary")
    t.append_generated([6], [-1.0], 0)
    t.reward_score = reward
    return t


@pytest.mark.parametrize("placement", ["last", "every"])
def test_collate_one_row_per_segment(placement):
    plain = _traj()
    plain.append_generated([4], [-0.1], 0)
    plain.reward_score = 0.5
    b = collate(
        [_segmented(1.0), plain],
        prompt_length=6,
        response_length=3,
        pad_token_id=0,
        reward_placement=placement,
    )
    assert len(b) == 3
    assert b.batch["prompts"].tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]]
    assert b.batch["responses"].tolist() == [[7, 8, 0], [6, 0, 0], [4, 0, 0]]
    assert b.batch["response_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 0, 0]]
    nt = b.non_tensor_batch
    assert list(nt["trajectory_id"]) == ["s-0-0"] * 3 and list(nt["uid"]) == ["u"] * 3
    assert nt["segment_index"].tolist() == [0, 1, 0] and nt["num_segments"].tolist() == [2, 2, 1]
    rm = b.batch["rm_scores"]
    assert rm[0, 1].item() == (1.0 if placement == "every" else 0.0) and rm[1, 0].item() == 1.0
    assert rm[2, 0].item() == 0.5 and float(rm.sum()) == (2.5 if placement == "every" else 1.5)
    samples = to_samples([_segmented(1.0), plain], placement)
    assert [(s.segment, s.num_segments, s.reward, s.response_ids) for s in samples] == [
        (0, 2, 1.0 if placement == "every" else 0.0, [7, 8]),
        (1, 2, 1.0, [6]),
        (0, 1, 0.5, [4]),
    ]


def test_unsegmented_batch_unchanged():
    t = _traj()
    t.append_generated([4], [-0.1], 0)
    b = collate([t], prompt_length=4, response_length=2, pad_token_id=0)
    assert b.non_tensor_batch["segment_index"].tolist() == [0] and b.non_tensor_batch[
        "num_segments"
    ].tolist() == [1]
    with pytest.raises(ValueError, match="reward_placement"):
        collate([t], prompt_length=4, response_length=2, pad_token_id=0, reward_placement="first")


# --- the rewrites, run ------------------------------------------------------------------------------------------


async def test_summary_compaction_rows_are_what_the_model_saw(compile_yaml, tok, call, turn):
    """specs/calculator_compact.yaml: after the tool result the context passes its threshold, so the model is asked
    for a summary (its own segment: the instruction in the prompt, the summary sampled), and the task plus the
    summary is the next segment's prompt. Each segment is exact against a render of its conversation."""
    agent = compile_yaml(COMPACT.replace("{placement}", "every"))
    script = [
        call(("calculator", {"expression": "2 + 3"})),
        turn("Asked 2 + 3; the tool said 5."),
        turn("#### 5"),
    ]
    (t,) = await run_agent(
        agent, scripted(script), tok, [user_row("What is 2 + 3?", reward_model={"ground_truth": "5"})]
    )
    assert t.error is None and t.token_check is None, (t.error, t.token_check)
    assert t.path == ["PENDING", "GENERATING", "PROCESSING_TOOLS", "COMPACTING", "GENERATING", "TERMINATED"]
    first, summary, after = t.segments
    assert [s.reason for s in t.segments] == ["prompt", "summary", "rewrite"]
    sampled = [
        s.response_ids[r.start : r.end].tolist() for s in t.segments for r in s.runs if r.role == "assistant"
    ]
    assert sampled == script  # every sampled token kept as sampled, in its own segment
    for seg in t.segments:
        assert seg.prompt_ids.tolist() == tok.apply_chat_template(
            seg.messages[: seg.prompt_messages],
            tools=t.tool_schemas,
            add_generation_prompt=True,
            return_dict=False,
        )
    assert summary.messages[-2]["content"].startswith("Summarize the work so far")
    assert after.messages[-2]["content"] == "Summary of the work so far:\nAsked 2 + 3; the tool said 5."
    assert [m["role"] for m in after.messages] == ["user", "user", "assistant"]
    assert t.reward_score == 1.0
    batch = fsm.collate(
        [t], prompt_length=640, response_length=160, pad_token_id=tok.pad_token_id, reward_placement="every"
    )
    assert len(batch) == 3 and batch.batch["rm_scores"].sum().item() == 3.0


async def test_window_keeps_the_task_and_the_last_exchanges(compile_yaml, tok, call, turn):
    agent = compile_yaml("""
        name: windowed
        extends: {specs}/calculator.yaml
        limits: {max_assistant_turns: 5, response_length: 400}
        context:
          rewrites:
            last_one: {keep_last: 1}
        states:
          PROCESSING_TOOLS:
            action: call_tools
            next: [{to: WINDOW}]
          WINDOW:
            action: last_one
            next: [{to: GENERATING}]
    """)
    script = [
        call(("calculator", {"expression": "1 + 1"})),
        call(("calculator", {"expression": "2 + 2"})),
        turn("#### 4"),
    ]
    (t,) = await run_agent(
        agent, scripted(script), tok, [user_row("Add.", reward_model={"ground_truth": "4"})]
    )
    assert t.error is None and t.token_check is None, (t.error, t.token_check)
    # the first window keeps the one exchange there is (nothing rewritten); the second drops the first exchange
    assert [s.reason for s in t.segments] == ["prompt", "rewrite"]
    last = t.segments[-1]
    assert [m.get("content") for m in last.messages if m["role"] == "tool"] == ["4"]
    assert "1 + 1" not in tok.decode(last.prompt_ids.tolist()) and "2 + 2" in tok.decode(
        last.prompt_ids.tolist()
    )


def drop_tools(messages):
    """A user rewrite: the tool results become one short note."""
    return [m for m in messages if m["role"] in ("system", "user")] + [
        {"role": "user", "content": "(tools done)"}
    ]


async def test_function_rewrite_and_its_errors(compile_yaml, tok, call, turn):
    spec = """
        name: fn
        extends: {specs}/calculator.yaml
        context:
          rewrites:
            squash: {function: tests.test_contexts:%s}
        states:
          PROCESSING_TOOLS:
            action: call_tools
            next: [{to: SQUASH}]
          SQUASH:
            action: squash
            next: [{to: GENERATING}]
    """
    script = [call(("calculator", {"expression": "1 + 1"})), turn("#### 2")]
    (t,) = await run_agent(
        compile_yaml(spec % "drop_tools"),
        scripted(script),
        tok,
        [user_row("Add.", reward_model={"ground_truth": "4"})],
    )
    assert t.error is None and t.token_check is None and t.num_segments == 2
    assert t.messages[-2] == {"role": "user", "content": "(tools done)"}
    (bad,) = await run_agent(
        compile_yaml(spec % "not_messages", "bad.yaml"),
        scripted(script),
        tok,
        [user_row("Add.", reward_model={"ground_truth": "4"})],
    )
    assert bad.failed and "must return a non-empty list of chat messages" in bad.error


def not_messages(messages):
    return "nope"


# --- validation -------------------------------------------------------------------------------------------------


def test_a_rewrite_cycle_without_a_model_turn_is_refused(compile_yaml):
    with pytest.raises(SpecError) as err:
        compile_yaml("""
            name: loops
            extends: {specs}/calculator.yaml
            context:
              rewrites: {w: {keep_last: 1}}
            states:
              PROCESSING_TOOLS:
                action: call_tools
                next: [{to: W}]
              W:
                action: w
                next: [{to: TERMINATED, when: max_assistant_turns}, {to: PROCESSING_TOOLS}]
        """)
    text = str(err.value)
    assert "rewrite-loop" in text and "PROCESSING_TOOLS, W" in text and "spec.yaml:" in text


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "{keep_last: 1, function: 'a:b'}",
            "exactly one of summary, keep_last, function; got ['keep_last', 'function']",
        ),
        ("{}", "exactly one of summary, keep_last, function; got none"),
    ],
)
def test_a_rewrite_is_exactly_one_thing(compile_yaml, body, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        compile_yaml(f"""
            name: r
            extends: {{specs}}/calculator.yaml
            context: {{rewrites: {{w: {body}}}}}
        """)


def test_context_guard_takes_tokens(compile_yaml):
    with pytest.raises(SpecError, match="context_tokens_over' takes a positive number of tokens"):
        compile_yaml("""
            name: g
            extends: {specs}/calculator.yaml
            states:
              PROCESSING_TOOLS:
                action: call_tools
                next: [{to: TERMINATED, when: {context_tokens_over: many}}, {to: GENERATING}]
        """)


def test_shipped_specs_validate():
    for name in ("calculator_compact", "qwen3_thinking"):
        agent = fsm.compile_spec(f"specs/{name}.yaml")
        assert agent.spec.context.policy == ("template" if name == "qwen3_thinking" else "append")


def test_transcript_record_lists_segments(tok):
    from fsm.output.rundir import trajectory_record
    from viz.transcript import render_transcript

    t = _segmented(1.0)
    record = trajectory_record(t, tok)
    assert [s["reason"] for s in record["segments"]] == ["prompt", "summary"]
    assert record["segments"][1]["turns"] == record["turns"] and record["segments"][0]["prompt_tokens"] == 3
    text = render_transcript(record, color=False)
    assert "=== segment 0 (prompt): prompt 3 tokens" in text and "=== segment 1 (summary), the last" in text
    assert "segments" not in trajectory_record(_traj(), tok)
