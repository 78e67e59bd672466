"""Property tests: whatever the model says, whatever the tools answer and whatever the limits, the token
bookkeeping and the padded batch keep verl's invariants.

Scripts are random multi-turn conversations (plain answers, tool calls, unknown tools, malformed calls,
turns cut without eos); the expected response layout is rebuilt from the script and the requests the
engine sent, never from the engine's own segment bookkeeping.
"""

from __future__ import annotations

import asyncio
import functools
import json

import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import fsm
from fsm.run.trajectory import Trajectory
from fsm.spec.model import LimitsSpec, RewardSpec, ToolSpec
from tests.conftest import PARTS, SPECS, scripted

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
P = 1024  # prompts (with the tool schemas in the system turn) are ~250 tokens

WORDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABC0123456789 .,!?-'", min_size=0, max_size=24)


@functools.cache
def agent_for(limits: tuple) -> fsm.CompiledAgent:
    """tool_agent with the echo/add tools, a reward, and the given limits (compiled once per limits)."""
    base = fsm.load_spec(SPECS / "tool_agent.yaml").spec
    spec = base.model_copy(
        update={
            "limits": LimitsSpec(**dict(limits)),
            "tools": [ToolSpec(function=f"{PARTS}:echo"), ToolSpec(function=f"{PARTS}:add")],
            "reward": RewardSpec(function=f"{PARTS}:reward_len"),
        }
    )
    return fsm.compile_spec(spec)


@st.composite
def limits(draw) -> tuple:
    r = draw(st.integers(16, 400))
    return tuple(
        sorted(
            {
                "prompt_length": P,
                "response_length": r,
                "max_new_tokens": draw(st.none() | st.integers(1, r)),
                "max_assistant_turns": draw(st.none() | st.integers(1, 5)),
                "max_user_turns": draw(st.none() | st.integers(1, 4)),
                "max_parallel_calls": draw(st.integers(1, 3)),
                "extra_calls": draw(st.sampled_from(["error", "drop"])),
                "max_tool_response_length": draw(st.integers(4, 60)),
                "tool_response_truncate_side": draw(st.sampled_from(["left", "right", "middle"])),
            }.items()
        )
    )


CALL = st.one_of(
    st.builds(lambda t: json.dumps({"name": "echo", "arguments": {"text": t}}), WORDS),
    st.builds(
        lambda a, b: json.dumps({"name": "add", "arguments": {"a": a, "b": b}}),
        st.integers(-99, 999),
        st.integers(0, 9),
    ),
    st.builds(lambda t: json.dumps({"name": "search", "arguments": {"q": t}}), WORDS),  # unknown tool
    st.just('{"name": "echo", "arguments": {"text": '),  # malformed JSON
    st.just('{"name": "add", "arguments": {"a": "one"}}'),  # wrong arguments
)


@st.composite
def model_turn(draw) -> tuple[str, bool]:
    """(text, ends with eos). Texts never contain '<', so only the calls drawn here are tool calls."""
    text = draw(WORDS)
    calls = draw(st.lists(CALL, max_size=3))
    if calls:  # text before calls without edge whitespace: a chat server strips it (the test below)
        text = "\n".join([text.strip()] + [f"<tool_call>\n{c}\n</tool_call>" for c in calls]).strip("\n")
    return text, draw(st.booleans()) or not calls  # a cut turn only ever ends a tool call turn here


conversations = st.lists(model_turn(), min_size=1, max_size=6)


def logprob(turn: int, i: int) -> float:
    return -0.01 * (turn + 1) - 0.001 * i  # never 0.0, so a 0.0 on a mask-1 token would show


