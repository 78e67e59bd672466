"""fsm/families/pieces.py: the chat template called past transformers' wrapper renders what `apply_chat_template`
renders, on every family's real template (tests/fixtures/chat_templates/), with tools, tool rounds, the model's
own calls as the codec writes them back, and template kwargs; inputs the wrapper would change (a None value,
reasoning under another name, a tuple) go through the wrapper."""

from __future__ import annotations

import pytest

from fsm.families import TemplateKwargs
from fsm.families.pieces import ChatRender
from specs.calculator import SYSTEM_PROMPT, TOOL_SCHEMA
from tests.fixtures.family_tokenizers import FAMILIES, family_tokenizer

CALL = {
    "id": "call_0",
    "type": "function",
    "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}},
}
CONVERSATIONS = [
    [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 2 + 3?"}],
    [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "5", "tool_call_id": "call_0", "name": "calculator"},
    ],
    [
        {"role": "user", "content": [{"type": "text", "text": "What is 2 + 3?"}]},
        {"role": "assistant", "content": "It is 5.\n#### 5"},
        {"role": "user", "content": "And 4 * 5?"},
    ],
]
# What the wrapper changes before the template sees it: these must not take the direct path.
WRAPPED = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "5", "reasoning": "2 + 3 is 5"}],
    [{"role": "user", "content": ("a", "b")}],
]


class Counting(ChatRender):
    """ChatRender that counts the renders it sent through the wrapper."""

    wrapped = 0

    def text(self, messages, tools, add_generation_prompt):
        if not (self._variables is not None and self._direct(messages, tools)):
            self.wrapped += 1
        return super().text(messages, tools, add_generation_prompt)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_direct_render_is_the_wrappers(family):
    tok = family_tokenizer(family)
    for tokenizer in (tok, TemplateKwargs(tok, {"enable_thinking": False})):
        render = Counting(tokenizer)
        for messages in CONVERSATIONS:
            for tools in (None, [TOOL_SCHEMA]):
                for gen in (True, False):
                    _same(tokenizer, render, messages, tools, gen)
        assert render.wrapped == 0, family  # every one of these took the direct path
        for messages in WRAPPED:
            _same(tokenizer, render, messages, None, True)
        assert render.wrapped == len(WRAPPED)


def _same(tokenizer, render, messages, tools, gen):
    """The render equals the wrapper's, or both refuse it alike (a template that raises on a content list)."""
    try:
        want = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)
    except Exception as e:
        with pytest.raises(type(e)):
            render.text(messages, tools, gen)
    else:
        assert render.text(messages, tools, gen) == want, (messages, tools, gen)


def test_remembered_tojson_tells_values_apart():
    """The direct render's tojson remembers texts (pieces.py `_environment`) yet never answers for another value:
    None and NaN (both orjson's `null`), 1, 1.0 and True, each rendered after the others."""
    tok = family_tokenizer("qwen2.5")
    render = ChatRender(tok)
    for value in (None, float("nan"), 1, 1.0, True, None, float("nan")):
        call = dict(CALL, function={"name": "calculator", "arguments": {"x": value}})
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
        for _ in range(2):
            _same(tok, render, messages, [TOOL_SCHEMA], False)
