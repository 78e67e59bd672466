"""Observation rendering per family (fsm/families/codec.py): the suffix a tool round or a user turn appends,
checked against a full re-render of the conversation through the family's real template. Where the template
is append-only the two are equal; where it is not, the difference is exactly the documented one (README,
"Model families"), and the sampled tokens are kept."""

from __future__ import annotations

import pytest

import fsm
from fsm.families import FAMILIES as REGISTRY
from fsm.families import Family, codec_for, make_parser, register_family
from fsm.families.parsers import ToolCall, register_parser
from tests.conftest import run_agent, scripted, user_row
from tests.fixtures.family_tokenizers import FAMILIES, family_tokenizer
from tests.test_families_e2e import TURNS

STOPS = ("<|call|>", "<|return|>", "<|observation|>", "<|user|>")
# A final answer per family (the second element of TURNS), then a new user question, then another answer.
SECOND = {f: t[1].replace("#### 5", "#### 7") for f, t in TURNS.items()}
# Where a user turn makes the template rewrite earlier turns: what the trajectory has at the first difference.
USER_TURN_DIFFERS = {
    "qwen3": "<think>",  # reasoning of turns before the last user turn is dropped
    "glm45": "Done.</think>",  # likewise: `<think></think>` instead
    "gpt_oss": "<|return|>",  # a past final answer is re-rendered with <|end|>
}


def simulate(family: str, model_turns: list[str], observations: list[list[dict]], **template_kwargs):
    """Prompt, then model turn / observation alternately, as the engine appends them: (ids, messages, codec)."""
    tok = family_tokenizer(family)
    codec = codec_for(tok, family, template_kwargs)
    parser = make_parser(None, codec)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = codec.encode_prompt(messages, None)
    for k, text in enumerate(model_turns):
        gen = tok.encode(text, add_special_tokens=False)
        if not text.endswith(STOPS):
            gen.append(tok.eos_token_id)
        ids += gen
        turn = codec.turn_text(gen)
        messages.append(codec.assistant_message(turn, parser.parse(turn)))
        if k < len(observations):
            closer, obs = codec.observation(observations[k], gen[-1:], messages)
            ids += closer + obs
            messages += observations[k]
    return ids, messages, codec


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_user_turn(family):
    user = [{"role": "user", "content": "And 3 + 4?"}]
    ids, messages, codec = simulate(family, [TURNS[family][1], SECOND[family]], [user])
    problem = codec.check(messages, None, ids, False)
    if family in USER_TURN_DIFFERS:
        assert problem is not None and f"trajectory has '{USER_TURN_DIFFERS[family]}" in problem, problem
    else:
        assert problem is None, problem
    # whatever the template does to earlier turns, the user turn itself is rendered as the template renders it
    tok = family_tokenizer(family)
    text = tok.decode(ids, skip_special_tokens=False)
    assert "And 3 + 4?" in text and text.count("And 3 + 4?") == 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_tool_rounds(family):
    """Two tool rounds then an answer: append-only within a tool cycle for every family but Harmony."""
    tool = [{"role": "tool", "content": "5", "tool_call_id": "functions.calculator:0"}]
    call = TURNS[family][0]
    ids, messages, codec = simulate(family, [call, call, TURNS[family][1]], [tool, tool])
    problem = codec.check(messages, None, ids, False)
    assert (problem is None) == (family != "gpt_oss"), problem


def test_template_kwargs_reach_every_render():
    """model.chat_template_kwargs: Qwen3 without thinking gets the empty block in its prompt; DeepSeek-V3.1 in
    thinking mode opens <think> in the prompt, and its re-render drops the reasoning (not append-only)."""
    codec = codec_for(family_tokenizer("qwen3"), "qwen3", {"enable_thinking": False})
    prompt = codec.decode(
        codec.encode_prompt([{"role": "user", "content": "Hi"}], None), skip_special_tokens=False
    )
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    user = [{"role": "user", "content": "And 3 + 4?"}]
    ids, messages, codec = simulate(
        "deepseek_v3", ["I add.</think>It is 5.", "Seven."], [user], thinking=True
    )
    text = codec.decode(ids, skip_special_tokens=False)
    assert (
        "<｜Assistant｜><think>I add.</think>It is 5.<｜end▁of▁sentence｜><｜User｜>And 3 + 4?<｜Assistant｜><think>"
        in text
    )
    problem = codec.check(messages, None, ids, False)
    assert problem is not None and "trajectory has '<think>I add." in problem, problem


def test_glm_observation_token_is_not_doubled():
    """GLM ends a calling turn with <|observation|>, the first token of the tool turn: it is there once."""
    tool = [{"role": "tool", "content": "5"}]
    ids, _, _ = simulate("glm45", [TURNS["glm45"][0], TURNS["glm45"][1]], [tool])
    tok = family_tokenizer("glm45")
    assert ids.count(tok.convert_tokens_to_ids("<|observation|>")) == 1


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"qwen2.5"}))
def test_a_cut_turn_owes_the_end_token(family):
    """A turn the budget cut before its end token gets the family's end token (mask 0) before an observation."""
    codec = codec_for(family_tokenizer(family), family)
    closer = codec.closer_for([10, 11])
    assert closer == codec._encode(codec.family.cut_closer)
    stop = sorted(codec.stop_ids)[0]
    assert codec.closer_for([10, stop]) == []


