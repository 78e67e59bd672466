"""--check-tokens on gpt-oss (Harmony) with the real tokenizer and the published template: the template drops
the analysis of a call turn once a final answer follows it, but when the final was generated the call was the
last turn and its analysis was in the prompt. A row built turn by turn is exact as each generation saw it."""

from __future__ import annotations

from tests.conftest import run_agent, scripted, user_row
from tests.test_real_tokenizers import ANSWER, ARGS, ARGS_JSON, TEXT, Case, _calls, model_ids, spec

# the model writes the recipient in the header, as the template writes a past call, so only the analysis differs
CALL = (
    f"<|channel|>analysis<|message|>I echo it .<|end|><|start|>assistant to=functions.echo<|channel|>commentary "
    f"json<|message|>{ARGS_JSON}<|call|>"
)
FINAL = f"<|channel|>analysis<|message|>It came back .<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
CASE = Case(
    "gptoss",
    "gpt_oss",
    CALL,
    FINAL,
    {"role": "assistant", "content": "", "thinking": "I echo it .", "tool_calls": _calls(ARGS)},
    {"role": "assistant", "content": ANSWER, "thinking": "It came back ."},
    template="gpt_oss.jinja",
    stops=("<|call|>", "<|return|>"),
)


async def test_a_call_then_its_final_is_exact_as_each_generation_saw_it(compile_yaml, real_tokenizer):
    tok = real_tokenizer(CASE.package, CASE.template)
    agent = compile_yaml(spec(CASE))
    call, answer = model_ids(tok, CASE.call, CASE), model_ids(tok, CASE.answer, CASE)
    backend = scripted([call, answer])
    (traj,) = await run_agent(agent, backend, tok, [user_row("Echo it.")], check_tokens=True)
    assert traj.error is None and traj.termination_reason == "done", (traj.termination_reason, traj.error)

    def render(msgs, gen):
        return tok.apply_chat_template(
            msgs,
            tools=traj.tool_schemas,
            add_generation_prompt=gen,
            tokenize=True,
            return_dict=False,
        )

    user = [{"role": "user", "content": "Echo it."}]
    tool = [{"role": "tool", "content": TEXT, "tool_call_id": "call_0", "name": "echo"}]
    ids = traj.prompt_ids.tolist() + traj.response_ids.tolist()
    # exact as generated: each request's prompt is the row up to that turn, and is the template's render of the
    # conversation before it; the final's prompt holds the call's analysis
    first, second = backend.requests
    assert first.prompt_ids == render(user, True) == ids[: len(first.prompt_ids)]
    assert (
        second.prompt_ids == render([*user, CASE.call_message, *tool], True) == ids[: len(second.prompt_ids)]
    )
    assert "I echo it ." in tok.decode(second.prompt_ids, skip_special_tokens=False)
    assert ids[len(second.prompt_ids) :] == answer
    # the whole conversation's render drops that analysis, so a re-render of the row differs ...
    full = render([*user, CASE.call_message, *tool, CASE.answer_message], False)
    assert "I echo it ." not in tok.decode(full, skip_special_tokens=False) and full != ids
    # ... and the row is not flagged: it is compared as each generation saw it
    assert traj.token_check is None, traj.token_check
