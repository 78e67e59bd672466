"""bench/fleet.py's traffic, without servers: the shapes, a recorded trace, prompts of exact token counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from backends.tiny import ASSET_DIR
from bench.fleet import Call, Words, load_trace, shape


def test_shapes_are_sessions_of_growing_prompts():
    for name in ("calculator", "long", "groups", "crowded"):
        calls = shape(name)
        by_session: dict[str, list[Call]] = {}
        for c in calls:
            by_session.setdefault(c.session, []).append(c)
        for turns in by_session.values():
            assert [c.turn for c in turns] == list(range(len(turns)))
            assert all(b.prompt_tokens > a.prompt_tokens for a, b in zip(turns, turns[1:]))
    groups = shape("groups")
    assert len({c.group for c in groups}) == 8 and len({c.session for c in groups}) == 64
    assert max(c.prompt_tokens for c in shape("long")) > 5 * 128  # several of vLLM's CPU KV blocks
    assert len({c.session for c in shape("crowded")}) > 2 * 128  # more than two servers run at once
    assert [c.session for c in shape("skewed", ["k1", "k2"]) if c.turn == 0] == ["k1", "k2"]
    with pytest.raises(ValueError, match="no shape 'nope'"):
        shape("nope")


def test_a_recorded_trace_is_read_and_a_bad_line_named(tmp_path):
    calls = shape("calculator")[:3]
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(
                {
                    f: getattr(c, f)
                    for f in ("session", "group", "turn", "prompt_tokens", "new_tokens", "tool_s")
                }
            )
            for c in calls
        )
        + '\n{"session": "x"}\n'
    )
    with pytest.raises(ValueError, match=r"trace.jsonl:4: not a call record"):
        load_trace(path)
    path.write_text("\n".join(path.read_text().splitlines()[:3]))
    assert load_trace(path) == calls


def test_prompts_have_the_recorded_token_counts_and_a_group_shares_its_prompt():
    words = Words(ASSET_DIR)
    tok = Tokenizer.from_file(str(ASSET_DIR / "tokenizer.json"))
    calls = shape("groups")
    a = [c for c in calls if c.session == "g0s0"]
    b = [c for c in calls if c.session == "g0s1"]
    for turns in (a, b):
        for k, c in enumerate(turns):
            assert len(tok.encode(words.prompt(turns, k)).ids) == c.prompt_tokens
    shared = a[0].prompt_tokens
    assert words.prompt(a, 0) == words.prompt(b, 0)  # the group's prompt
    if len(a) > 1:
        assert words.prompt(a, 1).split()[:shared] == words.prompt(a, 0).split()  # a turn extends the last


def test_an_unknown_router_name_is_refused_with_the_names_there_are():
    from bench.fleet import bench_fleet

    with pytest.raises(ValueError, match="no router 'sglang cache_aware'; the routers: agentfsm, agentfsm"):
        bench_fleet(routers=["agentfsm", "sglang cache_aware"])


def test_each_repeat_draws_the_turn_counts_anew_for_every_router_alike():
    first, again, other = shape("calculator"), shape("calculator", draw=0), shape("calculator", draw=1)
    assert first == again  # one draw is the same traffic for every router of a repeat
    assert [c.session for c in first if c.turn == 0] == [c.session for c in other if c.turn == 0]
    assert first != other  # the same sessions, other turn counts: a fixed placement meets another split


@pytest.mark.parametrize(
    "flags, says",
    [
        ([], "build it with `bash .ci/routers_env.sh`"),
        (["--router", "sglang cache_aware"], "no router 'sglang cache_aware'; the routers: agentfsm"),
    ],
)
def test_bench_fleet_that_cannot_start_says_why_in_one_line(tmp_path, flags, says):
    """The real command without the routers' virtualenv (issue 46 §4: a traceback): one line, before any server
    starts."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "AGENTFSM_ROUTERS_VENV": str(tmp_path / "no-venv")}
    done = subprocess.run(
        [sys.executable, "-m", "fsm.cli.commands", "bench", "fleet", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and says in lines[0], done.stderr
    assert lines[0].startswith("agentfsm: bench fleet: ") and not done.stdout