MALFORMED = {
    "qwen2.5": '<tool_call>\n{"name": "calculator", "arguments": {"expression": }}\n</tool_call>',
    "qwen3": '<think>\nx\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": }}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=calculator",
    "gpt_oss": '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": }<|call|>',
    "glm45": "<tool_call>\n</tool_call><|observation|>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0<|tool_call_argument_begin|>"
    '{"expression": }<|tool_call_end|><|tool_calls_section_end|>',
    "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>{"expression": }<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>",
    "llama3_1": '{"name": "calculator", "parameters": {"expression": }}',
    "seed_oss": "<seed:tool_call>\n<function=calculator",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_malformed_call_is_answered(family, compile_yaml):
    """As with Hermes: a malformed call is answered with an error observation and the model goes on."""
    tok = family_tokenizer(family)
    agent = compile_yaml(f"""
        name: fam
        extends: {{specs}}/family_calculator.yaml
        model: {{family: {family}}}
    """)
    turns = []
    for text in (MALFORMED[family], TURNS[family][1]):
        ids = tok.encode(text, add_special_tokens=False)
        turns.append(ids if text.endswith(STOPS) else [*ids, tok.eos_token_id])
    (traj,) = await run_agent(
        agent, scripted(turns), tok, [user_row("2 + 3?", reward_model={"ground_truth": "5"})]
    )
    assert traj.error is None and traj.assistant_turns == 2 and traj.metrics.tool_errors == 1
    (answer,) = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert answer.startswith("Error"), answer


@register_parser("tests_bracket")
class BracketParser:
    """A made-up format, `[[name {json}]]`, registered the way a user registers one."""

    def __init__(self, tokenizer=None):
        self.stop_token_ids = []

    def parse(self, text):
        import json
        import re

        return [
            ToolCall(m.group(1), json.loads(m.group(2)), m.group(0))
            for m in re.finditer(r"\[\[(\w+) (\{.*?\})\]\]", text)
        ]


async def test_register_a_family(compile_yaml):
    """A family added with register_family (its parser with register_parser) runs without engine changes."""
    family = Family(
        "tests_bracket_chatml", "tests_bracket", detect=(), turn_end=("<|im_end|>",), cut_closer="<|im_end|>"
    )
    register_family(family)
    try:
        tok = family_tokenizer("qwen2.5")
        agent = compile_yaml("""
            name: fam
            extends: {specs}/family_calculator.yaml
            model: {family: tests_bracket_chatml}
        """)
        call = tok.encode('[[calculator {"expression": "2 + 3"}]]') + [tok.eos_token_id]
        answer = tok.encode("It is #### 5.") + [tok.eos_token_id]
        runner = fsm.Runner(agent, scripted([call, answer]), tok, check_tokens=True)
        assert runner.codec.family is family
        (traj,) = await runner.run([user_row("2 + 3?", reward_model={"ground_truth": "5"})])
        assert traj.error is None and traj.reward_score == 1.0
        assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["5"]
        # the check renders the structured conversation: this template writes the parsed call as Hermes does,
        # not as the model wrote it, and a chat server would show the model that; the check says so
        assert traj.token_check is not None and "trajectory has '[[calculator" in traj.token_check, (
            traj.token_check
        )
        assert "a re-render has '<tool_call>" in traj.token_check
    finally:
        del REGISTRY[family.name]


def test_unknown_family_is_a_spec_error(compile_yaml):
    with pytest.raises(fsm.SpecError, match="unknown model family 'qwen9'"):
        compile_yaml("""
            name: fam
            extends: {specs}/family_calculator.yaml
            model: {family: qwen9}
        """)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"qwen2.5"}))
def test_kept_prefix_gives_the_suffix_a_fresh_codec_gives(family):
    """Observations of one shape reuse the text before the suffix; each still gets its own content."""
    tok = family_tokenizer(family)
    history = [{"role": "user", "content": "2 + 3?"}]
    warm = codec_for(tok, family)
    text = warm.turn_text(tok.encode(TURNS[family][0], add_special_tokens=False))
    history.append(warm.assistant_message(text, make_parser(None, warm).parse(text)))
    for content in ("5", "a much longer answer\nover two lines", "<tool_response>"):
        tool = [{"role": "tool", "content": content, "tool_call_id": "functions.calculator:0"}]
        assert warm.encode_observation(tool, history) == codec_for(tok, family).encode_observation(
            tool, history
        )
    user = [{"role": "user", "content": "thanks"}]
    assert warm.encode_observation(user, history) == codec_for(tok, family).encode_observation(user, history)