def run(tok, agent, rows, scripts, n):
    """Run rows (n samples each); scripts[row] is a list of (text, eos). Past its end a row answers 'bye'."""
    encoded = {
        row: [tok.encode(t, add_special_tokens=False) + ([tok.eos_token_id] if e else []) for t, e in s]
        for row, s in scripts.items()
    }
    bye = tok.encode("bye", add_special_tokens=False) + [tok.eos_token_id]

    def turn_fn(row, sample, turn, prompt_ids):
        return encoded[row][turn] if turn < len(encoded[row]) else bye

    backend = scripted(turn_fn, logprob=logprob)
    runner = fsm.Runner(agent, backend, tok, check_tokens=True)
    trajs = asyncio.run(runner.run(rows, n=n))
    return trajs, backend, encoded, bye


def expected_layout(traj, requests, script, bye, eos, stops):
    """Rebuild (mask, logprobs) of a trajectory from its script and the requests sent for it."""
    prompt = traj.prompt_ids.tolist()
    response = traj.response_ids.tolist()
    mask, lps = [], []
    for k, request in enumerate(requests):
        start = len(request.prompt_ids) - len(prompt)
        assert request.prompt_ids[: len(prompt)] == prompt  # the prompt is never re-encoded
        assert request.prompt_ids[len(prompt) :] == response[:start]  # each request is the context so far
        assert start >= len(mask)
        mask += [0] * (start - len(mask))  # observation / template tokens since the last turn
        lps += [0.0] * (start - len(lps))
        ids = list(script[k]) if k < len(script) else list(bye)
        cut = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
        ids = ids[: min(cut, request.sampling_params["max_new_tokens"])]
        assert response[start : start + len(ids)] == ids  # generated ids appear verbatim
        mask += [1] * len(ids)
        lps += [logprob(k, i) for i in range(len(ids))]
    assert len(mask) == len(response)  # the trajectory always ends on a model turn
    return mask, lps


