"""What a user reads when a data file or a row is wrong (issues 26.13, 27.20): a broken JSON line is refused
with its whole located message (the file is refused, every problem listed: docs/errors.md says why), and a
row whose messages cannot be rendered is an error row naming its number and the field, the others run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from backends.scripted import echo_backend
from fsm import DataError, RolloutEngine, load_rows
from tests.conftest import REPO, user_row

ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "PYTHONPATH": str(REPO)}


def test_a_raw_control_character_is_named_in_full_by_the_cli(tmp_path):
    data = tmp_path / "rows.jsonl"
    good = json.dumps({"raw_prompt": [{"role": "user", "content": "hi"}]})
    data.write_text(good + '\n{"raw_prompt": [{"role": "user", "content": "a\tb"}]}\n{"a": "x\\q"}\n')
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsm.cli",
            "run",
            str(REPO / "specs" / "calculator.yaml"),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "out"),
            "-q",
        ],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"agentfsm: {data}:2:47: invalid JSON: a raw control character U+0009 inside a string; JSON needs it "
        'escaped ("\\t")',
        f"agentfsm: {data}:3:9: invalid JSON: Invalid \\escape",
    ], proc.stderr
    assert not (tmp_path / "out").exists()  # refused before any rollout


def test_a_message_ending_in_at_is_never_cut(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": "open\n')
    with pytest.raises(DataError) as err:
        load_rows(path)
    assert err.value.problems == [f"{path}:1:7: invalid JSON: Unterminated string starting here"]


@pytest.mark.parametrize(
    "prompt, words",
    [
        (
            [{"role": "user", "content": 5}],
            "'raw_prompt[0].content' must be text or a list of content parts, got int 5",
        ),
        (
            [{"role": "system", "content": "s"}, {"role": "user", "content": {"text": "hi"}}],
            "'raw_prompt[1].content' must be text or a list of content parts, got dict {'text': 'hi'}",
        ),
        ([{"content": "hi"}], "'raw_prompt[0].role' must be a string, got NoneType None"),
        (["hi"], "'raw_prompt[0]' must be a chat message (a mapping with role and content), got str 'hi'"),
        ([], "'raw_prompt' must be a non-empty list of chat messages, got list []"),
    ],
)
def test_a_row_with_bad_message_content_names_its_number_and_the_field(tok, prompt, words):
    rows = [user_row("What is 1 + 1?"), {"raw_prompt": prompt}, user_row("What is 2 + 2?")]
    with RolloutEngine("calculator", tok, backend=echo_backend()) as engine:
        out = engine.generate_sequences(rows)
    reasons = list(out.non_tensor_batch["termination_reason"])
    assert reasons[1] == f"error: bad row 1: {words}", reasons[1]
    assert all(r == "done" or "ground_truth" in r for r in (reasons[0], reasons[2])), reasons


def test_content_parts_the_template_cannot_render_name_the_row_and_the_message(tok):
    rows = [
        user_row("What is 1 + 1?", uid="r0"),
        {"uid": "r1", "raw_prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    ]
    with RolloutEngine("calculator", tok, backend=echo_backend()) as engine:
        out = engine.generate_sequences(rows)
    reason = out.non_tensor_batch["termination_reason"][1]
    assert reason.startswith(
        "error: bad row r1: the chat template cannot render 'raw_prompt': TypeError: "
    ), reason
    assert reason.endswith("; 'raw_prompt[0].content' is a list, not text"), reason


def test_a_row_without_a_prompt_names_itself(tok):
    with RolloutEngine("calculator", tok, backend=echo_backend()) as engine:
        out = engine.generate_sequences([{"uid": "q7", "question": "no prompt"}])
    assert out.non_tensor_batch["termination_reason"][0] == (
        "error: bad row q7: 'raw_prompt' must be a non-empty list of chat messages, got nothing"
    )
