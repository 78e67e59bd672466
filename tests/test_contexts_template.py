"""The `template` context policy against real chat templates (tests/fixtures/family_tokenizers.py: the family's
own template on a small tokenizer; the full-size tokenizers under .tokenizers/ when present).

A simulated user answers each model turn. Qwen3 (thinking and not), GLM-4.5 and gpt-oss re-render history
differently once a user turn follows (earlier reasoning dropped, a past answer rewritten), so append mode's
row differs from a re-render (tests/test_families_e2e.py USER_TURN_DIFFERS). In template mode each model turn's
prompt is the template's render of the conversation: a new segment starts where the render does not extend the
tokens so far, every segment's prompt equals apply_chat_template of its conversation, and every sampled token is
kept as sampled.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_agent, scripted, user_row
from tests.fixtures.family_tokenizers import family_tokenizer
from tests.test_families_e2e import TURNS

CASES = {  # family -> chat_template_kwargs
    "qwen3": {},
    "qwen3-no-thinking": {"enable_thinking": False},
    "glm45": {},
    "gpt_oss": {},
}


def _script(tok, family: str, thinking: bool) -> list[list[int]]:
    out = []
    for guess in ("5", "7"):
        text = TURNS[family][1].replace("#### 5", f"#### {guess}")
        if not thinking:
            text = text.split("</think>\n\n", 1)[-1]
        ids = tok.encode(text, add_special_tokens=False)
        out.append(ids if text.endswith(("<|return|>", "<|user|>")) else [*ids, tok.eos_token_id])
    return out


@pytest.mark.parametrize("case", sorted(CASES))
async def test_template_mode_rows_equal_the_templates_render(case, compile_yaml):
    family = case.split("-")[0]
    kwargs = CASES[case]
    tok = family_tokenizer(family)
    agent = compile_yaml(f"""
        name: fam
        extends: {{specs}}/interaction_agent.yaml
        model: {{family: {family}, chat_template_kwargs: {kwargs or {}}}}
        context: {{policy: template}}
    """)
    script = _script(tok, family, thinking=kwargs.get("enable_thinking", True))
    row = user_row("Guess my number.", interaction_kwargs={"secret": 7})
    (t,) = await run_agent(agent, scripted(script), tok, [row])
    assert t.error is None and t.termination_reason == "interaction_done", (t.error, t.termination_reason)
    assert t.token_check is None, t.token_check  # every segment against a render of its own conversation
    assert t.num_segments == 2, [s.reason for s in t.segments]  # the user turn made the render differ
    sampled = [
        s.response_ids[r.start : r.end].tolist() for s in t.segments for r in s.runs if r.role == "assistant"
    ]
    assert sampled == script
    for seg in t.segments:
        want = tok.apply_chat_template(
            seg.messages[: seg.prompt_messages],
            tools=t.tool_schemas,
            add_generation_prompt=True,
            return_dict=False,
            **kwargs,
        )
        assert seg.prompt_ids.tolist() == want, seg.index
        assert all(
            m == 0 for r in seg.runs if r.role != "assistant" for m in seg.response_mask[r.start : r.end]
        )


async def test_append_mode_still_differs_where_the_template_rewrites(compile_yaml):
    """The same conversation in append mode is one segment whose re-render differs (why template mode exists)."""
    tok = family_tokenizer("qwen3")
    agent = compile_yaml("""
        name: fam
        extends: {specs}/interaction_agent.yaml
        model: {family: qwen3}
    """)
    (t,) = await run_agent(
        agent,
        scripted(_script(tok, "qwen3", True)),
        tok,
        [user_row("Guess my number.", interaction_kwargs={"secret": 7})],
    )
    assert t.num_segments == 1 and t.token_check is not None and "trajectory has '<think>" in t.token_check


FULL = Path(__file__).resolve().parent.parent / ".tokenizers"  # .ci/tokenizers.sh puts the real ones there
FULL_CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3-no-thinking": ("qwen3", {"enable_thinking": False}),
    "gpt_oss": ("gptoss", {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(FULL_CASES))
async def test_template_mode_with_full_size_tokenizers(case, compile_yaml):
    family = case.split("-")[0]
    folder, kwargs = FULL_CASES[case]
    if not (FULL / folder / "tokenizer.json").exists():
        pytest.skip(f"no full-size {folder} tokenizer under {FULL} (.ci/tokenizers.sh fetches them)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(FULL / folder)
    if not tok.chat_template:
        pytest.skip(f"the full-size {folder} tokenizer under {FULL} has no chat template")
    agent = compile_yaml(f"""
        name: fam
        extends: {{specs}}/interaction_agent.yaml
        model: {{family: {family}, chat_template_kwargs: {kwargs or {}}}}
        limits: {{prompt_length: 4096, response_length: 1024}}
        context: {{policy: template}}
    """)
    script = _script(tok, family, thinking=kwargs.get("enable_thinking", True))
    (t,) = await run_agent(
        agent, scripted(script), tok, [user_row("Guess my number.", interaction_kwargs={"secret": 7})]
    )
    assert t.error is None and t.token_check is None, (t.error, t.token_check)
    assert t.num_segments == 2
    assert [
        s.response_ids[r.start : r.end].tolist() for s in t.segments for r in s.runs if r.role == "assistant"
    ] == script
    for seg in t.segments:
        assert seg.prompt_ids.tolist() == tok.apply_chat_template(
            seg.messages[: seg.prompt_messages], add_generation_prompt=True, return_dict=False, **kwargs
        )


@pytest.mark.slow
def test_bench_row_template_against_append():
    """`agentfsm bench engine --workload contexts`: CPU per model turn of `template` against `append` on the same
    calculator conversation (the bench asserts both give the same rows on the append-only tiny template)."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsm.cli",
            "bench",
            "engine",
            "--workload",
            "contexts",
            "--n",
            "20",
            "--tool-turns",
            "2",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=repo,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (
        out["workload"] == "contexts" and out["trajectories"] == 20 and out["model_turns_per_trajectory"] == 3
    )
    assert out["append"]["us_per_model_turn"] > 0 and out["template"]["us_per_model_turn"] > 0
    assert out["ratio_template_to_append"] == round(
        out["template"]["median_cpu_s"] / out["append"]["median_cpu_s"], 3
    )