# derandomized: a fixed draw of 50, the same in every CI run
@settings(SETTINGS, derandomize=True)
@given(
    lim=limits(), scripts=st.lists(conversations, min_size=1, max_size=2), n=st.integers(1, 2), question=WORDS
)
def test_trajectory_token_invariants(tok, lim, scripts, n, question):
    agent = agent_for(lim)
    R = agent.limits.response_length
    rows = [
        {
            "raw_prompt": [{"role": "user", "content": f"{question} {i}"}],
            "reward_model": {"ground_truth": "bye"},
        }
        for i in range(len(scripts))
    ]
    trajs, backend, encoded, bye = run(tok, agent, rows, dict(enumerate(scripts)), n)
    assert len(trajs) == len(rows) * n
    stops = {tok.eos_token_id}
    for traj in trajs:
        assert not traj.failed, traj.termination_reason
        assert traj.token_check is None, traj.token_check  # the ids equal a full re-render of the messages
        assert traj.termination_reason in {"done", "response_length", "max_assistant_turns", "max_user_turns"}
        row = traj.index // n
        ids, mask, lps = (
            traj.response_ids.tolist(),
            traj.response_mask.tolist(),
            traj.response_logprobs.tolist(),
        )
        assert len(ids) == len(mask) == len(lps) <= R
        requests = [r for r in backend.requests if r.session_id == traj.session_id]
        assert len(requests) == traj.assistant_turns
        want_mask, want_lps = expected_layout(traj, requests, encoded[row], bye, tok.eos_token_id, stops)
        assert mask == want_mask
        np.testing.assert_allclose(lps, want_lps, rtol=0, atol=1e-6)  # float32 storage
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if m == 0)
        # budgets: every request asked for at most what was left, and at most max_new_tokens
        for r in requests:
            left = R - (len(r.prompt_ids) - len(traj.prompt_ids))
            cap = agent.limits.max_new_tokens
            assert r.sampling_params["max_new_tokens"] == (left if cap is None else min(left, cap))
        # the prompt is the chat template's rendering of raw_prompt with the tool schemas
        want_prompt = tok.apply_chat_template(
            rows[row]["raw_prompt"],
            tools=agent.tools.schemas,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert traj.prompt_ids.tolist() == want_prompt
        event(f"reason={traj.termination_reason}")
        event(f"tool_errors>0={traj.metrics.tool_errors > 0}")
        event(f"dropped={traj.metrics.dropped_calls > 0}")
        event(f"overflow={traj.observation_overflow}")
        assert traj.num_turns == traj.user_turns + traj.assistant_turns + 1
        if traj.termination_reason == "done":
            assert not traj.pending_calls and len(ids) < R
    check_batch(trajs, R, pad=tok.pad_token_id)


def check_batch(trajs, R, pad):
    b = fsm.collate(trajs, prompt_length=P, response_length=R, pad_token_id=pad)
    t = b.batch
    B = len(trajs)
    shapes = {
        "prompts": (B, P),
        "responses": (B, R),
        "response_mask": (B, R),
        "input_ids": (B, P + R),
        "attention_mask": (B, P + R),
        "position_ids": (B, P + R),
        "rollout_log_probs": (B, R),
        "rm_scores": (B, R),
    }
    for key, shape in shapes.items():
        assert tuple(t[key].shape) == shape, key
        assert t[key].dtype == (
            torch.float32 if key in ("rollout_log_probs", "rm_scores") else torch.int64
        ), key
    att = t["attention_mask"]
    assert torch.equal(t["input_ids"], torch.cat([t["prompts"], t["responses"]], dim=1))
    assert torch.equal(t["position_ids"], torch.clamp(torch.cumsum(att, dim=1) - 1, min=0))
    for i, traj in enumerate(trajs):
        p, r = traj.prompt_ids.tolist()[-P:], traj.response_ids.tolist()[:R]
        mask, lps = traj.response_mask.tolist()[:R], traj.response_logprobs.tolist()[:R]
        # unpadding round-trips
        assert att[i, :P].tolist() == [0] * (P - len(p)) + [1] * len(p)
        assert att[i, P:].tolist() == [1] * len(r) + [0] * (R - len(r))
        assert t["prompts"][i, P - len(p) :].tolist() == p and set(
            t["prompts"][i, : P - len(p)].tolist()
        ) <= {pad}
        assert t["responses"][i, : len(r)].tolist() == r and set(t["responses"][i, len(r) :].tolist()) <= {
            pad
        }
        assert t["response_mask"][i].tolist() == mask + [0] * (R - len(r))
        np.testing.assert_allclose(
            t["rollout_log_probs"][i].numpy(), np.array(lps + [0.0] * (R - len(r)), dtype=np.float32)
        )
        # response_mask == mask * response attention
        assert torch.equal(t["response_mask"][i], t["response_mask"][i] * att[i, P:])
        # rm_scores: the score on the last valid response token only; an empty response's at column R-1 (verl)
        rm = t["rm_scores"][i]
        at = len(r) - 1 if r else R - 1
        assert rm[at].item() == np.float32(traj.reward_score)
        assert torch.count_nonzero(torch.cat([rm[:at], rm[at + 1 :]])) == 0
    assert b.non_tensor_batch["__num_turns__"].dtype == np.int32
    assert list(b.non_tensor_batch["__num_turns__"]) == [traj.num_turns for traj in trajs]
    assert len(b.meta_info["metrics"]) == B


# --- collate alone, on arbitrary trajectories (empty, over-long, no scores) --------------------------------

seqs = st.lists(st.integers(1, 515), max_size=40)


@st.composite
def raw_trajectory(draw) -> Trajectory:
    traj = Trajectory(0, 0, "s", "u", {"raw_prompt": []}, "PENDING")
    traj.prompt_ids.extend(draw(seqs))
    for _ in range(draw(st.integers(0, 4))):
        ids = draw(seqs)
        if draw(st.booleans()):
            traj.append_generated(ids, [-(i + 1) / 7 for i in range(len(ids))], draw(st.integers(-1, 3)))
        else:
            traj.append_context(ids, "tool")
    traj.reward_score = draw(st.none() | st.floats(-2, 2, width=32))
    return traj


@SETTINGS
@given(trajs=st.lists(raw_trajectory(), min_size=1, max_size=6), p=st.integers(1, 48), r=st.integers(1, 64))
def test_collate_pads_any_trajectories(trajs, p, r):
    b = fsm.collate(trajs, prompt_length=p, response_length=r, pad_token_id=0)
    t = b.batch
    att = t["attention_mask"]
    assert torch.equal(t["input_ids"], torch.cat([t["prompts"], t["responses"]], dim=1))
    assert torch.equal(t["position_ids"], torch.clamp(torch.cumsum(att, dim=1) - 1, min=0))
    for i, traj in enumerate(trajs):
        prompt, resp = traj.prompt_ids.tolist()[-p:], traj.response_ids.tolist()[:r]
        assert t["prompts"][i, p - len(prompt) :].tolist() == prompt  # long prompts keep their tail (verl)
        assert t["responses"][i, : len(resp)].tolist() == resp  # long responses keep their head
        assert int(att[i].sum()) == len(prompt) + len(resp)
        assert t["response_mask"][i].tolist() == traj.response_mask.tolist()[:r] + [0] * (r - len(resp))
        versions = [v if m else -1 for v, m in zip(traj.response_versions.tolist()[:r], traj.response_mask)]
        assert t["weight_versions"][i].tolist() == versions + [-1] * (r - len(resp))
        lps = np.array(traj.response_logprobs.tolist()[:r] + [0.0] * (r - len(resp)), dtype=np.float32)
        np.testing.assert_array_equal(t["rollout_log_probs"][i].numpy(), lps)
    has_scores = all(traj.reward_score is not None for traj in trajs)
    assert ("rm_scores" in t.keys()) == has_scores
    if has_scores:
        for i, traj in enumerate(trajs):
            n = min(len(traj.response_ids), r)
            expect = np.zeros(r, dtype=np.float32)
            expect[n - 1] = np.float32(traj.reward_score)  # n == 0: column r-1, as verl's index -1
            np.testing.assert_array_equal(t["rm_scores"][i].numpy(), expect)


# --- observation suffixes: tokenized alone, exactly as in a full render -----------------------------------

TEXTS = st.text(max_size=40) | st.sampled_from(
    ["", "\n", "\n\n", " x", "<|im_start|>", "<|im_end|>\nx", "🎉 ünï"]
)


@SETTINGS
@given(turns=st.lists(st.tuples(st.sampled_from(["tool", "user"]), TEXTS), min_size=1, max_size=3))
def test_observation_suffix_equals_the_full_render(tok, turns):
    """encode_observation tokenizes only the suffix's text; its ids must be the full render's, cut. With
    special tokens allowed in observations that holds for any content; by default (special-token strings are
    text) it holds for content without them, and content with them adds no control token of its own."""
    from fsm.families import codec_for
    from fsm.families.codec import _BASE

    codec = codec_for(tok, "qwen2.5", special_tokens="allow")
    messages = [{"role": role, "content": text} for role, text in turns]
    full = codec.render(_BASE + messages, add_generation_prompt=True)
    assert codec._added_tokens and codec.encode_observation(messages) == full[len(codec._base_ids) :]
    safe = codec_for(tok, "qwen2.5").encode_observation(messages)
    specials = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    if not any(
        t.content in text for _, text in turns for t in tok.added_tokens_decoder.values() if t.special
    ):
        assert safe == full[len(codec._base_ids) :]
    harmless = codec.encode_observation([{"role": role, "content": "x"} for role, _ in turns])
    assert sum(i in specials for i in safe) == sum(i in specials for i in harmless)


def test_bench_collate_runs():
    from bench.collate import bench_collate

    out = bench_collate(n=6, prompt=16, response=40, repeats=1)
    assert out["collate_ms"] >= 0 and out["ratio_to_memcpy"] > 0 and out["ratio_to_memcpy_touched"] > 0


# --- the compact per-trajectory records read back exactly as the per-token lists they replace -------------

turn = st.tuples(
    st.booleans(),
    st.lists(st.integers(0, 1000), max_size=12),
    st.one_of(st.integers(-1, 3), st.lists(st.integers(-1, 3), min_size=12, max_size=12)),
    st.sampled_from(["tool", "user", "template", "judge"]),
)


@SETTINGS
@given(turns=st.lists(turn, max_size=8), fail_at=st.none() | st.integers(0, 8))
def test_segments_and_version_runs_read_back_per_token(turns, fail_at):
    """Token runs (one int array) and weight versions (runs) give what lists of records and of per-token
    versions would: the same runs, versions, masks and logprobs, through fail() and a snapshot."""
    from fsm.run.codec import decode_trajectory, encode_trajectory
    from fsm.run.trajectory import TokenRun

    traj = Trajectory(0, 0, "s", "u", {"raw_prompt": []}, "PENDING")
    runs, versions, mask = [], [], []
    for k, (generated, ids, version, role) in enumerate(turns):
        if k == fail_at:
            traj.fail("boom")
            runs, versions, mask = [], [], []
        start = len(versions)
        if generated:
            per_token = version if isinstance(version, int) else version[: len(ids)]
            traj.append_generated(ids, [0.5] * len(ids), per_token)
            versions += [per_token] * len(ids) if isinstance(per_token, int) else per_token
            mask += [1] * len(ids)
            runs.append(TokenRun("assistant", start, len(versions)))
        elif ids:
            traj.append_context(ids, role)
            versions += [-1] * len(ids)
            mask += [0] * len(ids)
            runs.append(TokenRun(role, start, len(versions)))
    for t in (traj, decode_trajectory(json.loads(json.dumps(encode_trajectory(traj))))):
        assert t.response_versions.tolist() == versions and t.response_mask.tolist() == mask
        assert list(t.runs) == runs and t.runs == runs and len(t.runs) == len(runs)
        assert list(reversed(t.runs)) == runs[::-1] and t.runs[1:] == runs[1:]
        assert t.runs.last("assistant") == next((s for s in reversed(runs) if s.role == "assistant"), None)
        model = sum(s.end - s.start for s in runs if s.role == "assistant")
        assert t.runs.tokens_since(0) == (model, len(versions) - model)
        own = [v for v, m in zip(versions, mask) if m and v >= 0]
        assert t.weight_versions() == ((min(own), max(own)) if own else None)


def test_whitespace_before_a_tool_call_is_a_difference_the_token_check_names(tok):
    """The model writes ' \\n' before its call. A chat server parses that turn into content and calls (SGLang
    strips the content to '', vLLM keeps ' \\n'), and the template renders either back without the ' ': the
    next turn's context as a server builds it differs from the tokens the model saw. The row keeps the model's
    tokens; the check names the difference (the property above draws only text a server renders back)."""
    lim = (
        ("extra_calls", "error"),
        ("max_assistant_turns", None),
        ("max_new_tokens", None),
        ("max_parallel_calls", 1),
        ("max_tool_response_length", 4),
        ("max_user_turns", None),
        ("prompt_length", 1024),
        ("response_length", 37),
        ("tool_response_truncate_side", "left"),
    )
    script = [(' \n<tool_call>\n{"name": "echo", "arguments": {"text": ""}}\n</tool_call>', False)]
    rows = [{"raw_prompt": [{"role": "user", "content": " 0"}], "reward_model": {"ground_truth": "bye"}}]
    trajs, *_ = run(tok, agent_for(lim), rows, {0: script}, 1)
    assert trajs[0].token_check is not None
    assert "trajectory has ' \\n<tool_call>" in trajs[0].token_check, trajs[0].token_check
